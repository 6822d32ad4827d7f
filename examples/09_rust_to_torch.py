"""09, the consumer side: receives GPU tensors from a Rust producer as torch tensors on the
producer's memory and computes on them in place. Started by `cargo run --example
09_rust_to_torch`; argument: the producer's listener name for acknowledgements."""

import sys

import numpy as np
import torch

import cuda_mp

acks = cuda_mp.connect(sys.argv[1], cuda_mp.HostTensor)
listener = cuda_mp.Listener(cuda_mp.GpuTensor)
print(f"LISTEN {listener.name}", flush=True)
rx = listener.accept(timeout=60)
for t in rx:  # until the producer closes its sender
    print(f"consumer: {tuple(t.shape)} {t.dtype} strides {t.stride()} on {t.device}", flush=True)
    t.mul_(2).add_(1)  # on torch's current stream, after the producer's work
    total = float(t.double().sum().item())  # waits for the stream
    acks.send(np.array([total]))
    del t
