"""``cuda_mp.Queue`` between processes of every start method: any picklable object, arrays in
cuda-mp memory shared rather than copied, each item to exactly one consumer. No GPU needed."""

import collections
import multiprocessing as mp
import pickle
import queue
import subprocess
import sys
import textwrap
import threading
import time

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


def test_stats_takes_a_timeout():
    q = cuda_mp.Queue()
    q.put(1)
    assert q._native.stats(5.0)[0] == 1
    assert q.qsize(timeout=5.0) == 1 and not q.empty(timeout=5.0)
    with pytest.raises(ValueError):
        q.qsize(timeout=float("nan"))
    with pytest.raises(ValueError):
        q._native.stats(float("nan"))
    assert q.get(timeout=10) == 1


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
        assert there.poll(), "pickled away: a recv raises at once"
        with pytest.raises(cuda_mp.Disconnected, match="was pickled"):
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
        # Cut short or damaged, the forgeries were refused by their check before anything was
        # fetched: the real bytes decode.
        decode(data)
    for decode in (cuda_mp._native.Sender.from_bytes, cuda_mp._native.Receiver.from_bytes):
        with pytest.raises(cuda_mp.Malformed):
            decode("host", b"\x00\x01garbage")
    with pytest.raises(ValueError, match="unknown channel kind"):
        cuda_mp._native.Sender.from_bytes("nope", b"")


Pair = collections.namedtuple("Pair", "x y")


class Point:
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Point) and other.x == self.x


def test_objects_keep_their_exact_types_as_values_or_pickles():
    deep = []
    for _ in range(100):
        deep = [deep]
    itself = [1]
    itself.append(itself)
    shared = cuda_mp.empty_host((3,), "int32")
    shared[:] = 7
    objects = [
        None,
        True,
        -(2**63),
        2**63,  # past 64 bits: pickled
        1.5,
        "text \u00e9",
        "lone \ud800",  # no UTF-8: pickled
        b"\x00bytes",
        [1, [2.0, ("three", None)]],
        (),
        {"a": 1, 2: "b", (3, 4): [5]},
        collections.OrderedDict(a=1),  # a dict's subclass: pickled, its type kept
        Pair(1, 2),  # a tuple's subclass: pickled
        {1, 2},
        Point(3),
        deep,
        np.arange(4),  # an ordinary array: copied
    ]
    q = cuda_mp.Queue()
    for obj in objects:
        q.put(obj)
    for obj in objects:
        got = q.get(timeout=10)
        assert type(got) is type(obj)
        if isinstance(obj, np.ndarray):
            assert got.tolist() == obj.tolist()
        else:
            assert got == obj
    q.put(itself)
    again = q.get(timeout=10)
    assert again[0] == 1 and again[1] is again, "a list that holds itself is pickled, whole"
    q.put({"shared": shared, "step": 3})
    got = q.get(timeout=10)
    got["shared"][:] = 9
    assert shared.tolist() == [9, 9, 9], "cuda-mp memory inside a value is shared"


class Tied:
    def __init__(self, a, b):
        self.a, self.b = a, b


def test_a_tensor_met_twice_in_an_item_arrives_as_one_object():
    # As pickle keeps one object for two references to it: tied weights stay tied.
    shared = cuda_mp.empty_host((4,), "float32")
    q = cuda_mp.Queue()
    a, b = cuda_mp.Pipe()
    for item in (Tied(shared, shared), [shared, shared], {"x": shared, "y": [shared]}):
        q.put(item)
        a.send(item)
        for got in (q.get(timeout=10), b.recv(timeout=10)):
            if isinstance(got, Tied):
                assert got.a is got.b
            elif isinstance(got, list):
                assert got[0] is got[1]
            else:
                assert got["x"] is got["y"][0]
    # cuda-mp's own tensors (as a bf16 host tensor arrives where torch is missing) too.
    native = cuda_mp._shared_array(shared, "f32")
    for item in ([native, native], {"a": native, "b": (native, 1)}):
        q.put(item)
        a.send(item)
        for got in (q.get(timeout=10), b.recv(timeout=10)):
            first, second = (got[0], got[1]) if isinstance(got, list) else (got["a"], got["b"][0])
            assert first is second and first.tolist() == shared.tolist()
    other = cuda_mp.empty_host((4,), "float32")
    q.put([shared, other])
    got = q.get(timeout=10)
    assert got[0] is not got[1], "two tensors stay two"
    got[0][:] = 1
    got[1][:] = 2
    assert shared.tolist() == [1.0] * 4 and other.tolist() == [2.0] * 4


def test_a_pipe_polls_as_multiprocessing_pipes_do():
    a, b = cuda_mp.Pipe()
    assert not b.poll(), "nothing sent"
    assert not b.poll(0.05)
    a.send({"n": 1})
    assert b.poll(5)
    assert b.poll(), "what poll saw stays until it is received"
    with pytest.raises(cuda_mp.Error, match="poll"):
        pickle.dumps(b)
    assert b.recv(timeout=5) == {"n": 1}
    assert not b.poll()
    a.send(2)
    a.send(3)
    assert b.poll(5) and b.recv(timeout=5) == 2 and b.recv(timeout=5) == 3, "in order"
    a.close()
    del a
    assert b.poll(5), "at the end poll says a recv returns at once"
    with pytest.raises(EOFError):  # as multiprocessing's recv at the end
        b.recv(timeout=5)


def test_a_rust_process_consumes_a_python_queue_and_answers_on_another():
    from conftest import start_rust_queue_consumer

    peer, work, answers = start_rust_queue_consumer()
    try:
        arrays = []
        for step in range(5):
            a = cuda_mp.empty_host((8,), "float32")
            a[:] = step
            arrays.append(a)
            work.put({"step": step, "x": a, "note": f"step {step}"})
        work.put(Point(1))  # only Python reads it: the Rust side counts it
        work.put(None)
        got = [answers.get(timeout=30) for _ in range(6)]
        assert got[:5] == [(step, f"step {step}", 8) for step in range(5)]
        assert got[5] == ("pickled", 0)
        assert [a.tolist() for a in arrays] == [[step + 1.0] * 8 for step in range(5)], "added to in place"
        assert peer.wait(30) == 0
    finally:
        peer.kill()
    assert "PASS" in peer.stdout.read()


def own_a_multiprocessing_queue(conn, done):
    q = cuda_mp.MultiprocessingQueue()
    conn.send(q.to_bytes())
    done.wait(60)  # then this process, and with it the queue, ends


def test_a_multiprocessing_queue_whose_process_is_gone_answers_as_multiprocessings_does():
    import time

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    done = ctx.Event()
    owner = ctx.Process(target=own_a_multiprocessing_queue, args=(there, done))
    owner.start()
    try:
        q = cuda_mp.MultiprocessingQueue._from_bytes(here.recv())
        q.put("before")
        assert q.get(timeout=30) == "before"
        done.set()
        owner.join(60)
        assert owner.exitcode == 0
        q.put("after")  # dropped, as on a pipe nobody reads
        start = time.monotonic()
        with pytest.raises(queue.Empty):
            q.get(timeout=0.5)
        assert time.monotonic() - start >= 0.45, "the timeout is waited out, not cut short"
        with pytest.raises(queue.Empty):
            q.get(block=False)
        with pytest.raises(cuda_mp.Disconnected):
            q.get()  # where multiprocessing's would wait for ever
        with pytest.raises(cuda_mp.Disconnected):
            q.qsize()
        assert repr(q) == "cuda_mp.Queue(disconnected)"
    finally:
        owner.kill()


def test_a_bf16_host_tensor_in_an_item_arrives_as_a_tensor_numpy_cannot_hold():
    q = cuda_mp.Queue()
    bf16 = cuda_mp._native.host_tensor("bf16", [2, 2], [], 0, 0, 0, bytes(range(8)))
    q.put({"w": bf16, "step": 3})
    got = q.get(timeout=10)
    assert got["step"] == 3
    try:
        import torch
    except ImportError:  # cuda-mp's own tensor, which a queue carries on as it is
        assert (got["w"].dtype, got["w"].shape) == ("bf16", [2, 2])
        q.put(got["w"])
        assert q.get(timeout=10).dtype == "bf16"
    else:
        assert got["w"].dtype == torch.bfloat16 and got["w"].shape == (2, 2)


def write_once(conn, i):
    conn.send(i)


def test_one_write_only_end_goes_to_many_spawned_children():
    ctx = mp.get_context("spawn")
    reader, writer = cuda_mp.Pipe(duplex=False)
    children = [ctx.Process(target=write_once, args=(writer, i)) for i in range(3)]
    for p in children:
        p.start()  # each pickles the writer again (the second raised: "pickled already")
    assert sorted(reader.recv(timeout=60) for _ in children) == [0, 1, 2]
    for p in children:
        p.join(60)
        assert p.exitcode == 0
    writer.send("and here")
    assert reader.recv(timeout=5) == "and here"


def test_a_pipe_has_the_rest_of_multiprocessings_connection():
    reader, writer = cuda_mp.Pipe(duplex=False)
    with pytest.raises(OSError, match="read-only"):
        reader.send(1)
    with pytest.raises(OSError, match="write-only"):
        writer.recv(timeout=1)
    writer.send_bytes(b"abcdef", 1, 3)
    assert reader.recv_bytes() == b"bcd"
    writer.send({"not": "bytes"})
    with pytest.raises(TypeError) as e:
        reader.recv_bytes()
    assert e.value.received == {"not": "bytes"}, "what came goes with the error"
    writer.send_bytes(bytearray(10))
    with pytest.raises(OSError) as e:
        reader.recv_bytes(maxlength=4)
    assert e.value.received == bytes(10)
    writer.send_bytes(b"kept")
    with pytest.raises(ValueError, match="negative maxlength"):
        reader.recv_bytes(-1)
    assert reader.recv_bytes() == b"kept", "nothing was received by the refused call"
    writer.send_bytes(b"hello")
    buf = bytearray(8)
    assert reader.recv_bytes_into(buf, 2) == 5 and bytes(buf) == b"\0\0hello\0"
    writer.send_bytes(b"too long")
    with pytest.raises(mp.BufferTooShort) as e:
        reader.recv_bytes_into(bytearray(4))
    assert e.value.args[0] == b"too long", "what came goes with the error"
    with writer:
        writer.send("last")
    assert writer.closed
    assert reader.recv(timeout=5) == "last"
    with pytest.raises(EOFError):
        reader.recv(timeout=5)


def test_a_queue_has_the_rest_of_multiprocessings_queue():
    q = cuda_mp.Queue()
    q.put(1)
    assert not q.full()
    assert q.get(timeout=5) == 1
    with pytest.raises(AssertionError):
        q.join_thread()  # only after close, as multiprocessing's
    q.close()
    q.join_thread()
    q.cancel_join_thread()
    with pytest.raises(ValueError):
        q.put(2)
    with pytest.raises(ValueError):
        q.get(timeout=1)


def test_an_item_goes_to_a_consumer_only_in_its_get_unless_it_asks_ahead():
    q = cuda_mp.Queue()
    q.put("first")
    assert q.get(timeout=5) == "first"
    for i in range(10):
        q.put(i)
    assert q.qsize() == 10 and not q.empty()
    drained = []
    while not q.empty():
        drained.append(q.get(timeout=5))
    assert drained == list(range(10)), "empty() counts nothing this process's gets hold ahead"
    ahead = cuda_mp.Queue(prefetch=2)
    for i in range(5):
        ahead.put(i)
    assert ahead.get(timeout=5) == 0
    # What this handle asked for ahead is counted: not yet taken by a get.
    assert ahead.qsize() == 4
    assert [ahead.get(timeout=5) for _ in range(4)] == [1, 2, 3, 4]


def test_cuda_mp_tensors_as_dict_keys_arrive_as_keys():
    q = cuda_mp.Queue()
    key = cuda_mp._native.host_tensor("f32", [2], [], 0, 0, 0, bytes(8))
    q.put({key: 1, "x": 2})
    got = q.get(timeout=5)  # a NumPy array cannot be a key: cuda-mp's own tensor is
    assert got["x"] == 2
    (tensor_key,) = [k for k in got if k != "x"]
    assert (tensor_key.dtype, tensor_key.shape, got[tensor_key]) == ("f32", [2], 1)


STOPPED_QUEUE_PROCESS = textwrap.dedent(
    """
    import multiprocessing as mp, os, signal, time
    import cuda_mp

    def serve(conn):
        q = cuda_mp.Queue()
        conn.send((q.to_bytes(), q.to_bytes()))
        time.sleep(60)

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        server = ctx.Process(target=serve, args=(there,), daemon=True)
        server.start()
        first, second = here.recv()
        q = cuda_mp.Queue.from_bytes(first)
        assert q.qsize(timeout=10) == 0
        os.kill(server.pid, signal.SIGSTOP)
        time.sleep(0.5)  # stopped by now
        signal.signal(signal.SIGALRM, signal.default_int_handler)  # Ctrl-C, one second on
        for name, wait in [("qsize", q.qsize), ("from_bytes", lambda: cuda_mp.Queue.from_bytes(second))]:
            signal.alarm(1)
            start = time.monotonic()
            try:
                wait()
                print(name, "returned", flush=True)
            except KeyboardInterrupt:
                print(name, "interrupted after", round(time.monotonic() - start, 1), flush=True)
        os.kill(server.pid, signal.SIGKILL)
    """
)


def test_waits_on_a_stopped_queue_process_end_at_ctrl_c(tmp_path):
    """``qsize()`` without a timeout, and decoding a queue's bytes, wait for the queue's process;
    stopped (SIGSTOP, Ctrl-Z), it never answers, and Ctrl-C must end the wait (both waited
    in one piece, the decode for 30 s, and ignored it)."""
    script = tmp_path / "stopped.py"
    script.write_text(STOPPED_QUEUE_PROCESS)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert [line.split(" after")[0] for line in lines] == ["qsize interrupted", "from_bytes interrupted"], out
    assert all(float(line.split()[-1]) < 5 for line in lines), out


def test_qsize_answers_while_another_thread_waits_in_get():
    """A thread waiting in ``get`` takes the handle back between its slices (it looks for
    Ctrl-C between them); a ``qsize`` of another thread used to time out against the queue."""
    q = cuda_mp.Queue()
    getter = threading.Thread(target=q.get, daemon=True)
    getter.start()
    time.sleep(0.3)
    sizes = []
    for _ in range(3):
        try:
            sizes.append(q.qsize(timeout=2))
        except cuda_mp.Timeout as e:
            sizes.append(e)
    q.put("stop")
    getter.join(5)
    assert sizes == [0, 0, 0]
