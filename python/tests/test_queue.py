"""``cuda_mp.Queue`` between processes of every start method: any picklable object, arrays in
cuda-mp memory shared rather than copied, each item to exactly one consumer. No GPU needed."""

import multiprocessing as mp
import pickle
import queue

import numpy as np
import pytest

import cuda_mp


def double_shared_and_report(q, results):
    while True:
        item = q.get(timeout=60)
        if item is None:
            return
        item["shared"] *= 2  # cuda-mp memory: the producer sees it
        item["copied"] *= 2  # an ordinary array: a copy
        results.put((item["id"], item["name"], float(item["copied"].sum())))


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_objects_cross_to_children_and_cuda_mp_memory_is_shared(method):
    ctx = mp.get_context(method)
    q, results = cuda_mp.Queue(), cuda_mp.Queue()
    workers = [ctx.Process(target=double_shared_and_report, args=(q, results)) for _ in range(2)]
    for w in workers:
        w.start()
    shared = []
    for i in range(20):
        a = cuda_mp.empty_host((16,), "float32")
        a[:] = i
        shared.append(a)
        q.put({"id": i, "name": f"item {i}", "shared": a, "copied": np.full(16, float(i))})
    got = sorted(results.get(timeout=60) for _ in range(20))
    for _ in workers:
        q.put(None)
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    assert got == [(i, f"item {i}", 32.0 * i) for i in range(20)], "every item to one worker, whole"
    assert [a.tolist() for a in shared] == [[2.0 * i] * 16 for i in range(20)], "the workers wrote to this memory"


def take_all(q, results):
    taken = []
    while True:
        item = q.get(timeout=60)
        if item is None:
            break
        taken.append(item)
    results.put(taken)


def test_each_item_goes_to_exactly_one_of_many_consumers():
    ctx = mp.get_context("spawn")
    q, results = cuda_mp.Queue(), cuda_mp.Queue()
    workers = [ctx.Process(target=take_all, args=(q, results)) for _ in range(3)]
    for w in workers:
        w.start()
    for i in range(300):
        q.put(i)
    for _ in workers:
        q.put(None)
    taken = sorted(i for _ in workers for i in results.get(timeout=60))
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    assert taken == list(range(300))


def put_from_child(q, n):
    for i in range(n):
        a = cuda_mp.empty_host((4,), "int64")
        a[:] = i
        q.put(("from the child", a))


def test_a_child_produces_for_its_parent_and_its_memory_outlives_it():
    ctx = mp.get_context("spawn")
    q = cuda_mp.Queue()
    p = ctx.Process(target=put_from_child, args=(q, 5))
    p.start()
    items = [q.get(timeout=60) for _ in range(5)]
    p.join(60)
    assert p.exitcode == 0
    assert [(w, a.tolist()) for w, a in items] == [("from the child", [i] * 4) for i in range(5)]


def test_gets_time_out_as_multiprocessing_queues_do():
    q = cuda_mp.Queue()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    q.put_nowait([1, "two", 3.0])
    assert q.qsize() == 1 and not q.empty()
    assert q.get(block=False) == [1, "two", 3.0]
    assert "waiting=0" in repr(q)


def test_a_pickled_handle_is_read_once():
    q = cuda_mp.Queue()
    data = pickle.dumps(q)
    other = pickle.loads(data)
    other.put("through the copy")
    assert q.get(timeout=10) == "through the copy"
    with pytest.raises(cuda_mp.Malformed):
        pickle.loads(data)


def answer_on_the_pipe(conn):
    while True:
        item = conn.recv(timeout=60)
        if item is None:
            return
        item["shared"] += 1
        conn.send(("done", item["n"], item["shared"]))


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_pipe_carries_objects_both_ways_and_shares_cuda_mp_memory(method):
    ctx = mp.get_context(method)
    here, there = cuda_mp.Pipe()
    p = ctx.Process(target=answer_on_the_pipe, args=(there,))
    p.start()
    a = cuda_mp.empty_host((8,), "int32")
    a[:] = 0
    for n in range(5):
        here.send({"n": n, "shared": a})
        done, m, back = here.recv(timeout=60)
        assert (done, m) == ("done", n)
        assert back.tolist() == [n + 1] * 8, "the reply carries the same memory back"
    here.send(None)
    p.join(60)
    assert p.exitcode == 0
    assert a.tolist() == [5] * 8, "the child wrote to this process's memory"
    if method != "fork":
        with pytest.raises(cuda_mp.Disconnected):
            there.recv(timeout=1)  # pickled to the child: this process receives no more on it
    there.close()  # this process's copy of the child's sending half
    with pytest.raises(cuda_mp.Disconnected):
        here.recv(timeout=5)  # the child is gone
    with pytest.raises(OSError, match="closed"):
        there.send(1)
    with pytest.raises(cuda_mp.Disconnected):
        here.send("to nobody")  # the child's receiving half is gone with it


def test_forged_handle_bytes_raise_and_leave_the_real_ones_readable():
    q = cuda_mp.Queue()
    a, _b = cuda_mp.Pipe()
    tx, rx = cuda_mp.channel(cuda_mp.HostTensor)
    real = {
        "queue": (cuda_mp._native.Queue.from_bytes, q._native.to_bytes(60.0)),
        "pipe": (cuda_mp._native.Connection.from_bytes, a._native.to_bytes(60.0)),
    }
    for name, (decode, data) in real.items():
        for forged in (b"", b"\xff" * 8, data[: len(data) // 2], bytes([data[0] ^ 0xFF]) + data[1:]):
            with pytest.raises(cuda_mp.Malformed):
                decode(forged)
        # A forgery that reached the deposit took it (the first decode that does takes it): the
        # real bytes then decode or are refused, never twice.
        try:
            decode(data)
        except cuda_mp.Malformed as e:
            assert "holds none" in str(e), (name, e)
    for decode in (cuda_mp._native.Sender.from_bytes, cuda_mp._native.Receiver.from_bytes):
        with pytest.raises(cuda_mp.Malformed):
            decode("host", b"\x00\x01garbage")
    with pytest.raises(ValueError, match="unknown channel kind"):
        cuda_mp._native.Sender.from_bytes("nope", b"")
