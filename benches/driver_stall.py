"""Does opening another process's large CUDA allocation stall the opening process afterwards?

The driver alone, no cuda-mp: a producer allocates SIZE bytes with cudaMalloc (cupy) and hands
its IPC handle to a consumer, which opens it (cudaIpcOpenMemHandle) and then, on the same
thread, times what a receiver does next: map and touch a fresh 4 KiB shared-memory page and
unmap it, over and over for 300 ms. A second thread does the same during the open. Printed:
how long the open took, and the slowest map of each thread with when it happened.

    python3 benches/driver_stall.py [SIZE_GB ...]     # default: 0.004 1 13.5
"""

import mmap
import multiprocessing as mp
import os
import sys
import threading
import time


def producer(size, conn):
    import cupy

    ptr = cupy.cuda.runtime.malloc(size)
    cupy.cuda.runtime.memset(ptr, 0, size)
    cupy.cuda.runtime.deviceSynchronize()
    conn.send(cupy.cuda.runtime.ipcGetMemHandle(ptr))
    conn.recv()  # until the consumer is done
    cupy.cuda.runtime.free(ptr)


def map_once():
    start = time.perf_counter_ns()
    fd = os.memfd_create("probe")
    os.ftruncate(fd, 4096)
    m = mmap.mmap(fd, 4096)
    m[0] = 1
    m.close()
    os.close(fd)
    return time.perf_counter_ns() - start


def watch(until, out):
    worst = (0, 0)
    while time.perf_counter_ns() < until:
        at = time.perf_counter_ns()
        took = map_once()
        if took > worst[0]:
            worst = (took, at)
    out.append(worst)


def consumer(size_gb, handle):
    import cupy

    cupy.cuda.Device(0).use()
    cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))  # the context exists before the open
    for _ in range(100):
        map_once()
    base = sorted(map_once() for _ in range(200))[100]
    seen = []
    t0 = time.perf_counter_ns()
    side = threading.Thread(target=watch, args=(t0 + 300_000_000, seen))
    side.start()
    ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle)
    opened = time.perf_counter_ns()
    after = []
    watch(opened + 300_000_000, after)
    side.join()
    cupy.cuda.runtime.ipcCloseMemHandle(ptr)
    (w_side, at_side), (w_after, at_after) = seen[0], after[0]
    print(
        f"{size_gb:>6} GB: open {(opened - t0) / 1e3:9.1f} us | map+touch of 4 KiB: median before {base / 1e3:.1f} us, "
        f"slowest after the open on its thread {w_after / 1e3:9.1f} us (at +{(at_after - opened) / 1e3:.1f} us), "
        f"on another thread {w_side / 1e3:9.1f} us (at {(at_side - t0) / 1e3:+.1f} us from the open's start)"
    )


def main():
    sizes = [float(a) for a in sys.argv[1:]] or [0.004, 1, 13.5]
    ctx = mp.get_context("spawn")
    for gb in sizes:
        size = int(gb * (1 << 30)) // (2 << 20) * (2 << 20) or (2 << 20)
        here, there = ctx.Pipe()
        p = ctx.Process(target=producer, args=(size, there))
        p.start()
        handle = here.recv()
        c = ctx.Process(target=consumer, args=(gb, handle))
        c.start()
        c.join()
        here.send(None)
        p.join()


if __name__ == "__main__":
    main()
