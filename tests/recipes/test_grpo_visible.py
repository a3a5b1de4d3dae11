"""What a run learnt is visible (issue 58, items 1 and 8). GRPO, through the command line
on a tiny llama GGUF and arithmetic prompts: completions.jsonl holds the first completions
of each step and every held-out prompt's greedy completion at each evaluation, with the
total and each function's reward and what the reward's log_extra gave it; a reward's
log_metric values are step and evaluation figures (step line, events, --json); `toy runs`
shows the held-out reward and its step; `toy plot` draws it. `toy describe RUN` describes
a run."""

from __future__ import annotations

import json

from helpers.gguf_fixtures import tiny_model, write_llama_gguf

from toy.data.arith import make_arith
from toy.data.prep import bundled_text_paths
from toy.tokenizer import train_bpe

REWARD = """
def short(completions, completion_ids=None, log_metric=None, log_extra=None, **kw):
    log_metric("mean_tokens", sum(len(i) for i in completion_ids) / len(completion_ids))
    log_extra("n_tokens", [len(i) for i in completion_ids])
    return [-len(ids) / 16.0 for ids in completion_ids]
"""


def test_completions_metrics_runs_and_plot_show_what_grpo_learns(tmp_path, toy_cli, toy_run):
    text = bundled_text_paths()[0].read_text()[:30000] + " 0 1 2 3 4 5 6 7 8 9 + - = ?"
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    base = write_llama_gguf(tmp_path / "b.gguf", tiny_model(vocab_size=402, max_seq_len=256), tok)
    make_arith(tmp_path / "arith", 40, 8, seed=0)
    (tmp_path / "rw.py").write_text(REWARD)
    r = toy_run("train", "--recipe", "grpo", "--model", base, "--data", tmp_path / "arith",
                "--reward", "length", "--reward", f"{tmp_path / 'rw.py'}:short",
                "--num-generations", "4", "--max-completion-length", "8", "--seq-len", "96",
                "--steps", "2", "--eval-every", "2", "--eval-batches", "1", "--threads", "1",
                "--out", tmp_path, "--run-id", "g", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert all("mean_tokens" in s for s in res["losses"])  # log_metric: a step figure
    assert all("mean_tokens" in v and "short" in v for v in res["val_rewards"])
    rows = [json.loads(x) for x in (tmp_path / "g" / "completions.jsonl").read_text().splitlines()]
    train = [x for x in rows if x["split"] == "train"]
    evals = [x for x in rows if x["split"] == "eval"]
    assert [x["step"] for x in train] == [1] * 4 + [2] * 4
    assert sorted({x["step"] for x in evals}) == [0, 2] and len(evals) == 2 * 4
    for x in rows:
        assert x["prompt"].startswith("What is") and isinstance(x["completion"], str)
        assert set(x["rewards"]) == {"length", "short"}
        assert x["extra"]["n_tokens"] >= 1
        assert abs(x["rewards"]["short"] + x["extra"]["n_tokens"] / 16.0) < 1e-9
    final = res["val_rewards"][-1]["reward"]
    code, out, err = toy_cli("runs", tmp_path)
    assert code == 0, err
    line = next(ln for ln in out.splitlines() if ln.startswith("g "))
    assert f"reward {final:.4g} @2" in line, line
    code, out, err = toy_cli("plot", tmp_path / "g", "--out", tmp_path / "g.png")
    assert code == 0 and (tmp_path / "g.png").stat().st_size > 0, err
    from toy.cli.cmd_plot import figure_curves

    ((fig, curve),) = figure_curves(tmp_path / "g")  # the curve the plot draws
    assert fig.key == "reward" and curve == [(v["step"], v["reward"]) for v in res["val_rewards"]]


def test_describe_takes_a_run_directory(tmp_path, toy_cli, toy_run):
    """`toy describe RUN` (it was refused: "not a model directory") says what trained,
    its status and held-out figure, what final/ holds and its exports."""
    from helpers.runs import TINY

    r = toy_run("train", *TINY, "--steps", "2", "--out", tmp_path, "--run-id", "s")
    assert r.returncode == 0, r.stderr[-2000:]
    code, out, err = toy_cli("describe", tmp_path / "s")
    assert code == 0, err
    assert "from-scratch" in out and "2 of 2, finished" in out and "a model" in out
    assert "val loss" in out and "at step 2" in out
    code, out, err = toy_cli("describe", tmp_path / "s", "--json")
    d = json.loads(out)
    assert d["type"] == "run" and d["steps"] == 2 and d["status"] == "finished"
