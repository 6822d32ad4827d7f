import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cuda_gpu():
    """Fails the tests that use it, with a clear message, where PyTorch sees no CUDA GPU. A
    fixture rather than a check at import, so that ``pytest -m "not gpu"`` collects the GPU
    modules and deselects their tests on a machine with PyTorch and no GPU."""
    import torch

    if not torch.cuda.is_available():
        pytest.fail("these tests need a CUDA GPU, and none is usable", pytrace=False)


def run_json_program(program: str, *args) -> dict:
    """Runs the test program ``program`` (beside this file) in an interpreter of its own and
    returns what it printed last, as JSON; fails with its stderr when it fails."""
    path = pathlib.Path(__file__).with_name(program)
    done = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(result)
    return result


def rust_example(name: str) -> pathlib.Path:
    """A built example of the Rust crate: in $CUDA_MP_EXAMPLES, else in the Cargo target folder
    ($CARGO_TARGET_DIR, else target/)."""
    folders = [os.environ.get("CUDA_MP_EXAMPLES", "")]
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    folders += [str(target / p / "examples") for p in ("debug", "release")]
    folders += [str(ROOT / ".gpu" / "bin")]
    for folder in folders:
        for candidate in (pathlib.Path(folder) / name, pathlib.Path(folder) / f"example-{name}"):
            if folder and candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
    pytest.fail(f"the Rust example {name} is not built: run `cargo build --example {name}` first")


def start_rust_peer(kind, timeout):
    """Starts example 14 serving channels of ``kind`` (a cuda_mp kind class): gives the process,
    a sender to it and the receiver of its answers. The caller kills the process when done."""
    import cuda_mp

    replies = cuda_mp.Listener(kind)
    peer = subprocess.Popen(
        [str(rust_example("14_python_peer")), "--kind", kind.kind, "--reply-to", replies.name],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = peer.stdout.readline()
        assert line.startswith("LISTEN "), line
        return peer, cuda_mp.connect(line.split()[1], kind), replies.accept(timeout=timeout)
    except BaseException:
        peer.kill()
        raise


def start_rust_queue_consumer():
    """Starts example 14 as a consumer of a new ``cuda_mp.Queue`` that answers on another:
    gives the process, the work queue and the answer queue. The caller kills the process when
    done."""
    import cuda_mp

    work, answers = cuda_mp.Queue(), cuda_mp.Queue()
    peer = subprocess.Popen(
        [
            str(rust_example("14_python_peer")),
            "--kind",
            "queue",
            "--queue",
            work.to_bytes().hex(),
            "--reply-to",
            answers.to_bytes().hex(),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    return peer, work, answers


def settled_lifetime_stats():
    """This process's lifetime counters once what earlier tests let go of has been released
    (a child's exit closes its leases a moment later, a pool's workers' too): unchanged for
    0.2 s, 10 s at most."""
    import gc
    import time

    from cuda_mp import _native

    deadline = time.time() + 10
    gc.collect()
    stats = _native.lifetime_stats()
    while time.time() < deadline:
        time.sleep(0.2)
        gc.collect()
        now = _native.lifetime_stats()
        if now == stats:
            break
        stats = now
    return stats
