#!/usr/bin/env python3
"""The CUDA driver alone: how long a consumer takes to open the IPC handles of a 7B model's
weights (291 allocations, as PyTorch's state dict is), one thread against several.

A producer process allocates the 291 weights of a 7B Llama-style transformer in bf16 (one
``cuMemAlloc`` each, 13.5 GB), takes their legacy IPC handles and sends them over a pipe; a
consumer process opens every handle (``cuIpcOpenMemHandle``), closes them all, and does it
again with 1, 2, 4, 8 and 16 threads (each thread with the primary context current), then with
one thread once more. ctypes and libcuda only: no cuda-mp, no PyTorch. ctypes lets the
interpreter's lock go during each driver call, so the threads' opens overlap in the driver.

    python3 benches/ipc_open_threads.py [--device 0] [--threads 1,2,4,8,16,1]
"""

import argparse
import ctypes
import multiprocessing as mp
import time
from concurrent.futures import ThreadPoolExecutor

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class IpcHandle(ctypes.Structure):
    """CUipcMemHandle: 64 bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_char * 64)]


def llama7b_bytes():
    vocab, d, ff, layers = 32000, 4096, 11008, 32
    shapes = [vocab * d]
    for _ in range(layers):
        shapes += [d * d] * 4 + [ff * d] * 3 + [d, d]
    shapes += [d, vocab * d]
    return [n * 2 for n in shapes]


def driver(device):
    cuda = ctypes.CDLL("libcuda.so.1")

    def check(r, what):
        if r != 0:
            name = ctypes.c_char_p()
            cuda.cuGetErrorName(r, ctypes.byref(name))
            raise RuntimeError(f"{what}: {name.value.decode() if name.value else r}")

    cuda.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), IpcHandle, ctypes.c_uint]
    cuda.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(IpcHandle), ctypes.c_ulonglong]
    check(cuda.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    check(cuda.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return cuda, check, ctx


def producer(conn, device):
    cuda, check, _ = driver(device)
    handles = []
    for size in llama7b_bytes():
        ptr = ctypes.c_ulonglong()
        check(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size)), "cuMemAlloc")
        handle = IpcHandle()
        check(cuda.cuIpcGetMemHandle(ctypes.byref(handle), ptr.value), "cuIpcGetMemHandle")
        handles.append(bytes(handle))
    conn.send(handles)
    conn.recv()  # until the consumer is done


def consumer(conn, device, thread_counts):
    cuda, check, ctx = driver(device)
    handles = conn.recv()
    local = __import__("threading").local()

    def open_one(raw):
        if not getattr(local, "current", False):
            check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            local.current = True
        handle = IpcHandle.from_buffer_copy(raw)
        ptr = ctypes.c_ulonglong()
        start = time.perf_counter()
        check(cuda.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "open")
        return ptr.value, time.perf_counter() - start

    rows = []
    for n in thread_counts:
        start = time.perf_counter()
        if n == 1:
            opened = [open_one(h) for h in handles]
        else:
            with ThreadPoolExecutor(n) as pool:
                opened = list(pool.map(open_one, handles))
        total = time.perf_counter() - start
        calls = sum(t for _, t in opened)
        for ptr, _ in opened:
            check(cuda.cuIpcCloseMemHandle(ctypes.c_ulonglong(ptr)), "close")
        rows.append((n, total, calls))
    conn.send(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--threads", default="1,2,4,8,16,1")
    args = parser.parse_args()
    counts = [int(n) for n in args.threads.split(",")]
    ctx = mp.get_context("spawn")
    p_end, p_far = ctx.Pipe()
    c_end, c_far = ctx.Pipe()
    prod = ctx.Process(target=producer, args=(p_far, args.device))
    cons = ctx.Process(target=consumer, args=(c_far, args.device, counts))
    prod.start()
    cons.start()
    try:
        if not p_end.poll(120):
            raise SystemExit("the producer sent no handles within 120 s")
        c_end.send(p_end.recv())
        if not c_end.poll(300):
            raise SystemExit("the consumer gave no result within 300 s")
        rows = c_end.recv()
    finally:
        for p in (prod, cons):
            if p.is_alive() and p is cons:
                p.terminate()
        p_end.send("done")
        prod.join(30)
        cons.join(30)
    sizes = llama7b_bytes()
    print(f"{len(sizes)} allocations, {sum(sizes) / 1e9:.2f} GB; every handle opened, then all closed, per row")
    print("| threads | all opens, wall | per open, wall | sum of the calls' own times |")
    print("|---|---|---|---|")
    for n, total, calls in rows:
        print(f"| {n} | {total * 1e3:.1f} ms | {total / len(sizes) * 1e6:.0f} us | {calls * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
