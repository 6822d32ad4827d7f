"""08, the trainer side: a PyTorch state dict packed into one cuda-mp allocation, updated in
place and published every step to a Rust rollout process. Started by
`cargo run --example 08_torch_trainer`; arguments: the rollout's listener name, the steps."""

import sys

import torch

import cuda_mp

name, steps = sys.argv[1], int(sys.argv[2])
layers, width = 8, 1024
state = {}
for layer in range(layers):
    state[f"layers.{layer}.weight"] = torch.empty(width, width, dtype=torch.bfloat16)
    state[f"layers.{layer}.bias"] = torch.empty(width, dtype=torch.float32)
# Element j of tensor i starts at (j % 7) + i: small integers, exact in bf16.
for i, t in enumerate(state.values()):
    t.copy_((torch.arange(t.numel()) % 7 + i).reshape(t.shape).to(t.dtype))
state = cuda_mp.pack_state_dict({k: v.cuda() for k, v in state.items()})
print(f"trainer: {len(state)} tensors in {state.allocations} allocation(s)", flush=True)

acks = cuda_mp.Listener(cuda_mp.HostTensor)
print(f"LISTEN {acks.name}", flush=True)
weights = cuda_mp.connect(name, cuda_mp.Bundle)
acks = acks.accept(timeout=60)
for step in range(1, steps + 1):
    with torch.no_grad():
        for t in state.values():
            t.add_(1)  # the training step, in place
    weights.send(state)
    got_step, checked = (int(x) for x in acks.recv(timeout=60))
    assert got_step == step, (got_step, step)
    print(f"trainer: step {step} acknowledged, {checked} elements verified by the rollout", flush=True)
