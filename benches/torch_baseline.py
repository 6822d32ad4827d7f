"""torch.multiprocessing baseline for benches/handoff.rs: the same workloads, printed as
`row <key> <median_us> <p99_us>` (for the rate row: `row c_rate <tensors_per_s> 0`).

    python3 benches/torch_baseline.py [--quick]
"""
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

SIZES = [("4K", 4 << 10), ("1M", 1 << 20), ("64M", 64 << 20), ("1G", 1 << 30)]


def summarize(us):
    us = sorted(us)
    return us[round((len(us) - 1) * 0.5)], us[round((len(us) - 1) * 0.99)]


def row(key, a, b):
    print(f"row {key} {a:.3f} {b:.3f}", flush=True)


def drop_and_ack(q, ack):
    torch.cuda.init()
    while True:
        t = q.get()
        if t is None:
            break
        del t
        ack.put(1)


def add_and_ack(q, ack):
    """Row s's consumer that uses each tensor: adds 1 to it (a kernel, no host wait), then
    drops it and acknowledges."""
    torch.cuda.init()
    while True:
        t = q.get()
        if t is None:
            break
        t.add_(1)
        del t
        ack.put(1)


def count_then_ack(q, ack, n, warm):
    torch.cuda.init()
    for i in range(n):
        t = q.get()
        del t
        if i + 1 == warm:
            ack.put(warm)
    ack.put(n)


def fresh_rate(ctx, dev, n, window, zeroed, use=False):
    """Row s: n fresh 1 MiB tensors, at most `window` unacknowledged, to a consumer that drops
    each (or adds 1 to each first); tensors per second."""
    make = torch.zeros if zeroed else torch.empty
    q, ack = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=add_and_ack if use else drop_and_ack, args=(q, ack))
    p.start()

    def send(k):
        for _ in range(k):
            q.put(make(1 << 20, dtype=torch.uint8, device=dev))

    send(window)  # warm-up, as ours
    for _ in range(window):
        ack.get()
    start = time.perf_counter()
    send(window)
    for _ in range(window, n):
        ack.get()
        send(1)
    for _ in range(window):
        ack.get()
    secs = time.perf_counter() - start
    q.put(None)
    p.join()
    return n / secs


def hold_latest(q, ack):
    torch.cuda.init()
    latest = None
    while True:
        d = q.get()
        if d is None:
            break
        step = int(d["step"].item())
        latest = d
        ack.put(step)
    del latest


def raw_open(q, ack):
    import cupy

    cupy.cuda.runtime.setDevice(0)
    cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))
    while True:
        h = q.get()
        if h is None:
            break
        start = time.perf_counter()
        ptr = cupy.cuda.runtime.ipcOpenMemHandle(h, 1)
        opened = (time.perf_counter() - start) * 1e6
        cupy.cuda.runtime.ipcCloseMemHandle(ptr)
        ack.put(opened)


def raw_open_profile(ctx):
    """The driver's own cost of opening a fresh allocation's IPC handle, through cupy."""
    try:
        import cupy
    except ImportError:
        print("cupy not available: no driver baseline for handle opening", flush=True)
        return
    q, ack = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=raw_open, args=(q, ack))
    p.start()
    for name, nbytes, n in [
        ("4K", 4 << 10, 20),
        ("1M", 1 << 20, 20),
        ("64M", 64 << 20, 20),
        ("1G", 1 << 30, 20),
        ("13.5G", 13_476_000_000, 3),
    ]:
        us = []
        for _ in range(n + 1):
            ptr = cupy.cuda.runtime.malloc(nbytes)
            q.put(cupy.cuda.runtime.ipcGetMemHandle(ptr))
            us.append(ack.get())
            cupy.cuda.runtime.free(ptr)
        row(f"p_rawopen_{name}", *summarize(us[1:]))
    q.put(None)
    p.join()


def echo(conn):
    while conn.recv() is not None:
        conn.send(None)


def wakeup_profile(ctx):
    """A machine baseline with nothing of torch's or ours: a multiprocessing.Pipe round trip of
    an empty message, back to back and after both processes idled 7 ms (the time the update
    kernels of row d take)."""
    a, b = ctx.Pipe()
    p = ctx.Process(target=echo, args=(b,))
    p.start()
    for key, pause in [("w_hot", 0.0), ("w_paused", 0.007)]:
        us = []
        for i in range(220):
            if pause:
                time.sleep(pause)
            start = time.perf_counter()
            a.send(0)
            a.recv()
            if i >= 20:
                us.append((time.perf_counter() - start) * 1e6)
        row(key, *summarize(us))
    a.send(None)
    p.join()


class Consumer:
    def __init__(self, ctx):
        self.q, self.ack = ctx.Queue(), ctx.Queue()
        self.p = ctx.Process(target=drop_and_ack, args=(self.q, self.ack))
        self.p.start()

    def round(self, t):
        start = time.perf_counter()
        self.q.put(t)
        self.ack.get()
        return (time.perf_counter() - start) * 1e6

    def finish(self):
        self.q.put(None)
        self.p.join()


def llama7b_shapes():
    vocab, d, ff, layers = 32000, 4096, 11008, 32
    v = [("model.embed_tokens.weight", (vocab, d))]
    for l in range(layers):
        p = f"model.layers.{l}"
        for n in ["q_proj", "k_proj", "v_proj", "o_proj"]:
            v.append((f"{p}.self_attn.{n}.weight", (d, d)))
        v.append((f"{p}.mlp.gate_proj.weight", (ff, d)))
        v.append((f"{p}.mlp.up_proj.weight", (ff, d)))
        v.append((f"{p}.mlp.down_proj.weight", (d, ff)))
        v.append((f"{p}.input_layernorm.weight", (d,)))
        v.append((f"{p}.post_attention_layernorm.weight", (d,)))
    v.append(("model.norm.weight", (d,)))
    v.append(("lm_head.weight", (vocab, d)))
    return v


def main():
    quick = "--quick" in sys.argv
    rounds, warm = (200, 20) if quick else (1000, 100)
    ctx = mp.get_context("spawn")
    dev = torch.device("cuda", 0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    raw_open_profile(ctx)
    wakeup_profile(ctx)

    for name, nbytes in SIZES:  # a: same storage resent
        c = Consumer(ctx)
        t = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        us = [c.round(t) for _ in range(rounds + warm)][warm:]
        c.finish()
        row(f"a_{name}", *summarize(us))

    for name, nbytes in SIZES:  # b: a fresh allocation every round
        c = Consumer(ctx)
        us = []
        for i in range(rounds + warm):
            t = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
            torch.cuda.synchronize()
            dt = c.round(t)
            del t
            if i >= warm:
                us.append(dt)
        c.finish()
        row(f"b_{name}", *summarize(us))

    n = 5000 if quick else 20000  # c: one-way throughput
    pool = [torch.zeros(4096, dtype=torch.uint8, device=dev) for _ in range(64)]
    q, ack = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=count_then_ack, args=(q, ack, n + 8, 8))
    p.start()
    for t in pool[:8]:
        q.put(t)
    # Timed from when the consumer has received the warm-up (its CUDA set up), as ours is.
    ack.get()
    start = time.perf_counter()
    for i in range(n):
        q.put(pool[i % len(pool)])
    ack.get()
    secs = time.perf_counter() - start
    p.join()
    row("c_rate", n / secs, 0)

    shapes = llama7b_shapes()  # d: weight publish
    weights = {k: torch.zeros(s, dtype=torch.bfloat16, device=dev) for k, s in shapes}
    weights["step"] = torch.zeros(1, dtype=torch.int64, device=dev)
    total = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"weights: {len(shapes)} tensors, {total / 1e9:.2f} GB", flush=True)
    q, ack = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=hold_latest, args=(q, ack))
    p.start()
    # Untimed warm-up: the consumer starts CUDA on a small dict first.
    q.put({"step": torch.zeros(1, dtype=torch.int64, device=dev)})
    ack.get()

    def publish(s):
        weights["step"].fill_(s)
        torch.cuda.synchronize()
        start = time.perf_counter()
        q.put(weights)
        got = ack.get()
        assert got == s, (got, s)
        return (time.perf_counter() - start) * 1e6

    first = publish(1)
    again = []
    for s in range(2, 12):
        for k, _ in shapes:
            weights[k].add_(1.0)
        again.append(publish(s))
    q.put(None)
    p.join()
    row("d_first", first, first)
    row("d_republish", *summarize(again))
    del weights
    torch.cuda.empty_cache()

    t = torch.zeros(1 << 20, dtype=torch.uint8, device=dev)  # e: fan-out to 8
    cs = [Consumer(ctx) for _ in range(8)]
    us = []
    for i in range(rounds + warm):
        start = time.perf_counter()
        for c in cs:
            c.q.put(t)
        for c in cs:
            c.ack.get()
        if i >= warm:
            us.append((time.perf_counter() - start) * 1e6)
    for c in cs:
        c.finish()
    row("e_fanout8", *summarize(us))

    n = 5000 if quick else 20000  # s: fresh tensors
    row("s_fresh1M", fresh_rate(ctx, dev, n, 64, True), 0)
    row("s_empty1M", fresh_rate(ctx, dev, n, 64, False), 0)
    row("s_use", fresh_rate(ctx, dev, n, 64, True, use=True), 0)


if __name__ == "__main__":
    main()
