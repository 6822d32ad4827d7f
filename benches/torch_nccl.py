"""torch.distributed baseline for benches/remote.rs: one-way NCCL send/recv from cuda:0 (rank 0)
to cuda:1 (rank 1), the same payloads and message counts, timed on the receiver. Prints
`first <seconds>` and `result <payload> <bytes> <messages> <seconds>` for the Rust bench.

    python3 benches/torch_nccl.py --transport net|nvlink [--quick]
    python3 benches/torch_nccl.py --nccl-path    # the NCCL library this torch loads

Payloads: 1 MiB, 64 MiB, 1 GiB of uint8, 64 tensors of 1 MiB per message, the 291 bf16 tensors of the 7B shapes sent one
`dist.send` each (how torch users publish weights), and the same 13.5 GB as one flat uint8
buffer (torch's best case).

Timing: the first message (1 MiB) alone, including the communicator torch sets up lazily at
the first send/recv; then per payload, warm-up messages uncounted, and the counted ones between
two `torch.cuda.synchronize()`.

Not quite the same work as ours: here the CPU queues sends and receives on NCCL's stream
without waiting for each, while a cuda-mp send returns once its bytes are acknowledged and a
receive once they are in. Both receive into memory allocated before (torch: tensors allocated
once; cuda-mp: the memory of the message dropped before).
"""
import glob
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The same 7B shapes as the handoff bench's baseline (this folder).
from torch_baseline import llama7b_shapes

# (name, bytes, warm-up messages, counted messages): PAYLOADS in benches/remote.rs.
PAYLOADS = [("1MiB", 1 << 20, 2, 200), ("64MiB", 64 << 20, 2, 50), ("1GiB", 1 << 30, 2, 10)]
# 64 tensors of 1 MiB per message (ours: one message holding all 64; here a send each).
BATCH, BATCH_WARM, BATCH_MESSAGES = 64, 2, 20
WEIGHTS_WARM, WEIGHTS_MESSAGES = 1, 3


def counted(n, quick):
    return max(1, n // 5) if quick else n


def nccl_env(transport):
    """NCCL reads these at its first use: set before any process group exists."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    for var in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"):
        if transport == "net":
            os.environ[var] = "1"  # the network transport, over loopback
        else:
            os.environ.pop(var, None)


def timed(rank, tensors, warm, messages):
    """Seconds of `messages` messages after `warm` uncounted ones; a message is `tensors`,
    one send/recv each."""

    def message():
        for t in tensors:
            if rank == 0:
                dist.send(t, dst=1)
            else:
                dist.recv(t, src=0)

    for _ in range(warm):
        message()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(messages):
        message()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def worker(rank, port, quick):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    # The sender's tensors hold zeros; the receiver's are written by the transfers.
    alloc = torch.zeros if rank == 0 else torch.empty

    def run(name, tensors, warm, messages):
        secs = timed(rank, tensors, warm, messages)
        if rank == 1:
            nbytes = sum(t.numel() * t.element_size() for t in tensors) * messages
            print(f"result {name} {nbytes} {messages} {secs:.6f}", flush=True)

    secs = timed(rank, [alloc(1 << 20, dtype=torch.uint8, device=dev)], 0, 1)
    if rank == 1:
        print(f"first {secs:.6f}", flush=True)
    for name, nbytes, warm, messages in PAYLOADS:
        run(name, [alloc(nbytes, dtype=torch.uint8, device=dev)], warm, counted(messages, quick))
    batch = [alloc(1 << 20, dtype=torch.uint8, device=dev) for _ in range(BATCH)]
    run(f"{BATCH}x1MiB", batch, BATCH_WARM, counted(BATCH_MESSAGES, quick))
    del batch
    weights = [alloc(shape, dtype=torch.bfloat16, device=dev) for _, shape in llama7b_shapes()]
    run("7B", weights, WEIGHTS_WARM, counted(WEIGHTS_MESSAGES, quick))
    total = sum(t.numel() * t.element_size() for t in weights)
    del weights
    run("7B-flat", [alloc(total, dtype=torch.uint8, device=dev)], WEIGHTS_WARM, counted(WEIGHTS_MESSAGES, quick))
    dist.destroy_process_group()


def nccl_path():
    """The NCCL library torch loaded at import, else one of the pip packages' (empty if none)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libnccl" in line:
                return line.split()[-1]
    for p in sys.path:
        for path in glob.glob(os.path.join(p, "nvidia", "**", "libnccl.so*"), recursive=True):
            return path
    return ""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    args = sys.argv[1:]
    if "--nccl-path" in args:
        print(nccl_path())
        return
    transport = args[args.index("--transport") + 1] if "--transport" in args else "net"
    if transport not in ("net", "nvlink"):
        sys.exit(f"--transport takes net or nvlink, not {transport}")
    if torch.cuda.device_count() < 2:
        sys.exit(f"needs GPUs 0 and 1; {torch.cuda.device_count()} visible")
    nccl_env(transport)
    version = torch.cuda.nccl.version()
    version = ".".join(map(str, version)) if isinstance(version, tuple) else version
    print(f"torch {torch.__version__}, NCCL {version}, {torch.cuda.get_device_name(0)}", flush=True)
    mp.spawn(worker, args=(free_port(), "--quick" in args), nprocs=2)


if __name__ == "__main__":
    main()
