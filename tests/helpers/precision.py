"""The small from-scratch run the precision tests share: its flags (SCRATCH), a corpus
(the `corpus` fixture) and the CPU's bf16 units (`units`)."""

from __future__ import annotations

import pytest

from helpers.common import drop_isa_caps  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402
from toy.train import device as device_mod  # noqa: E402

SCRATCH = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from toy.cli.main import main

    d = tmp_path_factory.mktemp("corpus")
    src = str(bundled_text_paths()[0])
    assert main(["prep", src, "--out", str(d / "c.bin"), "--vocab-size", "400"]) == 0
    return d / "c.bin"


def units(monkeypatch, unit: str | None) -> None:
    """Pretend the CPU has (or lacks) these bf16 units; a cap on the kernels in the
    environment (bench --isa avx2's variables) would override the pretence: dropped."""
    monkeypatch.setattr(device_mod, "cpu_bf16_units", lambda: unit)
    drop_isa_caps(monkeypatch)
