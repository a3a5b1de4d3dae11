"""The preference walk on the real SmolLM2-135M-Instruct (issue 34; slow): the pair set
`toy new` makes from the bundled plays (data/pairs/), whose chosen answers open with
"Verily," and whose rejected answers are the same words without it, 15% held out;
`toy train --recipe dpo` on the Q4_1 GGUF takes the held-out preference accuracy from a tie
to >= 90%; then a held-out prompt is answered "Verily, ..." by `toy infer --run`, by
llama.cpp with the `toy export --format gguf-lora` adapter on the same GGUF, and by mlx-lm
with the `--format mlx` adapter on SmolLM2's MLX 4-bit twin (the adapter trained on the
GGUF: training twice would double the test's time). docs/results.md has its numbers."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
from helpers.common import run_toy  # noqa: E402
from helpers.gguf_fixtures import smollm2_gguf  # noqa: E402,F401
from helpers.real_model import (  # noqa: F401
    LLAMA_CPP,
    MLX_LM,
    client,
    smol_dirs,  # noqa: E402,F401
)

OPENING = "Verily"
# The README's line: dpo's defaults (4 pairs a step, --lr 1e-3, --sft-weight 1; docs/results.md,
# "Preference defaults for small sets") for two passes over the 68 pairs, which this set
# needs: the third pass of the defaults (51 steps, 126 of the walk's 151 s) changed no check.
STEPS = 34
TRAIN = ["--seq-len", "96", "--eval-batches", "3", "--epochs", "2"]
NEW = 6  # tokens enough to read the opening word

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("mlx_lm") is None,
        reason="needs llama-cpp-python and mlx-lm (the real clients)",
    ),
]


def chat(run, *argv) -> str:
    r = run("infer", *argv, "--temperature", "0", "--max-new-tokens", NEW)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_dpo_on_smollm2_learns_the_chosen_style_and_every_client_answers_in_it(
    smollm2_gguf, smol_dirs, tmp_path, record_property, toy_run
):
    hf_dir, mlx_dir = smol_dirs
    # The pairs `toy new` puts in a project (README), the same set as
    # `scripts/make_pref_pairs.py --pairs 80 --max-chars 80`.
    # The commands around the training run go in this process (toy_run): the same CLI code,
    # without a fresh interpreter each; the run and the clients, each in a process of its own.
    assert toy_run("new", tmp_path / "proj").returncode == 0
    data = tmp_path / "proj" / "data" / "pairs"
    valid = [json.loads(x) for x in (data / "valid.jsonl").read_text().splitlines()]
    train = (data / "train.jsonl").read_text().splitlines()
    assert (len(train), len(valid)) == (68, 12)  # 15% held out
    assert all(p["chosen"].startswith(OPENING) and OPENING not in p["rejected"] for p in valid)

    t0 = time.perf_counter()
    runs = tmp_path / "runs"
    r = run_toy(
        "train",
        "--recipe",
        "dpo",
        "--model",
        smollm2_gguf,
        "--data",
        data,
        "--out",
        runs,
        "--run-id",
        "dpo",
        *TRAIN,
        "--json",
        timeout=1800,
    )
    assert r.returncode == 0, r.stderr
    train_s = time.perf_counter() - t0
    res = json.loads(r.stdout.strip().splitlines()[-1])
    acc = [(v["step"], v["accuracy"]) for v in res["val_pref_accuracies"]]
    record_property("val_pref_accuracies", acc)
    record_property("val_losses", [(v["step"], round(v["loss"], 4)) for v in res["val_losses"]])
    record_property("train_s", round(train_s, 1))
    # Before the first step every margin is 0 (the adapter starts at zero): a tie.
    assert acc[0] == (0, 0.0) and res["metrics"][0]["margin"] == 0.0
    assert acc[-1][0] == STEPS <= 100 and acc[-1][1] >= 0.9, acc

    run = runs / "dpo"
    prompt = valid[0]["prompt"]  # held out: never trained on
    base = chat(toy_run, "--model", smollm2_gguf, "--chat", prompt)
    ours = chat(toy_run, "--run", run, "--chat", prompt)
    record_property("answers", {"prompt": prompt, "base": base, "toy": ours})
    assert not base.startswith(OPENING), base  # the base does not answer so by itself
    assert ours.startswith(OPENING), ours

    assert (
        toy_run("export", run, "--format", "gguf-lora", "--out", tmp_path / "a.gguf").returncode
        == 0
    )
    cpp = client(LLAMA_CPP, smollm2_gguf, tmp_path / "a.gguf", hf_dir, prompt, NEW)
    record_property("llama_cpp", cpp)
    assert cpp.startswith(OPENING), cpp

    assert toy_run("export", run, "--format", "mlx", "--out", tmp_path / "mlx").returncode == 0
    mlx = client(MLX_LM, mlx_dir, tmp_path / "mlx", prompt, NEW)
    record_property("mlx_lm", mlx)
    assert mlx.startswith(OPENING), mlx
    print(
        f"\n{acc} in {train_s:.0f} s; {prompt!r}: base {base!r}, toy {ours!r}, "
        f"llama.cpp {cpp!r}, mlx-lm {mlx!r}"
    )
