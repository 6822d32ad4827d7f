"""Host arrays across processes, errors, and a Rust peer: no GPU needed."""

import multiprocessing as mp
import pickle
import time

import numpy as np
import pytest

import cuda_mp
from conftest import start_rust_peer


def pair(kind=cuda_mp.HostTensor, **kw):
    listener = cuda_mp.Listener(kind, **kw)
    tx = cuda_mp.connect(listener.name, kind)
    return tx, listener.accept(timeout=10)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int8", "uint8", "int16", "int32", "int64", "bool"])
def test_every_numpy_dtype_arrives_with_its_values(dtype):
    tx, rx = pair()
    a = (np.arange(24) % 5).astype(dtype).reshape(2, 3, 4)
    tx.send(a)
    b = rx.recv(timeout=10)
    assert b.dtype == a.dtype and b.shape == a.shape
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [">f4", ">f8", ">i2", ">i4", ">i8", ">f2"])
def test_arrays_of_the_other_byte_order_arrive_with_their_values(dtype):
    a = np.arange(-6, 6).astype(dtype).reshape(3, 4)
    tx, rx = pair()
    tx.send(a)
    np.testing.assert_array_equal(rx.recv(timeout=10), a)
    q = cuda_mp.Queue()
    q.put(a)
    np.testing.assert_array_equal(q.get(timeout=10), a)
    q.put({"a": a})
    np.testing.assert_array_equal(q.get(timeout=10)["a"], a)
    # A view of cuda-mp memory in the other byte order is copied, not shared as this machine's.
    shared = cuda_mp.empty_host((12,), dtype[1:]).view(dtype)
    shared[:] = np.arange(-6, 6)
    tx.send(shared)
    np.testing.assert_array_equal(rx.recv(timeout=10), shared)
    q.put([shared])
    np.testing.assert_array_equal(q.get(timeout=10)[0], shared)


def test_views_are_sent_by_value_and_shared_memory_by_reference():
    tx, rx = pair()
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    tx.send(a.T)  # not contiguous: copied in C order
    np.testing.assert_array_equal(rx.recv(timeout=10), a.T)
    shared = cuda_mp.empty_host((3, 4), "int32")
    shared[:] = a
    tx.send(shared[1:])  # cuda-mp's own memory: no copy, the same bytes
    got = rx.recv(timeout=10)
    assert got.__array_interface__["data"][0] == shared[1:].__array_interface__["data"][0]
    got[0, 0] = -1
    assert shared[1, 0] == -1


def test_views_of_shared_memory_whose_elements_repeat_arrive_read_only():
    tx, rx = pair()
    shared = cuda_mp.empty_host((4,), "int32")
    shared[:] = np.arange(4)
    tx.send(np.broadcast_to(shared, (3, 4)))  # each row the same 4 elements: stride 0
    got = rx.recv(timeout=10)
    assert got.strides[0] == 0
    np.testing.assert_array_equal(got, np.tile(np.arange(4), (3, 1)))
    assert not got.flags.writeable
    with pytest.raises(ValueError):
        got[0, 0] = -1
    assert shared[0] == 0
    windows = np.lib.stride_tricks.sliding_window_view(shared, 3)  # rows that overlap
    tx.send(windows)
    got = rx.recv(timeout=10)
    np.testing.assert_array_equal(got, windows)
    assert not got.flags.writeable
    tx.send(shared[::2])  # a view without repeats stays writable
    stepped = rx.recv(timeout=10)
    assert stepped.flags.writeable
    tx.send(shared[:2])
    plain = rx.recv(timeout=10)
    plain[0] = -1
    assert shared[0] == -1


def test_timeouts_disconnects_and_wrong_values_raise_their_exceptions():
    tx, rx = pair()
    with pytest.raises(cuda_mp.Timeout) as e:
        rx.recv(timeout=0.2)
    assert isinstance(e.value, TimeoutError) and isinstance(e.value, cuda_mp.Error)
    with pytest.raises(cuda_mp.DTypeError):
        tx.send(np.zeros(3, dtype=np.complex64))
    bundles = cuda_mp.Listener(cuda_mp.Bundle)
    with pytest.raises(TypeError):
        cuda_mp.connect(bundles.name, cuda_mp.Bundle).send(np.zeros(3))
    with pytest.raises(ValueError):
        cuda_mp.Listener("nonsense")
    with pytest.raises(ValueError):  # a forged view: no panic, no overflow
        cuda_mp._native.host_tensor("f32", [2**62, 4], [2**62, 1], 0, 0, 0, b"\0" * 16)
    del tx
    with pytest.raises(cuda_mp.Disconnected):
        rx.recv(timeout=5)
    with pytest.raises(cuda_mp.Error):
        cuda_mp.connect("no-such-listener-anywhere", cuda_mp.HostTensor)


def test_a_view_whose_offset_is_past_what_an_address_holds_is_refused():
    memory = cuda_mp.empty_host(8, "float32")
    address = memory.__array_interface__["data"][0]
    try:
        cuda_mp._native.host_tensor("f32", [1], [1], 2**64 - 1, address + 4, 4)
        raise AssertionError("the view was made")
    except ValueError:  # no panic, no wrap to a view at the start
        pass


def child_writes(tx, n):
    import numpy as np

    for i in range(n):
        shared = cuda_mp.empty_host((4,), "int64")
        shared[:] = i
        tx.send(shared)


def test_a_spawned_python_process_sends_over_a_channel():
    tx, rx = cuda_mp.channel(cuda_mp.HostTensor)
    p = mp.get_context("spawn").Process(target=child_writes, args=(tx, 5))
    p.start()
    got = [rx.recv(timeout=30) for _ in range(5)]
    p.join(30)
    assert p.exitcode == 0
    assert [int(g[0]) for g in got] == list(range(5))
    # The child exited: what it sent is still readable here (the memory is shared, not its own).
    assert all((g == i).all() for i, g in enumerate(got))


def test_a_rust_process_adds_one_in_place_and_sends_the_same_memory_back():
    peer, tx, rx = start_rust_peer(cuda_mp.HostTensor, timeout=30)
    try:
        for n in range(3):
            shared = cuda_mp.empty_host((2, 8), "float32")
            shared[:] = np.arange(16, dtype=np.float32).reshape(2, 8) * n
            tx.send(shared)
            back = rx.recv(timeout=30)
            expected = np.arange(16, dtype=np.float32).reshape(2, 8) * n + 1
            np.testing.assert_array_equal(back, expected)
            np.testing.assert_array_equal(shared, expected)  # written in this process's memory
            assert back.__array_interface__["data"][0] == shared.__array_interface__["data"][0]
        # A plain array is copied into shared memory on the way; the answer is that copy.
        back = None
        tx.send(np.full(3, 2.5, dtype=np.float32))
        np.testing.assert_array_equal(rx.recv(timeout=30), np.full(3, 3.5, dtype=np.float32))
        del tx
        out, _ = peer.communicate(timeout=30)
        assert peer.returncode == 0, out
        assert "PASS" in out and "served 4 host tensors" in out, out
    finally:
        peer.kill()


def test_host_arrays_come_from_the_caching_allocator_which_can_be_emptied_and_turned_off():
    cuda_mp.set_caching(True)
    before = cuda_mp.allocator_stats()
    a = cuda_mp.empty_host((1024,), "float32")
    during = cuda_mp.allocator_stats()
    assert during["blocks"] == before["blocks"] + 1
    assert during["allocated_bytes"] >= before["allocated_bytes"] + 4096
    del a
    assert cuda_mp.allocator_stats()["blocks"] == before["blocks"]
    # A peer process of an earlier test may still be releasing its claims on blocks of the
    # same segment (they end once this process's reaper sees the peer's exit): wait for them.
    deadline = time.monotonic() + 10
    freed = cuda_mp.empty_cache()
    while freed == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
        freed = cuda_mp.empty_cache()
    assert freed > 0
    assert cuda_mp.allocator_stats()["reserved_bytes"] == 0
    cuda_mp.set_cache_limit(1 << 20)
    with pytest.raises(cuda_mp.Error):
        cuda_mp.empty_host((1 << 20,), "float32")  # a 4 MiB block needs a 20 MiB segment
    cuda_mp.set_cache_limit(None)
    cuda_mp.set_caching(False)
    b = cuda_mp.empty_host((16,), "int64")
    assert cuda_mp.allocator_stats()["blocks"] == 0
    b[:] = 3
    assert b.sum() == 48
    cuda_mp.set_caching(True)


def test_dir_lists_the_api_and_every_name_in_it_exists():
    assert dir(cuda_mp) == sorted(cuda_mp.__all__)
    for name in cuda_mp.__all__:
        assert getattr(cuda_mp, name) is not None, name
    assert "Optional" not in dir(cuda_mp) and "threading" not in dir(cuda_mp)


def receive_sum_and_reply(rx, reply):
    a = rx.recv(timeout=60)
    reply.send(np.array([a.sum()]))


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_both_ends_of_a_channel_pickle_to_a_child(method):
    ctx = mp.get_context(method)
    listener = cuda_mp.Listener(cuda_mp.HostTensor)
    tx = cuda_mp.connect(listener.name, cuda_mp.HostTensor)
    rx = listener.accept(timeout=10)
    back_listener = cuda_mp.Listener(cuda_mp.HostTensor)
    back = cuda_mp.connect(back_listener.name, cuda_mp.HostTensor)
    replies = back_listener.accept(timeout=10)
    p = ctx.Process(target=receive_sum_and_reply, args=(rx, back))
    p.start()
    with pytest.raises(cuda_mp.Disconnected, match="was pickled"):
        rx.recv(timeout=1)  # moved: the child receives now
    tx.send(np.arange(10, dtype="float32"))
    assert replies.recv(timeout=60).tolist() == [45.0]
    p.join(60)
    assert p.exitcode == 0
    with pytest.raises(TypeError, match="stays in the process"):
        pickle.dumps(cuda_mp.channel(cuda_mp.HostTensor)[1])


def hold_until_told(conn):
    held = conn.recv(timeout=30)
    conn.send("held")
    conn.recv(timeout=30)
    del held
    conn.send("dropped")


def test_holder_stats_show_who_holds_this_process_memory():
    import multiprocessing as mp
    import time

    import cuda_mp

    earlier = {h["lease"] for h in cuda_mp.holder_stats()}  # other tests' holders, if any
    here, there = cuda_mp.Pipe()
    p = mp.get_context("spawn").Process(target=hold_until_told, args=(there,))
    p.start()
    a = cuda_mp.empty_host((1 << 18,), "float32")  # 1 MiB
    here.send(a)
    assert here.recv(timeout=30) == "held"
    (held,) = [h for h in cuda_mp.holder_stats() if h["lease"] not in earlier]
    assert held["storages"] == 1 and held["claims"] == 1 and held["bytes"] >= 1 << 20, held
    here.send("drop")
    assert here.recv(timeout=30) == "dropped"
    deadline = time.monotonic() + 30
    def still_held():
        return [h for h in cuda_mp.holder_stats() if h["lease"] == held["lease"]]

    while still_held() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not still_held(), "released when the holder dropped it"
    p.join(30)
    assert p.exitcode == 0


def test_a_bf16_message_that_numpy_cannot_hold_is_not_lost():
    bf16 = cuda_mp._native.host_tensor("bf16", [4], [], 0, 0, 0, bytes(range(8)))
    tx, rx = pair()
    tx.send(bf16)
    with pytest.raises(cuda_mp.DTypeError) as e:
        rx.recv(timeout=10)  # a NumPy receiver: no bfloat16
    got = e.value.received  # the message goes with the error
    assert (got.dtype, got.shape) == ("bf16", [4])
    tx.send(np.arange(3, dtype=np.float32))
    assert rx.recv(timeout=10).tolist() == [0.0, 1.0, 2.0], "the channel goes on"


def test_a_view_of_shared_memory_that_reuses_freed_blocks_travels_without_a_copy():
    import gc

    tx, rx = pair()
    a, b = cuda_mp.empty_host((256,), "float32"), cuda_mp.empty_host(256, "float32")
    for x in (a, b):
        tx.send(x)  # both are remembered as this process's storages
        rx.recv(timeout=10)
    del a, b, x
    gc.collect()
    c = cuda_mp.empty_host((1024,), "float32")  # may reuse their memory
    for view in (c[:10], c[300:310], c[-10:]):
        tx.send(view)
        got = rx.recv(timeout=10)
        got[:] = 7
        assert (view == 7).all(), "the receiver wrote the sender's memory, not a copy"
