"""Preference tuning (issue 34): the pair data in TRL's three forms, the bad lines counted,
disable_adapter, the reference pass once a pair, step-0 DPO loss = log 2, DPO and ORPO
log-probs and losses equal to TRL's on the same tiny model, pairs and adapter weights, and
`toy train --recipe dpo|orpo` through the command line to infer and export."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from helpers.model_dirs import tiny_dir  # noqa: E402
from helpers.preference import LINES, base, encoded_pairs, toy_and_peft  # noqa: F401

from toy.data.chat import BUILTIN_TEMPLATES  # noqa: E402
from toy.data.preference import encode_pair, pair_batch, parse_pair  # noqa: E402
from toy.formats.base_readers import read_base  # noqa: E402
from toy.lora import apply_lora, disable_adapter  # noqa: E402


def three_forms(prompt: str, chosen: str, rejected: str) -> list[dict]:
    user = {"role": "user", "content": prompt}
    c, r = {"role": "assistant", "content": chosen}, {"role": "assistant", "content": rejected}
    return [
        {"prompt": prompt, "chosen": chosen, "rejected": rejected},
        {"prompt": [user], "chosen": [c], "rejected": [r]},
        {"chosen": [user, c], "rejected": [user, r]},
    ]


def test_the_three_forms_give_the_same_ids_and_answer_mask(base):
    b = read_base(base["gguf"], "float32")
    tok, s = b.tokenizer, b.special
    chatml = BUILTIN_TEMPLATES["chatml"]  # with its generation prompt, unlike the fixture's
    got = []
    for obj in three_forms("What news?", "Verily, none.", "None."):
        pair, why, detail = parse_pair(obj)
        assert pair is not None, (why, detail)
        e = encode_pair(tok, chatml, pair, 200, b.token(s.bos), b.token(s.eos), s.eos)
        got.append((e.chosen, e.rejected))
    assert got[0] == got[1] == got[2]
    (ids, mask), _ = got[0]
    answer = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert answer == "Verily, none.<|im_end|>"  # the answer and its end-of-turn, no prompt
    # An earlier assistant turn of a conversational prompt is context, not the answer.
    many = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hail."},
        {"role": "user", "content": "What news?"},
    ]
    pair, _, _ = parse_pair(
        {
            "prompt": many,
            "chosen": [{"role": "assistant", "content": "Verily, none."}],
            "rejected": [{"role": "assistant", "content": "None."}],
        }
    )
    e = encode_pair(tok, chatml, pair, 200, b.token(s.bos), b.token(s.eos), s.eos)
    ids, mask = e.chosen
    assert tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == answer


def bad_file(path: Path) -> Path:
    good = three_forms(LINES[0], "Verily, " + LINES[1], LINES[1])
    lines = [json.dumps(g) for g in good] * 3
    lines += [
        "{not json",  # 10
        "[1, 2]",  # 11
        json.dumps({"prompt": "p", "chosen": "a"}),  # 12 missing key
        json.dumps({"prompt": "p", "chosen": "same", "rejected": "same"}),  # 13
        json.dumps({"prompt": "p", "chosen": " ", "rejected": "b"}),  # 14 empty answer
        json.dumps({"prompt": "p", "chosen": [{"role": "x"}], "rejected": [1]}),  # 15
        # 16: the answers differ only past --max-seq-len
        json.dumps({"prompt": "p", "chosen": LINES[2] * 4 + " yes", "rejected": LINES[2] * 4}),
        json.dumps({"chosen": "a", "rejected": "b"}),  # 17 missing key (no prompt)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_every_bad_line_kind_is_counted_with_its_first_line(base, toy_cli, tmp_path):
    data = bad_file(tmp_path / "bad.jsonl")
    code, out, err = toy_cli(
        "train",
        "--recipe",
        "dpo",
        "--model",
        base["gguf"],
        "--data",
        data,
        "--out",
        tmp_path,
        "--steps",
        "1",
        "--seq-len",
        "48",
        "--json",
    )
    assert code == 0, err
    line = next(ln for ln in err.splitlines() if "skipped" in ln)
    for needle in (
        "skipped 8 lines",
        "2 missing key (first line 12)",
        "1 not valid JSON (line 10)",
        "1 not a JSON object (line 11)",
        "1 chosen == rejected (line 13)",
        "1 empty answer (line 14)",
        "1 unknown role (line 15)",  # the wording of data/chat.py's check_messages
        "1 cannot fit --max-seq-len (line 16)",
    ):
        assert needle in line, (needle, line)


def test_a_file_with_no_pair_left_exits_2_in_one_line(base, toy_cli, tmp_path):
    data = tmp_path / "none.jsonl"
    data.write_text(json.dumps({"prompt": "p", "chosen": "x", "rejected": "x"}) + "\n")
    code, _, err = toy_cli(
        "train", "--recipe", "orpo", "--model", base["gguf"], "--data", data, "--out", tmp_path
    )
    assert code == 2 and err.count("\n") == 1, err
    assert "none.jsonl" in err and "1 chosen == rejected (line 1)" in err
    assert not any(p.is_dir() for p in tmp_path.iterdir())  # nothing half-written


def test_lora_names_the_preference_recipes_in_one_line(base, toy_cli, tmp_path):
    """Issue 35 item 6: preference lines given to SFT were warned six times that
    "completion" must be a string."""
    code, _, err = toy_cli(
        "train",
        "--recipe",
        "lora",
        "--model",
        base["gguf"],
        "--data",
        base["pairs"],
        "--out",
        tmp_path,
    )
    assert code == 2 and err.count("\n") == 1, err
    assert "--recipe dpo" in err and "--recipe orpo" in err and "pairs.jsonl:1" in err
    assert "completion" not in err.split(";")[0]


@pytest.mark.parametrize("dtype", ["float32", "quantized"])
def test_disable_adapter_gives_the_base_logits_exactly(base, dtype):
    b = read_base(base["gguf"], dtype)
    model = b.build_model()
    ids = torch.randint(0, b.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids)
        apply_lora(model, ["q_proj", "v_proj"], 4, 8.0, 0.1, 0)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
        model.train()  # dropout on: disabled adapters skip it too
        with disable_adapter(model):
            off = model(ids)
        on = model(ids)
    assert torch.equal(off, want)
    assert not torch.allclose(on, want)  # switched back on after the block


def run_pairs(base, tmp_path, recipe, *extra):
    from toy.recipes import load_recipe, recipe_names
    from toy.runs import Project
    from toy.train.run import new_run

    cli = dict(
        recipe=recipe,
        model=str(base["gguf"]),
        data=str(base["pairs"]),
        seq_len=64,
        lr=1e-2,
        warmup=0,
        eval_batches=2,
        batch_size=4,
        **dict(extra),
    )
    recipes = {n: load_recipe(n) for n in recipe_names()}
    return new_run(cli, Project(root=None), recipes, out=str(tmp_path), json_mode=True)


def test_step0_dpo_loss_is_log2_and_the_reference_runs_once_a_pair(base, tmp_path):
    o = run_pairs(base, tmp_path, "dpo", ("epochs", 2), ("sft_weight", 0.0))
    # 60 pairs: 3 held out, 57 train in 15 batches of 4; 2 epochs = 30 steps.
    assert o.cfg.steps == 30
    assert o.res.val_losses[0]["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert o.res.losses[0]["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert o.res.losses[0]["pref_accuracy"] == 0.0 and o.res.losses[0]["margin"] == 0.0
    # Every pair's reference once: the training pairs (epoch 2 reads them kept) and
    # the held-out ones, though they are evaluated at step 0 and at the end.
    assert o.built.job.references.computed == 57 + 3
    assert o.res.metrics[-1]["pref_accuracy"] > o.res.metrics[0]["pref_accuracy"]


def test_dpo_and_orpo_default_to_three_epochs_that_a_given_steps_replaces(base, tmp_path):
    """Issue 47 item 5: three passes over a small set by default (57 training pairs, 4 a
    step: 15 steps an epoch), at the recipe's own LR; --steps replaces the epochs."""
    for recipe, lr in (("dpo", 1e-3), ("orpo", 2e-3)):
        cli = dict(recipe=recipe, model=str(base["gguf"]), data=str(base["pairs"]), seq_len=64)
        cfg = resolve_config(cli)
        assert (cfg.epochs, cfg.lr) == (3, lr)
        assert resolve_config({**cli, "steps": 2}).epochs is None
    from toy.recipes import load_recipe, recipe_names
    from toy.runs import Project
    from toy.train.run import new_run

    recipes = {n: load_recipe(n) for n in recipe_names()}
    cli = dict(recipe="orpo", model=str(base["gguf"]), data=str(base["pairs"]), seq_len=64)
    o = new_run(cli, Project(root=None), recipes, out=str(tmp_path), json_mode=True)
    assert o.cfg.steps == 45 and o.cfg.lr == 2e-3
    assert not any("too short" in n for n in o.built.notes)  # the recipe's own schedule
    o = run_pairs(base, tmp_path / "b", "orpo", ("steps", 2))
    assert o.cfg.steps == 2


def resolve_config(cli):
    from toy.recipes import load_recipe, recipe_names
    from toy.runs import Project
    from toy.train.run import resolve_config as resolve

    return resolve(cli, Project(root=None), {n: load_recipe(n) for n in recipe_names()})


def test_sft_weight_adds_the_chosen_nll_linearly_to_dpos_loss(base, tmp_path):
    """--sft-weight W: the step-0 held-out loss is log 2 plus W times one positive NLL (the
    same for W = 0.5 and 1: linear in W), the term test_dpo_logprobs_and_loss_equal_trls
    checks against TRL's "sft" loss type."""
    val = {}
    for w in (0.0, 0.5, 1.0):
        o = run_pairs(base, tmp_path / str(w), "dpo", ("steps", 1), ("sft_weight", w))
        val[w] = o.res.val_losses[0]["loss"]
    assert val[0.0] == pytest.approx(math.log(2), abs=1e-7)
    nll = val[1.0] - val[0.0]
    assert nll > 0.5 and val[0.5] - val[0.0] == pytest.approx(nll / 2, rel=1e-5)


def test_trained_pairs_run_infer_and_export_like_a_lora_run(base, toy_cli, tmp_path):
    code, out, err = toy_cli(
        "train",
        "--recipe",
        "dpo",
        "--model",
        base["gguf"],
        "--data",
        base["pairs"],
        "--out",
        tmp_path / "runs",
        "--steps",
        "6",
        "--seq-len",
        "64",
        "--lr",
        "1e-2",
        "--eval-every",
        "3",
        "--json",
        "--output",
        tmp_path / "mlx" / "adapters.safetensors",
    )
    assert code == 0, err
    res = json.loads(out)
    assert [v["step"] for v in res["val_pref_accuracies"]] == [0, 3, 6]
    assert [v["step"] for v in res["val_losses"]] == [0, 3, 6]
    assert {"reward_chosen", "reward_rejected", "margin", "pref_accuracy"} <= set(res["losses"][0])
    run = Path(res["run_dir"])
    events = [json.loads(ln) for ln in (run / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "eval" and "pref_accuracy" in e for e in events)
    assert (tmp_path / "mlx" / "adapters.safetensors").is_file()
    code, out, err = toy_cli("infer", "--run", run, "--prompt", "Hail", "--max-new-tokens", "4")
    assert code == 0, err
    for fmt, dest in (("gguf-lora", "a.gguf"), ("peft", "peft")):
        code, _, err = toy_cli("export", run, "--format", fmt, "--out", tmp_path / dest)
        assert code == 0, err
    code, _, err = toy_cli("plot", run, "--out", tmp_path / "p.png")
    assert code == 0, err
    from toy.cli.cmd_plot import figure_curves

    [(fig, curve)] = figure_curves(run)
    assert fig.key == "pref_accuracy" and [s for s, _ in curve] == [0, 3, 6]


# ------------------------------------------------------------------ against TRL


def split(seq):
    ids, mask = seq
    start = mask.index(1)
    end = len(mask) - mask[::-1].index(1)
    return ids[:start], ids[start:end]


def test_dpo_logprobs_and_loss_equal_trls():
    from trl import DPOConfig, DPOTrainer

    from toy.models.losses import dpo_loss
    from toy.recipes.pairs import answer_logps

    b, model, peft, same_adapter = toy_and_peft()
    enc = encoded_pairs(b)
    batch = pair_batch(list(enumerate(enc)), 0)
    n = len(enc)
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(tiny_dir("llama") / "tokenizer.json"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    args = DPOConfig(
        output_dir=str(Path(os.environ.get("TMPDIR", "/tmp")) / "toy-trl"),
        report_to=[],
        beta=0.1,
        use_cpu=True,
        max_length=None,
    )
    ds = Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}])
    trainer = DPOTrainer(model=peft, args=args, train_dataset=ds, processing_class=tok)
    same_adapter()
    with torch.no_grad():
        pi, _ = answer_logps(model, batch)
        with disable_adapter(model):
            ref, _ = answer_logps(model, batch)
    for smoothing, loss_type in ((0.0, "sigmoid"), (0.2, "aot")):
        # TRL 1.16's "sigmoid" has no label smoothing; its "aot" loss on one pair (a
        # sort of one element) is conservative DPO's -(1-e) ls(bz) - e ls(-bz).
        trainer.loss_types, trainer.label_smoothing = [loss_type], smoothing
        for j, e in enumerate(enc):
            (p, c), (p2, r) = split(e.chosen), split(e.rejected)
            assert p == p2
            inputs = trainer.data_collator([{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r}])
            with torch.no_grad():
                theirs = trainer._compute_loss(peft, inputs, False)
            m = trainer._metrics["eval"]
            assert m["logps/chosen"][-1] == pytest.approx(float(pi[j]), abs=1e-4)
            assert m["logps/rejected"][-1] == pytest.approx(float(pi[n + j]), abs=1e-4)
            ours, rc, rr = dpo_loss(
                pi[j : j + 1],
                pi[n + j : n + j + 1],
                ref[j : j + 1],
                ref[n + j : n + j + 1],
                0.1,
                smoothing,
            )
            assert float(ours) == pytest.approx(float(theirs), abs=1e-4)
            assert float(rc) == pytest.approx(m["rewards/chosen"][-1], abs=1e-4)
            assert float(rr) == pytest.approx(m["rewards/rejected"][-1], abs=1e-4)
    # --sft-weight W (RPO): TRL's loss_type ["sigmoid", "sft"] with loss_weights [1, W],
    # the sft term the chosen answer's mean token NLL; as toy's dpo recipe adds it
    trainer.loss_types, trainer.loss_weights, trainer.label_smoothing = (
        ["sigmoid", "sft"],
        [1.0, 0.7],
        0.0,
    )
    for j, e in enumerate(enc):
        (p, c), (_, r) = split(e.chosen), split(e.rejected)
        inputs = trainer.data_collator([{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r}])
        with torch.no_grad():
            theirs = trainer._compute_loss(peft, inputs, False)
        dpo, _, _ = dpo_loss(
            pi[j : j + 1], pi[n + j : n + j + 1], ref[j : j + 1], ref[n + j : n + j + 1]
        )
        ours = dpo + 0.7 * (-pi[j] / batch["n_ans"][j])
        assert float(ours) == pytest.approx(float(theirs), abs=1e-4)


def test_orpo_logprobs_and_loss_equal_trls():
    import torch.nn as nn
    from trl.experimental.orpo import ORPOTrainer

    from toy.models.losses import orpo_loss, sequence_logprobs
    from toy.recipes.pairs import answer_logps

    b, model, peft, same_adapter = toy_and_peft(1)
    same_adapter()
    enc = encoded_pairs(b)
    batch = pair_batch(list(enumerate(enc)), 0)
    with torch.no_grad():
        s, h = answer_logps(model, batch)
        mean = s / batch["n_ans"]
        n = len(enc)
        nll = -sequence_logprobs(h[:n], model.lm_head, batch["full"][:n]) / batch["n_full"][:n]
        ours, rc, rr = orpo_loss(mean[:n], mean[n:], nll, 0.1)
    me = SimpleNamespace(beta=0.1, accelerator=SimpleNamespace(device="cpu"))
    for j, e in enumerate(enc):
        rows = []
        for seq in (e.chosen, e.rejected):
            ids, mask = seq
            labels = torch.tensor([i if m else -100 for i, m in zip(ids, mask)])
            with torch.no_grad():
                logits = peft(torch.tensor([ids])).logits
            rows.append((logits, labels[None], torch.tensor([ids])))
        lp = [ORPOTrainer.get_batch_logps(lg, lb, average_log_prob=True) for lg, lb, _ in rows]
        assert float(lp[0]) == pytest.approx(float(mean[j]), abs=1e-4)
        assert float(lp[1]) == pytest.approx(float(mean[n + j]), abs=1e-4)
        # TRL's chosen NLL: over the whole chosen sequence (prompt and answer), mean.
        lg, _, ids = rows[0]
        their_nll = nn.CrossEntropyLoss()(lg[0, :-1], ids[0, 1:])
        losses, crew, rrew, _, _ = ORPOTrainer.odds_ratio_loss(me, lp[0], lp[1])
        theirs = their_nll - losses.mean()
        assert float(ours[j]) == pytest.approx(float(theirs), abs=1e-4)
        assert float(rc[j]) == pytest.approx(float(crew), abs=1e-4)
        assert float(rr[j]) == pytest.approx(float(rrew), abs=1e-4)


def test_make_pref_pairs_is_deterministic_and_holds_out_15_percent(tmp_path):
    """scripts/make_pref_pairs.py (the walk's pair set): the same seed, the same bytes;
    15% held out; the chosen answer is the rejected one opened by "Verily,"."""
    import subprocess

    script = Path(__file__).resolve().parents[2] / "scripts" / "make_pref_pairs.py"

    def make(out, seed, pairs=40, chars=160):
        argv = [sys.executable, str(script), "--out", str(out), "--seed", seed]
        argv += ["--pairs", str(pairs), "--max-chars", str(chars)]
        assert subprocess.run(argv, capture_output=True).returncode == 0
        return [(out / n).read_bytes() for n in ("train.jsonl", "valid.jsonl")]

    a, b, c = make(tmp_path / "a", "1"), make(tmp_path / "b", "1"), make(tmp_path / "c", "2")
    assert a == b and a != c
    # `toy new`'s data/pairs is the script's set of 80 speeches up to 80 characters, seed 0
    # (the walk's numbers in the README are measured on it).
    from toy.cli.cmd_new import PAIR_CHARS, PAIRS
    from toy.data.dialogue import preference_pairs, write_pairs
    from toy.data.prep import bundled_text_paths

    ours = write_pairs(
        preference_pairs(bundled_text_paths(), PAIRS, 0, max_chars=PAIR_CHARS), tmp_path / "n"
    )
    walk = make(tmp_path / "w", "0", PAIRS, PAIR_CHARS)
    assert [(ours / n).read_bytes() for n in ("train.jsonl", "valid.jsonl")] == walk
    train, valid = ([json.loads(x) for x in f.splitlines()] for f in a)
    assert (len(train), len(valid)) == (34, 6)
    for p in train + valid:
        assert p["chosen"].startswith("Verily, ") and not p["rejected"].startswith("Verily")
        assert p["chosen"][8:].lower() == p["rejected"].lower()
