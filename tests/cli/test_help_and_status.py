"""A user's first hour, third pass (issue 47 items 2 and 8): what `toy train --help` says of
--data for each recipe, and what a LoRA run, `toy runs` and `toy list` say, each through the
command line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import model_dirs  # noqa: E402
from helpers.model_dirs import tiny_dir  # noqa: E402


def help_of(toy_cli, capsys, *argv) -> str:
    """`toy train [ARGV] --help`'s text, whitespace collapsed (argparse wraps it)."""
    with pytest.raises(SystemExit) as e:
        toy_cli("train", *argv, "--help")
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def data_help(text: str) -> str:
    """The help of --data alone: from its option up to --val-data's."""
    return text.split("--data DATA ", 1)[1].split(" --val-data VAL_DATA ", 1)[0]


def test_train_help_describes_data_for_every_recipe(toy_cli, capsys):
    """--data's help read as one recipe's (the preference pairs of dpo, first in the
    alphabet); lora's forms, the recipe most users start with, come first now, and the
    recipes that take no --data are pointed to --corpus."""
    said = data_help(help_of(toy_cli, capsys))
    assert said.startswith("lora: "), said
    lora, rest = said.split("; dpo, orpo, simpo: ", 1)
    for form in ('{"messages"', '{"prompt", "completion"}', '{"text"}', "a directory"):
        assert form in lora, (form, lora)
    assert "from-scratch and warm-start train on instead of --data" in lora, lora
    pairs, prompts = rest.split("; grpo: ", 1)
    assert '{"prompt", "chosen", "rejected"}' in pairs, pairs
    assert '{"prompt": "..."}' in prompts and "a column the reward functions get" in prompts


def test_train_recipe_help_shows_that_recipes_own(toy_cli, capsys):
    """`toy train --recipe grpo --help` printed every recipe's flags; now its own --data
    forms, its own defaults and no other recipe's flags."""
    text = help_of(toy_cli, capsys, "--recipe", "grpo")
    said = data_help(text)
    assert said.startswith("prompts, one JSON object a line"), said
    assert "lora:" not in said and "preference pairs" not in said, said
    assert "--lr LR, --learning-rate LR peak learning rate" in text, text
    assert "mlx_lm.lora's name) (default 5e-05)" in text, text
    assert "--reward SPEC" in text and "--gamma" not in text and "--images" not in text
    text = help_of(toy_cli, capsys, "--recipe", "from-scratch")
    assert "--data DATA" not in text and "--corpus CORPUS" in text
    assert "--seq-len SEQ_LEN training sequence length (default the preset context)" in text


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny transformers base, and 20 lines of each non-chat --data form: at
    --batch-size 64 and --seq-len 64 each fits one length-grouped batch."""
    root = tmp_path_factory.mktemp("first-hour3")
    model_dirs.set_root(root / "models")
    (root / "models").mkdir()
    pc = root / "pc.jsonl"
    pc.write_text(
        "".join(
            json.dumps({"prompt": f"what is {i}?", "completion": f" {i}."}) + "\n"
            for i in range(20)
        )
    )
    text = root / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"line {i} of text"}) + "\n" for i in range(20)))
    return {"base": tiny_dir("llama"), "pc": pc, "text": text, "root": root}


def lora(toy_cli, data, form: str, *more) -> str:
    code, out, err = toy_cli(
        "train", "--recipe", "lora", "--model", data["base"], "--data", data[form],
        "--out", data["root"] / "runs", "--seq-len", "64", "--batch-size", "64",
        "--eval-batches", "1", "--epochs", "2", *more,
    )  # fmt: skip
    assert code == 0, err
    return out


def test_lora_run_names_where_output_puts_the_mlx_adapter(toy_cli, data, tmp_path, monkeypatch):
    """--output adapters/adapters.safetensors wrote mlx-lm's adapter there, and nothing the
    run printed said so (the done line names RUN_DIR/final only)."""
    monkeypatch.chdir(tmp_path)
    out = lora(toy_cli, data, "pc", "--output", "adapters/adapters.safetensors")
    dest = tmp_path / "adapters" / "adapters.safetensors"
    assert dest.is_file() and (dest.parent / "adapter_config.json").is_file()
    note = next(line for line in out.splitlines() if line.strip().startswith("--output"))
    assert str(dest) in note and "mlx-lm" in note and "adapter_config.json" in note, note


@pytest.mark.parametrize("form", ["pc", "text"])
def test_non_chat_lora_data_is_not_called_chat(toy_cli, data, form):
    """A {"prompt", "completion"} or {"text"} run said "with chat data --batch-size is a token
    budget": every form is batched under that budget, so the line names no form; and one
    batch an epoch read "of 1 batches"."""
    out = lora(toy_cli, data, form)
    first = out.splitlines()[0]
    assert "chat" not in first and "with --data, --batch-size is a token budget" in first, first
    assert "  2 epochs of 1 batch, 1 a step = 2 steps" in out.splitlines(), out


def _fake_run(runs: Path, rid: str, events: list[dict]) -> None:
    d = runs / rid
    d.mkdir(parents=True)
    info = {"run_id": rid, "recipe": "lora", "arch": "llama", "train": {"steps": 4}, "job": {}}
    (d / "run.json").write_text(json.dumps(info))
    lines = [json.dumps({"time": 100.0 + i, **e}) for i, e in enumerate(events)]
    (d / "events.jsonl").write_text("\n".join(lines) + "\n")


def test_runs_and_list_say_the_same_status(toy_cli, tmp_path, monkeypatch):
    """A run with no closing event was "running" in `toy runs` and "incomplete (last event
    step, step 2)" in `toy list`. The log cannot tell a live run from a killed one: both say
    "unfinished" now, and every other status the same way too."""
    start = {"event": "run_started", "steps": 4}
    step = lambda s: {"event": "step", "step": s, "loss": 3.0}  # noqa: E731
    runs = tmp_path / "runs"
    _fake_run(runs, "live", [start, step(1), step(2)])
    _fake_run(runs, "resumed", [start, step(1), {"event": "interrupted"}, start, step(2)])
    _fake_run(runs, "done", [start, step(1), {"event": "run_finished", "step": 1}])
    _fake_run(runs, "cut", [start, step(1), {"event": "interrupted", "step": 1}])
    _fake_run(runs, "boom", [start, {"event": "run_failed", "error": "loss became nan"}])
    monkeypatch.chdir(tmp_path)
    code, out, err = toy_cli("runs", "--json")
    assert code == 0, err
    by_runs = {r["id"]: r["status"] for r in json.loads(out)["runs"]}
    code, out, err = toy_cli("list", "--json")
    assert code == 0, err
    by_list = {r["run_id"]: r["status"] for r in json.loads(out)["runs"]}
    assert (
        by_runs
        == by_list
        == {
            "live": "unfinished",
            "resumed": "unfinished",
            "done": "finished",
            "cut": "interrupted",
            "boom": "failed",
        }
    ), (by_runs, by_list)
    code, out, err = toy_cli("list")
    live = next(line.split() for line in out.splitlines() if line.split()[:1] == ["live"])
    assert live[-4:] == ["unfinished", "at", "step", "2"], live
    code, out, err = toy_cli("runs")
    assert next(ln for ln in out.splitlines() if ln.startswith("live")).endswith(" unfinished")


def mlx_lm_data_dir(data, tmp_path, monkeypatch, test: bool = False):
    """mlx_lm.lora's --data DIR, in the working folder: train.jsonl, valid.jsonl and (with
    `test`) test.jsonl of the kit's prompt/completion lines."""
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "data"
    d.mkdir()
    lines = data["pc"].read_text().splitlines()
    (d / "train.jsonl").write_text("\n".join(lines[:16]) + "\n")
    (d / "valid.jsonl").write_text("\n".join(lines[16:]) + "\n")
    if test:
        (d / "test.jsonl").write_text("\n".join(lines[:6]) + "\n")
    return d


def test_an_mlx_lm_lora_command_line_runs_as_it_is(toy_cli, data, tmp_path, monkeypatch):
    """mlx_lm.lora's own flags (issue 47 item 3): --train, --iters, --learning-rate,
    --adapter-path, --num-layers, --max-seq-length, --mask-prompt, --grad-checkpoint,
    --steps-per-eval, --val-batches and a data directory of train.jsonl/valid.jsonl run as
    they are, meaning what they mean there; where toy reads one differently, a note says so."""
    d = mlx_lm_data_dir(data, tmp_path, monkeypatch)
    code, out, err = toy_cli(
        "train", "--recipe", "lora", "--model", data["base"], "--train", "--data", d,
        "--iters", "3", "--learning-rate", "2e-4", "--batch-size", "64", "--adapter-path",
        "adapters", "--num-layers", "1", "--max-seq-length", "48", "--mask-prompt",
        "--grad-checkpoint", "--steps-per-eval", "2", "--val-batches", "1", "--out",
        tmp_path / "runs", "--run-id", "m",
    )  # fmt: skip
    assert code == 0, err
    cfg = json.loads((tmp_path / "runs" / "m" / "run.json").read_text())["config"]
    assert (cfg["steps"], cfg["lr"], cfg["seq_len"]) == (3, 2e-4, 48)
    assert cfg["checkpointing"] is True and cfg["eval_every"] == 2 and cfg["eval_batches"] == 1
    assert (tmp_path / "adapters" / "adapters.safetensors").is_file()
    assert (tmp_path / "adapters" / "adapter_config.json").is_file()
    # --num-layers 1: the last of the 2 blocks, as mlx_lm.lora; each export says which
    assert "--num-layers 1: adapters on the last 1 of the 2 blocks" in out, out
    mlx = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert mlx["num_layers"] == 1
    from safetensors import safe_open

    with safe_open(str(tmp_path / "adapters" / "adapters.safetensors"), "pt") as f:
        assert {k.split(".")[2] for k in f.keys()} == {"1"}
    peft = json.loads((tmp_path / "runs" / "m" / "final" / "adapter_config.json").read_text())
    assert peft["layers_to_transform"] == [1]
    for bad in ("3", "0"):
        code, _, err = toy_cli(
            "train", "--recipe", "lora", "--model", data["base"], "--data", d,
            "--num-layers", bad, "--out", tmp_path / "runs", "--run-id", f"bad{bad}",
        )  # fmt: skip
        assert code == 2 and err.count("\n") == 1, err
        assert f"--num-layers {bad}: the model has 2 blocks" in err, err
    assert "--mask-prompt: toy scores only the replies" in out
    # --adapter-path is --output DIR/adapters.safetensors: both at once conflict.
    code, _, err = toy_cli(
        "train", "--recipe", "lora", "--model", data["base"], "--data", d, "--adapter-path",
        "a", "--output", "b", "--out", tmp_path / "runs",
    )  # fmt: skip
    assert code == 2 and "--output and --adapter-path conflict" in err


def test_every_mlx_lm_lora_config_key_is_read():
    """-c's key table (cli/mlx_config.py) holds every key of the installed mlx_lm.lora's
    config (its CONFIG_DEFAULTS): a key mlx-lm adds is not taken for unknown in silence."""
    lora = pytest.importorskip("mlx_lm.lora")
    from toy.cli.mlx_config import FLAGS

    assert set(lora.CONFIG_DEFAULTS) <= set(FLAGS), set(lora.CONFIG_DEFAULTS) - set(FLAGS)


def test_an_mlx_lm_lora_config_file_runs_as_it_is(toy_cli, data, tmp_path, monkeypatch):
    """Issue 58 item 6: `toy train -c config.yaml` reads mlx_lm.lora's YAML config (its
    example file's keys) as its flags, the recipe lora, the command line winning; what toy
    cannot honour is one line naming the file and the key, exit 2, before any work."""
    d = mlx_lm_data_dir(data, tmp_path, monkeypatch, test=True)
    conf = tmp_path / "lora_config.yaml"
    conf.write_text(
        f"model: {data['base']}\ntrain: true\nfine_tune_type: lora\noptimizer: adamw\n"
        f"data: {d}\nseed: 0\nnum_layers: 1\nbatch_size: 4\niters: 3\nval_batches: 1\n"
        "learning_rate: 2e-4\nsteps_per_report: 10\nsteps_per_eval: 2\n"
        "resume_adapter_file: null\nadapter_path: adapters\nsave_every: 100\ntest: true\n"
        "test_batches: -1\nmax_seq_length: 48\ngrad_checkpoint: false\n"
        "lora_parameters:\n  keys: [self_attn.q_proj, self_attn.v_proj, mlp.down_proj]\n"
        "  rank: 4\n  scale: 10.0\n  dropout: 0.0\n"
    )
    code, out, err = toy_cli("train", "-c", conf, "--iters", "2", "--out", tmp_path / "runs",
                             "--run-id", "c")  # fmt: skip
    assert code == 0, err
    info = json.loads((tmp_path / "runs" / "c" / "run.json").read_text())
    cfg = info["config"]
    assert info["recipe"] == "lora" and (cfg["fine_tune_type"], cfg["optimizer"]) == (
        "lora",
        "adamw",
    )
    assert (cfg["steps"], cfg["lr"], cfg["seq_len"], cfg["eval_every"]) == (2, 2e-4, 48, 2)
    assert (cfg["rank"], cfg["alpha"], cfg["num_layers"]) == (4, 40.0, 1)
    assert cfg["targets"] == "q_proj,v_proj,down_proj"
    assert (
        json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())["num_layers"] == 1
    )
    # test: true, as mlx_lm.lora --test: the final adapter's loss on DIR/test.jsonl
    assert "test loss " in out and "test ppl " in out, out
    events = (tmp_path / "runs" / "c" / "events.jsonl").read_text().splitlines()
    (t,) = [e for e in map(json.loads, events) if e["event"] == "test"]
    assert t["loss"] > 0 and abs(t["ppl"] - math.exp(t["loss"])) < 1e-6 * t["ppl"], t
    code, out, err = toy_cli("train", "--recipe", "lora", "--model", data["base"], "--data", d,
                             "--steps", "1", "--test", "--test-batches", "1", "--json",
                             "--out", tmp_path / "runs", "--run-id", "j")  # fmt: skip
    assert code == 0, err
    res = json.loads(out)
    assert res["test_loss"] > 0 and res["test_ppl"] == math.exp(res["test_loss"]), res
    for extra, says in (
        ("lr_schedule:\n  name: cosine_decay\n", "lr_schedule"),
        ("fine_tune_type: full\n", "--fine-tune-type full: toy trains LoRA adapters only"),
        ("optimizer: sgd\n", "--optimizer sgd: toy trains with AdamW"),
        ("stepz: 3\n", "'stepz' is not one of mlx_lm.lora's config keys"),
        ("resume_adapter_file: a.safetensors\n", "toy resumes a run from its checkpoint"),
        (f"data: {d / 'train.jsonl'}\ntest: true\n", "--test reads test.jsonl in --data's"),
        ("iters: [3\n", "line"),
    ):
        bad = tmp_path / "bad.yaml"
        bad.write_text(f"data: {d}\nmodel: {data['base']}\n{extra}")
        code, _, err = toy_cli("train", "-c", bad, "--out", tmp_path / "runs", "--run-id", "b")
        assert code == 2 and err.count("\n") == 1 and says in err, err
        assert "bad.yaml" in err or "--" in err, err
    assert not (tmp_path / "runs" / "b").exists()


def test_resume_raises_epochs_on_a_run_begun_with_epochs(toy_cli, data):
    """`--resume RUN --epochs 4` on a run begun with --epochs 2 was refused ("only --steps
    may be raised"): it trains to 4 epochs' steps (an epoch's steps fixed when the run
    began); fewer epochs, or epochs on a run that counts steps, are one line each."""
    out = lora(toy_cli, data, "text", "--run-id", "ep")
    assert "  2 epochs of 1 batch, 1 a step = 2 steps" in out.splitlines(), out
    run = data["root"] / "runs" / "ep"
    code, out, err = toy_cli("train", "--resume", run, "--epochs", "4")
    assert code == 0, err
    steps = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in steps if e["event"] == "step"] == [1, 2, 3, 4]
    assert json.loads((run / "run.json").read_text())["config"]["epochs"] == 4
    code, out, err = toy_cli("train", "--resume", run, "--epochs", "3")
    assert code == 2 and "--epochs 3 is below the run's 4" in err, err
    code, out, err = toy_cli(
        "train", "--recipe", "lora", "--model", data["base"], "--data", data["text"],
        "--out", data["root"] / "runs", "--run-id", "st", "--seq-len", "64",
        "--batch-size", "64", "--eval-batches", "1", "--steps", "2",
    )  # fmt: skip
    assert code == 0, err
    code, out, err = toy_cli("train", "--resume", data["root"] / "runs" / "st", "--epochs", "3")
    assert code == 2 and "counts steps (2), not epochs; raise --steps" in err, err
    assert len(err.strip().splitlines()) == 1


def test_list_says_an_export_is_older_than_its_resumed_run(toy_cli, data, monkeypatch):
    """After a resume, export/ kept the earlier step's files and `toy list` listed them as
    current: an export older than its run's final/ is marked, until exported again."""
    proj = data["root"] / "stale-proj"
    (proj / "runs").mkdir(parents=True)
    (proj / "toy.toml").write_text("")
    monkeypatch.chdir(proj)
    code, _, err = toy_cli(
        "train", "--recipe", "lora", "--model", data["base"], "--data", data["text"],
        "--run-id", "r", "--seq-len", "64", "--batch-size", "64", "--eval-batches", "1",
        "--steps", "2",
    )  # fmt: skip
    assert code == 0, err

    def row():
        code, out, err = toy_cli("list", "--json")
        assert code == 0, err
        (m,) = [m for m in json.loads(out)["models"] if m["path"].endswith("r-peft")]
        return m

    assert toy_cli("export", "runs/r", "--format", "peft")[0] == 0
    assert "stale" not in row()
    assert toy_cli("train", "--resume", "runs/r", "--steps", "3")[0] == 0
    m = row()
    assert m.get("stale") is True and "export again with --force" in m["note"], m
    code, out, err = toy_cli("list")
    assert "STALE" in next(x for x in out.splitlines() if "r-peft" in x)
    assert toy_cli("export", "runs/r", "--format", "peft", "--force")[0] == 0
    assert "stale" not in row()
