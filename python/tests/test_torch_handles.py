"""PyTorch's own CUDA IPC handles, between this process (cuda-mp) and a PyTorch process
started with torch.multiprocessing's spawn: a PyTorch producer's reduction rebuilt here, and a
cuda-mp tensor rebuilt by a PyTorch consumer, each written on the other side and released.

Needs PyTorch and a CUDA GPU (skipped otherwise) and the built extension
(``maturin develop`` in python/).
"""

import gc
import os
import time

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_gpu")]

torch = pytest.importorskip("torch", reason="the PyTorch interop tests need PyTorch")

from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor  # noqa: E402

import cuda_mp  # noqa: E402
from cuda_mp import _errors, _native  # noqa: E402
from cuda_mp.torch_handles import from_torch_reduction, rebuild, to_torch_args  # noqa: E402

TIMEOUT = 60.0


def _slot(name, slot):
    """The value of slot ``slot`` of the reference-counter file ``name`` (None once gone)."""
    path = "/dev/shm/" + name.decode().lstrip("/")
    try:
        with open(path, "rb") as f:
            f.seek(64 + 8 * slot)
            return int.from_bytes(f.read(8), "little", signed=True)
    except FileNotFoundError:
        return None


def _wait_for(condition, what, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _live_storages_settled():
    """This process's live storages, once those of earlier tests have been freed: their
    releases land a little after the tests end, and a count read meanwhile moves under the
    test that reads it."""
    gc.collect()
    _wait_for(lambda: _native.lifetime_stats()[0] == 0, "the storages of earlier tests to be freed")
    return _native.lifetime_stats()[0]


def _recv(conn, timeout=TIMEOUT):
    if not conn.poll(timeout):
        raise AssertionError("the other process did not answer in time")
    message = conn.recv()
    if isinstance(message, tuple) and message and message[0] == "error":
        raise AssertionError(f"the other process failed: {message[1]}")
    return message


def _spawn(target, *args, env=None):
    """Starts ``target(conn, *args)`` in a fresh PyTorch process; returns (process, conn)."""
    ctx = torch.multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        p = ctx.Process(target=target, args=(theirs, *args), daemon=True)
        p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    theirs.close()
    return p, ours


def _join(p):
    p.join(TIMEOUT)
    if p.is_alive():
        p.kill()
        raise AssertionError("the other process did not exit")
    assert p.exitcode == 0, f"the other process exited with {p.exitcode}"


# ---------------------------------------------------------------------------------------------
# The PyTorch processes (module level, for spawn).


def torch_producer(conn):
    """Shares rows 4..8 of a 16x64 float tensor; checks our write; waits for its slot to come
    back to 0 and for ipc_collect to free the block."""
    try:
        import torch

        base = torch.arange(16 * 64, dtype=torch.float32, device="cuda").reshape(16, 64)
        view = base[4:8]
        rebuild_fn, args = reduce_tensor(view)
        name, slot = args[11], args[12]
        conn.send(("args", args))
        assert _recv(conn) == "written"
        torch.cuda.synchronize()
        expected = torch.arange(16 * 64, dtype=torch.float32, device="cuda").reshape(16, 64)
        expected[4:8] = -expected[4:8]
        assert torch.equal(base, expected), "the consumer's write is not seen"
        assert _slot(name, slot) == 1, "released before the consumer dropped it"
        conn.send("seen")
        assert _recv(conn) == "dropped"
        _wait_for(lambda: _slot(name, slot) == 0, "the slot to come back to 0")
        del view, args, rebuild_fn
        held = torch.cuda.memory_allocated()
        del base
        gc.collect()
        torch.cuda.ipc_collect()
        freed = held - torch.cuda.memory_allocated()
        conn.send(("freed", freed, _slot(name, slot)))
    except BaseException as e:  # reported to the test
        conn.send(("error", repr(e)))
        raise


def torch_producer_expandable(conn):
    """Shares a tensor of the expandable_segments allocator."""
    try:
        import torch

        t = torch.ones(1 << 20, device="cuda")
        try:
            rebuild_fn, args = reduce_tensor(t)
        except RuntimeError as e:  # this PyTorch or machine cannot share them at all
            conn.send(("unsupported", repr(e)))
            return
        conn.send(("args", args))
        _recv(conn)
    except BaseException as e:
        conn.send(("error", repr(e)))
        raise


def torch_consumer(conn, args):
    """Rebuilds a cuda-mp tensor with PyTorch's rebuild_cuda_tensor, checks it, doubles it,
    then frees it."""
    try:
        import torch

        t = rebuild(args)
        expected = torch.arange(256, dtype=torch.float32, device="cuda").reshape(16, 16)[:, 2:10]
        assert t.shape == (16, 8) and t.dtype == torch.float32
        assert torch.equal(t, expected), "the producer's values are not seen"
        t.mul_(2)
        torch.cuda.synchronize()
        conn.send("written")
        assert _recv(conn) == "drop"
        del t
        gc.collect()
        torch.cuda.synchronize()
        conn.send("dropped")
    except BaseException as e:
        conn.send(("error", repr(e)))
        raise


# ---------------------------------------------------------------------------------------------
# Tests.


def test_a_pytorch_producers_tensor_is_used_here_and_given_back():
    live_before = _live_storages_settled()
    p, conn = _spawn(torch_producer)
    try:
        tag, args = _recv(conn)
        assert tag == "args"
        name, slot = args[11], args[12]
        assert _slot(name, slot) == 1
        t = from_torch_reduction((rebuild_cuda_tensor, args))
        assert (t.dtype, t.shape, t.strides) == ("f32", [4, 64], [64, 1])
        x = torch.from_dlpack(t)
        expected = torch.arange(16 * 64, dtype=torch.float32, device="cuda").reshape(16, 64)[4:8]
        assert torch.equal(x, expected)
        assert _native.lifetime_stats()[0] == live_before + 1
        x.neg_()
        torch.cuda.synchronize()
        conn.send("written")
        assert _recv(conn) == "seen"
        # Rebuilding the same share again while it is held would take from its slot twice.
        with pytest.raises(_errors.Malformed, match="rebuilt once"):
            from_torch_reduction((rebuild_cuda_tensor, args))
        assert _slot(name, slot) == 1, "held while the tensor lives"
        del x, t
        gc.collect()
        _wait_for(lambda: _native.lifetime_stats()[0] == live_before, "the storage to be freed")
        assert _slot(name, slot) == 0, "released exactly once"
        conn.send("dropped")
        tag, freed, slot_after = _recv(conn)
        assert tag == "freed"
        # None: PyTorch removed its file when it collected, which it does only with no slot in use.
        assert slot_after in (0, None)
        assert freed >= 16 * 64 * 4, "ipc_collect did not free the producer's block"
        _join(p)
    finally:
        if p.is_alive():
            p.kill()


def test_a_failed_rebuild_leaves_the_slot_for_a_retry():
    p, conn = _spawn(torch_producer)
    try:
        tag, args = _recv(conn)
        name, slot = args[11], args[12]
        handle = args[7]
        forged = list(args)
        forged[7] = handle[:-64] + bytes(64)  # the same form, with a handle the driver refuses
        with pytest.raises(_errors.Error):
            from_torch_reduction((rebuild_cuda_tensor, tuple(forged)))
        too_long = list(args)
        too_long[8] = 1 << 40  # more bytes than the block holds
        with pytest.raises(_errors.Malformed):
            from_torch_reduction((rebuild_cuda_tensor, tuple(too_long)))
        assert _slot(name, slot) == 1, "a failed rebuild released the slot"
        t = from_torch_reduction((rebuild_cuda_tensor, args))
        x = torch.from_dlpack(t)
        x.neg_()
        torch.cuda.synchronize()
        conn.send("written")
        assert _recv(conn) == "seen"
        del x, t
        gc.collect()
        _wait_for(lambda: _slot(name, slot) == 0, "the slot to come back to 0")
        conn.send("dropped")
        tag, freed, slot_after = _recv(conn)
        assert tag == "freed" and slot_after in (0, None)
        _join(p)
    finally:
        if p.is_alive():
            p.kill()


def test_expandable_segments_are_refused_with_what_to_do():
    p, conn = _spawn(torch_producer_expandable, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    try:
        tag, args = _recv(conn)
        if tag == "unsupported":
            _join(p)
            pytest.skip(f"this PyTorch cannot share expandable segments: {args}")
        if not bytes(args[7]).startswith(b"\x02e"):
            conn.send("done")
            pytest.skip("this PyTorch shares expandable segments as legacy handles")
        with pytest.raises(_errors.Error, match="expandable_segments"):
            from_torch_reduction((rebuild_cuda_tensor, args))
        conn.send("done")
        _join(p)
    finally:
        if p.is_alive():
            p.kill()


def _consumer_round_trip(t, x):
    """Hands ``t`` (a cuda-mp tensor or a CUDA torch.Tensor of this process: columns 2..10 of
    ``x``, a 16x16 arange) to a PyTorch consumer, which doubles it; checks the write and the
    release. Gives the arguments sent."""
    outstanding, _, released = _native.torch_ipc_stats()
    args = to_torch_args(t)
    assert args[7] is not None and len(args[7]) == 64
    assert (tuple(args[1]), tuple(args[2]), args[5]) == ((16, 8), (16, 1), torch.float32)
    assert _native.torch_ipc_stats()[0] == outstanding + 1
    p, conn = _spawn(torch_consumer, args)
    try:
        assert _recv(conn) == "written"
        torch.cuda.synchronize()
        expected = torch.arange(256, dtype=torch.float32, device="cuda").reshape(16, 16)
        expected[:, 2:10] *= 2
        assert torch.equal(x, expected)
        assert _native.torch_ipc_stats()[0] == outstanding + 1, "kept while the consumer holds it"
        conn.send("drop")
        assert _recv(conn) == "dropped"
        _wait_for(lambda: _native.torch_ipc_stats()[0] == outstanding, "the share to be released")
        assert _native.torch_ipc_stats()[2] == released + 1
        _join(p)
    finally:
        if p.is_alive():
            p.kill()
    return args


@pytest.fixture
def legacy_segments():
    """PyTorch opens legacy CUDA IPC handles only: this process's fresh tensors are cut from
    legacy segments for the test (VMM ones are the default where the GPU has VMM)."""
    cuda_mp.set_segment_kind("legacy", 0)
    yield
    cuda_mp.set_segment_kind("auto", 0)


def test_a_block_of_a_vmm_segment_says_how_to_share_it_with_pytorch():
    cuda_mp.set_segment_kind("vmm", 0)
    try:
        bundle = _native.pack(0, [("w", "f32", [16, 16])])
    finally:
        cuda_mp.set_segment_kind("auto", 0)
    with pytest.raises(_errors.Error, match="set_segment_kind"):
        to_torch_args(bundle.get("w"))


def test_a_cuda_mp_tensor_is_used_by_a_pytorch_consumer_and_released(legacy_segments):
    live_before = _live_storages_settled()
    bundle = _native.pack(0, [("pad", "u8", [300]), ("w", "f32", [16, 16])])
    whole = bundle.get("w")
    x = torch.from_dlpack(whole)
    # Queued on PyTorch's stream right before the handoff: the consumer must see it.
    x.copy_(torch.arange(256, dtype=torch.float32, device="cuda").reshape(16, 16))
    # A strided view, past the bundle's first entry: cuda-mp's own allocation, at an offset.
    view = _native.gpu_tensor(0, x.data_ptr(), x.untyped_storage().nbytes(), "f32", [16, 8], [16, 1], 2, x)
    offset = _native.element_offset(view)
    assert offset > 2
    args = _consumer_round_trip(view, x)
    assert (args[3], args[9]) == (offset, 0), "the allocation itself, the view at its offset"
    del view, x, whole, bundle
    gc.collect()
    _wait_for(lambda: _native.lifetime_stats()[0] == live_before, "the storage to be freed")


def test_a_pytorch_view_of_cuda_mp_memory_is_shared_as_that_memory(legacy_segments):
    bundle = _native.pack(0, [("w", "f32", [16, 16])])
    x = torch.from_dlpack(bundle.get("w"))
    x.copy_(torch.arange(256, dtype=torch.float32, device="cuda").reshape(16, 16))
    args = _consumer_round_trip(x[:, 2:10], x)
    assert (args[3], args[9]) == (2, 0)


def test_pytorch_memory_of_this_process_is_used_by_a_pytorch_consumer_and_released():
    x = torch.arange(256, dtype=torch.float32, device="cuda").reshape(16, 16)
    args = _consumer_round_trip(x[:, 2:10], x)
    assert args[3] == 2


def test_a_host_tensor_has_no_pytorch_handle():
    with pytest.raises(TypeError):
        to_torch_args(_native.empty_host(16))
