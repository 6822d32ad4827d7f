"""cuda-mp tensors as bytes through multiprocessing's own queues (what ``cuda_mp.torch`` pickles),
with every start method; no GPU and no PyTorch needed."""

import multiprocessing as mp
import time
import zlib

import numpy as np
import pytest

import cuda_mp
from conftest import settled_lifetime_stats
from cuda_mp import _native


def add_100_and_decode_twice(q, back):
    data = q.get(timeout=60)
    a = np.from_dlpack(_native.tensor_from_bytes(data))
    a += 100
    back.put(float(a.sum()))
    try:
        _native.tensor_from_bytes(data)
        back.put("decoded twice")
    except cuda_mp.Malformed as e:
        back.put(str(e))


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_shared_memory_crosses_a_multiprocessing_queue_as_bytes_once(method):
    ctx = mp.get_context(method)
    a = cuda_mp.empty_host((4,), "float32")
    a[:] = [1, 2, 3, 4]
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=add_100_and_decode_twice, args=(q, back))
    p.start()
    q.put(_native.tensor_to_bytes(cuda_mp._host(a), 60.0))
    assert back.get(timeout=60) == 410.0
    assert "holds none" in back.get(timeout=60), "bytes decode once"
    p.join(60)
    assert p.exitcode == 0
    assert a.tolist() == [101, 102, 103, 104], "the child wrote to this process's memory"


def test_bytes_that_nobody_reads_in_time_release_their_memory():
    before = settled_lifetime_stats()
    a = cuda_mp.empty_host((16,), "int32")
    data = _native.tensor_to_bytes(cuda_mp._host(a), 0.2)
    del a
    assert _native.lifetime_stats()[0] == before[0] + 1, "the waiting bytes hold the memory"
    deadline = time.time() + 10
    while _native.lifetime_stats() != before and time.time() < deadline:
        time.sleep(0.01)
    assert _native.lifetime_stats() == before, "released when their time was up"
    with pytest.raises(cuda_mp.Malformed, match="holds none"):
        _native.tensor_from_bytes(data)


def test_forged_bytes_raise():
    data = _native.tensor_to_bytes(cuda_mp._host(cuda_mp.empty_host((4,), "uint8")), 60.0)
    # The kind's tag, the mark and the version (5 bytes), a CRC-32 of the rest (4 bytes), then
    # the value's own bytes.
    head, body = data[:5], data[9:]
    other_version = data[:4] + bytes([data[4] ^ 1]) + data[5:]
    damaged = [b"", b"\x07" + data[1:], data[:1] + bytes(len(data) - 1), other_version]
    # Cut short or damaged on the way: refused by the check.
    damaged += [data[:n] for n in range(len(data))] + [data[:-1] + bytes([data[-1] ^ 1])]
    for f in damaged:
        with pytest.raises(cuda_mp.Malformed):
            _native.tensor_from_bytes(f)
    # The real bytes still decode: nothing refused took what they carry.
    assert np.from_dlpack(_native.tensor_from_bytes(data)).shape == (4,)

    # Forged past the check (written again), so that the value's decoder reads them, each from
    # bytes whose deposit waits: every cut of the value's bytes, and bytes of the right length
    # that are not a value's. The real bytes after each decode, or find their deposit taken.
    def sealed(head, value):
        return head + zlib.crc32(value).to_bytes(4, "little") + value

    assert sealed(head, body) == data, "the check is a CRC-32 of the value's bytes"
    forgeries = [lambda b, n=n: b[:n] for n in range(len(body))]
    forgeries += [lambda b: bytes(len(b)), lambda b: bytes([0xFF]) * len(b), lambda b: b[::-1]]
    tensor = cuda_mp._host(cuda_mp.empty_host((4,), "uint8"))
    for forge in forgeries:
        real = _native.tensor_to_bytes(tensor, 60.0)
        forged = forge(real[9:])
        # (A cut past the end of bytes a little shorter than the first, whose ticket's numbers
        # took fewer bytes, is the intact value: not a forgery.)
        if forged != real[9:]:
            with pytest.raises(cuda_mp.Malformed):
                _native.tensor_from_bytes(sealed(real[:5], forged))
        # Taken here either way: a deposit left waiting would hold the block's memory (and a
        # later test's empty cache) for its 60 s.
        try:
            _native.tensor_from_bytes(real)
        except cuda_mp.Malformed as e:
            assert "holds none" in str(e), e


def add_index_to_each(q, back):
    items = q.get(timeout=60)
    for i, data in reversed(list(enumerate(items))):
        np.from_dlpack(_native.tensor_from_bytes(data))[:] += i
    back.put(sum(1 for data in items if _try_decode(data)))


def _try_decode(data):
    try:
        _native.tensor_from_bytes(data)
        return True
    except cuda_mp.Malformed:
        return False


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_batch_of_tensors_crosses_as_bytes_read_once_in_any_order(method):
    ctx = mp.get_context(method)
    arrays = [cuda_mp.empty_host((8,), "int64") for _ in range(50)]
    for a in arrays:
        a[:] = 0
    batch = _native.HandoffBatch(60.0)
    items = [batch.tensor_to_bytes(cuda_mp._host(a)) for a in arrays]
    with pytest.raises(cuda_mp.Malformed, match="not finished"):
        _native.tensor_from_bytes(items[0])
    batch.finish()
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=add_index_to_each, args=(q, back))
    p.start()
    q.put(items)
    assert back.get(timeout=60) == 0, "no item decodes twice"
    p.join(60)
    assert p.exitcode == 0
    assert [a.tolist() for a in arrays] == [[i] * 8 for i in range(50)], "the child wrote to this process's memory"


def test_a_batch_withdrawn_unfinished_releases_its_memory():
    before = settled_lifetime_stats()
    a = cuda_mp.empty_host((16,), "int32")
    batch = _native.HandoffBatch(60.0)
    data = batch.tensor_to_bytes(cuda_mp._host(a))
    del a
    assert "values: 1" in repr(batch)
    batch.withdraw()
    deadline = time.time() + 10
    while _native.lifetime_stats() != before and time.time() < deadline:
        time.sleep(0.01)
    assert _native.lifetime_stats() == before, "released at once"
    with pytest.raises(cuda_mp.Malformed):
        _native.tensor_from_bytes(data)
    with pytest.raises(cuda_mp.Error, match="ended"):
        batch.tensor_to_bytes(cuda_mp._host(cuda_mp.empty_host((4,), "uint8")))
