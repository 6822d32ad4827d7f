"""Whether the first launch of a kernel waits for the work already queued (CUDA's lazy
loading), in a spawned PyTorch worker with and without cuda-mp, and with eager loading:
the measurement behind "A worker's queued work that had ended by its send" in
docs/performance.md.

    python3 benches/lazy_loading.py

Each worker queues 100 products of 4096 x 4096 float32 matrices (the first one starts cuBLAS),
then an in-place add (a kernel it has not launched before), then asks whether its stream is
idle. With cuda-mp, the worker then queues the products again and times a put of a fresh
tensor (its export and event record) while they run. Needs torch and one GPU; the `put` case needs the cuda_mp package.
"""

import os
import sys
import time

import torch
import torch.multiprocessing as mp


def worker(q, report, case):
    t = torch.zeros(1 << 20, device="cuda")
    if q is not None:
        q.put(torch.ones(1, device="cuda"))
    a, b = torch.rand(4096, 4096, device="cuda"), torch.empty(4096, 4096, device="cuda")
    marks = [time.perf_counter()]
    for _ in range(100):
        torch.mm(a, a, out=b)
        marks.append(time.perf_counter())
    added = time.perf_counter()
    t.add_(1)
    queried = time.perf_counter()
    idle = torch.cuda.current_stream().query()
    synced = time.perf_counter()
    torch.cuda.synchronize()
    end = time.perf_counter()
    line = (
        f"{case:6s} first mm {1e3 * (marks[1] - marks[0]):8.1f} ms | other 99 mm {1e3 * (marks[-1] - marks[1]):5.1f} ms"
        f" | add_ {1e3 * (queried - added):6.1f} ms | idle after {str(idle):5s} | synchronize {1e3 * (end - synced):6.1f} ms"
    )
    if q is not None:
        # A put while work is queued (every kernel loaded by now): a fresh storage's export
        # and the interprocess event's first record must not wait for that work.
        fresh = torch.empty(1 << 20, device="cuda")
        for _ in range(100):
            torch.mm(a, a, out=b)
        fresh.fill_(2)
        began = time.perf_counter()
        q.put(fresh)
        put = time.perf_counter() - began
        line += f" | then a put with work queued {1e3 * put:.2f} ms, busy after {not torch.cuda.current_stream().query()}"
        torch.cuda.synchronize()
    report.put(line)


def main():
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    for case in sys.argv[1:] or ["plain", "put", "eager"]:
        q = None
        if case == "put":
            import cuda_mp

            q = cuda_mp.Queue()
        os.environ.pop("CUDA_MODULE_LOADING", None)
        if case == "eager":
            os.environ["CUDA_MODULE_LOADING"] = "EAGER"
        p = ctx.Process(target=worker, args=(q, report, case))
        p.start()
        os.environ.pop("CUDA_MODULE_LOADING", None)
        if q is not None:
            q.get(timeout=60)  # the worker's first put, taken and dropped at once
        if q is not None:
            fresh = q.get(timeout=120)
            assert bool((fresh == 2).all()), "the values of the put with work queued"
            del fresh
        print(report.get(timeout=120), flush=True)
        p.join(60)


if __name__ == "__main__":
    main()
