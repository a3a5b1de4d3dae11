"""What the test modules share that is not a fixture: the repository root, the real CLI in a
subprocess, and small checks (tests/conftest.py holds the fixtures)."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# mlx-lm (a test-only dependency) makes MLX directories and is the MLX reference.
needs_mlx = pytest.mark.skipif(
    importlib.util.find_spec("mlx_lm") is None,
    reason="mlx-lm (a test-only dependency) makes MLX directories and is the MLX reference",
)


def run_toy(*argv, cwd=None, timeout=600, env=None):
    """Run the real `python -m toy` in a subprocess."""
    import subprocess

    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "toy", *map(str, argv)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
    )


def drop_isa_caps(monkeypatch) -> None:
    """Unset the variables that hold the kernels below the CPU (bench --isa avx2's, or a
    shell's): a test sees the machine as a user with none set would."""
    from toy.models.decode import ISA_CAP_VARS

    for var in ISA_CAP_VARS:
        monkeypatch.delenv(var, raising=False)


def assert_every_parameter_learns(model) -> None:
    """After a backward pass: every parameter has a finite, non-zero gradient."""
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def no_c_step(monkeypatch) -> None:
    """decode_step.c as where it does not build (no C compiler, TOY_NATIVE=0): a llama reply on
    packed codes takes decode.py's compiled steps, as every other family's does; what a test
    of those steps (their builds, notes and fallbacks) runs on the tiny llama GGUF."""
    from toy.models import native

    monkeypatch.setitem(native._loaded, "decode_step", None)
