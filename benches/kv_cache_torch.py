"""The workload of examples/16_kv_cache.rs with torch.multiprocessing: a prefill process sends
each request's KV blocks (2 MiB bf16 tensors, fresh from PyTorch's caching allocator) to one of
two decode processes through a Queue; each decode process checks every value of every block on
the GPU, appends a block of its own, keeps 4 requests running and reports each finished one.

As in the example, both sides work in steps: a prefill step writes the blocks of `--batch`
requests, then puts each on its decode process's queue; a decode step takes every request that
has arrived. The clock starts once both decode processes have set up CUDA on a first request.

    python3 benches/kv_cache_torch.py [--requests 400] [--batch 4] [--no-kernels]

Prints `torch.mp blocks/s: <rate>` (what the example reads) and the requests per second.
`--no-kernels` leaves every kernel out of the timed part (blocks from `torch.empty`, nothing
checked; the warm-up requests before the clock still run theirs): what torch.mp's transport of
the blocks alone allows, the most this workload could reach with it.
"""

import queue
import sys
import time

import torch
import torch.multiprocessing as mp

BLOCK = (32, 2, 16, 8, 128)
RUNNING = 4
WINDOW = 16
MAX_BATCH = 2 * (WINDOW - RUNNING - 1)


def block_value(rid, b):
    return float((rid * 7 + b * 3) % 251 + 1)


def prompt_blocks(rid):
    return (rid * 5 + 3) % 8 + 1


def arg(name, default):
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def new_block(value, dev, kernels):
    if kernels:
        return torch.full(BLOCK, value, dtype=torch.bfloat16, device=dev)
    return torch.empty(BLOCK, dtype=torch.bfloat16, device=dev)


def decode(requests, finished, report, kernels):
    dev = torch.device("cuda", 0)
    wrong = torch.zeros(1, dtype=torch.int64, device=dev)
    checked = 0

    def check(rid, blocks):
        nonlocal wrong, checked
        if kernels:
            for b, block in enumerate(blocks):
                wrong += (block != block_value(rid, b)).sum()
        checked += len(blocks)

    def check_appended(block):
        nonlocal wrong
        if kernels:
            wrong += (block != 512.0).sum()

    # The first request warms the process up and finishes at once.
    rid, blocks = requests.get()
    check(rid, blocks)
    torch.cuda.synchronize(dev)
    del blocks
    finished.put(rid)
    running = []
    stop = False
    while not stop:
        # A decode step: every request that has arrived.
        step = [requests.get()]
        while True:
            try:
                step.append(requests.get_nowait())
            except queue.Empty:
                break
        for item in step:
            if item is None:
                stop = True
                break
            rid, blocks = item
            check(rid, blocks)
            blocks.append(new_block(512.0, dev, kernels))
            running.append((rid, blocks))
            if len(running) > RUNNING:
                rid, done = running.pop(0)
                check_appended(done[-1])
                del done
                finished.put(rid)
    for rid, done in running:
        check_appended(done[-1])
        del done
        finished.put(rid)
    running.clear()
    report.put((checked, int(wrong.item())))


def main():
    n = arg("--requests", 400)
    batch = arg("--batch", 4)
    kernels = "--no-kernels" not in sys.argv
    assert 1 <= batch <= MAX_BATCH, f"--batch must be 1 to {MAX_BATCH}"
    ctx = mp.get_context("spawn")
    dev = torch.device("cuda", 0)
    decoders = []
    for _ in range(2):
        q, fin, rep = ctx.Queue(), ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=decode, args=(q, fin, rep, kernels))
        p.start()
        decoders.append([q, fin, rep, p, 0])
    for i, d in enumerate(decoders):  # warm-up, as the example's, before the clock starts
        rid = 1000000 + i
        d[0].put((rid, [torch.full(BLOCK, block_value(rid, 0), dtype=torch.bfloat16, device=dev)]))
    for d in decoders:
        d[1].get()
    start = time.perf_counter()
    sent = 0
    step = []
    for rid in range(n):
        d = decoders[rid % 2]
        if d[4] == WINDOW:
            d[1].get()
            d[4] -= 1
        count = prompt_blocks(rid)
        blocks = [new_block(block_value(rid, b), dev, kernels) for b in range(count)]
        sent += count
        d[4] += 1
        step.append((d, (rid, blocks)))
        del blocks
        # The step's prompts are written: each request goes to its decode process.
        if len(step) == batch or rid + 1 == n:
            for d, item in step:
                d[0].put(item)
            step.clear()
    checked, wrong = 0, 0
    for d in decoders:
        d[0].put(None)
        for _ in range(d[4]):
            d[1].get()
        c, w = d[2].get()
        checked, wrong = checked + c, wrong + w
    # Every block is checked and reported: the decode processes' exit is not part of the rate.
    secs = time.perf_counter() - start
    for d in decoders:
        d[3].join()
    assert wrong == 0, f"{wrong} values differed"
    assert checked == sent + 2, "a decode process missed blocks"
    if not kernels:
        print("no kernels: nothing was written or checked", flush=True)
    print(f"torch.mp requests/s: {n / secs:.0f}", flush=True)
    print(f"torch.mp blocks/s: {sent / secs:.0f}", flush=True)


if __name__ == "__main__":
    main()
