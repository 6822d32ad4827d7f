"""PyTorch's own CUDA IPC handles checked before any GPU is touched: errors, not crashes, and
a failed rebuild leaves the producer's slot alone. No GPU needed (PyTorch is)."""

import os
import struct

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch handle tests need PyTorch")

from torch.multiprocessing.reductions import rebuild_cuda_tensor  # noqa: E402

from cuda_mp import _errors, _native  # noqa: E402
from cuda_mp.torch_handles import from_torch_reduction, to_torch_args  # noqa: E402

HANDLE = b"\x02c" + bytes(range(64))


def reduction(handle=HANDLE, name=b"/cuda_mp_no_such_file", slot=3, size=4096, sync=False, event=bytes(64)):
    """A reduction as ``reduce_tensor`` makes one: rows 4..8 of a 16x64 float32 storage."""
    args = (
        torch.Tensor,
        torch.Size((4, 64)),
        (64, 1),
        256,
        torch.storage.TypedStorage,
        torch.float32,
        0,
        handle,
        size,
        512,
        False,
        name,
        slot,
        event,
        sync,
    )
    return (rebuild_cuda_tensor, args)


@pytest.fixture
def ref_file():
    """A reference-counter file as PyTorch's producer makes one: count 1, slot 3 set to 1."""
    name = f"/cuda_mp_pytest_{os.getpid()}"
    path = "/dev/shm" + name
    with open(path, "wb") as f:
        f.write(struct.pack("=i", 1) + bytes(60) + bytes(8 * 3) + struct.pack("=q", 1))
        f.write(bytes(80064 - f.tell()))
    yield name.encode(), path
    if os.path.exists(path):
        os.unlink(path)


def read(path, offset, fmt):
    with open(path, "rb") as f:
        f.seek(offset)
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def test_expandable_segments_are_refused_with_what_to_do():
    for extra in (0, 64, 200):
        with pytest.raises(_errors.Error) as e:
            from_torch_reduction(reduction(handle=b"\x02e" + bytes(extra)))
        message = str(e.value)
        assert "expandable_segments" in message
        assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False" in message


@pytest.mark.parametrize(
    "handle",
    [b"\x02", bytes(63), bytes(65), b"\x02c" + bytes(63), b"\x02c" + bytes(65), b"\x01c" + bytes(64)],
)
def test_handles_of_other_lengths_or_marks_are_malformed(handle):
    with pytest.raises(_errors.Malformed, match="64 bytes"):
        from_torch_reduction(reduction(handle=handle))


def test_names_slots_and_event_handles_are_checked():
    with pytest.raises(_errors.Malformed, match="does not exist"):
        from_torch_reduction(reduction())
    with pytest.raises(_errors.Malformed, match="shared-memory name"):
        from_torch_reduction(reduction(name=b"../etc/passwd"))
    with pytest.raises(_errors.Malformed, match="10000"):
        from_torch_reduction(reduction(slot=10_000))
    with pytest.raises(_errors.Malformed, match="event handle"):
        from_torch_reduction(reduction(sync=True, event=b"short"))
    with pytest.raises(TypeError):
        from_torch_reduction(reduction(sync=1))
    # The view (rows 4..8 at element 256) needs 2048 bytes: refused before anything is opened.
    with pytest.raises(ValueError):
        from_torch_reduction(reduction(size=1024))


def test_a_failed_rebuild_leaves_the_slot_alone(ref_file):
    name, path = ref_file
    # Well formed, but no driver opens it: no GPU here, or a handle that no process exported.
    with pytest.raises(_errors.Error):
        from_torch_reduction(reduction(handle=b"\x02c" + bytes(64), name=name))
    assert read(path, 64 + 8 * 3, "=q") == 1, "the slot was released"
    assert read(path, 0, "=i") == 1, "the count was changed"
    assert os.path.getsize(path) == 80064


def test_what_is_not_a_cuda_reduction_is_a_type_error():
    with pytest.raises(TypeError):
        from_torch_reduction((print, reduction()[1]))
    with pytest.raises(TypeError):
        from_torch_reduction(reduction()[1])
    with pytest.raises(ValueError):
        _native.from_torch((0, None), "f32", [1], [1], 0)


def test_host_memory_has_no_pytorch_cuda_handle():
    with pytest.raises(TypeError):
        to_torch_args(_native.empty_host(16))
    with pytest.raises(TypeError):
        to_torch_args(torch.zeros(4))
