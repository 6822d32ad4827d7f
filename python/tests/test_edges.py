"""Edges of the Python API: limits of every size, a first receive that times out, objects a
`poll` took in before a fork, shared parts of a value, unaligned views. No GPU needed."""

import multiprocessing as mp
import queue
import threading
import time

import numpy as np

import cuda_mp


def test_a_limit_of_any_size_is_a_limit_and_a_negative_one_no_wait():
    a, b = cuda_mp.Pipe()
    a.send("there")
    # Past what the clock holds: no limit (it panicked into Python).
    assert b.recv(timeout=1e19) == "there"
    cuda_mp.flush_sends(1e19)
    cuda_mp._native.flush_backlogs(1e19)  # what the exit finalizer waits for: the messages alone
    a.send("again")
    assert b.recv(timeout=1e300) == "again"
    # Negative: no wait, as multiprocessing takes it (it raised ValueError).
    assert b.poll(-1) is False
    for bad in (float("nan"), float("inf")):
        try:
            b.poll(bad)
            raise AssertionError(f"a timeout of {bad} was taken")
        except ValueError:
            pass
    q = cuda_mp.Queue()
    try:
        q.get(timeout=-1)
        raise AssertionError("an empty queue gave an item")
    except queue.Empty:
        pass


def send_late(tx):
    time.sleep(1.0)
    tx.send(np.arange(3, dtype=np.int32))


def test_the_first_receive_of_a_channel_may_time_out_and_be_tried_again():
    tx, rx = cuda_mp.channel(cuda_mp.HostTensor)
    p = mp.get_context("spawn").Process(target=send_late, args=(tx,))
    p.start()
    timeouts = 0
    while True:
        try:
            got = rx.recv(timeout=0.2)
            break
        except cuda_mp.Timeout:
            timeouts += 1
            assert timeouts < 100, "the sender never came"
    p.join(30)
    assert p.exitcode == 0
    assert timeouts >= 1, "the first receive waited for the late sender"
    assert np.asarray(got).tolist() == [0, 1, 2]


def test_the_first_receive_of_a_channel_waits_at_most_its_timeout_in_all():
    # The sender connects after 0.6 s and sends 0.6 s later: a first receive of 1 s times out
    # at 1 s (it waited 1 s for the connection, then 1 s more for the message).
    tx, rx = cuda_mp.channel(cuda_mp.HostTensor)

    def connect_then_send_late():
        time.sleep(0.6)
        with tx._lock:
            tx._native = cuda_mp._native.Sender.connect(tx._name, tx.kind)
        time.sleep(0.6)
        tx.send(np.arange(3))

    threading.Thread(target=connect_then_send_late, daemon=True).start()
    start = time.monotonic()
    try:
        rx.recv(timeout=1.0)
        raise AssertionError("the first receive outlasted its timeout")
    except cuda_mp.Timeout:
        pass
    assert time.monotonic() - start < 1.15
    assert np.asarray(rx.recv(timeout=10)).tolist() == [0, 1, 2]


def test_threads_that_make_the_first_receive_together_share_one_accept():
    tx, rx = cuda_mp.channel(cuda_mp.HostTensor)
    got, errors = [], []

    def receive():
        try:
            got.append(np.asarray(rx.recv(timeout=20)).tolist())
        except Exception as e:  # noqa: BLE001 (the test reports what any thread met)
            errors.append(e)

    threads = [threading.Thread(target=receive) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    for i in range(4):
        tx.send(np.array([i]))
    for t in threads:
        t.join(30)
    assert errors == [] and sorted(got) == [[0], [1], [2], [3]]


def receive_one(conn, out):
    out.put(("child", conn.recv(timeout=2) if conn.poll(2) else None))


def test_what_poll_took_in_is_received_once_after_a_fork():
    a, b = cuda_mp.Pipe()
    a.send("only one copy of me")
    assert b.poll(2)
    out = cuda_mp.Queue()
    p = mp.get_context("fork").Process(target=receive_one, args=(b, out))
    p.start()
    p.join(30)
    got = [out.get(timeout=5)[1]]
    if b.poll(0.5):
        got.append(b.recv(timeout=1))
    assert got.count("only one copy of me") == 1, got


def poll_and_receive(conn, rx, out):
    started = time.monotonic()
    try:
        conn.poll(1)
        rx.recv(timeout=1)
    except cuda_mp.Timeout:
        pass
    out.put(time.monotonic() - started)


def test_a_child_forked_while_a_thread_receives_keeps_to_its_timeouts():
    # A thread of the parent holds each receiving end for a slice of its wait when the child is
    # forked: the child's poll and recv keep to their limits (they hung for ever on its lock).
    a, b = cuda_mp.Pipe()
    listener = cuda_mp.Listener(cuda_mp.HostTensor)
    tx = cuda_mp.connect(listener.name, cuda_mp.HostTensor)
    rx = listener.accept(timeout=5)
    stop = threading.Event()

    def receive_for_ever(end):
        while not stop.is_set():
            try:
                end.recv(timeout=0.5)
            except cuda_mp.Timeout:
                pass

    readers = [threading.Thread(target=receive_for_ever, args=(end,), daemon=True) for end in (b, rx)]
    for t in readers:
        t.start()
    time.sleep(0.3)
    out = mp.get_context("fork").SimpleQueue()
    p = mp.get_context("fork").Process(target=poll_and_receive, args=(b, rx, out))
    p.start()
    p.join(20)
    hung = p.is_alive()
    p.kill()
    stop.set()
    for t in readers:
        t.join(5)
    assert not hung, "the forked child's poll(1) and recv(timeout=1) did not return"
    assert out.get() < 10
    del tx


def send_once(tx, out):
    started = time.monotonic()
    tx.send(np.arange(4, dtype=np.float32))
    out.put(time.monotonic() - started)


def test_a_child_forked_while_a_thread_sends_can_send():
    # A thread of the parent sends on the same end, without pause, when each child is forked:
    # the child's own send goes (it could wait for ever on a lock the parent's thread held).
    listener = cuda_mp.Listener(cuda_mp.HostTensor)
    tx = cuda_mp.connect(listener.name, cuda_mp.HostTensor)
    rx = listener.accept(timeout=5)
    stop = threading.Event()
    counts = {"sent": 0, "received": 0}

    def send_for_ever():
        small = np.zeros(1, dtype=np.uint8)
        while not stop.is_set():
            tx.send(small)
            counts["sent"] += 1

    def receive_for_ever():
        while not stop.is_set():
            try:
                rx.recv(timeout=0.2)
                counts["received"] += 1
            except cuda_mp.Timeout:
                pass

    threads = [threading.Thread(target=f, daemon=True) for f in (send_for_ever, receive_for_ever)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    hung = 0
    out = mp.get_context("fork").SimpleQueue()
    for _ in range(20):
        p = mp.get_context("fork").Process(target=send_once, args=(tx, out))
        p.start()
        p.join(10)
        if p.is_alive():
            hung += 1
            p.kill()
            p.join()
    stop.set()
    for t in threads:
        t.join(5)
    assert hung == 0, f"{hung} of 20 children forked during a send could not send"
    assert counts["sent"] > 0 and counts["received"] > 0


def test_small_immutable_parts_met_twice_still_travel_as_a_value():
    # CPython shares these by itself (the empty tuple and bytes, a literal's equal constant
    # tuples): a Rust consumer reads the item as a value (it was pickled, unreadable there).
    from cuda_mp.queue import _Leaves

    q = cuda_mp.Queue()
    pair = (1, "two")
    item = {"a": (), "b": (), "c": b"", "d": b"", "e": pair, "f": pair}
    assert q._native.put(item, _Leaves()) is True
    assert q.get(timeout=5) == item
    big = bytes(1000)
    assert q._native.put([big, big], _Leaves()) is False, "a large part met twice is pickled, once"


def test_parts_of_a_value_met_twice_stay_one_object():
    q = cuda_mp.Queue()
    inner = []
    q.put([inner, inner])
    got = q.get(timeout=5)
    got[0].append(1)
    assert got == [[1], [1]], "the two references name one list, as with pickle"
    x = 0
    for _ in range(40):
        x = [x, x]
    start = time.monotonic()
    q.put(x)
    q.get(timeout=30)
    assert time.monotonic() - start < 10, "a value of shared parts is not walked once per path"


def test_a_view_of_cuda_mp_memory_off_its_elements_boundary_is_copied():
    tx, rx = cuda_mp.Pipe()
    raw = cuda_mp.empty_host((64,), "uint8")
    raw[1:9] = np.arange(8, dtype=np.uint8)
    view = raw[1:9].view(np.float32)
    tx.send(view)
    got = rx.recv(timeout=5)
    assert got.tobytes() == view.tobytes()
