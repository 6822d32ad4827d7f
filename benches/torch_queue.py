"""torch.multiprocessing baseline for benches/queue.rs: one torch.multiprocessing.Queue drained
by 1 and 4 consumer processes, 4 KiB uint8 CPU tensors, fresh (a new tensor per put) or resent
(the same 8 tensors again and again), the producer at most 1,024 tensors ahead of the consumers
(each returns a credit per 256 tensors), as in benches/queue.rs. Prints
`row <key> <tensors_per_s>` per workload (the median of the rounds), then `row rt_int <us>` and
`row rt_tensor <us>`: the median round trip of an int and of a resent 4 KiB tensor put on a
queue whose consumer drops it and puts an acknowledgement on a second queue; or `skip <why>`
when torch is not installed.

    python3 benches/torch_queue.py [--quick] [--n N] [--rounds R]
"""
import statistics
import sys
import time

try:
    import torch
    import torch.multiprocessing as mp
except ImportError:
    print("skip torch is not installed", flush=True)
    sys.exit(0)

BYTES = 4096
POOL = 8
WINDOW = 1024
CREDIT = 256


def consume(q, ready, credit, done):
    ready.put(1)
    n = 0
    while True:
        t = q.get()
        if t is None:
            break
        del t
        n += 1
        if n % CREDIT == 0:
            credit.put(1)
    done.put(n)


def one_round(ctx, consumers, mode, n):
    q, ready, credit, done = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    ps = [ctx.Process(target=consume, args=(q, ready, credit, done)) for _ in range(consumers)]
    for p in ps:
        p.start()
    for _ in ps:
        ready.get()
    pool = [torch.zeros(BYTES, dtype=torch.uint8) for _ in range(POOL)]
    returned = 0
    start = time.perf_counter()
    for i in range(n):
        while i >= returned * CREDIT + WINDOW:
            credit.get()
            returned += 1
        t = torch.zeros(BYTES, dtype=torch.uint8) if mode == "fresh" else pool[i % POOL]
        q.put(t)
    for _ in ps:
        q.put(None)
    got = sum(done.get() for _ in ps)
    secs = time.perf_counter() - start
    for p in ps:
        p.join()
    assert got == n, (got, n)
    return n / secs


def acknowledge(q, acks):
    while True:
        x = q.get()
        if x is None:
            break
        del x
        acks.put(1)


def round_trip_us(ctx, item, rounds):
    q, acks = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=acknowledge, args=(q, acks))
    p.start()
    times = []
    for _ in range(50 + rounds):
        start = time.perf_counter()
        q.put(item)
        acks.get()
        times.append(time.perf_counter() - start)
    q.put(None)
    p.join()
    return statistics.median(times[50:]) * 1e6


def arg(name, default):
    if name in sys.argv:
        return int(sys.argv[sys.argv.index(name) + 1])
    return default


def main():
    quick = "--quick" in sys.argv
    n = arg("--n", 5000 if quick else 20000)
    rounds = arg("--rounds", 1 if quick else 3)
    ctx = mp.get_context("spawn")
    print(f"torch {torch.__version__}, sharing strategy {mp.get_sharing_strategy()}", flush=True)
    for consumers in (1, 4):
        for mode in ("fresh", "resent"):
            one_round(ctx, consumers, mode, max(n // 10, 1))  # warm-up
            rates = [one_round(ctx, consumers, mode, n) for _ in range(rounds)]
            print(f"row c{consumers}_{mode} {statistics.median(rates):.1f}", flush=True)
    trips = 1000 if quick else 5000
    print(f"row rt_int {round_trip_us(ctx, 7, trips):.1f}", flush=True)
    tensor = torch.zeros(BYTES, dtype=torch.uint8)
    print(f"row rt_tensor {round_trip_us(ctx, tensor, trips):.1f}", flush=True)


if __name__ == "__main__":
    main()
