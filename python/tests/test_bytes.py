"""cuda-mp tensors as bytes through multiprocessing's own queues (what ``cuda_mp.torch`` pickles),
with every start method; no GPU and no PyTorch needed."""

import multiprocessing as mp
import time

import numpy as np
import pytest

import cuda_mp
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
    before = _native.lifetime_stats()
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
    for forged in (b"", b"\x07" + data[1:], data[:5], data[:1] + bytes(len(data) - 1)):
        with pytest.raises(cuda_mp.Malformed):
            _native.tensor_from_bytes(forged)
    # The real bytes still decode (nothing of them waits on after the test).
    assert np.from_dlpack(_native.tensor_from_bytes(data)).shape == (4,)
