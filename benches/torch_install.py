"""The same torch.multiprocessing programs with and without ``cuda_mp.torch.install()``, in one call:

- rt: round trip of a re-sent 1 MiB CUDA tensor (put, the consumer drops it and acknowledges),
  median (torch's own numbers for the same round: row a of benches/torch_baseline.py); and the
  same round trip of an int, the floor of the queue itself;
- fresh: fresh 1 MiB CUDA tensors per second to a consumer that drops each (all put at once,
  after a warm-up);
- 7B first / republish: a 7B-parameter bf16 state dict (291 tensors) put on the queue until the
  consumer has it all: three state dicts for the first time each (the median, and each), then
  the first one again;
- 7B split: the same state dict pickled by hand (``ForkingPickler.dumps``, timed in the
  producer), its bytes sent on a pipe, and loaded (``pickle.loads``, timed in a fresh consumer):
  where a publish's time goes, first and again.

Five modes, the programs unchanged in each: torch.mp alone; with ``install()``; with
``install(queues=True)``, which makes their ``multiprocessing`` queues cuda-mp queues (the pipe
of the by-hand rows stays); and both with ``allocator=True``, which makes cuda-mp's caching
allocator PyTorch's in the producer. Each mode runs in an interpreter of its own (spawn
consumers, one GPU); torch.mp alone always runs, ``--modes`` picks the others:

    python3 benches/torch_install.py [--quick] [--modes allocator,allocator-queue]
"""

import json
import statistics
import subprocess
import sys
import time

NUMEL = 256 * 1024  # 1 MiB of float32
FIRSTS = 3  # 7B state dicts published for the first time (13.5 GB of GPU memory each)


def drain(q_in, q_out, warm):
    n = 0
    while True:
        item = q_in.get()
        if item is None:
            q_out.put(n)
            return
        n += 1
        del item
        if n == warm:
            q_out.put(n)


def take_weights(q_in, q_out):
    import torch

    while True:
        d = q_in.get()
        if d is None:
            return
        torch.cuda.synchronize()
        q_out.put(len(d))
        del d


def load_weights(conn):
    import pickle

    import torch

    while True:
        data = conn.recv_bytes()
        if not data:
            return
        start = time.perf_counter()
        d = pickle.loads(data)
        torch.cuda.synchronize()
        conn.send((len(d), time.perf_counter() - start))
        del d


def llama_7b_shapes():
    shapes = [(32000, 4096)]
    for _ in range(32):
        shapes += [(4096, 4096)] * 4 + [(11008, 4096), (11008, 4096), (4096, 11008), (4096,), (4096,)]
    return shapes + [(4096,), (32000, 4096)]


def round_trip_us(q_in, q_out, item, rounds):
    """The median round trip of ``item`` (put, the consumer acknowledges), in microseconds,
    after 50 rounds not counted."""
    times = []
    for _ in range(50 + rounds):
        start = time.perf_counter()
        q_in.put(item)
        q_out.get(timeout=60)
        times.append(time.perf_counter() - start)
    return statistics.median(times[50:]) * 1e6


def measure(mode, quick):
    import torch
    import torch.multiprocessing as mp
    from torch_baseline import drop_and_ack  # row a's consumer: drops each tensor, acknowledges

    if mode != "torch":
        import cuda_mp.torch

        cuda_mp.torch.install(queues=mode.endswith("queue"), allocator=mode.startswith("allocator"))
    ctx = mp.get_context("spawn")
    out = {}
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=drop_and_ack, args=(q_in, q_out))
    p.start()
    t = torch.ones(NUMEL, device="cuda")
    torch.cuda.synchronize()
    rounds = 200 if quick else 1000
    out["rt_us"] = round_trip_us(q_in, q_out, t, rounds)
    # The queue's own floor: the same round trip of an int, no tensor.
    out["rt_int_us"] = round_trip_us(q_in, q_out, 1, rounds)
    q_in.put(None)
    p.join(60)
    print(f"  {mode}: round trip {out['rt_us']:.1f} us (an int: {out['rt_int_us']:.1f} us)", file=sys.stderr, flush=True)

    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=drain, args=(q_in, q_out, 100))
    p.start()
    n = 1000 if quick else 5000
    for _ in range(100):  # warm-up, not timed: the consumer's start, CUDA context, first opens
        q_in.put(torch.zeros(NUMEL, device="cuda"))
    assert q_out.get(timeout=120) == 100
    start = time.perf_counter()
    for _ in range(n):
        q_in.put(torch.zeros(NUMEL, device="cuda"))
    q_in.put(None)
    assert q_out.get(timeout=120) == n + 100
    out["fresh_per_s"] = n / (time.perf_counter() - start)
    p.join(60)
    print(f"  {mode}: fresh {out['fresh_per_s']:.0f}/s", file=sys.stderr, flush=True)

    def state_dict():
        return {f"w{i}": torch.zeros(s, dtype=torch.bfloat16, device="cuda") for i, s in enumerate(llama_7b_shapes())}

    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=take_weights, args=(q_in, q_out))
    p.start()
    q_in.put({"w": torch.zeros(1, device="cuda")})  # the consumer's start and CUDA context, not timed
    q_out.get(timeout=120)

    def publish(weights, what):
        start = time.perf_counter()
        q_in.put(weights)
        assert q_out.get(timeout=120) == len(weights)
        took = time.perf_counter() - start
        print(f"  {mode}: 7B {what} {took * 1e3:.1f} ms", file=sys.stderr, flush=True)
        return took

    # A first publish is of memory neither side has shared before: each of FIRSTS state dicts
    # (all kept, so that none is made in memory of one before) once, then the first one again.
    sets = [state_dict() for _ in range(FIRSTS)]
    torch.cuda.synchronize()
    firsts = [publish(weights, "first publish") for weights in sets]
    weights = sets[0]
    del sets[1:]
    again = [publish(weights, "republish") for _ in range(3)]
    q_in.put(None)
    p.join(60)
    out["firsts_ms"] = [x * 1e3 for x in firsts]
    out["first_ms"] = statistics.median(firsts) * 1e3
    out["republish_ms"] = statistics.median(again) * 1e3

    from multiprocessing.reduction import ForkingPickler

    here, there = ctx.Pipe()
    p = ctx.Process(target=load_weights, args=(there,))
    p.start()
    here.send_bytes(bytes(ForkingPickler.dumps({"w": torch.zeros(1, device="cuda")})))  # start, CUDA context
    here.recv()
    split = []
    for _ in range(4):
        start = time.perf_counter()
        data = bytes(ForkingPickler.dumps(weights))
        dumped = time.perf_counter() - start
        here.send_bytes(data)
        n, loaded = here.recv()
        assert n == len(weights)
        split.append((dumped * 1e3, loaded * 1e3, (time.perf_counter() - start) * 1e3))
        print(f"  {mode}: 7B by hand: dumps {split[-1][0]:.1f} ms, loads {split[-1][1]:.1f} ms, in all {split[-1][2]:.1f} ms", file=sys.stderr, flush=True)
    here.send_bytes(b"")
    p.join(60)
    out["split_first"] = split[0]
    out["split_again"] = [statistics.median(x[i] for x in split[1:]) for i in range(3)]
    out["tensors"] = len(weights)
    out["gb"] = sum(w.numel() * 2 for w in weights.values()) / 1e9
    return out


def span(times):
    return ", ".join(f"{x:.1f}" for x in times) + " ms"


CALLS = {
    "cuda-mp": "install()",
    "queue": "install(queues=True)",
    "allocator": "install(allocator=True)",
    "allocator-queue": "install(allocator=True, queues=True)",
}


def main():
    quick = "--quick" in sys.argv
    if "--mode" in sys.argv:
        print(json.dumps(measure(sys.argv[sys.argv.index("--mode") + 1], quick)), flush=True)
        return
    modes = sys.argv[sys.argv.index("--modes") + 1].split(",") if "--modes" in sys.argv else list(CALLS)
    results = {}
    for mode in ["torch"] + modes:
        # Progress and errors on stderr as they come; the result is the last line of stdout.
        done = subprocess.run(
            [sys.executable, __file__, "--mode", mode] + (["--quick"] if quick else []),
            stdout=subprocess.PIPE,
            text=True,
            timeout=250,
        )
        if done.returncode != 0:
            sys.exit(f"{mode} failed (exit status {done.returncode})")
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    t = results["torch"]
    print(f"7B state dict: {t['tensors']} bf16 tensors, {t['gb']:.2f} GB")
    for mode in modes:
        c = results[mode]
        print()
        print(f"| workload | torch.mp alone | torch.mp + cuda_mp.torch.{CALLS[mode]} | speed-up |")
        print("|---|---|---|---|")
        print(f"| round trip, re-sent 1 MiB tensor | {t['rt_us']:.1f} us | {c['rt_us']:.1f} us | {t['rt_us'] / c['rt_us']:.2f}x |")
        print(f"| round trip of an int (the queue's floor) | {t['rt_int_us']:.1f} us | {c['rt_int_us']:.1f} us | {t['rt_int_us'] / c['rt_int_us']:.2f}x |")
        print(f"| fresh 1 MiB tensors per second | {t['fresh_per_s']:.0f}/s | {c['fresh_per_s']:.0f}/s | {c['fresh_per_s'] / t['fresh_per_s']:.2f}x |")
        print(f"| 7B weights, first publish (median of {FIRSTS}) | {t['first_ms']:.1f} ms | {c['first_ms']:.1f} ms | {t['first_ms'] / c['first_ms']:.2f}x |")
        print(f"| 7B weights, first publishes, each | {span(t['firsts_ms'])} | {span(c['firsts_ms'])} | |")
        print(f"| 7B weights, republish | {t['republish_ms']:.1f} ms | {c['republish_ms']:.1f} ms | {t['republish_ms'] / c['republish_ms']:.2f}x |")
        for key, what in (("split_first", "first"), ("split_again", "again")):
            for i, part in enumerate(("dumps (producer)", "loads (consumer)", "in all, by hand")):
                print(f"| 7B {what}: {part} | {t[key][i]:.1f} ms | {c[key][i]:.1f} ms | {t[key][i] / c[key][i]:.2f}x |")


if __name__ == "__main__":
    main()
