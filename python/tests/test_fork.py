"""Children of every multiprocessing start method, fork included, after the parent used cuda-mp:
each child has its own identity and trades shared host arrays with its parent both ways."""

import multiprocessing as mp

import numpy as np
import pytest

import cuda_mp


def _name_as_array(name: str) -> np.ndarray:
    return np.frombuffer(name.encode(), dtype=np.uint8).copy()


def _child(to_parent, inherited):
    # The parent's array reached this child by fork (inherited) or by pickling (a copy); either
    # way this child may send it: a copy travels, never the parent's identity.
    listener = cuda_mp.Listener(cuda_mp.HostTensor)
    to_parent.send(_name_as_array(listener.name))
    rx = listener.accept(timeout=30)
    shared = rx.recv(timeout=30)  # the parent's shared memory, sent after the start
    shared += 1
    fresh = cuda_mp.empty_host((256,), "float32")  # memory of this child's own
    fresh[:] = 2
    to_parent.send(fresh)
    to_parent.send(inherited)
    to_parent.send(shared)  # the parent's memory goes back to it
    # The parent has received everything once this arrives: nothing is left for an exit
    # that skips the exit hooks (multiprocessing's fork children end with os._exit).
    assert rx.recv(timeout=30)[0] == 99


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_child_of_any_start_method_trades_arrays_with_a_parent_that_used_cuda_mp(method):
    if method not in mp.get_all_start_methods():
        pytest.skip(f"{method} is not available here")
    # The parent uses cuda-mp before it starts the child: a send, a receive, shared memory.
    listener = cuda_mp.Listener(cuda_mp.HostTensor)
    warm = cuda_mp.connect(listener.name, cuda_mp.HostTensor)
    warm.send(np.ones(4, dtype=np.float32))
    assert listener.accept(timeout=10).recv(timeout=10).sum() == 4
    inherited = cuda_mp.empty_host((16,), "int32")
    inherited[:] = 7

    to_parent, from_child = cuda_mp.channel(cuda_mp.HostTensor)
    child = mp.get_context(method).Process(target=_child, args=(to_parent, inherited))
    child.start()
    try:
        to_child = cuda_mp.connect(bytes(from_child.recv(timeout=60)).decode(), cuda_mp.HostTensor)
        shared = cuda_mp.empty_host((64,), "float32")
        to_child.send(shared)
        fresh = from_child.recv(timeout=30)
        np.testing.assert_array_equal(fresh, np.full(256, 2, dtype=np.float32))
        copy = from_child.recv(timeout=30)
        np.testing.assert_array_equal(copy, np.full(16, 7, dtype=np.int32))
        back = from_child.recv(timeout=30)
        assert back.__array_interface__["data"][0] == shared.__array_interface__["data"][0], "not the parent's memory"
        np.testing.assert_array_equal(shared, np.ones(64, dtype=np.float32))  # the child's write is seen
        to_child.send(np.array([99], dtype=np.int32))
        child.join(timeout=60)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()


def _send_many(tx, n):
    # Far more than the socket holds: most of it waits in this child's backlog when it returns.
    for i in range(n):
        tx.send(np.array([i], dtype=np.int64))


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_child_that_returns_with_its_sends_still_queued_loses_none_of_them(method):
    if method not in mp.get_all_start_methods():
        pytest.skip(f"{method} is not available here")
    n = 3000
    tx, rx = cuda_mp.channel(cuda_mp.HostTensor)
    child = mp.get_context(method).Process(target=_send_many, args=(tx, n))
    child.start()
    import time

    time.sleep(0.5)  # the child's sends fill the socket before anyone reads
    got = [int(rx.recv(timeout=30)[0]) for _ in range(n)]
    child.join(timeout=60)
    assert child.exitcode == 0
    assert got == list(range(n)), "messages of the child were lost or reordered"


def _note_before_exit(path):
    from cuda_mp import _native

    # What the worker's exit runs, observed: the real one finishes cuda-mp's part of the exit.
    _native.before_exit = lambda: open(path, "a").write("ran\n")


def _note_before_exit_after_a_thread(path):
    import threading
    import time

    _note_before_exit(path)

    def late():
        time.sleep(0.3)
        open(path, "a").write("thread\n")

    threading.Thread(target=late).start()  # not a daemon: the worker joins it as it ends


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_worker_does_cuda_mps_part_of_an_exit_that_os_exit_skips(method, tmp_path, monkeypatch):
    if method not in mp.get_all_start_methods():
        pytest.skip(f"{method} is not available here")
    path = tmp_path / "ran"
    child = mp.get_context(method).Process(target=_note_before_exit_after_a_thread, args=(str(path),))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    if method == "spawn":
        # A normal exit: the C library runs cuda-mp's hooks after every Python one.
        assert path.read_text() == "thread\n"
    else:
        assert path.read_text() == "thread\nran\n", "once, after the worker's threads ended"
    # The main process leaves it to its normal exit, whose hooks run after every Python one.
    called = []
    monkeypatch.setattr(cuda_mp._native, "before_exit", lambda: called.append(1))
    cuda_mp._before_exit_of_worker()
    assert called == []
