"""CUDA tensors between PyTorch processes and Rust, on a GPU machine: `pytest -m gpu`."""

import subprocess

import pytest

import cuda_mp
from conftest import start_rust_peer

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_gpu")]

torch = pytest.importorskip("torch", reason="PyTorch is not installed")


def pair(kind=cuda_mp.GpuTensor):
    listener = cuda_mp.Listener(kind)
    tx = cuda_mp.connect(listener.name, kind)
    return tx, listener.accept(timeout=10)


def consumer_adds(tx_name, n):
    import torch

    import cuda_mp

    rx_listener = cuda_mp.Listener(cuda_mp.GpuTensor)
    back = cuda_mp.connect(tx_name, cuda_mp.HostTensor)
    back.send(__import__("numpy").frombuffer(rx_listener.name.encode(), dtype="uint8"))
    rx = rx_listener.accept(timeout=60)
    for _ in range(n):
        t = rx.recv(timeout=60)
        t.add_(1)  # on torch's current stream, ordered after the sender's work
        torch.cuda.current_stream().synchronize()
        back.send(__import__("numpy").array([t.numel()]))
        del t


def test_a_torch_tensor_crosses_to_another_process_and_is_written_in_place():
    import numpy as np

    ctx = torch.multiprocessing.get_context("spawn")
    acks = cuda_mp.Listener(cuda_mp.HostTensor)
    p = ctx.Process(target=consumer_adds, args=(acks.name, 3))
    p.start()
    rx = acks.accept(timeout=60)
    name = bytes(rx.recv(timeout=60)).decode()
    tx = cuda_mp.connect(name, cuda_mp.GpuTensor)
    # bf16, a strided view at a storage offset, and a tensor from the caching allocator's pool
    big = torch.arange(4096, dtype=torch.float32, device="cuda").reshape(64, 64)
    cases = [
        torch.zeros(1000, dtype=torch.bfloat16, device="cuda"),
        big[8:, 3],  # strided, offset into its storage
        big,
    ]
    for t in cases:
        before = t.clone()
        # Queue work right before sending: the receiver must see its result.
        t.mul_(1)
        tx.send(t)
        assert int(rx.recv(timeout=60)[0]) == t.numel()
        assert torch.equal(t, before + 1), "the consumer's in-place add is visible here"
    p.join(60)
    assert p.exitcode == 0


def holder(acks_name):
    import gc

    import numpy as np

    import cuda_mp

    acks = cuda_mp.connect(acks_name, cuda_mp.HostTensor)
    listener = cuda_mp.Listener(cuda_mp.GpuTensor)
    acks.send(np.frombuffer(listener.name.encode(), dtype="uint8"))
    rx = listener.accept(timeout=60)
    t = rx.recv(timeout=60)
    view = t[10:20]  # a view keeps the memory too
    del t
    gc.collect()
    acks.send(np.array([float(view.sum().item())]))
    rx.recv(timeout=60)  # told to drop
    del view
    gc.collect()
    acks.send(np.array([0.0]))


def test_the_sender_memory_lives_until_the_receiver_garbage_collects_its_last_view():
    import time

    acks_listener = cuda_mp.Listener(cuda_mp.HostTensor)
    p = torch.multiprocessing.get_context("spawn").Process(target=holder, args=(acks_listener.name,))
    p.start()
    acks = acks_listener.accept(timeout=60)
    tx = cuda_mp.connect(bytes(acks.recv(timeout=60)).decode(), cuda_mp.GpuTensor)
    baseline = cuda_mp._native.lifetime_stats()[1]
    t = torch.ones(1000, device="cuda")
    tx.send(t)
    del t
    torch.cuda.synchronize()
    assert float(acks.recv(timeout=60)[0]) == 10.0
    assert cuda_mp._native.lifetime_stats()[1] == baseline + 1, "kept while the receiver holds a view"
    tx.send(torch.zeros(1, device="cuda"))  # tells it to drop
    assert float(acks.recv(timeout=60)[0]) == 0.0
    deadline = time.time() + 10
    while cuda_mp._native.lifetime_stats()[1] > baseline and time.time() < deadline:
        time.sleep(0.01)
    assert cuda_mp._native.lifetime_stats()[1] == baseline, "released once the receiver dropped its view"
    p.join(60)
    assert p.exitcode == 0


def test_a_state_dict_is_sent_as_one_allocation_and_republished_in_place():
    sd = {
        "w": torch.randn(256, 256, device="cuda").to(torch.bfloat16),
        "b": torch.randn(256, device="cuda"),
        "step": torch.zeros(1, dtype=torch.int64, device="cuda"),
    }
    packed = cuda_mp.pack_state_dict(sd)
    assert packed.allocations == 1
    for k in sd:
        assert torch.equal(packed[k], sd[k])
    tx, rx = pair(cuda_mp.Bundle)
    for step in range(1, 4):
        packed["step"].fill_(step)
        packed["w"].add_(1)
        tx.send(packed)
        got = rx.recv(timeout=10)
        assert int(got["step"].item()) == step
        assert torch.equal(got["w"], packed["w"])
    # Replacing an entry would send the packed memory all the same: refused, nothing sent.
    b = packed["b"]
    packed["b"] = torch.zeros(256, device="cuda")
    with pytest.raises(ValueError, match="copy into the packed tensor"):
        tx.send(packed)
    with pytest.raises(cuda_mp.Timeout):
        rx.recv(timeout=0.2)
    # So is a dict with an entry taken out; the packed views put back, in any order, go.
    del packed["b"]
    with pytest.raises(ValueError, match="added to or taken out"):
        tx.send(packed)
    packed["b"] = b
    # A view under another name would reach the receiver under its packed name: refused.
    packed["steps"] = packed.pop("step")
    with pytest.raises(ValueError, match="added to or taken out"):
        tx.send(packed)
    packed["step"] = packed.pop("steps")
    tx.send(packed)
    assert int(rx.recv(timeout=10)["step"].item()) == 3
    # A view pointed at other memory in place (`.data =`, `set_`) is still the same object, and
    # the send would carry the packed memory all the same: refused, and sent once put back.
    w = packed["w"].data
    packed["w"].data = torch.ones_like(w)
    with pytest.raises(ValueError, match="no longer views the packed memory"):
        tx.send(packed)
    packed["w"].data = w
    packed_b = b.data
    b.set_(torch.zeros(256, device="cuda"))
    with pytest.raises(ValueError, match="no longer views the packed memory"):
        tx.send(packed)
    with pytest.raises(cuda_mp.Timeout):
        rx.recv(timeout=0.2)
    b.set_(packed_b)
    packed["w"].add_(1)
    tx.send(packed)
    assert torch.equal(rx.recv(timeout=10)["w"], packed["w"])
    # A plain dict of torch tensors goes too (one allocation per storage).
    tx.send(sd)
    got = rx.recv(timeout=10)
    assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)


def test_a_rust_process_adds_one_to_torch_memory_and_sends_it_back():
    peer, tx, rx = start_rust_peer(cuda_mp.GpuTensor, timeout=60)
    try:
        t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        for n in range(1, 4):
            tx.send(t)
            back = rx.recv(timeout=60)
            assert torch.equal(back, torch.arange(1 << 20, dtype=torch.float32, device="cuda") + n)
            assert back.data_ptr() == t.data_ptr(), "the same memory came back"
            del back
        del tx
        out, _ = peer.communicate(timeout=60)
        assert peer.returncode == 0 and "PASS" in out, out
    finally:
        peer.kill()


def test_an_empty_cuda_tensor_crosses_a_gpu_channel_and_a_bundle():
    # PyTorch gives an empty tensor no memory (address 0): it arrives empty, in its shape.
    tx, rx = pair()
    tx.send(torch.empty((0, 4), device="cuda"))
    got = rx.recv(timeout=10)
    assert got.is_cuda and tuple(got.shape) == (0, 4) and got.dtype == torch.float32
    tx, rx = pair(cuda_mp.Bundle)
    tx.send({"empty": torch.empty(0, device="cuda"), "w": torch.ones(8, device="cuda")})
    got = rx.recv(timeout=10)
    assert got["empty"].numel() == 0 and torch.equal(got["w"], torch.ones(8, device="cuda"))


def test_wrong_values_raise():
    tx, _rx = pair()
    with pytest.raises(TypeError):
        tx.send(torch.zeros(3))  # a CPU tensor on a gpu channel
    with pytest.raises(cuda_mp.DTypeError):
        tx.send(torch.zeros(3, dtype=torch.complex64, device="cuda"))


def test_cpu_torch_tensors_cross_a_host_channel_bf16_included():
    listener = cuda_mp.Listener(cuda_mp.HostTensor, as_torch=True)
    tx = cuda_mp.connect(listener.name, cuda_mp.HostTensor)
    rx = listener.accept(timeout=10)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        t = (torch.arange(12) % 5).to(dtype).reshape(3, 4)
        tx.send(t.T)  # not contiguous: copied in C order
        got = rx.recv(timeout=10)
        assert got.dtype == dtype and torch.equal(got, t.T)
    # A parameter (it requires grad, which numpy() refuses) goes as its values.
    tx.send(torch.nn.Parameter(torch.full((4,), 2.5)))
    assert torch.equal(rx.recv(timeout=10), torch.full((4,), 2.5))


EXPANDABLE = """
import torch, cuda_mp
listener = cuda_mp.Listener(cuda_mp.GpuTensor)
tx = cuda_mp.connect(listener.name, cuda_mp.GpuTensor)
try:
    tx.send(torch.ones(1 << 20, device="cuda"))
except cuda_mp.Error as e:
    print("REFUSED", e)
"""


def test_memory_of_the_expandable_segments_allocator_is_refused_with_what_to_do():
    import os
    import sys

    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    out = subprocess.run([sys.executable, "-c", EXPANDABLE], env=env, capture_output=True, text=True, timeout=120)
    assert "REFUSED" in out.stdout, out.stdout + out.stderr
    assert "expandable_segments" in out.stdout, out.stdout


def add_one_to_each(q, results):
    import torch

    while True:
        item = q.get(timeout=60)
        if item is None:
            return
        for t in item["tensors"]:
            t.add_(1)
        torch.cuda.synchronize()
        results.put((item["step"], isinstance(item["param"], torch.nn.Parameter), item["param"].requires_grad))


def test_cuda_tensors_in_any_object_cross_a_cuda_mp_queue_in_place():
    ctx = torch.multiprocessing.get_context("spawn")
    q, results = cuda_mp.Queue(), cuda_mp.Queue()
    # One worker: two adding to the same memory at once would race.
    workers = [ctx.Process(target=add_one_to_each, args=(q, results))]
    for w in workers:
        w.start()
    base = torch.zeros(64, 64, device="cuda")
    tensors = [torch.zeros(1 << 16, device="cuda") for _ in range(8)]
    param = torch.nn.Parameter(torch.ones(4, device="cuda"))
    for step in range(10):
        q.put({"step": step, "tensors": tensors + [base[:, 3]], "param": param})
    got = sorted(results.get(timeout=60) for _ in range(10))
    for _ in workers:
        q.put(None)
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    assert got == [(step, True, True) for step in range(10)]
    torch.cuda.synchronize()
    assert all(bool((t == 10).all()) for t in tensors), "every worker's add is seen here"
    assert base[:, 3].eq(10).all() and base[:, 2].eq(0).all(), "a strided view crossed as a view"


def add_one_to_values(q, results):
    import torch

    while True:
        item = q.get(timeout=60)
        if item is None:
            return
        assert type(item) is dict and type(item["tensors"]) is list
        for t in item["tensors"]:
            t.add_(1)
        torch.cuda.synchronize()
        results.put(item["step"])


def test_cuda_tensors_in_plain_containers_cross_as_values_in_place():
    ctx = torch.multiprocessing.get_context("spawn")
    q, results = cuda_mp.Queue(), cuda_mp.Queue()
    worker = ctx.Process(target=add_one_to_values, args=(q, results))
    worker.start()
    tensors = [torch.zeros(1 << 16, device="cuda") for _ in range(4)]
    base = torch.zeros(64, 64, device="cuda")
    for step in range(10):
        q.put({"step": step, "tensors": tensors + [base[:, 3]]})
    assert sorted(results.get(timeout=60) for _ in range(10)) == list(range(10))
    q.put(None)
    worker.join(60)
    assert worker.exitcode == 0
    torch.cuda.synchronize()
    assert all(bool((t == 10).all()) for t in tensors)
    assert base[:, 3].eq(10).all() and base[:, 2].eq(0).all(), "a strided view crossed as a view"


def test_a_rust_process_consumes_cuda_tensors_from_a_python_queue():
    from conftest import start_rust_queue_consumer

    peer, work, answers = start_rust_queue_consumer()
    try:
        xs = [torch.full((1000,), float(step), device="cuda") for step in range(5)]
        for step, x in enumerate(xs):
            work.put({"step": step, "x": x, "note": "cuda"})
        work.put(None)
        assert [answers.get(timeout=60) for _ in range(5)] == [(step, "cuda", 1000) for step in range(5)]
        assert all(bool((x == step + 1).all()) for step, x in enumerate(xs)), "the Rust process wrote to this memory"
        assert peer.wait(60) == 0
    finally:
        peer.kill()


def put_after_queued_work(q, done):
    import torch

    t = torch.zeros(1 << 20, device="cuda")
    a, b = torch.rand(4096, 4096, device="cuda"), torch.empty(4096, 4096, device="cuda")
    # The kernels used below, loaded first: the driver loads a kernel at its first launch
    # (CUDA's lazy loading), and that load waits for all work queued in the context, which
    # would leave nothing queued at the send.
    torch.mm(a, a, out=b)
    t.add_(0)
    torch.cuda.synchronize()
    # cuda-mp's start in this process (its device and stream, at the first send) comes first:
    # work that ends before the send needs no event, and a send finds its stream idle.
    q.put(torch.ones(1, device="cuda"))
    # Work still queued at the send, which an event orders: products of 4096 x 4096 matrices,
    # about 0.25 s in all on an H100.
    for _ in range(100):
        torch.mm(a, a, out=b)
    t.add_(1)
    # The test needs work queued at the send; where there is none it says so at once.
    q.put("the worker's work had ended before its send" if torch.cuda.current_stream().query() else t)
    assert done.wait(60)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_workers_gpu_event_leaves_no_file_in_dev__shm(method):
    """A spawn worker ends with a normal exit, whose hooks remove the driver's file; a
    forkserver worker with os._exit, after which only the package's exit finalizer does."""
    import glob

    ctx = torch.multiprocessing.get_context(method)
    q, done = cuda_mp.Queue(), ctx.Event()
    w = ctx.Process(target=put_after_queued_work, args=(q, done))
    w.start()
    try:
        q.get(timeout=60)  # the worker's first send
        t = q.get(timeout=60)
        assert not isinstance(t, str), t
        assert bool((t == 1).all()), "the worker's queued work is seen"
        files = f"/dev/shm/cuda.shm.*.{w.pid:x}.*"
        assert glob.glob(files), "the worker's send made an interprocess event (the driver's file)"
        del t
        done.set()
        w.join(60)
        assert w.exitcode == 0
        assert glob.glob(files) == [], "the worker's exit left the driver's file behind"
    finally:
        w.kill()
