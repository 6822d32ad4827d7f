"""An unchanged torch.multiprocessing program: a producer, four consumers started with spawn, one
of them SIGKILLed while it holds what it received. ``--install`` adds the one call
(``cuda_mp.torch.install()``), ``--queues`` makes it ``install(queues=True)``. Prints one JSON line: whether every consumer saw the right values,
the producer's allocated CUDA memory still held for the killed consumer, and how long after the
kill it was back (None: not within 5 s)."""

import json
import os
import signal
import sys
import time

import torch
import torch.multiprocessing as mp

SHARED = 48  # tensors for the three consumers that live
HELD = 16  # tensors for the one that is killed
NUMEL = 256 * 1024  # 1 MiB of float32 each


def consumer(q, done):
    while True:
        item = q.get()
        if item is None:
            return
        i, t = item
        done.put((i, bool(torch.all(t == float(i)).item())))
        del t, item


def victim(q, done):
    held = []
    for _ in range(HELD):
        i, t = q.get()
        held.append(t)
        done.put((i, bool(torch.all(t == float(i)).item())))
    time.sleep(600)


def main():
    queues = "--queues" in sys.argv
    install = "--install" in sys.argv or queues
    if install:
        import cuda_mp.torch

        cuda_mp.torch.install(queues=queues)
    ctx = mp.get_context("spawn")
    shared_q, victim_q, done = ctx.Queue(), ctx.Queue(), ctx.Queue()
    consumers = [ctx.Process(target=consumer, args=(shared_q, done)) for _ in range(3)]
    killed = ctx.Process(target=victim, args=(victim_q, done))
    for p in consumers + [killed]:
        p.start()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for i in range(SHARED + HELD):
        t = torch.full((NUMEL,), float(i), device="cuda")
        (victim_q if i >= SHARED else shared_q).put((i, t))
        del t
    seen = dict(done.get(timeout=120) for _ in range(SHARED + HELD))
    ok = len(seen) == SHARED + HELD and all(seen.values())
    for _ in consumers:
        shared_q.put(None)
    for p in consumers:
        p.join(60)
    torch.cuda.synchronize()
    # What the exited consumers released goes back (torch: at ipc_collect), within 2 s.
    settle = time.monotonic()
    while torch.cuda.memory_allocated() - base > HELD * NUMEL * 4 and time.monotonic() - settle < 2:
        if not install:
            torch.cuda.ipc_collect()
        time.sleep(0.002)
    held = torch.cuda.memory_allocated() - base
    os.kill(killed.pid, signal.SIGKILL)
    at = time.monotonic()
    killed.join(30)
    back = None
    while time.monotonic() - at < 5:
        if torch.cuda.memory_allocated() <= base:
            back = time.monotonic() - at
            break
        if not install:
            torch.cuda.ipc_collect()
        time.sleep(0.002)
    left = torch.cuda.memory_allocated() - base
    print(json.dumps({"install": install, "queues": queues, "ok": ok, "held_mib": held / 2**20, "left_mib": left / 2**20, "back_s": back}))


if __name__ == "__main__":
    main()
