"""SimPO (`toy train --recipe simpo`): added as one file (recipes/simpo.py) and one line
in RECIPES. Its loss and the answers' mean log-probs equal TRL's CPOTrainer with
loss_type="simpo" (cpo_alpha 0) on the same tiny model; its flags and figures reach the
help, the step lines, events.jsonl, --json and `toy plot` with no other file changed."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers.preference import base, encoded_pairs, toy_and_peft  # noqa: E402,F401

from toy.data.preference import pair_batch  # noqa: E402


@pytest.mark.parametrize("beta,gamma", [(2.0, 1.0), (0.5, 0.0), (2.5, 1.6)])
def test_simpo_loss_and_mean_logprobs_equal_trls(beta, gamma):
    from trl.experimental.cpo import CPOTrainer

    from toy.recipes.pairs import answer_logps
    from toy.recipes.simpo import simpo_loss

    b, model, peft, same_adapter = toy_and_peft(2)
    same_adapter()
    enc = encoded_pairs(b)
    batch = pair_batch(list(enumerate(enc)), 0)
    n = len(enc)
    with torch.no_grad():
        s, _ = answer_logps(model, batch)
        mean = s / batch["n_ans"]
        ours, rc, rr = simpo_loss(mean[:n], mean[n:], beta, gamma)
    # TRL's own code: its mean log-probs (get_batch_logps, average_log_prob as simpo sets
    # it) on the PEFT model, and its cpo_loss with loss_type "simpo".
    me = SimpleNamespace(
        alpha=0.0,
        beta=beta,
        simpo_gamma=gamma,
        loss_type="simpo",
        label_smoothing=0.0,
        accelerator=SimpleNamespace(device="cpu"),
    )
    for j, e in enumerate(enc):
        lp = []
        for ids, mask in (e.chosen, e.rejected):
            labels = torch.tensor([[i if m else -100 for i, m in zip(ids, mask)]])
            with torch.no_grad():
                logits = peft(torch.tensor([ids])).logits
            lp.append(CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True))
        assert float(lp[0]) == pytest.approx(float(mean[j]), abs=1e-5)
        assert float(lp[1]) == pytest.approx(float(mean[n + j]), abs=1e-5)
        losses, crew, rrew = CPOTrainer.cpo_loss(me, lp[0], lp[1])
        assert float(ours[j]) == pytest.approx(float(losses[0]), abs=1e-4)
        assert float(rc[j]) == pytest.approx(float(crew[0]), abs=1e-4)
        assert float(rr[j]) == pytest.approx(float(rrew[0]), abs=1e-4)


def test_simpo_runs_and_shows_its_figures_everywhere(base, toy_cli, tmp_path, capsys):
    from toy.cli.main import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "simpo: SimPO's beta" in out and "--gamma" in out
    code, out, err = toy_cli(
        "train", "--recipe", "simpo", "--model", base["gguf"], "--data", base["pairs"],
        "--out", tmp_path / "runs", "--run-id", "s", "--steps", "4", "--seq-len", "64",
        "--lr", "1e-2", "--eval-every", "2", "--gamma", "0.5",
    )  # fmt: skip
    assert code == 0, err
    steps = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert len(steps) == 4 and all("pref_accuracy" in ln and "margin" in ln for ln in steps)
    assert "held-out preference accuracy" in out.splitlines()[-1]
    run = tmp_path / "runs" / "s"
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 2, 4] and all("pref_accuracy" in e for e in evals)
    info = json.loads((run / "run.json").read_text())
    assert info["config"]["gamma"] == 0.5 and info["config"]["beta"] == 2.0
    assert info["job"]["gamma"] == 0.5
    code, out, err = toy_cli(
        "train", "--recipe", "simpo", "--model", base["gguf"], "--data", base["pairs"],
        "--out", tmp_path / "runs", "--run-id", "j", "--steps", "2", "--seq-len", "64", "--json",
    )  # fmt: skip
    assert code == 0, err
    res = json.loads(out)
    assert res["recipe"] == "simpo" and [v["step"] for v in res["val_pref_accuracies"]] == [0, 2]
    assert {"reward_chosen", "reward_rejected", "margin", "pref_accuracy"} <= set(res["losses"][0])
    code, out, err = toy_cli("plot", run, "--out", tmp_path / "p.png")
    assert code == 0 and (tmp_path / "p.png").stat().st_size > 0, err
    from toy.cli.cmd_plot import figure_curves

    [(fig, curve)] = figure_curves(run)
    assert fig.key == "pref_accuracy" and [s for s, _ in curve] == [0, 2, 4]
    # It resumes like any recipe, and its own flags are checked as declared.
    code, out, err = toy_cli("train", "--resume", run, "--steps", "5")
    assert code == 0, err
    code, out, err = toy_cli(
        "train", "--recipe", "simpo", "--model", base["gguf"], "--data", base["pairs"],
        "--out", tmp_path / "runs", "--gamma", "-1", "--beta", "0",
    )  # fmt: skip
    assert code == 2 and "--beta must be > 0, got 0.0" in err and "--gamma must be >= 0" in err
    code, out, err = toy_cli(
        "train", "--recipe", "dpo", "--model", base["gguf"], "--data", base["pairs"],
        "--out", tmp_path / "runs", "--gamma", "1",
    )  # fmt: skip
    assert code == 2 and "--gamma is a simpo recipe flag" in err, err
