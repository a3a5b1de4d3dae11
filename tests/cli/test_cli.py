"""The command line end to end: new -> prep -> train -> infer, the run directory, the
event schema, determinism, and each user-error path (exit 2, one line, no traceback)."""

import json
from pathlib import Path

import pytest
from helpers.common import run_toy

from toy.data.prep import bundled_text_paths

TINY = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two plays, a 512-token BPE: small enough for fast tests, real text."""
    from toy.cli.main import main

    d = tmp_path_factory.mktemp("corpus")
    texts = bundled_text_paths()[:2]
    assert main(["prep", *map(str, texts), "--out", str(d / "c.bin"), "--vocab-size", "512"]) == 0
    return d / "c.bin"


def test_prep_writes_train_val_and_tokenizer(corpus, toy_cli, tmp_path):
    assert corpus.is_file() and (corpus.parent / "c.val.bin").is_file()
    assert (corpus.parent / "c.tokenizer.json").is_file() and not (
        corpus.parent / "tokenizer.json"
    ).exists()
    code, out, _ = toy_cli(
        "prep",
        *bundled_text_paths()[:1],
        "--out",
        tmp_path / "x.bin",
        "--tokenizer",
        corpus.parent / "c.tokenizer.json",
        "--val-fraction",
        "0.1",
        "--json",
    )
    assert code == 0
    r = json.loads(out)
    assert r["vocab_size"] == 512 and r["val_tokens"] > 0
    assert abs(r["val_tokens"] / (r["train_tokens"] + r["val_tokens"]) - 0.1) < 0.001
    # A reused tokenizer.json is copied beside the corpus too: the corpus owns its tokenizer.
    assert r["tokenizer"] == str(tmp_path / "x.tokenizer.json")
    assert (tmp_path / "x.tokenizer.json").read_bytes() == (
        corpus.parent / "c.tokenizer.json"
    ).read_bytes()


def test_two_corpora_in_one_folder_keep_their_own_tokenizers(toy_cli, tmp_path):
    """Prepping a second corpus into a folder used to write tokenizer.json over the first
    corpus's; each now owns NAME.tokenizer.json, and training and infer on the first
    still work after the second is prepped."""
    d = tmp_path / "data"
    d.mkdir()
    plays = bundled_text_paths()
    code, out, err = toy_cli(
        "prep", plays[0], "--out", d / "a.bin", "--vocab-size", "400", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["tokenizer"] == str(d / "a.tokenizer.json")
    first = (d / "a.tokenizer.json").read_bytes()
    code, out, err = toy_cli("prep", plays[1], "--out", d / "b.bin", "--vocab-size", "300")
    assert code == 0, err
    assert f"tokenizer trained -> {d / 'b.tokenizer.json'}" in out and "1 document," in out
    assert (d / "a.tokenizer.json").read_bytes() == first  # untouched
    assert (d / "b.tokenizer.json").read_bytes() != first
    assert not (d / "tokenizer.json").exists()
    for name, _vocab in (("a", 400), ("b", 300)):
        r = train_json(
            toy_cli, d / f"{name}.bin", tmp_path / "runs", "--steps", "2", "--run-id", name
        )
        assert r["params"] > 0
        final = tmp_path / "runs" / name / "final"
        assert (final / "tokenizer.json").read_bytes() == (
            d / f"{name}.tokenizer.json"
        ).read_bytes()
        code, out, err = toy_cli(
            "infer",
            "--run",
            final.parent,
            "--prompt",
            "HAMLET.",
            "--max-new-tokens",
            "4",
            "--temperature",
            "0",
        )
        assert code == 0, err
        assert out.startswith("HAMLET.")


def test_prep_with_a_gguf_tokenizer_writes_it_beside_the_corpus(toy_cli, tmp_path):
    """`toy prep --tokenizer X.gguf` wrote no tokenizer file, so a from-scratch run on the
    corpus had none for `toy infer`; NAME.tokenizer.json now holds the GGUF's."""
    from helpers.gguf_fixtures import tiny_model, write_llama_gguf

    from toy import tokenizer as toktools
    from toy.data.tokens import read_tokens

    text = bundled_text_paths()[0].read_text()[:40000]
    tok = toktools.train_bpe([text[i : i + 500] for i in range(0, len(text), 500)], 320)
    gguf = write_llama_gguf(
        tmp_path / "m.gguf", tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True)), tok
    )
    txt = tmp_path / "t.txt"
    txt.write_text(text)
    code, out, err = toy_cli(
        "prep", txt, "--out", tmp_path / "g.bin", "--tokenizer", gguf, "--json"
    )
    assert code == 0, err
    beside = tmp_path / "g.tokenizer.json"
    assert json.loads(out)["tokenizer"] == str(beside)
    assert toktools.hash_matches(
        toktools.load(beside), read_tokens(tmp_path / "g.bin").tokenizer_hash
    )
    train_json(toy_cli, tmp_path / "g.bin", tmp_path / "runs", "--steps", "2", "--run-id", "g")
    code, out, err = toy_cli(
        "infer", "--run", tmp_path / "runs" / "g", "--prompt", "HAMLET.", "--max-new-tokens", "3"
    )
    assert code == 0 and out.startswith("HAMLET."), err


def test_prep_jsonl(toy_cli, tmp_path):
    p = tmp_path / "docs.jsonl"
    p.write_text(
        "\n".join(json.dumps({"text": f"document number {i} says hello"}) for i in range(50)) + "\n"
    )
    code, out, err = toy_cli(
        "prep", p, "--out", tmp_path / "j.bin", "--vocab-size", "300", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["documents"] == 50


def train_json(toy_cli, corpus, tmp_path, *extra):
    code, out, err = toy_cli(
        "train", "--corpus", corpus, "--out", tmp_path, *TINY, "--json", *extra
    )
    assert code == 0, err
    return json.loads(out)


def test_train_json_contract_and_run_directory(corpus, toy_cli, tmp_path):
    r = train_json(
        toy_cli,
        corpus,
        tmp_path,
        "--steps",
        "6",
        "--run-id",
        "r1",
        "--eval-every",
        "3",
        "--save-every",
        "3",
    )
    assert r["format"] == "toy/train-v1"
    assert r["run_id"] == "r1" and Path(r["run_dir"]) == tmp_path / "r1"
    assert (r["recipe"], r["arch"], r["device"], r["seed"], r["steps"]) == (
        "from-scratch",
        "llama",
        "cpu",
        0,
        6,
    )
    assert r["params"] > 0
    assert [x["step"] for x in r["losses"]] == [1, 2, 3, 4, 5, 6]
    assert [x["step"] for x in r["val_losses"]] == [0, 3, 6]
    assert r["tokens_per_s"] > 0
    run = tmp_path / "r1"
    info = json.loads((run / "run.json").read_text())
    assert info["device"]["type"] == "cpu" and info["device"]["torch_threads"] >= 1
    assert info["versions"]["torch"] and info["config"]["steps"] == 6 and info["seed"] == 0
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "run_started" and kinds[-1] == "run_finished"
    assert kinds.count("step") == 6 and kinds.count("eval") == 3 and kinds.count("checkpoint") == 2
    assert all("time" in e for e in events)
    steps = [e for e in events if e["event"] == "step"]
    assert [e["loss"] for e in steps] == [x["loss"] for x in r["losses"]]
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (run / "final" / name).is_file(), name
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step-000003", "step-000006"]
    for name in ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"):
        assert (run / "checkpoints" / "step-000006" / name).is_file()


def test_same_seed_same_bytes_other_seed_differs(corpus, toy_cli, tmp_path):
    def lines(seed, rid):
        code, out, err = toy_cli(
            "train",
            "--corpus",
            corpus,
            "--out",
            tmp_path,
            *TINY,
            "--steps",
            "4",
            "--seed",
            seed,
            "--run-id",
            rid,
        )
        assert code == 0, err
        return [line for line in out.splitlines() if line.startswith("step ")]

    a, b, c = lines(1, "a"), lines(1, "b"), lines(2, "c")
    assert len(a) == 4 and all(
        line.split()[3].count(".") == 1 and len(line.split()[3].split(".")[1]) == 6 for line in a
    )
    assert a == b
    assert a != c


def test_grad_accum_keeps_the_objective(corpus, toy_cli, tmp_path):
    # batch 2 x 2 micro-steps must train as batch 4 in one: the same windows, normalised
    # by the step's token count (not averaged per micro-batch). In float32: bf16 rounds the
    # two groupings differently, past the 1e-5 this checks.
    split = train_json(
        toy_cli,
        corpus,
        tmp_path,
        "--steps",
        "4",
        "--batch-size",
        "2",
        "--grad-accum",
        "2",
        "--precision",
        "float32",
        "--run-id",
        "ga",
    )
    whole = train_json(
        toy_cli,
        corpus,
        tmp_path,
        "--steps",
        "4",
        "--batch-size",
        "4",
        "--precision",
        "float32",
        "--run-id",
        "gb",
    )
    for a, b in zip(split["losses"], whole["losses"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"]


def test_end_to_end_new_prep_train_infer(tmp_path):
    proj = tmp_path / "proj"
    r = run_toy("new", proj)
    assert r.returncode == 0, r.stderr
    assert (proj / "toy.toml").is_file() and (proj / "data" / "corpus.bin").is_file()
    assert sorted(p.name for p in (proj / "data").iterdir()) == [
        "arith",
        "chat.jsonl",
        "corpus.bin",
        "corpus.tokenizer.json",
        "corpus.val.bin",
        "pairs",
    ]
    assert (proj / "runs").is_dir()
    # data/chat.jsonl, for the README's first LoRA run: conversations from the plays that
    # the chat reader takes whole (every line valid, each with an assistant reply).
    from toy.data.chat import read_chat_jsonl

    chats = read_chat_jsonl(proj / "data" / "chat.jsonl", strict=True)
    assert len(chats.conversations) == 240 and chats.n_skipped == 0
    # data/pairs/, for the README's first DPO and ORPO runs: the pair reader takes every
    # line; 15% held out; the chosen answer is the rejected one opened by "Verily,".
    from toy.data.preference import read_pairs

    sets = [read_pairs(proj / "data" / "pairs" / f"{n}.jsonl") for n in ("train", "valid")]
    assert [len(f.pairs) for f in sets] == [68, 12] and not any(f.skipped for f in sets)
    for pair in sets[0].pairs + sets[1].pairs:
        assert pair.chosen.startswith("Verily, ") and pair.prompt
        assert pair.chosen[8:].lower() == pair.rejected.lower()
    txt = tmp_path / "t.txt"
    txt.write_text(bundled_text_paths()[0].read_text()[:60000])
    r = run_toy(
        "prep",
        txt,
        "--out",
        proj / "data" / "small.bin",
        "--tokenizer",
        proj / "data" / "corpus.tokenizer.json",
    )
    assert r.returncode == 0, r.stderr
    r = run_toy(
        "train",
        "--recipe",
        "from-scratch",
        "--corpus",
        "data/small.bin",
        *TINY,
        "--steps",
        "3",
        "--json",
        cwd=proj,
    )
    assert r.returncode == 0, r.stderr
    run_dir = Path(json.loads(r.stdout)["run_dir"])
    assert run_dir.parent == proj / "runs" and run_dir.name.endswith("-from-scratch-llama-1")
    r = run_toy(
        "infer", "--run", run_dir, "--prompt", "HAMLET.", "--max-new-tokens", "12", "--seed", "1"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("HAMLET.") and len(r.stdout) > len("HAMLET.\n")
    g1 = run_toy(
        "infer",
        "--run",
        run_dir,
        "--prompt",
        "HAMLET.",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
    )
    g2 = run_toy(
        "infer",
        "--run",
        run_dir,
        "--prompt",
        "HAMLET.",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
    )
    assert g1.stdout == g2.stdout  # greedy is deterministic


def test_project_from_before_per_corpus_tokenizers_still_trains(toy_cli, tmp_path, monkeypatch):
    # Projects made by an older `toy new` hold data/tokenizer.json, not data/corpus.tokenizer.json.
    proj = tmp_path / "old"
    assert toy_cli("new", proj)[0] == 0
    (proj / "data" / "corpus.tokenizer.json").rename(proj / "data" / "tokenizer.json")
    monkeypatch.chdir(proj)
    code, out, err = toy_cli("train", *TINY, "--steps", "1", "--run-id", "o", "--json")
    assert code == 0, err
    final = proj / "runs" / "o" / "final"
    assert (final / "tokenizer.json").read_bytes() == (
        proj / "data" / "tokenizer.json"
    ).read_bytes()


def test_default_corpus_is_the_bundled_one(toy_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no toy.toml here: the bundled plays are used
    code, out, err = toy_cli(
        "train",
        "--preset",
        "tiny",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--steps",
        "2",
        "--eval-batches",
        "1",
        "--json",
    )
    assert code == 0, err
    r = json.loads(out)
    assert Path(r["run_dir"]).parent == tmp_path / "runs"
    info = json.loads((Path(r["run_dir"]) / "run.json").read_text())
    assert "bundled" in info["job"]["corpus"]


def test_help_documents_every_flag(toy_cli):
    with pytest.raises(SystemExit) as e:
        toy_cli("train", "--help")
    assert e.value.code == 0


def test_every_train_flag_has_help_text():
    from toy.cli.main import build_parser

    p = build_parser()
    sub = next(a for a in p._actions if a.dest == "command").choices["train"]
    flags = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 30
    for a in flags:
        assert a.help and len(a.help) > 5, a.option_strings
    for needed in (
        "--arch",
        "--corpus",
        "--steps",
        "--seed",
        "--out",
        "--run-id",
        "--json",
        "--device",
        "--preset",
        "--n-layer",
        "--d-model",
        "--n-head",
        "--n-kv-head",
        "--seq-len",
        "--batch-size",
        "--grad-accum",
        "--lr",
        "--min-lr",
        "--warmup",
        "--weight-decay",
        "--clip",
        "--eval-every",
        "--save-every",
    ):
        assert any(needed in a.option_strings for a in flags), needed


# Every subcommand but train (whose flags belong to cmd_train and the recipes).
HELP_CHECKED = (
    "new",
    "prep",
    "train",
    "infer",
    "describe",
    "runs",
    "plot",
    "list",
    "export",
    "fetch",
)


def _subparsers():
    from toy.cli.main import build_parser

    p = build_parser()
    return p, next(a for a in p._actions if a.dest == "command").choices


def test_help_states_every_default():
    import argparse

    _, subs = _subparsers()
    for name in HELP_CHECKED:
        for a in subs[name]._actions:
            if (
                not a.option_strings
                or a.required
                or isinstance(a, (argparse._HelpAction, argparse._StoreTrueAction))
            ):
                continue
            assert a.help and "default" in a.help, (name, a.option_strings, a.help)
    infer_help = subs["infer"].format_help()
    assert "interactive chat" in " ".join(infer_help.split())


def test_no_parser_takes_abbreviations():
    p, subs = _subparsers()
    assert not p.allow_abbrev and all(not s.allow_abbrev for s in subs.values())
    assert p.parse_args(["train", "--steps=5"]).steps == 5


TYPOS = [
    (
        ["train", "--lerning-rate", "1"],
        "unrecognized arguments: --lerning-rate 1; did you mean --learning-rate?",
    ),
    (["train", "--learning_rate", "1"], "did you mean --learning-rate?"),
    (["train", "--step", "5"], "did you mean --steps?"),  # an abbreviation is refused, not taken
    (["train", "--batchsize", "5"], "did you mean --batch-size?"),
    (["train", "--gradient-accumulation-steps", "2"], "did you mean --grad-accum?"),
    (["infer", "--temprature", "0"], "did you mean --temperature?"),
    (["infer", "--temp", "0"], "did you mean --temperature?"),
    (["prep", "x.txt", "--out", "x.bin", "--vocab", "300"], "did you mean --vocab-size?"),
    (["train", "--zqxj-wvu"], "unrecognized arguments: --zqxj-wvu (see"),
    (["trian"], "did you mean 'train'?"),
]


@pytest.mark.parametrize("argv,needle", TYPOS, ids=[" ".join(a) for a, _ in TYPOS])
def test_flag_typos_suggest_a_flag_and_point_to_the_commands_help(argv, needle, capsys):
    from toy.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    cmd = "toy" if argv[0] == "trian" else f"toy {argv[0]}"
    assert err.startswith(f"{cmd}: error:") and err.rstrip().endswith(f"(see `{cmd} --help`)"), err
    if "zqxj" in argv[-1]:
        assert "did you mean" not in err


# ---------------------------------------------------------------- user errors

ERRORS = [
    (["train", "--corpus", "nope/missing.bin"], "nope/missing.bin"),
    (["train", "--recipe", "bogus"], "valid: distill, dpo, from-scratch"),
    (["train", "--arch", "bogus"], "valid: gpt2, llama"),
    (["train", "--preset", "bogus"], "valid:"),
    (["train", "--steps", "0"], "--steps"),
    (["train", "--steps", "x"], "--steps"),
    (["train", "--lr", "-1"], "--lr"),
    (["train", "--run-id", "../escape"], "--run-id"),
    (["train", "--device", "metal"], "metal is only available on macOS"),
    (
        ["train", "--n-head", "3", "--d-model", "64", "--n-kv-head", "3", "--preset", "tiny"],
        "divisible",
    ),
    (["infer", "--run", "no/such/run", "--prompt", "x"], "no/such/run"),
    (["prep", "missing.txt", "--out", "x.bin", "--vocab-size", "300"], "missing.txt"),
    (["prep", "missing.txt", "--out", "x.bin"], "--vocab-size"),
    (["new", "."], "not an empty directory"),
]


@pytest.mark.parametrize("argv,needle", ERRORS, ids=[" ".join(a) for a, _ in ERRORS])
def test_user_errors_exit_2_with_one_line(argv, needle, tmp_path, monkeypatch, capsys):
    import sys

    if "metal" in argv and sys.platform == "darwin":
        pytest.skip("metal exists here")
    from toy.cli.main import main

    monkeypatch.chdir(tmp_path)
    if argv[0] == "new":
        (tmp_path / "occupied").write_text("x")
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists() or not any(
        (tmp_path / "runs").iterdir()
    )  # nothing half-made


def test_seq_len_longer_than_corpus(corpus, toy_cli, tmp_path):
    code, _, err = toy_cli(
        "train", "--corpus", corpus, "--out", tmp_path, "--preset", "tiny", "--seq-len", "100000000"
    )
    assert code == 2 and "--seq-len" in err and "corpus" in err
    assert not any(tmp_path.iterdir())


def test_cuda_absent_exits_2(toy_cli):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    code, _, err = toy_cli("train", "--device", "cuda")
    assert code == 2 and "--device cuda" in err


def test_failed_run_writes_run_failed_and_exits_1(corpus, toy_cli, tmp_path):
    # An absurd learning rate drives the loss to inf/nan within a few steps.
    code, _, err = toy_cli(
        "train",
        "--corpus",
        corpus,
        "--out",
        tmp_path,
        *TINY,
        "--steps",
        "30",
        "--lr",
        "1e6",
        "--min-lr",
        "1e6",
        "--warmup",
        "0",
        "--clip",
        "0",
        "--run-id",
        "boom",
    )
    assert code == 1, err
    assert "loss became" in err
    events = [json.loads(x) for x in (tmp_path / "boom" / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "run_failed" and isinstance(events[-1]["step"], int)
    assert not (tmp_path / "boom" / "final").exists()


def test_the_command_table_matches_each_commands_own_help():
    from toy.cli.main import COMMANDS

    _, subs = _subparsers()
    p = build_parser_all()
    actions = next(a for a in p._actions if a.dest == "command")
    helps = {c.dest: c.help for c in actions._choices_actions}
    assert set(subs) == set(COMMANDS)
    assert {name: helps[name] for name in COMMANDS} == {
        name: h for name, (_, h) in COMMANDS.items()
    }


def build_parser_all():
    from toy.cli.main import build_parser

    return build_parser("all")


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["runs"], ["list"], ["fetch", "--list"], ["new", "p"], ["prep", "--help"]]
    + [["prep", "t.txt", "--vocab-size", "300", "--out", "t.bin"]],
)
def test_quick_commands_never_import_torch(argv, tmp_path):
    """torch takes about a second to import: the commands that only read and write files
    answer without it (startup is timed in docs, not here): `toy new`, and `toy prep` with a
    tokenizer trained or read from a tokenizer.json (the README walk runs seven such). A GGUF's
    tokenizer, and `toy describe`, read a model's family, whose file holds its torch module
    too (a family is one file): they import torch."""
    import subprocess
    import sys

    from toy.data.prep import bundled_text_paths

    (tmp_path / "t.txt").write_text(bundled_text_paths()[0].read_text()[:20000])
    code = (
        "import sys\nfrom toy.cli.main import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert "NO-TORCH" in r.stderr, r.stderr[-2000:]
    if "--help" not in argv and argv[0] in ("new", "prep"):  # and the work was done
        assert "error" not in r.stderr and (tmp_path / argv[-1]).exists(), r.stderr[-2000:]


def test_a_refused_train_never_imports_fsdps_tensors(tmp_path):
    """A mistake in `toy train` is answered before any training: without
    torch.distributed.tensor, which the loop imported at its top for one isinstance check
    (0.5-0.6 s of the 2.3 s a refusal took on a 2-core Zen 4; --fsdp alone needs it)."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom toy.cli.main import main\n"
        "code = main(['train', '--recipe', 'dpo', '--model', 'x.gguf', '--data', 'none'])\n"
        "print(code, 'torch.distributed.tensor' in sys.modules, 'toy.train.loop' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.stdout.split() == ["2", "False", "True"], r.stdout + r.stderr[-2000:]


def test_fit_schedule_caps_the_warmup_and_warns_of_runs_too_short_to_learn():
    from toy.recipes import from_scratch, lora
    from toy.train.run import SHORT_RUN, fit_schedule

    lora_cfg = lora.RECIPE.config()
    default_lr = lora_cfg.lr
    # README's first LoRA line once ran 2 steps inside a 10-step warmup and learned nothing.
    notes = []
    cfg = fit_schedule(lora_cfg.replace(steps=2), notes, default_lr)
    assert cfg.warmup == 0 and "--warmup 10 cut to 0" in notes[0]
    assert notes[1].startswith("warning: 2 optimizer steps is too short") and "--epochs" in notes[1]
    # Long enough: the warmup keeps its 10%, nothing to warn of.
    notes = []
    cfg = fit_schedule(lora_cfg.replace(steps=200), notes, default_lr)
    assert cfg.warmup == 10 and notes == []
    # Short, but with a raised --lr (the README example): a choice, not a mistake.
    notes = []
    fit_schedule(lora_cfg.replace(steps=SHORT_RUN - 5, lr=1e-3), notes, default_lr)
    assert not any(n.startswith("warning:") for n in notes), notes
    notes = []
    fit_schedule(
        from_scratch.RECIPE.config().replace(steps=5),
        notes,
        from_scratch.RECIPE.config().lr,
    )
    assert (
        notes[-1].startswith("warning: 5 optimizer steps") and "--epochs" in notes[-1]
    )  # every recipe takes it


def test_a_short_run_warns_on_stderr_even_with_json(tmp_path):
    from toy.data.prep import bundled_corpus

    r = run_toy(
        "train",
        "--corpus",
        bundled_corpus(),
        "--preset",
        "tiny",
        "--seq-len",
        "16",
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--eval-batches",
        "1",
        "--json",
        "--out",
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "warning: 2 optimizer steps is too short" in r.stderr
    assert json.loads(r.stdout)["format"] == "toy/train-v1"


def test_a_training_process_never_imports_dynamo(tmp_path):
    """A run that compiles nothing never imports torch._dynamo: torch.optim's optimizer
    methods imported it at their first call (1.0-1.2 s of every training process, before its
    first step; a tiny run's whole process 3.6-3.9 s before, 2.2-2.35 s after, on a 2-core
    Zen 4). float32 (foreach AdamW) and bf16 (fused), a resume (the optimizer's state loaded)."""
    import subprocess
    import sys

    from toy.data.prep import bundled_text_paths

    (tmp_path / "t.txt").write_text(bundled_text_paths()[0].read_text()[:20000])
    run = ["train", "--corpus", "c.bin", "--preset", "tiny", "--eval-batches", "1", "--out", "r"]
    run += ["--steps", "2", "--precision"]
    code = (
        "import sys\nfrom toy.cli.main import main\n"
        "codes = [main(['prep', 't.txt', '--out', 'c.bin', '--vocab-size', '300'])]\n"
        f"codes.append(main({run + ['float32', '--run-id', 'a']!r}))\n"
        f"codes.append(main({run + ['bf16', '--run-id', 'b']!r}))\n"
        "codes.append(main(['train', '--resume', 'r/a', '--steps', '3']))\n"
        "print(codes, 'torch._dynamo' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.stdout.split("\n")[-2] == "[0, 0, 0, 0] False", r.stdout[-1000:] + r.stderr[-2000:]
