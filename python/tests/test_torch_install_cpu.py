"""``cuda_mp.torch.install()`` with CPU tensors, no GPU needed (PyTorch is): CPU tensors in
ordinary memory keep torch's own sharing, CPU tensors in cuda-mp memory travel as that memory,
and cuda-mp's reductions raise no warning of their own."""

import multiprocessing as mp
import warnings

import pytest

torch = pytest.importorskip("torch", reason="the install() CPU tests need PyTorch")

import cuda_mp  # noqa: E402
import cuda_mp.torch  # noqa: E402


@pytest.fixture
def installed():
    """install() for the test, with torch warning of TypedStorage every time (not once a
    process), so that a warning our reductions cause is seen whichever test runs first."""
    always = torch.storage._get_always_warn_typed_storage_removal()
    torch.storage._set_always_warn_typed_storage_removal(True)
    cuda_mp.torch.install()
    yield
    cuda_mp.torch.uninstall()
    torch.storage._set_always_warn_typed_storage_removal(always)


def add_one_and_answer(conn):
    assert conn.poll(60)
    t = conn.recv()
    t += 1
    conn.send("done")


def round_trip_in_place(t):
    """Sends ``t`` to a spawn child on a pipe (which pickles on this thread, unlike a queue's
    feeder); the child adds 1 in place and answers."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=add_one_and_answer, args=(there,))
    p.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a warning of our reductions fails the pickling
            here.send(t)
        assert here.poll(60)
        assert here.recv() == "done"
        p.join(60)
        assert p.exitcode == 0
    finally:
        p.kill()


def test_cpu_tensors_in_ordinary_memory_keep_torchs_sharing(installed):
    t = torch.zeros(1024)
    round_trip_in_place(t)
    assert t.is_shared(), "torch moved the storage to shared memory, as without install()"
    assert torch.equal(t, torch.ones(1024)), "the child's write is seen here"


def test_cpu_tensors_in_cuda_mp_memory_travel_as_that_memory(installed):
    a = cuda_mp.empty_host((1024,), "float32")
    t = torch.from_numpy(a)
    round_trip_in_place(t)
    assert not t.is_shared(), "torch's sharing did not move it: cuda-mp carried it"
    assert (a == 1).all(), "the child wrote this process's memory"


def test_a_cpu_typed_storage_pickles_without_a_deprecation_warning(installed):
    from multiprocessing.reduction import ForkingPickler

    untyped = torch.zeros(16).share_memory_().untyped_storage()
    # A TypedStorage, as torch's reduce_tensor pickles one.
    storage = torch.storage.TypedStorage(wrap_storage=untyped, dtype=torch.float32, _internal=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ForkingPickler.dumps(storage)


@pytest.fixture
def queues_installed():
    cuda_mp.torch.install(queues=True)
    yield
    cuda_mp.torch.uninstall()


def test_with_queues_every_contexts_queue_is_a_cuda_mp_queue_until_uninstall(queues_installed):
    import torch.multiprocessing as tmp

    for method in ("fork", "spawn", "forkserver"):
        assert type(mp.get_context(method).Queue()) is cuda_mp.MultiprocessingQueue, method
    assert type(mp.Queue()) is cuda_mp.MultiprocessingQueue
    assert type(tmp.Queue()) is cuda_mp.MultiprocessingQueue
    bounded = mp.get_context("spawn").Queue(2)
    assert type(bounded) is mp.queues.Queue, "a bounded queue stays multiprocessing's own"
    bounded.put(1)
    assert bounded.get(timeout=10) == 1
    joinable = mp.get_context("spawn").JoinableQueue()
    joinable.put(2)
    assert joinable.get(timeout=10) == 2
    joinable.task_done()
    joinable.join()
    cuda_mp.torch.uninstall()
    assert type(mp.Queue()) is mp.queues.Queue
    assert type(tmp.Queue()) is mp.queues.Queue
    assert type(mp.get_context("spawn").Queue()) is mp.queues.Queue


def echo_and_write(q_in, q_out):
    """An unchanged torch.mp consumer: answers what it gets, adds 1 to tensors in place, and
    ends as multiprocessing's queues let a process end."""
    while True:
        item = q_in.get(timeout=60)
        if item is None:
            break
        if isinstance(item, torch.Tensor):
            item += 1
            item = "written"
        q_out.put(item)
    q_in.close()
    q_out.close()
    q_out.join_thread()


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_with_queues_an_unchanged_program_carries_objects_and_shares_cuda_mp_memory(queues_installed, method):
    ctx = mp.get_context(method)
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=echo_and_write, args=(q_in, q_out))
    p.start()
    try:
        for item in (1, "two", {"three": [3.0, b"3"]}, (None, True)):
            q_in.put(item)
            got = q_out.get(timeout=60)
            assert type(got) is type(item) and got == item
        ordinary = torch.zeros(256)
        q_in.put(ordinary)
        assert q_out.get(timeout=60) == "written"
        assert ordinary.is_shared(), "torch's sharing moved it to shared memory, as on its own queues"
        assert torch.equal(ordinary, torch.ones(256)), "the child wrote this process's memory"
        ours = torch.from_numpy(cuda_mp.empty_host((256,), "float32")).zero_()
        q_in.put(ours)
        assert q_out.get(timeout=60) == "written"
        assert not ours.is_shared(), "cuda-mp carried it as its own memory"
        assert torch.equal(ours, torch.ones(256)), "the child wrote this process's memory"
        q_in.put(None)
        p.join(60)
        assert p.exitcode == 0
        assert q_out.empty() and not q_out.full()
        q_in.close()
        with pytest.raises(ValueError, match="closed"):
            q_in.put(1)
    finally:
        p.kill()


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((4,), float(i)), i


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_with_queues_a_data_loaders_workers_feed_it_through_cuda_mp_queues(queues_installed, method):
    loader = torch.utils.data.DataLoader(Numbers(), batch_size=8, num_workers=2, multiprocessing_context=method)
    batches = iter(loader)
    assert type(batches._worker_result_queue) is cuda_mp.MultiprocessingQueue
    seen = []
    for x, i in batches:
        assert torch.equal(x[:, 0], i.float())
        seen += i.tolist()
    assert sorted(seen) == list(range(64))


def take_one_then_wait(q, out, done):
    out.put(q.get(timeout=60))
    done.wait(60)  # alive, and getting no more


def take_until_none(q, out):
    while (item := q.get(timeout=60)) is not None:
        out.put(item)


def test_with_queues_a_consumer_that_stops_getting_holds_no_item(queues_installed):
    ctx = mp.get_context("spawn")
    q, out, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    a = ctx.Process(target=take_one_then_wait, args=(q, out, done))
    a.start()
    try:
        q.put(0)
        assert out.get(timeout=60) == 0
        for i in range(1, 6):
            q.put(i)
        b = ctx.Process(target=take_until_none, args=(q, out))
        b.start()
        # As with multiprocessing's queue: the consumer that stopped getting took nothing ahead.
        assert sorted(out.get(timeout=30) for _ in range(5)) == [1, 2, 3, 4, 5]
        q.put(None)
        b.join(60)
    finally:
        done.set()
        a.join(60)


def test_with_queues_size_counts_every_item_not_yet_taken_and_timeouts_read_as_multiprocessing(queues_installed):
    import queue

    q = mp.get_context("spawn").Queue()
    for i in range(5):
        q.put(i)
    assert q.get(timeout=10) == 0
    assert q.qsize() == 4
    got = []
    while not q.empty():
        got.append(q.get(timeout=10))
    assert got == [1, 2, 3, 4]
    with pytest.raises(queue.Empty):
        q.get(timeout=-1)


def make_a_queue(conn):
    q = mp.get_context("spawn").Queue()
    conn.send(q)
    conn.recv()  # until the parent has its handle


def test_with_queues_a_closed_handle_says_so_after_the_queues_process_is_gone(queues_installed):
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    # The queue's process is a spawned child, which calls install(queues=True) itself.
    p = ctx.Process(target=make_a_queue_installed, args=(there,))
    p.start()
    q = here.recv()
    here.send(1)
    p.join(60)
    assert type(q) is cuda_mp.MultiprocessingQueue
    q.close()
    with pytest.raises(ValueError, match="closed"):
        q.put(1)
    with pytest.raises(ValueError, match="closed"):
        q.get(timeout=1)


def make_a_queue_installed(conn):
    cuda_mp.torch.install(queues=True)
    make_a_queue(conn)


def test_the_sweep_lets_go_of_the_oldest_storages_no_longer_held_and_moves_the_held_back():
    import cuda_mp.torch as ct

    with ct._book_lock:
        saved, alone = list(ct._book.items()), ct._alone
        try:
            ct._book.clear()
            ct._alone = 1
            # Entries as (wrapper, storage address, keeper); the use count read here is the address.
            ct._book.update({"a": ("A", 1, "a"), "b": ("B", 5, "b"), "c": ("C", 1, "c"), "d": ("D", 1, "d")})
            assert ct._sweep(lambda count: count) == [("A", 1, "a")]
            assert list(ct._book) == ["c", "d", "b"], "the held one went to the back"
            assert ct._sweep(lambda count: count) == [("C", 1, "c"), ("D", 1, "d")]
            assert list(ct._book) == ["b"]
            assert ct._sweep(lambda count: count) == [] and list(ct._book) == ["b"]
        finally:
            ct._book.clear()
            ct._book.update(saved)
            ct._alone = alone


LOADER_PROGRAM = """
import sys, time
import torch
import cuda_mp.torch

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        time.sleep(0.01)
        return torch.full((4,), float(i))

if __name__ == "__main__":
    if sys.argv[2] == "queues":
        cuda_mp.torch.install(queues=True)
    loader = torch.utils.data.DataLoader(Slow(), batch_size=4, num_workers=2, multiprocessing_context=sys.argv[1])
    batches = iter(loader)
    next(batches), next(batches)  # one from each worker: both have their queues
    print("ready", flush=True)
    time.sleep(120)
"""


@pytest.mark.parametrize("queues", ["queues", "torch"])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_data_loader_workers_whose_parent_is_killed_end_quietly(tmp_path, method, queues):
    """As with multiprocessing's queues: a worker's put on a queue whose process is gone drops
    the item, and its get with a timeout waits and raises queue.Empty, so that the worker's
    watchdog sees the parent gone and the worker ends without a traceback."""
    import os
    import signal
    import subprocess
    import sys
    import time

    program = tmp_path / "loader.py"
    program.write_text(LOADER_PROGRAM)
    p = subprocess.Popen(
        [sys.executable, str(program), method, queues],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
        os.kill(p.pid, signal.SIGKILL)
        start = time.monotonic()
        err = p.stderr.read()  # until the workers, which share it, have ended
        assert time.monotonic() - start < 30
    finally:
        p.kill()
    assert "Traceback" not in err, err


@pytest.mark.skipif(cuda_mp.cuda_available(), reason="this machine has a GPU")
def test_the_allocator_needs_a_gpu_and_installs_nothing_without_one():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        cuda_mp.torch.install(allocator=True)
    assert not cuda_mp.torch.allocator_in_use()
    assert not cuda_mp.torch.installed()
