import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def rust_example(name: str) -> pathlib.Path:
    """A built example of the Rust crate (CUDA_MP_EXAMPLES names the folder, else target/)."""
    folders = [os.environ.get("CUDA_MP_EXAMPLES", "")]
    folders += [str(ROOT / "target" / p / "examples") for p in ("debug", "release")]
    folders += [str(ROOT / ".gpu" / "bin")]
    for folder in folders:
        for candidate in (pathlib.Path(folder) / name, pathlib.Path(folder) / f"example-{name}"):
            if folder and candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
    pytest.fail(f"the Rust example {name} is not built: run `cargo build --example {name}` first")
