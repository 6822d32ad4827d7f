"""``cuda_mp.torch.install(allocator=True)``: PyTorch's CUDA memory from cuda-mp's caching
allocator, on a GPU machine (``pytest -m gpu``). Each case runs in an interpreter of its own: the
allocator is chosen before a process's first CUDA tensor."""

import pytest
from conftest import run_json_program

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_gpu")]

pytest.importorskip("torch", reason="PyTorch is not installed")


def run_program(*args):
    return run_json_program("torch_allocator_program.py", *args)


def test_tensors_of_the_allocator_travel_as_blocks_of_segments_mapped_once():
    r = run_program()
    assert r["in_use"] and r["matmul"] and r["record_stream"] and r["empty_is_null"]
    assert r["complex_refused"], "a tensor cuda-mp cannot carry is refused, not shared wrongly by torch"
    assert r["weights_ok"], "the consumer read every weight's value"
    assert r["consumer_write_seen"], "the consumer wrote the producer's memory, not a copy"
    # Storages opened (each block counts) and segments mapped (what costs a driver call).
    storages, segments = r["consumer_mappings_for_weights"]
    assert storages == 48 and 0 < segments <= r["segments"] < 48, r
    assert r["fresh_ok"], "fresh tensors dropped by the producer right after their put read right"
    storages_after, segments_after = r["consumer_mappings_after_fresh"]
    # A window of 8 MiB in flight needs a few segments of its own, then its blocks are reused.
    assert storages_after == 48 + 300 and segments_after <= segments + 8, "300 fresh tensors mapped a few segments"
    assert r["consumer_exit"] == 0
    assert r["torch_holds"] == [0, 0]
    assert r["allocated_bytes_at_end"] == 0, "every block came back once the consumer was gone"


def test_the_allocator_cannot_be_chosen_after_the_first_cuda_tensor():
    r = run_program("--too-late")
    assert r["error"] and "before this process's first CUDA tensor" in r["error"], r
    assert r["in_use"] is False
