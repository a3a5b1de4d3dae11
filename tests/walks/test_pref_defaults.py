"""DPO's and ORPO's defaults on a small user set (issue 47 item 5; slow, the real
SmolLM2-135M-Instruct): 24 pairs whose chosen answer opens "Aye, captain!" and whose
rejected answer is the same words without it (bench/pref_sets/captain: the user's report).
`toy train --recipe dpo|orpo --model ... --data DIR` with no other setting must move the
held-out preference accuracy, answer a prompt from outside the set in the chosen style,
and not degenerate: the README's old DPO line (6 steps at --lr 6e-3) answered "What colour
is grass?" with "Aye, captain! Aye, captain!", and ORPO's old default (5e-5) moved nothing.
docs/results.md, "Preference defaults for small sets", has the grid these came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.common import run_toy  # noqa: E402
from helpers.gguf_fixtures import smollm2_gguf  # noqa: E402,F401

SET = Path(__file__).resolve().parents[2] / "bench" / "pref_sets" / "captain"
MARKER = "Aye, captain"
PROBES = ["What colour is grass?", "What is the opposite of hot?"]  # not in the set

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("recipe", ["dpo", "orpo"])
def test_the_defaults_move_a_small_set_without_collapse(smollm2_gguf, tmp_path, recipe, toy_run):
    r = run_toy(
        "train", "--recipe", recipe, "--model", smollm2_gguf, "--data", SET,
        "--out", tmp_path, "--run-id", recipe, "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    acc = out["val_pref_accuracies"]
    assert out["steps"] == 18  # 3 epochs of 24 pairs, 4 a step
    assert acc[0]["accuracy"] == 0.0 and acc[-1]["accuracy"] >= 0.75, acc
    replies = []
    for prompt in PROBES:
        c = toy_run(  # in this process: the CLI's code, without a fresh interpreter each
            "infer", "--run", tmp_path / recipe, "--chat", prompt,
            "--temperature", "0", "--max-new-tokens", "24",
        )  # fmt: skip
        assert c.returncode == 0, c.stderr[-2000:]
        replies.append(c.stdout.strip())
    assert any(t.startswith(MARKER) for t in replies), replies  # the style carries over
    assert all(t.count(MARKER) <= 1 for t in replies), replies  # and does not take over
    # the rest of the reply is words, not the marker again or nothing
    assert all(len(t.replace(MARKER, "").split()) >= 3 for t in replies), replies
