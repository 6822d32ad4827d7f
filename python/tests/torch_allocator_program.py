"""A torch.multiprocessing program whose producer allocates through cuda-mp's allocator
(``cuda_mp.torch.install(allocator=True)``), run in an interpreter of its own by
test_torch_allocator.py: the allocator must be chosen before the process's first CUDA tensor.
Prints one JSON line of what it saw."""

import json
import sys
import time


def consume(q_in, q_out):
    import torch

    import cuda_mp

    weights = q_in.get(timeout=120)
    ok = all(bool((w == float(i)).all()) for i, w in enumerate(weights.values()))
    mapped_after_weights = (cuda_mp._native.opened_mappings(), cuda_mp._native.opened_segments())
    next(iter(weights.values())).add_(1)  # the producer sees it: the same memory
    torch.cuda.synchronize()
    del weights
    q_out.put((ok, mapped_after_weights))
    fresh_ok = True
    while True:
        item = q_in.get(timeout=120)
        if item is None:
            break
        value, t = item
        fresh_ok &= bool((t == value).all())
        del t
        q_out.put("dropped")
    torch.cuda.synchronize()
    q_out.put((fresh_ok, (cuda_mp._native.opened_mappings(), cuda_mp._native.opened_segments())))


def main():
    import torch
    import torch.multiprocessing as mp

    import cuda_mp
    import cuda_mp.torch

    cuda_mp.torch.install(allocator=True)
    report = {"in_use": cuda_mp.torch.allocator_in_use()}
    # Weights: 24 large tensors (which share grown segments) and 24 small ones.
    weights = {}
    for i in range(48):
        shape = (3072, 4096) if i % 2 == 0 else (4096,)
        weights[f"w{i}"] = torch.full(shape, float(i), dtype=torch.bfloat16, device="cuda")
    # PyTorch's own work on this memory: a matmul (cuBLAS's workspace comes from the allocator too).
    a = torch.randn(512, 512, device="cuda")
    report["matmul"] = bool(torch.allclose(a @ torch.eye(512, device="cuda"), a))
    del a
    # A tensor made on a side stream and used on the default one: record_stream reaches the
    # allocator (its free waits for both streams).
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.ones(1 << 20, device="cuda")
    torch.cuda.current_stream().wait_stream(side)
    x.record_stream(torch.cuda.current_stream())
    report["record_stream"] = float((x * 2).sum().item()) == 2.0 * (1 << 20)
    del x
    # Empty tensors have no memory (a null pointer, as with PyTorch's allocator).
    report["empty_is_null"] = torch.empty(0, device="cuda").data_ptr() == 0
    # What cuda-mp cannot carry cannot go through PyTorch's own sharing here either.
    from multiprocessing.reduction import ForkingPickler

    try:
        ForkingPickler.dumps(torch.zeros(2, dtype=torch.complex64, device="cuda"))
        report["complex_refused"] = False
    except RuntimeError as e:
        report["complex_refused"] = "cuda-mp's allocator" in str(e)
    torch.cuda.synchronize()
    report["segments"] = cuda_mp.allocator_stats(0)["segments"]

    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consume, args=(q_in, q_out))
    p.start()
    q_in.put(weights)
    ok, mapped = q_out.get(timeout=120)
    report["weights_ok"] = ok
    report["consumer_mappings_for_weights"] = mapped
    report["consumer_write_seen"] = bool((weights["w0"] == 1.0).all())

    # Fresh 1 MiB tensors, each dropped here right after its put: the consumer reads them after.
    # A window of 8 in flight (the consumer says when it has dropped each): blocks come back
    # and are reused, in segments the consumer has mapped.
    for k in range(300):
        t = torch.full((256 * 1024,), float(k % 7), device="cuda")
        q_in.put((float(k % 7), t))
        del t
        if k >= 8:
            assert q_out.get(timeout=120) == "dropped"
    for _ in range(8):
        assert q_out.get(timeout=120) == "dropped"
    q_in.put(None)
    fresh_ok, mapped_after = q_out.get(timeout=120)
    report["fresh_ok"] = fresh_ok
    report["consumer_mappings_after_fresh"] = mapped_after
    p.join(60)
    report["consumer_exit"] = p.exitcode

    # Everything dropped: PyTorch holds nothing through the allocator, and once the frees
    # behind the GPU's work have run, no block of the allocator is in use.
    del weights
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # cuBLAS keeps its workspace (an allocation) until this
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and cuda_mp.allocator_stats(0)["allocated_bytes"] > 0:
        time.sleep(0.05)
    report["torch_holds"] = list(cuda_mp._native.torch_allocations(0))
    report["allocated_bytes_at_end"] = cuda_mp.allocator_stats(0)["allocated_bytes"]
    print(json.dumps(report), flush=True)


def too_late():
    import torch

    import cuda_mp.torch

    torch.zeros(1, device="cuda")
    try:
        cuda_mp.torch.install(allocator=True)
    except RuntimeError as e:
        print(json.dumps({"error": str(e), "in_use": cuda_mp.torch.allocator_in_use()}), flush=True)
        return
    print(json.dumps({"error": None}), flush=True)


if __name__ == "__main__":
    too_late() if sys.argv[1:] == ["--too-late"] else main()
