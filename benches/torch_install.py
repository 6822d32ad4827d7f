"""The same torch.multiprocessing programs with and without ``cuda_mp.torch.install()``, in one call:

- rt: round trip of a re-sent 1 MiB CUDA tensor (the consumer puts back what it got), median;
- fresh: fresh 1 MiB CUDA tensors per second to a consumer that drops each;
- 7B first / republish: a 7B-parameter bf16 state dict (291 tensors) put on the queue until the
  consumer has it all, first time and again.

Each mode runs in an interpreter of its own (spawn consumers, one GPU):

    python3 benches/torch_install.py [--quick]
"""

import json
import statistics
import subprocess
import sys
import time

NUMEL = 256 * 1024  # 1 MiB of float32


def echo(q_in, q_out):
    import torch

    torch.cuda.init()
    while True:
        item = q_in.get()
        if item is None:
            return
        q_out.put(item)
        del item


def drain(q_in, q_out):
    n = 0
    while True:
        item = q_in.get()
        if item is None:
            q_out.put(n)
            return
        n += 1
        del item


def take_weights(q_in, q_out):
    import torch

    while True:
        d = q_in.get()
        if d is None:
            return
        torch.cuda.synchronize()
        q_out.put(len(d))
        del d


def llama_7b_shapes():
    shapes = [(32000, 4096)]
    for _ in range(32):
        shapes += [(4096, 4096)] * 4 + [(11008, 4096), (11008, 4096), (4096, 11008), (4096,), (4096,)]
    return shapes + [(4096,), (32000, 4096)]


def measure(mode, quick):
    import torch
    import torch.multiprocessing as mp

    if mode == "cuda-mp":
        import cuda_mp.torch

        cuda_mp.torch.install()
    ctx = mp.get_context("spawn")
    out = {}

    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=echo, args=(q_in, q_out))
    p.start()
    t = torch.ones(NUMEL, device="cuda")
    torch.cuda.synchronize()
    rounds = []
    for k in range(50 + (200 if quick else 1000)):
        start = time.perf_counter()
        q_in.put(t)
        back = q_out.get()
        rounds.append(time.perf_counter() - start)
        del back
    q_in.put(None)
    p.join(60)
    out["rt_us"] = statistics.median(rounds[50:]) * 1e6

    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=drain, args=(q_in, q_out))
    p.start()
    n = 1000 if quick else 5000
    for _ in range(100):  # warm-up: the consumer's start and the first opens
        q_in.put(torch.zeros(NUMEL, device="cuda"))
    start = time.perf_counter()
    for _ in range(n):
        q_in.put(torch.zeros(NUMEL, device="cuda"))
    q_in.put(None)
    assert q_out.get(timeout=600) == n + 100
    out["fresh_per_s"] = n / (time.perf_counter() - start)
    p.join(60)

    weights = {f"w{i}": torch.zeros(s, dtype=torch.bfloat16, device="cuda") for i, s in enumerate(llama_7b_shapes())}
    torch.cuda.synchronize()
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=take_weights, args=(q_in, q_out))
    p.start()
    q_in.put({"w": torch.zeros(1, device="cuda")})  # the consumer's start and CUDA context, not timed
    q_out.get(timeout=600)
    times = []
    for _ in range(4):
        start = time.perf_counter()
        q_in.put(weights)
        assert q_out.get(timeout=600) == len(weights)
        times.append(time.perf_counter() - start)
    q_in.put(None)
    p.join(60)
    out["first_ms"] = times[0] * 1e3
    out["republish_ms"] = statistics.median(times[1:]) * 1e3
    out["tensors"] = len(weights)
    out["gb"] = sum(w.numel() * 2 for w in weights.values()) / 1e9
    return out


def main():
    quick = "--quick" in sys.argv
    if "--mode" in sys.argv:
        print(json.dumps(measure(sys.argv[sys.argv.index("--mode") + 1], quick)), flush=True)
        return
    results = {}
    for mode in ("torch", "cuda-mp"):
        done = subprocess.run(
            [sys.executable, __file__, "--mode", mode] + (["--quick"] if quick else []),
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            sys.exit(f"{mode} failed:\n{done.stderr[-3000:]}")
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    t, c = results["torch"], results["cuda-mp"]
    print(f"7B state dict: {c['tensors']} bf16 tensors, {c['gb']:.2f} GB")
    print("| workload | torch.mp alone | torch.mp + cuda_mp.torch.install() | speed-up |")
    print("|---|---|---|---|")
    print(f"| round trip, re-sent 1 MiB tensor | {t['rt_us']:.1f} us | {c['rt_us']:.1f} us | {t['rt_us'] / c['rt_us']:.2f}x |")
    print(f"| fresh 1 MiB tensors per second | {t['fresh_per_s']:.0f}/s | {c['fresh_per_s']:.0f}/s | {c['fresh_per_s'] / t['fresh_per_s']:.2f}x |")
    print(f"| 7B weights, first publish | {t['first_ms']:.1f} ms | {c['first_ms']:.1f} ms | {t['first_ms'] / c['first_ms']:.2f}x |")
    print(f"| 7B weights, republish | {t['republish_ms']:.1f} ms | {c['republish_ms']:.1f} ms | {t['republish_ms'] / c['republish_ms']:.2f}x |")


if __name__ == "__main__":
    main()
