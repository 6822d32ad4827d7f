"""Values as bytes in one batch (what a pickle of many tensors makes with
``cuda_mp.torch.install()``), on the CPU: the cost per value of encoding a batch of host
tensors (``HandoffBatch.tensor_to_bytes``) and of decoding it in another process
(``tensor_from_bytes``), first batch and later ones, for batches of several sizes. No GPU or
torch needed:

    python3 benches/handoff_batch.py [--rounds N]
"""

import multiprocessing as mp
import statistics
import sys
import time

import cuda_mp
from cuda_mp import _native


def decode(conn):
    while True:
        batch = conn.recv()
        if batch is None:
            return
        start = time.perf_counter()
        tensors = [_native.tensor_from_bytes(b) for b in batch]
        took = time.perf_counter() - start
        conn.send(took)
        del tensors


def main():
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 20
    here, there = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(target=decode, args=(there,))
    child.start()
    # The decoder's first decode sets up its process (threads, its home): not timed.
    warm = _native.tensor_to_bytes(cuda_mp._host(cuda_mp.empty_host((4,), "float32")), 60.0)
    here.send([warm])
    here.recv()
    print("| values in the batch | encode, us a value (median) | decode, first batch | decode, later (median) |")
    print("|---|---|---|---|")
    for n in (1, 32, 291, 1024):
        arrays = [cuda_mp.empty_host((16384,), "float32") for _ in range(n)]
        natives = [cuda_mp._host(a) for a in arrays]
        encodes, decodes = [], []
        for _ in range(rounds):
            start = time.perf_counter()
            batch = _native.HandoffBatch(60.0)
            data = [batch.tensor_to_bytes(t) for t in natives]
            batch.finish()
            encodes.append((time.perf_counter() - start) / n)
            here.send(data)
            decodes.append(here.recv() / n)
        us = 1e6
        print(
            f"| {n} | {statistics.median(encodes) * us:.1f} | {decodes[0] * us:.1f} | "
            f"{statistics.median(decodes[1:]) * us:.1f} |",
            flush=True,
        )
    here.send(None)
    child.join(60)


if __name__ == "__main__":
    main()
