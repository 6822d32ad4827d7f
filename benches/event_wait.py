"""What a receiver's wait on its sender's interprocess event costs, the driver alone (cupy).

Row s of bench-handoff sends fresh 1 MiB tensors that the sender zeroes with a kernel: each
message carries the sender's interprocess event, recorded after the memset. This script runs
the same pattern without cuda-mp: a producer process zeroes 1 MiB buffers (cudaMemsetAsync on
its stream, 64 buffers, 64 messages in flight), records one interprocess event after each
memset and sends a token over a pipe; a consumer process answers each token, doing before it,
by mode:

    none        nothing (the pipe's cost)
    query       cudaEventQuery on the opened event
    wait        cudaStreamWaitEvent on its stream when the event is not complete
    wait_sync   that wait, then cudaStreamSynchronize (what a drop that syncs adds)
    sync        cudaStreamSynchronize of its idle stream only

Printed: tokens per second per mode and what each mode adds per token over `none`, in us.
The same Python pipe runs in every mode, so the differences are the driver's (and the GPU's
switching between the two processes' contexts).

    python3 benches/event_wait.py [--n N]     # default 20000 tokens a mode
"""

import multiprocessing as mp
import sys
import time

BUFS = 64
SIZE = 1 << 20
MODES = ["none", "query", "wait", "wait_sync", "sync"]
NOT_READY = 600  # cudaErrorNotReady


def consumer(conn, mode, handle):
    import cupy

    rt = cupy.cuda.runtime
    cupy.cuda.Device(0).use()
    rt.free(rt.malloc(1))  # the context exists before the first token
    stream = cupy.cuda.Stream(non_blocking=True)
    event = rt.ipcOpenEventHandle(handle)
    conn.send_bytes(b"ready")
    while True:
        msg = conn.recv_bytes()
        if msg == b"stop":
            break
        if mode in ("query", "wait", "wait_sync"):
            try:
                done = rt.eventQuery(event) == 0
            except cupy.cuda.runtime.CUDARuntimeError as e:
                if e.status != NOT_READY:
                    raise
                done = False
            if mode != "query" and not done:
                rt.streamWaitEvent(stream.ptr, event, 0)
        if mode in ("wait_sync", "sync"):
            stream.synchronize()
        conn.send_bytes(b"a")
    rt.eventDestroy(event)


def rate(ctx, mode, n, zeroed):
    import cupy

    rt = cupy.cuda.runtime
    stream = cupy.cuda.Stream(non_blocking=True)
    event = cupy.cuda.Event(block=False, disable_timing=True, interprocess=True)
    bufs = [rt.malloc(SIZE) for _ in range(BUFS)]
    here, there = ctx.Pipe()
    p = ctx.Process(target=consumer, args=(there, mode, rt.ipcGetEventHandle(event.ptr)))
    p.start()
    assert here.recv_bytes() == b"ready"

    def send(i):
        if zeroed:
            rt.memsetAsync(bufs[i % BUFS], 0, SIZE, stream.ptr)
            rt.eventRecord(event.ptr, stream.ptr)
        here.send_bytes(b"t")

    warm = BUFS * 4
    total = warm + n
    start = None
    for i in range(BUFS):
        send(i)
    for i in range(BUFS, total + BUFS):
        here.recv_bytes()
        if i - BUFS == warm:
            start = time.perf_counter()
        if i < total:
            send(i)
    elapsed = time.perf_counter() - start
    here.send_bytes(b"stop")
    p.join()
    stream.synchronize()
    for b in bufs:
        rt.free(b)
    return n / elapsed


def main():
    n = 20000
    if "--n" in sys.argv:
        n = int(sys.argv[sys.argv.index("--n") + 1])
    import cupy

    print(f"GPU 0: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, driver {cupy.cuda.runtime.driverGetVersion()}")
    ctx = mp.get_context("spawn")
    base = rate(ctx, "none", n, zeroed=False)
    print(f"pipe only (no memset, no event): {base:,.0f} tokens/s")
    rates = {m: rate(ctx, m, n, zeroed=True) for m in MODES}
    for m in MODES:
        extra = (1 / rates[m] - 1 / rates["none"]) * 1e6
        print(f"memset + event record per token, consumer {m:9s}: {rates[m]:9,.0f} tokens/s, {extra:+7.1f} us a token over none")


if __name__ == "__main__":
    main()
