"""Runs through the CLI: the tiny preset's flags (TINY), a corpus (the `corpus` fixture), the step
lines of a run's output and waiting for its first checkpoint."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from toy.data.prep import bundled_text_paths

TINY = [
    "--preset",
    "tiny",
    "--batch-size",
    "4",
    "--seq-len",
    "32",
    "--eval-batches",
    "2",
    "--eval-every",
    "5",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from toy.cli.main import main

    d = tmp_path_factory.mktemp("corpus")
    assert (
        main(
            ["prep", str(bundled_text_paths()[0]), "--out", str(d / "c.bin"), "--vocab-size", "400"]
        )
        == 0
    )
    return d / "c.bin"


def wait_for_checkpoint(run_dir: Path, proc, timeout=120) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        ev = run_dir / "events.jsonl"
        if ev.is_file() and '"checkpoint"' in ev.read_text():
            return
        if proc.poll() is not None:
            pytest.fail(f"run ended before its first checkpoint: {proc.stderr.read()}")
        time.sleep(0.02)
    pytest.fail("no checkpoint appeared")


def step_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("step ")]
