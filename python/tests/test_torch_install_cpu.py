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
