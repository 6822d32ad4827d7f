"""torch.multiprocessing programs with ``cuda_mp.torch.install()``, on a GPU machine: ``pytest -m gpu``."""

import contextlib

import pytest

import cuda_mp
from conftest import run_json_program, settled_lifetime_stats

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_gpu")]

torch = pytest.importorskip("torch", reason="PyTorch is not installed")


def run_program(*args):
    return run_json_program("torch_mp_program.py", *args)


@pytest.mark.parametrize("call", ["--install", "--queues"])
def test_with_install_a_sigkilled_consumers_memory_is_back_within_a_second(call):
    r = run_program(call)
    assert r["ok"], "every consumer saw the values it was sent"
    assert r["held_mib"] == 16, "only what the consumer about to be killed holds is still allocated"
    assert r["back_s"] is not None and r["back_s"] <= 1.0, r
    assert r["left_mib"] == 0


def test_without_install_the_same_program_runs_on_torchs_own_sharing():
    # What torch does with the killed consumer's memory is reported, not asserted.
    r = run_program()
    assert r["ok"]


def check_and_add_one(conn):
    import torch

    import cuda_mp.torch

    items = conn.recv()
    view, param, storage = items["view"], items["param"], items["storage"]
    report = {
        "installed": cuda_mp.torch.installed(),
        "view": view.tolist() == [float(8 * 64 + 3 + 64 * k) for k in range(56)],
        "param": isinstance(param, torch.nn.Parameter) and param.requires_grad and bool((param == 2).all()),
        "storage": isinstance(storage, torch.UntypedStorage) and storage.nbytes() == 4096,
    }
    view.add_(1)
    torch.tensor([], dtype=torch.uint8, device=storage.device).set_(storage).fill_(7)
    torch.cuda.synchronize()
    conn.send(report)
    conn.send(torch.full((10,), 5.0, device="cuda"))  # sent back the same way
    conn.recv()


def total(t):
    return float(t.sum().item())


@pytest.fixture
def installed():
    import cuda_mp.torch

    cuda_mp.torch.install()
    yield
    cuda_mp.torch.uninstall()


def test_pipes_and_pool_arguments_carry_views_parameters_and_storages_in_place(installed):
    ctx = torch.multiprocessing.get_context("spawn")
    big = torch.arange(4096, dtype=torch.float32, device="cuda").reshape(64, 64)
    param = torch.nn.Parameter(torch.full((8,), 2.0, device="cuda"))
    storage = torch.zeros(4096, dtype=torch.uint8, device="cuda").untyped_storage()
    here, there = ctx.Pipe()
    p = ctx.Process(target=check_and_add_one, args=(there,))
    p.start()
    here.send({"view": big[8:, 3], "param": param, "storage": storage})
    assert here.poll(60), "the child answers"
    assert here.recv() == {"installed": True, "view": True, "param": True, "storage": True}
    back = here.recv()
    assert back.tolist() == [5.0] * 10
    del back  # the child's memory: it exits once nothing here holds it
    torch.cuda.synchronize()
    assert big[8:, 3].tolist() == [float(8 * 64 + 3 + 64 * k + 1) for k in range(56)], "the child's add is seen here"
    assert torch.tensor([], dtype=torch.uint8, device="cuda").set_(storage).eq(7).all(), "and its fill"
    here.send(None)
    p.join(60)
    assert p.exitcode == 0
    with ctx.Pool(2) as pool:
        sums = pool.map(total, [torch.full((1000,), float(i), device="cuda") for i in range(4)])
    assert sums == [0.0, 1000.0, 2000.0, 3000.0]


def load_twice_and_sum(conn):
    import pickle

    data = conn.recv_bytes()
    weights = pickle.loads(data)
    sums = {name: float(t.sum().item()) for name, t in weights.items()}
    try:
        pickle.loads(data)
        again = "loaded"
    except cuda_mp.Malformed:
        again = "Malformed"
    conn.send((sums, again))


def lifetime_settles_at(stats, seconds=10.0):
    import gc
    import time

    deadline = time.monotonic() + seconds
    while cuda_mp._native.lifetime_stats() != stats and time.monotonic() < deadline:
        gc.collect()  # a failed pickle's traceback holds its pickler, and the pickler its tensors
        time.sleep(0.05)
    return cuda_mp._native.lifetime_stats()


def test_the_tensors_of_one_pickle_travel_as_one_batch_loaded_once(installed):
    from multiprocessing.reduction import ForkingPickler

    # What the tests before let go of (a pool's workers exit after them) is released first.
    before = settled_lifetime_stats()
    weights = {f"w{i}": torch.full((256,), float(i), device="cuda") for i in range(300)}
    data = bytes(ForkingPickler.dumps(weights))
    ctx = torch.multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=load_twice_and_sum, args=(there,))
    p.start()
    here.send_bytes(data)
    assert here.poll(120), "the child answers"
    sums, again = here.recv()
    p.join(60)
    assert p.exitcode == 0
    assert sums == {f"w{i}": 256.0 * i for i in range(300)}, "every tensor of the pickle read"
    assert again == "Malformed", "a pickle's tensors load once"
    del weights
    assert lifetime_settles_at(before) == before, "every storage freed once the child is gone"


def test_a_pickle_that_fails_midway_withdraws_its_batch(installed):
    from multiprocessing.reduction import ForkingPickler

    before = settled_lifetime_stats()
    ts = [torch.ones(1024, device="cuda") for _ in range(3)]
    with pytest.raises(Exception):
        ForkingPickler.dumps(ts + [lambda: None])
    del ts
    assert lifetime_settles_at(before) == before, "nothing of the failed pickle waits for a reader"


def load_and_count_openings(conn):
    import pickle

    while True:
        data = conn.recv_bytes()
        if not data:
            return
        before = cuda_mp._native.opened_mappings()
        weights = pickle.loads(data)
        sums = [float(t.sum().item()) for t in weights]
        conn.send((sums, cuda_mp._native.opened_mappings() - before))
        del weights


def test_a_storage_sent_again_keeps_its_identity_and_its_receivers_mapping(installed):
    import time
    from multiprocessing.reduction import ForkingPickler

    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    weights = [torch.full((1 << 18,), float(i), device="cuda") for i in range(20)]
    ctx = torch.multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=load_and_count_openings, args=(there,))
    p.start()
    opened = []
    for step in range(3):
        for w in weights:
            w.add_(1)
        here.send_bytes(bytes(ForkingPickler.dumps(weights)))
        assert here.poll(120), "the child answers"
        sums, n = here.recv()
        assert sums == [float((1 << 18) * (i + step + 1)) for i in range(20)], "each publish's values"
        opened.append(n)
    here.send_bytes(b"")
    p.join(60)
    assert p.exitcode == 0
    assert opened[0] >= 1 and opened[1:] == [0, 0], f"mapped at the first publish, then kept: {opened}"
    del weights, w
    deadline = time.monotonic() + 10
    while torch.cuda.memory_allocated() > baseline and time.monotonic() < deadline:
        time.sleep(0.1)
    assert torch.cuda.memory_allocated() == baseline, "the program's memory goes back once it holds it no more"


def drop_each(q_in, q_out):
    import torch  # noqa: F401

    n = 0
    while q_in.get(timeout=120) is not None:
        n += 1
    q_out.put(n)


def test_fresh_tensors_are_let_go_as_they_are_sent_not_a_second_later(installed):
    import cuda_mp.torch as ct

    ctx = torch.multiprocessing.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=drop_each, args=(q_in, q_out))
    p.start()
    kept = []
    for _ in range(300):
        q_in.put(torch.zeros(1 << 18, device="cuda"))  # the program drops each at once
        with ct._book_lock:
            kept.append(len(ct._book))
    q_in.put(None)
    assert q_out.get(timeout=120) == 300
    p.join(60)
    # Each new storage sent looks at the two oldest the book holds: those of fresh tensors go
    # as the next ones are sent, long before the pruner's look a second later.
    assert max(kept) <= 3, f"storages held for the program after it let go of them: {max(kept)}"


def test_a_booked_storage_is_held_by_its_entry_also_where_cuda_mp_knew_its_memory(installed):
    import cuda_mp.torch as ct

    listener = cuda_mp.Listener(cuda_mp.GpuTensor, as_torch=True)
    tx = cuda_mp.connect(listener.name, cuda_mp.GpuTensor)
    rx = listener.accept(timeout=10)
    tx.send(torch.full((1024,), 3.0, device="cuda"))
    got = rx.recv(timeout=30)  # PyTorch's tensor over memory that cuda-mp handed to PyTorch
    ct._sent(got)  # as a pickle of it (forwarding what was received) does
    storage = got.untyped_storage()
    with ct._book_lock:
        entries = [entry for key, entry in ct._book.items() if key[1] == storage.data_ptr()]
    assert len(entries) == 1
    _, cdata, keeper = entries[0]
    # The book reads the use count at this address until the program lets go of the storage:
    # something the entry holds must keep the storage there (the wrapper holds cuda-mp's
    # storage of this memory, not PyTorch's).
    assert keeper.untyped_storage()._cdata == cdata == storage._cdata
    assert float(got.sum()) == 3.0 * 1024


@contextlib.contextmanager
def a_busy_side_stream():
    """A side stream made current, with about a tenth of a second of GPU time queued on it
    before what the block queues: a receiver that did not wait for this stream would read the
    memory as it was before. Checks at the end that the stream was still working."""
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        yield
        assert not side.query(), "the send came while the side stream still worked"


def sum_on_a_side_stream(conn):
    import pickle

    import torch

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        # Loaded while `side` is current: its work must come after the sender's.
        x = pickle.loads(conn.recv_bytes())
        total = x.double().sum().item()
    conn.send(total)


def test_a_tensor_pickled_on_a_side_stream_is_read_after_that_streams_work(installed):
    from multiprocessing.reduction import ForkingPickler

    ctx = torch.multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=sum_on_a_side_stream, args=(there,))
    p.start()
    x = torch.zeros(1 << 24, device="cuda")
    with a_busy_side_stream():
        x.fill_(7.0)
        data = bytes(ForkingPickler.dumps(x))
    here.send_bytes(data)
    assert here.poll(120), "the child answers"
    total = here.recv()
    p.join(60)
    assert p.exitcode == 0
    assert total == 7.0 * x.numel()


def sum_values_on_a_side_stream(q, results):
    import torch

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        # Taken while `side` is current: its work must come after the sender's.
        d = q.get(timeout=120)
        results.put([d[k].double().sum().item() for k in ("a", "b")])


def test_the_tensors_of_a_value_on_a_side_stream_are_read_after_that_streams_work():
    # A value (a dict of tensors) on cuda-mp's queue orders cuda-mp's stream after PyTorch's
    # current stream once per device, at its first tensor: the work queued before the put,
    # for every tensor of the value, is what the receiver waits for.
    ctx = torch.multiprocessing.get_context("spawn")
    q, results = cuda_mp.Queue(), cuda_mp.Queue()
    p = ctx.Process(target=sum_values_on_a_side_stream, args=(q, results))
    p.start()
    a = torch.zeros(1 << 24, device="cuda")
    b = torch.zeros(1 << 22, device="cuda")
    with a_busy_side_stream():
        a.fill_(3.0)
        b.fill_(5.0)
        q.put({"a": a, "b": b})
    sums = results.get(timeout=120)
    p.join(60)
    assert p.exitcode == 0
    assert sums == [3.0 * a.numel(), 5.0 * b.numel()]
