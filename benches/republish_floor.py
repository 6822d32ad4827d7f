"""The floor under row d's re-publish, the driver and the machine alone (cupy, no cuda-mp).

Row d of bench-handoff re-publishes 7B weights after the producer updated every tensor in place
(291 kernels, about 7 ms of GPU work); the consumer reads the step counter of each publish and
acknowledges. This script does the same round with nothing of cuda-mp: a producer process owns
the weights (one `cudaMalloc` of 13.48 GB, the 291 tensors as slices of it) and an interprocess
event; a consumer process has opened both once. One round, timed from after the producer's
synchronize to its receipt of the acknowledgement:

    producer: cudaEventRecord on its stream, then signals the step
    consumer: cudaStreamWaitEvent on its stream, cudaMemcpyAsync of the 8-byte step to pinned
              host memory, cudaStreamSynchronize, checks the step, acknowledges

By what happens between rounds (`work`):

    update   291 in-place kernels (`w += 1` on each tensor, fp16) and the step's fill, then a
             synchronize: row d's re-publish
    pause    a 7 ms sleep of the producer, no GPU work (the step stays 0)
    none     nothing: back to back (the step stays 0)

and how the two processes signal each other (`signal`):

    pipe     a blocking read of a pipe (`os.read`), woken by the other's `os.write`: each side
             sleeps in the kernel while it waits, as a blocking receive does
    spin     a busy loop on a shared-memory word: neither side sleeps

Each row also splits the round (medians, both processes on CLOCK_MONOTONIC): the producer's
send (event record and signal), until the consumer woke, the consumer's wait enqueued, its
read of the step, and until the producer had the acknowledgement.

So `pipe` rows are what any library whose processes sleep between messages pays on this machine
(two wake-ups after an idle period, plus the GPU's switch between the two processes' contexts
after `update`); `spin` rows take the wake-ups out and leave the driver and the GPU.

    python3 benches/republish_floor.py [--rounds N]     # default 30 rounds a case
"""

import multiprocessing as mp
import os
import statistics
import sys
import time

WORKS = ["none", "pause", "update"]
SIGNALS = ["spin", "pipe"]
WAITS = ["if not complete", "always"]
EVENT_FLAGS = 0x2 | 0x4  # cudaEventDisableTiming | cudaEventInterprocess
D2H = 2  # cudaMemcpyDeviceToHost


def llama7b_shapes():
    """The 291 weight shapes of row d (examples/common/llama.rs)."""
    vocab, d, ff, layers = 32000, 4096, 11008, 32
    v = [(vocab, d)]
    for _ in range(layers):
        v += [(d, d)] * 4 + [(ff, d), (ff, d), (d, ff), (d,), (d,)]
    v += [(d,), (vocab, d)]
    return v


class Signal:
    """One direction of a round's signal: a pipe (a `Connection` used as a bare pipe, without
    its framing) or a shared-memory word. A round's value is its number, negated to say that
    the step read was wrong."""

    def __init__(self, kind, word, conn):
        self.kind, self.word, self.fd = kind, word, conn.fileno()

    def send(self, value):
        if self.kind == "spin":
            self.word[0] = value
        else:
            os.write(self.fd, value.to_bytes(8, "little", signed=True))

    def recv(self, round_):
        if self.kind == "spin":
            while abs(int(self.word[0])) != round_:
                pass
            return int(self.word[0])
        return int.from_bytes(os.read(self.fd, 8), "little", signed=True)


def complete(rt, ev):
    """Whether the event has completed (cudaEventQuery), as cuda-mp asks before it waits."""
    import cupy

    try:
        return rt.eventQuery(ev) == 0
    except cupy.cuda.runtime.CUDARuntimeError as e:
        if e.status != 600:  # cudaErrorNotReady
            raise
        return False


def consumer(mem, event, step_offset, shm_name, conns, kind, waits, rounds, fills, ready):
    import ctypes

    import cupy
    import numpy as np
    from multiprocessing import shared_memory

    rt = cupy.cuda.runtime
    cupy.cuda.Device(0).use()
    rt.free(rt.malloc(1))  # the context exists before the opens
    stream = cupy.cuda.Stream(non_blocking=True)
    base = rt.ipcOpenMemHandle(mem, 1)  # cudaIpcMemLazyEnablePeerAccess
    ev = rt.ipcOpenEventHandle(event)
    host = rt.hostAlloc(8, 0)  # cudaHostAllocDefault: pinned
    step = ctypes.c_int64.from_address(host)
    shm = shared_memory.SharedMemory(name=shm_name)
    words = np.ndarray((2,), dtype=np.int64, buffer=shm.buf)
    request = Signal(kind, words[0:1], conns[0])
    ack = Signal(kind, words[1:2], conns[1])
    # A first read outside the rounds: the context and the mapping are warm.
    rt.memcpyAsync(host, base + step_offset, 8, D2H, stream.ptr)
    stream.synchronize()
    ready.set()
    clock = time.perf_counter  # CLOCK_MONOTONIC: one clock for both processes
    marks = []
    for r in range(1, rounds + 1):
        s = request.recv(r)
        woken = clock()
        if waits == "always" or not complete(rt, ev):
            rt.streamWaitEvent(stream.ptr, ev, 0)
        waited = clock()
        rt.memcpyAsync(host, base + step_offset, 8, D2H, stream.ptr)
        stream.synchronize()
        read = clock()
        ack.send(s if step.value == (s if fills else 0) else -s)
        marks.append((woken, waited, read, clock()))
    conns[1].send(marks)  # after the rounds: the bare pipe is empty
    del words
    shm.close()
    rt.freeHost(host)
    rt.eventDestroy(ev)
    rt.ipcCloseMemHandle(base)


def case(ctx, weights, base, step_offset, stream, work, kind, waits, rounds):
    import cupy
    import numpy as np
    from multiprocessing import shared_memory

    rt = cupy.cuda.runtime
    event = rt.eventCreateWithFlags(EVENT_FLAGS)
    shm = shared_memory.SharedMemory(create=True, size=16)
    words = np.ndarray((2,), dtype=np.int64, buffer=shm.buf)
    words[:] = 0
    requests_in, requests_out = ctx.Pipe(duplex=False)
    acks_in, acks_out = ctx.Pipe(duplex=False)
    ready = ctx.Event()
    p = ctx.Process(
        target=consumer,
        args=(
            rt.ipcGetMemHandle(base),
            rt.ipcGetEventHandle(event),
            step_offset,
            shm.name,
            (requests_in, acks_out),
            kind,
            waits,
            rounds,
            work == "update",
            ready,
        ),
    )
    p.start()
    while not ready.wait(0.5):
        if not p.is_alive():
            raise SystemExit(f"the consumer ended before its first round (exit code {p.exitcode})")
    request = Signal(kind, words[0:1], requests_out)
    ack = Signal(kind, words[1:2], acks_in)
    step = cupy.ndarray((1,), dtype=cupy.int64, memptr=cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(base + step_offset, 8, None), 0))
    with stream:
        step.fill(0)
    stream.synchronize()
    times, starts, sent, acked = [], [], [], []
    with stream:
        for s in range(1, rounds + 1):
            if work == "update":
                for w in weights:
                    w += 1
                step.fill(s)
            elif work == "pause":
                time.sleep(0.007)
            stream.synchronize()
            start = time.perf_counter()
            starts.append(start)
            rt.eventRecord(event, stream.ptr)
            request.send(s)
            sent.append(time.perf_counter())
            got = ack.recv(s)
            acked.append(time.perf_counter())
            times.append((acked[-1] - start) * 1e6)
            assert got == s, f"round {s}: the consumer read the step of another round"
    marks = acks_in.recv()
    p.join(120)
    # Medians of each part of a round, us: the send (event record and signal), until the
    # consumer woke, its wait's enqueue, its read of the step, until the producer had the ack.
    parts = []
    for i, (woken, waited, read, answered) in enumerate(marks):
        parts.append(
            (
                (sent[i] - starts[i]) * 1e6,
                (woken - sent[i]) * 1e6,
                (waited - woken) * 1e6,
                (read - waited) * 1e6,
                (acked[i] - read) * 1e6,
            )
        )
    split = [statistics.median(x[j] for x in parts) for j in range(5)]
    for c in (requests_in, requests_out, acks_in, acks_out):
        c.close()
    del words
    shm.close()
    shm.unlink()
    rt.eventDestroy(event)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(len(times) * 0.99))], split


def main():
    rounds = 30
    if "--rounds" in sys.argv:
        rounds = int(sys.argv[sys.argv.index("--rounds") + 1])
    import cupy

    rt = cupy.cuda.runtime
    print(f"GPU 0: {rt.getDeviceProperties(0)['name'].decode()}, driver {rt.driverGetVersion()}, {os.cpu_count()} CPUs")
    shapes = llama7b_shapes()
    sizes = [2 * (s[0] * (s[1] if len(s) > 1 else 1)) for s in shapes]
    total = sum(sizes) + 8
    base = rt.malloc(total)  # one allocation, as row d's bundle
    weights, offset = [], 0
    for shape, size in zip(shapes, sizes):
        mem = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(base + offset, size, None), 0)
        weights.append(cupy.ndarray(shape, dtype=cupy.float16, memptr=mem))
        offset += size
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for w in weights:
            w.fill(0)
    stream.synchronize()
    print(f"weights: {len(shapes)} tensors, {total / 1e9:.2f} GB in one allocation; {rounds} rounds a case")
    ctx = mp.get_context("spawn")
    print(
        f"{'between rounds':14s} {'signal':6s} {'median us':>9s} {'p99 us':>9s} | medians, us: "
        "send, until woken, wait enqueued, step read, until acknowledged"
    )
    for waits in WAITS:
        print(f"the consumer waits on the event: {waits}")
        for work in WORKS:
            for kind in SIGNALS:
                med, p99, split = case(ctx, weights, base, offset, stream, work, kind, waits, rounds)
                print(f"{work:14s} {kind:6s} {med:9.1f} {p99:9.1f} | " + " / ".join(f"{x:.1f}" for x in split))
    rt.free(base)


if __name__ == "__main__":
    main()
