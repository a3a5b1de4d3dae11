"""A small verifiable task for GRPO: arithmetic questions made from seeded numbers,

    {"prompt": "What is 17 + 25? Answer with the number only.", "answer": "42"}

a mix of sums and differences of numbers up to 50 (never below zero) and products of
2..12: short and easy, so a 135M instruct model is sometimes right from the first step
and the reward has something to pick out. The built-in `accuracy` reward
(data/rewards.py) reads the "answer" column; the question asks for the number alone, a
form SmolLM2-135M-Instruct follows about half the time ("7 x 7 = 49") and that a format
reward can teach it. `toy new` writes these for the GRPO demo.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from toy.errors import UsageError
from toy.runs import write_file_atomic

ASK = " Answer with the number only."


def questions(n: int, seed: int) -> list[dict]:
    """n distinct {"prompt", "answer"} lines, the same for the same seed."""
    rng = np.random.default_rng(seed)
    out: dict[str, str] = {}
    # About 4,000 distinct questions exist; far fewer are drawn, so repeats are rare.
    for _ in range(20 * n + 100):
        if len(out) == n:
            break
        op = ("+", "-", "x")[int(rng.integers(3))]
        if op == "x":
            a, b = (int(v) for v in rng.integers(2, 13, size=2))
            c = a * b
        else:
            a, b = (int(v) for v in rng.integers(0, 51, size=2))
            if op == "-" and a < b:
                a, b = b, a  # no negative answers: easier, and no "-" sign to get wrong
            c = a + b if op == "+" else a - b
        out.setdefault(f"What is {a} {op} {b}?{ASK}", str(c))
    if len(out) < n:
        raise UsageError(f"only {len(out)} distinct arithmetic questions drawn; ask for fewer")
    return [{"prompt": q, "answer": a} for q, a in out.items()]


def make_arith(out_dir: str | Path, n_train: int, n_valid: int, seed: int = 0) -> Path:
    """out_dir/train.jsonl and out_dir/valid.jsonl: n_train and n_valid questions, none in
    both, deterministic by seed; the layout `--data DIR` reads. Each file is written whole
    or not at all."""
    out = Path(out_dir)
    qs = questions(n_train + n_valid, seed)
    for name, part in (("train.jsonl", qs[:n_train]), ("valid.jsonl", qs[n_train:])):
        text = "".join(json.dumps(q) + "\n" for q in part)
        write_file_atomic(out / name, lambda tmp, text=text: tmp.write_text(text))
    return out
