"""The correctness round (issue 13): the final step is always checkpointed, the LR
schedule of an extended run, one typed resolved config, per-rank RNG, the loss on chat
batches, one data resolution, and the GPT-2 / FSDP re-tie. Each test failed on the code
before its fix."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.gguf_fixtures import tiny_model, write_llama_gguf  # noqa: E402

from toy.data.dialogue import conversations, write_jsonl  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402
from toy.models.losses import IGNORE  # noqa: E402
from toy.runs import read_events  # noqa: E402
from toy.tokenizer import train_bpe  # noqa: E402
from toy.train.config import RunConfig  # noqa: E402
from toy.train.schedule import Schedule  # noqa: E402

TINY = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2", "--json"]
LORA = [
    "--seq-len",
    "128",
    "--batch-size",
    "2",
    "--eval-batches",
    "2",
    "--lr",
    "1e-2",
    "--warmup",
    "0",
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


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny llama GGUF with a ChatML-aware tokenizer, and chat data from the plays."""
    d = tmp_path_factory.mktemp("base")
    text = bundled_text_paths()[0].read_text()[:40000]
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    model = tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True), max_seq_len=256)
    path = write_llama_gguf(d / "base.gguf", model, tok)
    chat = write_jsonl(
        conversations(bundled_text_paths(), 40, seed=1, turns=(1, 2), max_chars=150),
        d / "chat.jsonl",
    )
    return {"gguf": path, "chat": chat, "dir": d}


def run_json(toy_cli, *argv):
    code, out, err = toy_cli(*argv)
    assert code == 0, err
    return json.loads(out)


def step_events(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "step"]


# ---------------------------------------------------------------- 2. the last step is checkpointed


def test_the_last_step_is_always_checkpointed_and_a_finished_run_extends(corpus, toy_cli, tmp_path):
    # 45 steps with --save-every 40: the checkpoint used to stay at step 40 of 40... of 45.
    run_json(
        toy_cli,
        "train",
        "--corpus",
        corpus,
        "--out",
        tmp_path,
        *TINY,
        "--steps",
        "7",
        "--save-every",
        "5",
        "--run-id",
        "r",
    )
    ckpts = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    assert ckpts == ["step-000005", "step-000007"]
    r = run_json(toy_cli, "train", "--resume", tmp_path / "r", "--steps", "9", "--json")
    assert [x["step"] for x in r["losses"]] == list(range(1, 10))
    assert [e["step"] for e in step_events(tmp_path / "r")][-2:] == [8, 9]
    info = json.loads((tmp_path / "r" / "run.json").read_text())
    assert info["config"]["steps"] == 9  # run.json tells the run as it now stands
    assert [s["from_step"] for s in info["segments"]] == [0, 7]
    assert (tmp_path / "r" / "checkpoints" / "step-000009").is_dir()


def test_a_run_without_save_every_still_leaves_its_last_step(corpus, toy_cli, tmp_path):
    run_json(
        toy_cli,
        "train",
        "--corpus",
        corpus,
        "--out",
        tmp_path,
        *TINY,
        "--steps",
        "3",
        "--run-id",
        "r",
    )
    assert [p.name for p in (tmp_path / "r" / "checkpoints").iterdir()] == ["step-000003"]


# ---------------------------------------------------------------- 3. the LR of an extension


def test_schedule_same_total_is_unchanged_and_warmup_extension_equals_an_unbroken_run():
    s = Schedule(1e-3, 1e-4, warmup=10, total=40)
    assert s.extended(25, 40) is s
    # Resumed inside the warmup: every LR equals the unbroken 80-step schedule's.
    ext = s.extended(5, 80)
    whole = Schedule(1e-3, 1e-4, warmup=10, total=80)
    assert [ext.at(i) for i in range(80)] == [whole.at(i) for i in range(80)]


def test_schedule_extension_warms_back_to_the_peak_then_decays_to_min_lr():
    s = Schedule(1e-3, 1e-4, warmup=10, total=40)
    ext = s.extended(30, 60)
    assert ext.at(29) == s.at(29)  # the steps already taken keep their LR
    assert ext.rewarm == 3  # a tenth of the 30 new steps
    warm = [ext.at(i) for i in range(29, 33)]
    assert all(a < b for a, b in zip(warm, warm[1:]))  # from the restored LR, rising
    assert ext.at(32) == pytest.approx(1e-3)  # back to the run's peak
    lrs = [ext.at(i) for i in range(32, 60)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # then a cosine
    assert ext.at(59) == pytest.approx(1e-4)  # and the new last step reaches --min-lr
    # A finished run (last LR = min_lr) trains again: not flat at min_lr (issue 35 item 4).
    done = s.extended(40, 50)
    assert done.at(40) > 1e-4 and max(done.at(i) for i in range(40, 50)) == pytest.approx(1e-3)
    assert done.at(49) == pytest.approx(1e-4)
    # Extending an extension starts a new segment from where it is.
    again = ext.extended(45, 70)
    assert again.at(44) == ext.at(44) and again.at(69) == pytest.approx(1e-4)
    assert max(again.at(i) for i in range(45, 70)) == pytest.approx(1e-3)
    # A checkpoint from before the warmup existed keeps its curve (a cosine from its LR).
    old = Schedule.from_dict({k: v for k, v in ext.to_dict().items() if k != "rewarm"})
    assert old.at(30) == pytest.approx(s.at(29)) and old.at(59) == pytest.approx(1e-4)
    assert Schedule.from_dict(ext.to_dict()) == ext


def test_extension_lr_end_to_end_and_a_second_resume_keeps_the_curve(corpus, toy_cli, tmp_path):
    common = ["--corpus", corpus, "--out", tmp_path, *TINY, "--warmup", "2", "--save-every", "2"]
    run_json(toy_cli, "train", *common, "--steps", "6", "--run-id", "r")
    run_json(toy_cli, "train", "--resume", tmp_path / "r", "--steps", "12", "--json")
    lrs = {e["step"]: e["lr"] for e in step_events(tmp_path / "r")}
    assert lrs[7] > lrs[6] and lrs[12] == pytest.approx(1e-4)  # warmed up again, then decayed
    # Cut the extension after step 10 and resume it: the same LRs and losses as unbroken.
    shutil.copytree(tmp_path / "r", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step-000012")
    r = run_json(toy_cli, "train", "--resume", tmp_path / "cut", "--json")
    full = [x for x in json.loads(json.dumps(step_events(tmp_path / "r")))]
    again = step_events(tmp_path / "cut")[-2:]
    assert [(e["step"], e["lr"], e["loss"]) for e in again] == [
        (e["step"], e["lr"], e["loss"]) for e in full[-2:]
    ]
    assert r["losses"][-1]["loss"] == full[-1]["loss"]


def test_a_finished_run_extended_trains_at_its_peak_lr_not_at_min_lr(corpus, toy_cli, tmp_path):
    """Issue 35 item 4: `--resume RUN --steps 60` after a 3e-3 run of 30 steps trained
    every new step at --min-lr 1e-4 ("cosine from its LR 0.0001 to --min-lr 0.0001"). The
    extension warms back to the run's peak, then decays, and says so in one line."""
    common = ["--corpus", corpus, "--out", tmp_path, *TINY, "--lr", "3e-3", "--warmup", "2"]
    run_json(toy_cli, "train", *common, "--steps", "10", "--run-id", "f")
    code, out, err = toy_cli("train", "--resume", tmp_path / "f", "--steps", "30")
    assert code == 0, err
    lrs = {e["step"]: e["lr"] for e in step_events(tmp_path / "f")}
    assert lrs[10] == pytest.approx(1e-4)  # the run had finished at --min-lr
    new = [lrs[k] for k in range(11, 31)]
    assert max(new) == pytest.approx(3e-3) and sum(new) / len(new) > 10 * 1e-4, new
    assert lrs[30] == pytest.approx(1e-4)
    said = [line for line in (out + err).splitlines() if "LR schedule extended" in line]
    assert len(said) == 1 and "warmup 2" in said[0] and "peak 0.003" in said[0], said


# ---------------------------------------------------------------- 4. one resolved config


def test_lora_epochs_run_extends_with_steps(base, toy_cli, tmp_path):
    r = run_json(
        toy_cli,
        "train",
        "--recipe",
        "lora",
        "--model",
        base["gguf"],
        "--data",
        base["chat"],
        "--out",
        tmp_path,
        *LORA,
        "--epochs",
        "1",
        "--json",
        "--run-id",
        "e",
    )
    n = r["steps"]
    r2 = run_json(toy_cli, "train", "--resume", tmp_path / "e", "--steps", str(n + 2), "--json")
    assert [x["step"] for x in r2["losses"]] == list(
        range(1, n + 3)
    )  # it trained the two new steps
    assert [e["step"] for e in step_events(tmp_path / "e")][-2:] == [n + 1, n + 2]
    cfg = json.loads((tmp_path / "e" / "run.json").read_text())["config"]
    assert cfg["steps"] == n + 2 and cfg["epochs"] == 1 and cfg["seq_len"] == 128


def test_run_json_records_the_resolved_config(base, toy_cli, tmp_path):
    run_json(
        toy_cli,
        "train",
        "--recipe",
        "lora",
        "--model",
        base["gguf"],
        "--data",
        base["chat"],
        "--out",
        tmp_path,
        *LORA,
        "--epochs",
        "2",
        "--json",
        "--run-id",
        "e",
        "--seq-len",
        "100000",
    )
    cfg = json.loads((tmp_path / "e" / "run.json").read_text())["config"]
    # the general flags and the lora recipe's own, flat (train/recipe.py: Flag)
    from toy.recipes import lora

    assert set(cfg) == set(RunConfig.keys()) | {f.key for f in lora.RECIPE.own()}
    assert cfg["seq_len"] == 256  # clamped to the GGUF's context, as trained
    assert isinstance(cfg["steps"], int) and cfg["steps"] >= 2  # --epochs resolved into steps
    assert (
        cfg["rank"] == 8 and cfg["lr"] == 1e-2 and cfg["weight_decay"] == 0.0
    )  # recipe defaults and flags


def test_run_config_is_read_only_and_refuses_unknown_records():
    c = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.steps = 3  # frozen
    from toy.errors import InputError

    with pytest.raises(InputError, match="another toy version"):
        RunConfig.from_record({**c.to_dict(), "bogus": 1}, own=())
    # a record made before the recipes' flags moved to their files: other recipes' keys, null
    old = RunConfig.from_record({**c.to_dict(), "images": None, "beta": 0.5}, own=("beta",))
    assert old.beta == 0.5 and "images" not in old.to_dict()
    with pytest.raises(AttributeError, match="from-scratch recipe"):
        old.images  # noqa: B018
    with pytest.raises(InputError, match="images"):
        RunConfig.from_record({**c.to_dict(), "images": "a/dir"}, own=("beta",))


def test_every_recipe_flag_is_declared_once():
    """A recipe's defaults name general flags only; its own flags are Flags, each a key no
    general flag has, with a default a config can hold."""
    from toy.recipes import load_recipe, recipe_names

    for name in recipe_names():
        r = load_recipe(name)
        assert set(r.defaults) <= set(RunConfig.keys()), name
        own = [f.key for f in r.own()]
        assert len(own) == len(set(own)), name
        cfg = r.config()
        assert all(getattr(cfg, k) == f.default for k, f in zip(own, r.own())), name


# ---------------------------------------------------------------- 7. RNG per rank


def test_lora_dropout_follows_the_seed_not_the_process_state(base, tmp_path):
    """The loop seeds each process from (seed, rank): what ran before in the process
    (here: other draws from torch's generator) must not change the losses."""
    from toy.recipes import lora
    from toy.runs import EventLog, Project
    from toy.train.loop import train

    def losses(noise: int) -> list[float]:
        torch.manual_seed(noise)
        torch.rand(noise)
        cfg = lora.RECIPE.config(
            model=str(base["gguf"]),
            data=str(base["chat"]),
            seed=3,
            seq_len=128,
            batch_size=2,
            dropout=0.3,
            steps=3,
            warmup=0,
            lr=1e-2,
        )
        built = lora.build(cfg, Project(root=None))
        tc = cfg.with_derived(built.derived)
        return [
            x["loss"]
            for x in train(built.job, tc, None, torch.device("cpu"), EventLog(None)).losses
        ]

    assert losses(1) == losses(12345)


def test_each_rank_seeds_its_own_stream(monkeypatch):
    from toy.train import dist, loop

    assert loop.rank_seed(0, 0) != loop.rank_seed(0, 1) != loop.rank_seed(1, 1)
    seen = {}
    for rank in (0, 1):
        monkeypatch.setattr(dist, "_INFO", dist.DistInfo(rank=rank, world=1))
        t = loop.Trainer.__new__(loop.Trainer)
        t.cfg, t.d = RunConfig(seed=5), dist.info()
        t._start(None)
        seen[rank] = torch.initial_seed()
    assert seen == {0: loop.rank_seed(5, 0), 1: loop.rank_seed(5, 1)}


def test_checkpoint_keeps_every_ranks_rng_and_restores_its_own(tmp_path):
    """Twelve ranks: rank 2 must get rank 2's state (a sorted key order put cuda_10
    before cuda_2, and rank 0's states were restored to everyone)."""
    from toy.formats import checkpoint as ckpt

    states = []
    for r in range(12):
        torch.manual_seed(1000 + r)
        states.append({"cpu": torch.get_rng_state()})
    ckpt.save_checkpoint(tmp_path, 1, {"w": torch.zeros(1)}, ({}, {"param_groups": []}), {}, states)
    _, _, rng_t, state = ckpt.load_checkpoint(tmp_path / "step-000001")
    for r in (2, 10):
        assert ckpt.set_rng_state(rng_t, state["rng"], rank=r)
        assert torch.equal(torch.get_rng_state(), states[r]["cpu"])
    assert not ckpt.set_rng_state(rng_t, state["rng"], rank=12)  # a rank the run did not have


# ---------------------------------------------------------------- the loss on chat batches


def test_chat_batches_shift_by_one_and_ignore_what_is_not_supervised():
    from toy.data.chat import to_batch

    samples = [([10, 11, 12, 13, 14], [0, 0, 1, 1, 0]), ([20, 21, 22], [0, 1, 1])]
    b = to_batch(samples, pad=99)
    assert b["ids"].tolist() == [[10, 11, 12, 13], [20, 21, 22, 99]]
    assert b["targets"].tolist() == [[IGNORE, 12, 13, IGNORE], [21, 22, IGNORE, IGNORE]]


def test_masked_head_loss_equals_cross_entropy_on_the_supervised_positions():
    from toy.models.llama import Llama, LlamaConfig
    from toy.train.job import lm_loss

    torch.manual_seed(0)
    model = Llama(
        LlamaConfig(vocab_size=300, n_layer=2, d_model=32, n_head=4, n_kv_head=2, max_seq_len=32)
    )
    ids = torch.randint(0, 300, (3, 12))
    targets = torch.randint(0, 300, (3, 12))
    targets[0, :5] = IGNORE
    targets[2, 7:] = IGNORE
    got, n = lm_loss(model, {"ids": ids, "targets": targets})
    want = F.cross_entropy(
        model(ids).flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    assert int(n) == int((targets != IGNORE).sum()) == 36 - 5 - 5
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    # and its gradient
    g1 = torch.autograd.grad(got, model.layers[0].mlp.up_proj.weight)[0]
    g2 = torch.autograd.grad(
        F.cross_entropy(
            model(ids).flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"
        ),
        model.layers[0].mlp.up_proj.weight,
    )[0]
    assert torch.allclose(g1, g2, rtol=1e-4, atol=1e-6)


def test_one_epoch_feeds_every_conversation_exactly_once(base):
    """An epoch's step count (--epochs 1) covers the training set once: off by one and
    a batch would be missed or repeated."""
    from toy.recipes import lora
    from toy.runs import Project

    for accum in (1, 2, 3):
        cfg = lora.RECIPE.config(
            model=str(base["gguf"]),
            data=str(base["chat"]),
            seq_len=128,
            batch_size=2,
            grad_accum=accum,
            epochs=1,
            steps=None,
        )
        built = lora.build(cfg, Project(root=None))
        steps, n_conv, n_batches = (
            built.derived["steps"],
            built.job.config["conversations"],
            built.job.config["batches"],
        )
        assert steps == math.ceil(n_batches / accum)
        rows = sum(int(built.job.micro_batch(k)["ids"].shape[0]) for k in range(n_batches))
        assert rows == n_conv  # the epoch's batches hold every conversation once
        assert (
            int(built.job.micro_batch(n_batches)["ids"].shape[0]) > 0
        )  # the next epoch starts over


# ---------------------------------------------------------------- 9. one data resolution


def test_lora_token_stream_checks_the_validation_split(base, toy_cli, tmp_path):
    code, _, err = toy_cli(
        "prep",
        bundled_text_paths()[1],
        "--out",
        tmp_path / "c.bin",
        "--tokenizer",
        base["gguf"],
        "--val-fraction",
        "0.0005",
    )
    assert code == 0, err
    code, _, err = toy_cli(
        "train",
        "--recipe",
        "lora",
        "--model",
        base["gguf"],
        "--corpus",
        tmp_path / "c.bin",
        "--out",
        tmp_path / "runs",
        *LORA,
    )
    assert code == 2 and "c.val.bin" in err and "validation tokens" in err, (
        err
    )  # never silently dropped


def test_lora_token_stream_refuses_a_corpus_without_the_models_tokenizer_hash(
    base, toy_cli, tmp_path
):
    import numpy as np

    from toy.data.tokens import write_tokens

    vocab = 402
    write_tokens(tmp_path / "n.bin", np.arange(5000) % vocab, vocab)  # no hash: unknown tokenizer
    code, _, err = toy_cli(
        "train",
        "--recipe",
        "lora",
        "--model",
        base["gguf"],
        "--corpus",
        tmp_path / "n.bin",
        "--out",
        tmp_path / "runs",
        *LORA,
    )
    assert code == 2 and "no tokenizer hash" in err and "toy prep" in err, err


# ---------------------------------------------------------------- 1. tying after FSDP


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_materialize_ties_each_architectures_head_again(arch):
    from toy.models import registry

    model = registry.build_model(registry.build_config(arch, "tiny", 100))
    model.lm_head.weight = torch.nn.Parameter(
        model.lm_head.weight.detach().clone()
    )  # what FSDP's gather leaves
    model.tie_weights()
    emb = model.embed_tokens if arch == "llama" else model.wte
    assert model.lm_head.weight is emb.weight
