"""Python -> Rust weight publish, beside torch.multiprocessing on the same workload.

A PyTorch process packs 7B-shaped weights (291 bf16 tensors, 13.5 GB, plus a step counter)
with cuda_mp.pack_state_dict and publishes them to a Rust consumer (examples/14_python_peer
--kind bundle), which keeps the latest weights and answers with the step it read: the first
publish to a fresh consumer, then re-publishes after every tensor was updated in place.
torch.multiprocessing does the same with its Queue and a torch consumer process, in this run.

    python3 benches/python_publish.py [--rust-peer PATH] [--no-torch] [--sample]

With --sample, every thread of the Rust consumer is sampled every 0.2 ms while it runs (its
current system call and kernel wait channel, from /proc/PID/task/TID/{syscall,wchan}: no
tracing tools needed), and the states seen during the first publish's receive and reply are
printed: where a stall inside a system call happens.

Needs a GPU, torch, and the cuda_mp package; the Rust peer is built by
`cargo build --release --example 14_python_peer`.
"""

import collections
import os
import subprocess
import sys
import threading
import time

import torch
import torch.multiprocessing as mp

import cuda_mp

# The same weights and the same torch consumer as the handoff bench's baseline (this folder).
from torch_baseline import hold_latest, llama7b_shapes

ROUNDS = 10


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def p99(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]


def publish_rounds(state, send, wait_step):
    """First publish, then ROUNDS re-publishes after an in-place update; microseconds."""

    def one(step):
        state["step"].fill_(step)
        torch.cuda.synchronize()
        start = time.perf_counter()
        send(step)
        got = wait_step()
        assert got == step, (got, step)
        return (time.perf_counter() - start) * 1e6

    first = one(1)
    again = []
    for step in range(2, 2 + ROUNDS):
        with torch.no_grad():
            for name, t in state.items():
                if name != "step":
                    t.add_(1)
        again.append(one(step))
    return first, again


class Sampler:
    """Samples what each thread of process `pid` is doing until stopped."""

    def __init__(self, pid):
        self.samples = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, args=(pid,), daemon=True)
        self.thread.start()

    def run(self, pid):
        while not self.stopped.is_set():
            now = time.monotonic_ns()
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                return
            for tid in tids:
                base = f"/proc/{pid}/task/{tid}"
                try:
                    with open(base + "/comm") as f:
                        comm = f.read().strip()
                    with open(base + "/syscall") as f:
                        call = f.read().split()[0]
                    with open(base + "/wchan") as f:
                        wchan = f.read().strip()
                    with open(base + "/stat") as f:
                        state = f.read().rsplit(")", 1)[1].split()[0]
                except OSError:
                    continue
                self.samples.append((now, comm, state, call, wchan))
            time.sleep(0.0002)

    def report(self, name, start, end):
        self.stopped.set()
        seen = collections.Counter(s[1:] for s in self.samples if start <= s[0] <= end)
        print(f"  sampled during {name} ({(end - start) / 1e3:.1f} us):")
        for (comm, state, call, wchan), n in seen.most_common(12):
            print(f"    {n:5d} x {comm:18s} state {state} syscall {call:>7s} wchan {wchan}")


def ours(rust_peer, sample=False):
    meta = {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in llama7b_shapes()}
    meta["step"] = torch.empty(1, dtype=torch.int64, device="meta")
    layout = os.environ.get("PACK_AFTER_TORCH") == "1"
    if layout:  # the weights made by PyTorch first, then packed (PyTorch's memory freed after)
        weights = {n: torch.zeros(t.shape, dtype=t.dtype, device="cuda") for n, t in meta.items()}
        packed = cuda_mp.pack_state_dict(weights)
        del weights
        torch.cuda.empty_cache()
    else:  # packed from the shapes: no PyTorch allocation before it
        packed = cuda_mp.pack_state_dict(meta, device="cuda")
    replies = cuda_mp.Listener(cuda_mp.HostTensor)
    peer = subprocess.Popen([rust_peer, "--kind", "bundle", "--reply-to", replies.name], stdout=subprocess.PIPE, text=True)
    sampler = Sampler(peer.pid) if sample else None
    line = peer.stdout.readline()
    assert line.startswith("LISTEN "), line
    tx = cuda_mp.connect(line.split()[1], cuda_mp.Bundle)
    rx = replies.accept(timeout=60)
    # Untimed warm-up: the consumer starts CUDA on a small bundle first.
    warm = cuda_mp.pack_state_dict({"step": torch.zeros(1, dtype=torch.int64, device="cuda")})
    tx.send(warm)
    rx.recv(timeout=60)
    sends = []
    marks = []

    def send(step):
        start = time.monotonic_ns()
        tx.send(packed)
        sent = time.monotonic_ns()
        sends.append((sent - start) / 1e3)
        marks.append([start, sent])

    def wait_step():
        step = int(rx.recv(timeout=120)[0])
        marks[-1].append(time.monotonic_ns())
        return step

    first, again = publish_rounds(packed, send, wait_step)
    del tx
    out, _ = peer.communicate(timeout=120)
    assert peer.returncode == 0, out
    traces = [line for line in out.splitlines() if line.startswith("TRACE")]
    print(f"cuda-mp sends (this process): first {sends[0]:.1f} us, re-publish median {median(sends[1:]):.1f} us")
    for mark, line in zip(marks[:2], traces[1:3]):  # the first publish, then a re-publish (traces[0]: warm-up)
        f = line.split()
        keys = ("waiting_ns", "received_ns", "dropped_ns", "made_ns", "replied_ns")
        waiting, received, dropped, made, replied = (int(f[f.index(k) + 1]) for k in keys)
        start, sent, back = mark
        print(
            f"timeline (us, one clock): send {(sent - start) / 1e3:.1f} (the consumer was waiting since "
            f"{(start - waiting) / 1e3:.1f} before it), until the consumer's receive returned "
            f"{(received - sent) / 1e3:.1f}, its read and drop of the previous {(dropped - received) / 1e3:.1f}, "
            f"its reply: made {(made - dropped) / 1e3:.1f}, sent {(replied - made) / 1e3:.1f}, "
            f"until the reply was read here {(back - replied) / 1e3:.1f}"
        )
        print(f"cuda-mp consumer (Rust): {line[line.index('decode'):]}")
        if sampler is not None and mark is marks[0]:
            sampler.report("the first publish's receive", sent, received)
            sampler.report("the first publish's reply", dropped, made)
    return first, again, packed.allocations


def theirs():
    ctx = mp.get_context("spawn")
    q, ack = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=hold_latest, args=(q, ack))
    p.start()
    q.put({"step": torch.zeros(1, dtype=torch.int64, device="cuda")})
    ack.get()
    weights = {n: torch.zeros(s, dtype=torch.bfloat16, device="cuda") for n, s in llama7b_shapes()}
    weights["step"] = torch.zeros(1, dtype=torch.int64, device="cuda")
    first, again = publish_rounds(weights, lambda step: q.put(weights), lambda: ack.get(timeout=120))
    q.put(None)
    p.join()
    return first, again


def main():
    args = sys.argv[1:]
    peer = os.environ.get("CUDA_MP_RUST_PEER", "target/release/examples/14_python_peer")
    if "--rust-peer" in args:
        peer = args[args.index("--rust-peer") + 1]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    first, again, allocations = ours(peer, sample="--sample" in args)
    rows = [("Python -> Rust, first publish", first, first), ("Python -> Rust, re-publish", median(again), p99(again))]
    torch_rows = [None, None]
    if "--no-torch" not in args:
        t_first, t_again = theirs()
        torch_rows = [(t_first, t_first), (median(t_again), p99(t_again))]
    print(f"\nweights: 291 bf16 tensors + step, 13.48 GB, packed into {allocations} cuda-mp allocation(s)\n")
    print("| workload | cuda-mp median | cuda-mp p99 | torch.mp median | torch.mp p99 | torch / cuda-mp |")
    print("|---|---|---|---|---|---|")
    for (what, m, p), t in zip(rows, torch_rows):
        if t is None:
            print(f"| {what} | {m:.1f} us | {p:.1f} us | n/a | n/a | n/a |")
        else:
            print(f"| {what} | {m:.1f} us | {p:.1f} us | {t[0]:.1f} us | {t[1]:.1f} us | {t[0] / m:.1f}x |")


if __name__ == "__main__":
    main()
