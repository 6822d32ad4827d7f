"""The workload of examples/16_kv_cache.rs with torch.multiprocessing: a prefill process sends
each request's KV blocks (2 MiB bf16 tensors, fresh from PyTorch's caching allocator) to one of
two decode processes through a Queue; each decode process checks every value of every block on
the GPU, appends a block of its own, keeps 4 requests running and reports each finished one.

    python3 benches/kv_cache_torch.py [--requests 400]

Prints `torch.mp blocks/s: <rate>` (what the example reads) and the requests per second.
"""

import sys
import time

import torch
import torch.multiprocessing as mp

BLOCK = (32, 2, 16, 8, 128)
RUNNING = 4
WINDOW = 16


def block_value(rid, b):
    return float((rid * 7 + b * 3) % 251 + 1)


def prompt_blocks(rid):
    return (rid * 5 + 3) % 8 + 1


def decode(requests, finished, report):
    dev = torch.device("cuda", 0)
    wrong = torch.zeros(1, dtype=torch.int64, device=dev)
    running = []
    checked = 0
    while True:
        item = requests.get()
        if item is None:
            break
        rid, blocks = item
        for b, block in enumerate(blocks):
            wrong += (block != block_value(rid, b)).sum()
        checked += len(blocks)
        blocks.append(torch.full(BLOCK, 512.0, dtype=torch.bfloat16, device=dev))
        running.append((rid, blocks))
        if len(running) > RUNNING:
            rid, done = running.pop(0)
            wrong += (done[-1] != 512.0).sum()
            del done
            finished.put(rid)
    for rid, done in running:
        del done
        finished.put(rid)
    running.clear()
    report.put((checked, int(wrong.item())))


def main():
    n = int(sys.argv[sys.argv.index("--requests") + 1]) if "--requests" in sys.argv else 400
    ctx = mp.get_context("spawn")
    dev = torch.device("cuda", 0)
    decoders = []
    for _ in range(2):
        q, fin, rep = ctx.Queue(), ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=decode, args=(q, fin, rep))
        p.start()
        decoders.append([q, fin, rep, p, 0])
    for i, d in enumerate(decoders):  # warm-up, as the example's
        rid = 1000000 + i
        d[0].put((rid, [torch.full(BLOCK, block_value(rid, 0), dtype=torch.bfloat16, device=dev)]))
    start = time.perf_counter()
    sent = 0
    for rid in range(n):
        d = decoders[rid % 2]
        if d[4] == WINDOW:
            d[1].get()
            d[4] -= 1
        count = prompt_blocks(rid)
        blocks = [torch.full(BLOCK, block_value(rid, b), dtype=torch.bfloat16, device=dev) for b in range(count)]
        sent += count
        d[0].put((rid, blocks))
        del blocks
        d[4] += 1
    checked, wrong = 0, 0
    for d in decoders:
        d[0].put(None)
        for _ in range(d[4] + 1):
            d[1].get()
        c, w = d[2].get()
        checked, wrong = checked + c, wrong + w
    # Every block is checked and reported: the decode processes' exit is not part of the rate.
    secs = time.perf_counter() - start
    for d in decoders:
        d[3].join()
    assert wrong == 0, f"{wrong} values differed"
    assert checked == sent + 2, "a decode process missed blocks"
    print(f"torch.mp requests/s: {n / secs:.0f}", flush=True)
    print(f"torch.mp blocks/s: {sent / secs:.0f}", flush=True)


if __name__ == "__main__":
    main()
