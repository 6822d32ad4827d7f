"""Whether a legacy IPC handle to a small allocation maps its neighbours too, the driver alone
(cupy's runtime calls, no memory pool, no cuda-mp).

A producer process makes two allocations of SIZE bytes with cudaMalloc, fills the second with
7.0 (float32) and exports an IPC handle to the first only; a consumer process opens the handle
and copies 16 bytes from the first allocation's address plus the distance to the second. For
each size it prints whether that copy succeeded and what it read: `neighbour read` means the
handle mapped an allocation that was never exported (the driver cut both from one block).

    python3 benches/ipc_neighbours.py
"""

import multiprocessing as mp

import numpy as np

SIZES = [16, 4096, 1 << 20, 2 << 20]


def producer(size, conn):
    import cupy

    rt = cupy.cuda.runtime
    rt.setDevice(0)
    sent = rt.malloc(size)
    unsent = rt.malloc(size)
    sevens = np.full(4, 7.0, dtype=np.float32)
    rt.memcpy(unsent, sevens.ctypes.data, 16, rt.memcpyHostToDevice)
    rt.deviceSynchronize()
    conn.send((rt.ipcGetMemHandle(sent), unsent - sent))
    conn.recv()  # the consumer is done
    rt.free(unsent)
    rt.free(sent)


def consumer(conn, out):
    out.send(look(conn))


def look(conn):
    import cupy

    rt = cupy.cuda.runtime
    rt.setDevice(0)
    handle, distance = conn.recv()
    base = rt.ipcOpenMemHandle(handle)
    seen = np.zeros(4, dtype=np.float32)
    try:
        rt.memcpy(seen.ctypes.data, base + distance, 16, rt.memcpyDeviceToHost)
        outcome = "neighbour read" if (seen == 7.0).all() else f"read other bytes {seen.tolist()}"
    except cupy.cuda.runtime.CUDARuntimeError as e:
        outcome = f"refused ({e})"
    rt.ipcCloseMemHandle(base)
    return distance, outcome


def main():
    ctx = mp.get_context("spawn")
    for size in SIZES:
        # Each side a process of its own: a failed copy must not touch the next size's context.
        here, there = ctx.Pipe()
        result, out = ctx.Pipe()
        p = ctx.Process(target=producer, args=(size, there))
        c = ctx.Process(target=consumer, args=(here, out))
        p.start()
        c.start()
        distance, outcome = result.recv()
        c.join(60)
        here.send(None)  # to the producer, which waits on the other end
        p.join(60)
        print(f"allocations of {size:>8} bytes, {distance:>9} bytes apart: {outcome}")


if __name__ == "__main__":
    main()
