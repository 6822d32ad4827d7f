"""What the GPU's switching between processes costs, with the driver alone (cupy, no cuda-mp).

Without MPS a GPU runs the kernels of one process's context at a time and switches between the
contexts that have work. Example 16 (the KV cache) runs three processes that each give the GPU
short bursts of small kernels; this script measures what that costs with nothing of a library
in it. Each of P processes runs the same loop on a 2 MiB buffer of its own (the size of one KV
block), started together:

    a burst of B fill kernels (cupy's `fill`, about 6 us each on an H100), then a synchronize

and reports the median time of a loop (the middle half of the loops, when all P run). The GPU
time of one kernel is measured alone first (events around 1,000 kernels back to back). Alone,
a loop takes B kernels plus what is not kernels (the launches' host time and the synchronize's
wake-up). With three processes at once, the GPU runs three bursts for every loop of each: the
time of a loop less three bursts' kernels is what the GPU and the processes spend on what is not
kernels, the switches between the contexts among it; against the same figure alone, it says
what the switches cost.

    python3 benches/context_switch.py [--loops N]       # default 2,000 loops a process
"""

import multiprocessing as mp
import statistics
import sys
import time

BLOCK_BYTES = 2 << 20
BURSTS = [1, 4, 16]


def warm_buffer():
    """cupy and a 2 MiB buffer of this process, after 50 fills (the kernel loaded, the clocks
    up)."""
    import cupy

    a = cupy.zeros(BLOCK_BYTES // 2, dtype=cupy.float16)
    for _ in range(50):
        a.fill(1)
    return cupy, a


def worker(burst, loops, ready, go, results):
    cupy, a = warm_buffer()
    cupy.cuda.Stream.null.synchronize()
    ready.put(None)
    go.wait()
    times = []
    for i in range(loops):
        t0 = time.perf_counter()
        for _ in range(burst):
            a.fill((i & 7) + 1)  # never 0: cupy sets zeros with a memset, not a kernel
        cupy.cuda.Stream.null.synchronize()
        times.append(time.perf_counter() - t0)
    results.put(times)


def kernel_time():
    cupy, a = warm_buffer()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for i in range(1000):
        a.fill((i & 7) + 1)
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) * 1e3 / 1000


def run(processes, burst, loops):
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=worker, args=(burst, loops, ready, go, results)) for _ in range(processes)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=120)
    go.set()
    times = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join()
    # The middle half of every process's loops: all of them run at once there.
    middle = [t for ts in times for t in ts[loops // 4 : 3 * loops // 4]]
    return statistics.median(middle) * 1e6


def main():
    loops = int(sys.argv[sys.argv.index("--loops") + 1]) if "--loops" in sys.argv else 2000
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        k = pool.apply(kernel_time)
    print(f"one fill of 2 MiB: {k:.2f} us of GPU time (1,000 back to back)")
    print("| kernels a burst | alone: a loop | not kernels | three at once: a loop | not kernels (three bursts) |")
    print("|---|---|---|---|---|")
    for burst in BURSTS:
        alone = run(1, burst, loops)
        three = run(3, burst, loops)
        print(
            f"| {burst} | {alone:.1f} us | {alone - burst * k:.1f} us | {three:.1f} us | {three - 3 * burst * k:.1f} us |",
            flush=True,
        )


if __name__ == "__main__":
    main()
