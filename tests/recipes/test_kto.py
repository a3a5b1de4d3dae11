"""KTO (`toy train --recipe kto`, issue 58 item 7): labelled completions, unpaired, as TRL's
KTOTrainer. Its KL completions are TRL's (the same rotation of the same examples), its
loss and gradients equal TRL's own trainer's on the same tiny model and tokens; it runs
through the command line with its figures everywhere, resumes, and refuses bad input in
one line."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.preference import LINES, base, toy_and_peft  # noqa: E402,F401

from toy.data.preference import encode_unpaired, pair_batch, read_unpaired  # noqa: E402


def conversations(n: int, labels) -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": LINES[2 * i]}],
            "completion": [{"role": "assistant", "content": LINES[2 * i + 1]}],
            "label": labels[i % len(labels)],
        }
        for i in range(n)
    ]


def encoded(b, path, per):
    s = b.special
    pf = read_unpaired(path, per)
    enc = [
        encode_unpaired(b.tokenizer, b.chat_template, x, 96, b.token(s.bos), b.token(s.eos), s.eos)
        for x in pf.pairs
    ]
    return pf, enc


def split(seq):
    """(prompt ids, the supervised answer ids) of an encoded (ids, mask)."""
    ids, mask = seq
    k = mask.index(1)
    end = len(mask) - mask[::-1].index(1)
    return ids[:k], ids[k:end]


@pytest.mark.parametrize(
    "beta,wd,wu,labels,shift",
    [
        (0.1, 1.0, 1.0, [True, False], None),
        (0.5, 1.33, 1.0, [True, True, False], None),
        (2.0, 1.0, 0.7, [False], None),  # every example undesirable
        # reference log-probs given to both (TRL's precomputed ones), the KL sequences'
        # raised by 5 nats: the KL estimate is below 0 and clamped
        (0.5, 1.0, 1.0, [True, False], 5.0),
    ],
)
def test_kto_loss_and_gradients_equal_trls_trainer(tmp_path, beta, wd, wu, labels, shift):
    from datasets import Dataset
    from helpers.model_dirs import tiny_dir
    from transformers import AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    from toy.recipes.kto import KTOTally, batch_loss
    from toy.recipes.pairs import References

    b, model, peft, same_adapter = toy_and_peft(3)
    rows = conversations(8, labels)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pf, enc = encoded(b, path, 4)
    args = KTOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, report_to=[],
        beta=beta, desirable_weight=wd, undesirable_weight=wu, max_length=None, use_cpu=True,
        precompute_ref_log_probs=shift is not None,
    )  # fmt: skip
    trainer = KTOTrainer(
        model=peft,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(tiny_dir("llama")),
    )
    same_adapter()  # after the trainer is made: the reference is the base, adapter off
    # TRL's KL completions are toy's: its dataset's, tokenized by itself, against ours
    for j, e in enumerate(enc):
        assert trainer.train_dataset[j]["KL_completion_ids"][:-1] == split(e.rejected)[1], j
    for first in (0, 4):  # both runs of 4 (the rotation restarts at each)
        part = enc[first : first + 4]
        # TRL's collator and loss on toy's tokens (TRL's own tokens also supervise the "\n"
        # after <|im_end|>, which toy's answer mask leaves out)
        feats = [
            {
                "prompt_ids": split(e.chosen)[0],
                "completion_ids": split(e.chosen)[1],
                "KL_completion_ids": split(e.rejected)[1],
                "label": e.label,
            }
            for e in part
        ]
        assert all(split(e.rejected)[0] == split(e.chosen)[0] for e in part)
        batch = pair_batch(list(enumerate(part)), 0)
        batch = References(model, len(part), None, halves=True).fill(batch)
        if shift is not None:
            batch["ref"] = batch["ref"] + torch.tensor([0.0, shift])
            for f, r in zip(feats, batch["ref"].tolist()):
                f["ref_logps"], f["ref_KL_logps"] = r
        theirs = trainer.compute_loss(trainer.model, trainer.data_collator(feats))
        peft.zero_grad()
        theirs.backward()
        model.zero_grad()
        total, n = batch_loss(model, batch, KTOTally(), beta, wd, wu)
        ours = total / n
        ours.backward()
        assert float(ours.detach()) == pytest.approx(float(theirs.detach()), abs=1e-4)
        grads = dict(peft.named_parameters())
        for name, p in model.named_parameters():
            if "lora_" in name:
                mod, ab = name.rsplit(".", 1)
                g = grads[f"base_model.model.model.{mod}.{ab}.default.weight"].grad
                assert torch.allclose(p.grad, g, atol=1e-5, rtol=1e-4), name


def test_unpaired_lines_pairs_and_bad_labels(tmp_path):
    from toy.data.preference import read_unpaired

    f = tmp_path / "mixed.jsonl"
    f.write_text(
        json.dumps({"prompt": "Hi", "completion": "Hello there", "label": True}) + "\n"
        + json.dumps({"prompt": "Hi", "chosen": "Good day", "rejected": "Go away"}) + "\n"
        + json.dumps({"prompt": "Hi", "completion": "Yo", "label": "yes"}) + "\n"
        + json.dumps({"prompt": "Hi", "completion": " ", "label": False}) + "\n"
        + json.dumps({"prompt": "Hi", "label": False}) + "\n"
    )  # fmt: skip
    pf = read_unpaired(f, 2)
    got = [(p.chosen, p.rejected, p.label) for p in pf.pairs]
    # the pair became two examples; runs of 2, each run's completions turned by one
    assert got == [
        ("Hello there", "Good day", True),
        ("Good day", "Hello there", True),
        ("Go away", "Go away", False),  # a run of one: its own completion
    ]
    assert pf.lines == [1, 2, 2]
    assert dict(pf.skipped) == {"bad label": 1, "empty answer": 1, "missing key": 1}


def test_kto_runs_shows_its_figures_resumes_and_refuses_bad_input(base, toy_cli, tmp_path):
    data = tmp_path / "kto.jsonl"
    pairs = [json.loads(x) for x in base["pairs"].read_text().splitlines()]
    data.write_text(
        "".join(
            json.dumps({"prompt": p["prompt"], "completion": p[k], "label": k == "chosen"}) + "\n"
            for p in pairs
            for k in ("chosen", "rejected")
        )
    )
    common = ["train", "--recipe", "kto", "--model", base["gguf"], "--data", data,
              "--out", tmp_path / "runs", "--seq-len", "64"]  # fmt: skip
    code, out, err = toy_cli(*common, "--run-id", "k", "--steps", "4", "--lr", "1e-2",
                             "--eval-every", "2", "--save-every", "2")  # fmt: skip
    assert code == 0, err
    assert "120 labelled completions" in out or "labelled completions in" in out, out
    steps = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert len(steps) == 4 and all("label_accuracy" in ln and " kl " in ln for ln in steps)
    evals = [ln for ln in out.splitlines() if ln.startswith("eval step 0")]
    assert evals and "margin 0.000000" in evals[0]  # the adapter starts as the reference
    assert "held-out label accuracy" in out.splitlines()[-1]
    run = tmp_path / "runs" / "k"
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    ev = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in ev] == [0, 2, 4] and all("label_accuracy" in e for e in ev)
    info = json.loads((run / "run.json").read_text())
    assert info["job"]["beta"] == 0.1 and info["job"]["undesirable_weight"] == 1.0
    code, out, err = toy_cli("plot", run, "--out", tmp_path / "p.png")
    assert code == 0 and (tmp_path / "p.png").stat().st_size > 0, err
    # a resume from step 2 gives the unbroken run's steps 3 and 4, byte for byte
    code, again, err = toy_cli("train", "--resume", run / "checkpoints" / "step-000002")
    assert code == 0, err
    assert [ln for ln in again.splitlines() if ln.startswith("step ")] == steps[2:]
    # across an epoch (27 batches of 4 here): the reference log-probs come back with the
    # checkpoint rather than being computed again in other batches (other float rounding)
    code, ep, err = toy_cli(*common, "--run-id", "e", "--steps", "30", "--lr", "1e-2",
                            "--save-every", "26", "--precision", "float32", "--json")  # fmt: skip
    assert code == 0, err
    code, again, err = toy_cli("train", "--resume", tmp_path / "runs" / "e" / "checkpoints"
                               / "step-000026", "--json")  # fmt: skip
    assert code == 0, err
    assert json.loads(again)["losses"][26:] == json.loads(ep)["losses"][26:]  # every figure, exact
    code, out, err = toy_cli(*common, "--run-id", "j", "--steps", "2", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert [v["step"] for v in res["val_label_accuracies"]] == [0, 2]
    assert {"reward_desirable", "reward_undesirable", "kl"} <= set(res["losses"][0])
    # bad input: one line each, exit 2, before any run directory
    code, _, err = toy_cli(*common, "--batch-size", "1")
    assert code == 2 and "--batch-size 1" in err and "2 or more" in err, err
    empty = tmp_path / "none.jsonl"
    empty.write_text(json.dumps({"prompt": "a", "completion": "b", "label": 1}) + "\n")
    code, _, err = toy_cli(*common[:6], empty, *common[7:])
    assert code == 2 and str(empty) in err and "1 bad label (line 1)" in err, err
    assert len(err.strip().splitlines()) == 1
    code, _, err = toy_cli(*common, "--beta", "0")
    assert code == 2 and "--beta must be > 0" in err
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["e", "j", "k"]
