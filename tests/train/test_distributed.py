"""Training across processes on torch.distributed (gloo on CPU): 2 processes with a
per-process batch b give the losses of 1 process with batch 2b; torchrun and
`toy train --nproc 2` both work; a DDP run resumes exactly."""

from __future__ import annotations

import json

import pytest
from helpers.common import run_toy
from helpers.distributed import close, torchrun  # noqa: F401

from toy.data.prep import bundled_text_paths

# Processes against one compare losses to 1e-5: float32, where a split batch sums the same
# products (bf16 matmuls round per shape), on every CPU.
TINY = [
    "--precision",
    "float32",
    "--preset",
    "tiny",
    "--seq-len",
    "32",
    "--eval-batches",
    "2",
    "--steps",
    "6",
    "--eval-every",
    "3",
    "--warmup",
    "2",
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


def losses(stdout: str) -> list[float]:
    return [x["loss"] for x in json.loads(stdout.strip().splitlines()[-1])["losses"]]


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    import contextlib
    import io

    from toy.cli.main import main

    out = tmp_path_factory.mktemp("single")
    argv = ["train", "--corpus", corpus, "--out", out, *TINY, "--batch-size", "4", "--json"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # one process: this one
        assert main([str(a) for a in [*argv, "--run-id", "one"]]) == 0
    return losses(printed.getvalue()), json.loads(printed.getvalue().strip())


def test_torchrun_two_processes_match_one(corpus, single, tmp_path):
    r = torchrun(
        "train",
        "--corpus",
        corpus,
        "--out",
        tmp_path,
        *TINY,
        "--batch-size",
        "2",
        "--json",
        "--run-id",
        "two",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])  # rank 0 alone prints
    assert len([ln for ln in r.stdout.splitlines() if ln.startswith("{")]) == 1
    close(losses(r.stdout), single[0])
    close([v["loss"] for v in out["val_losses"]], [v["loss"] for v in single[1]["val_losses"]])
    info = json.loads((tmp_path / "two" / "run.json").read_text())
    assert info["distributed"] == {
        "world_size": 2,
        "backend": "gloo",
        "global_batch": 4,
        "fsdp": False,
        "launcher": "torchrun",
    }
    started = json.loads((tmp_path / "two" / "events.jsonl").read_text().splitlines()[0])
    assert started["world_size"] == 2 and started["global_batch"] == 4


def test_nproc_flag_matches_one(corpus, single, tmp_path):
    r = run_toy(
        "train",
        "--nproc",
        "2",
        "--corpus",
        corpus,
        "--out",
        tmp_path,
        *TINY,
        "--batch-size",
        "2",
        "--json",
        "--run-id",
        "n2",
        env={"OMP_NUM_THREADS": "1", "TOY_DIST_TIMEOUT": "240"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    close(losses(r.stdout), single[0])


def test_grad_accum_across_processes(corpus, single, tmp_path):
    # 2 processes x batch 1 x 2 micro-steps = the same global batch of 4.
    r = torchrun(
        "train",
        "--corpus",
        corpus,
        "--out",
        tmp_path,
        *TINY,
        "--batch-size",
        "1",
        "--grad-accum",
        "2",
        "--json",
        "--run-id",
        "acc",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    close(losses(r.stdout), single[0])


def test_ddp_resume_is_exact(corpus, tmp_path):
    import shutil

    r = torchrun(
        "train",
        "--corpus",
        corpus,
        "--out",
        tmp_path,
        *TINY,
        "--batch-size",
        "2",
        "--json",
        "--run-id",
        "full",
        "--save-every",
        "3",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    full = losses(r.stdout)
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step-000006")
    shutil.rmtree(tmp_path / "cut" / "final")
    r = torchrun("train", "--resume", tmp_path / "cut", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(r.stdout) == full


def test_fsdp_on_gloo_matches_and_resumes(corpus, single, tmp_path, toy_run):
    import shutil

    r = torchrun(
        "train",
        "--corpus",
        corpus,
        "--out",
        tmp_path,
        *TINY,
        "--batch-size",
        "2",
        "--json",
        "--run-id",
        "fsdp",
        "--fsdp",
        "--save-every",
        "3",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    full = losses(r.stdout)
    close(full, single[0], rel=1e-4)  # reduce-scatter sums in another order than one process
    assert json.loads((tmp_path / "fsdp" / "run.json").read_text())["distributed"]["fsdp"] is True
    assert (tmp_path / "fsdp" / "final" / "model.safetensors").is_file()
    # The sharded run's checkpoint holds whole tensors keyed by name: it resumes on another
    # number of processes (here one, no FSDP) and continues the same curve.
    shutil.copytree(tmp_path / "fsdp", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step-000006")
    shutil.rmtree(tmp_path / "cut" / "final")
    r = toy_run("train", "--resume", tmp_path / "cut", "--json")  # one process: this one
    assert r.returncode == 0, r.stderr[-3000:]
    close(losses(r.stdout), full, rel=1e-4)
    r = toy_run("infer", "--run", tmp_path / "fsdp", "--prompt", "the", "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr


def test_nproc_refuses_bad_values(toy_cli, capsys):
    with pytest.raises(SystemExit) as e:
        toy_cli("train", "--nproc", "0")
    assert e.value.code == 2 and "--nproc" in capsys.readouterr().err


# ---------------------------------------------------------------- every recipe under FSDP and DDP


@pytest.fixture(scope="module")
def lora_base(tmp_path_factory):
    """A tiny llama GGUF with a ChatML-aware tokenizer, chat data from the plays, and a
    token corpus made with the model's tokenizer."""
    from helpers.gguf_fixtures import tiny_model, write_llama_gguf

    from toy.cli.main import main
    from toy.data.dialogue import conversations, write_jsonl
    from toy.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("lora")
    text = bundled_text_paths()[0].read_text()[:40000]
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    model = tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True), max_seq_len=256)
    gguf = write_llama_gguf(d / "base.gguf", model, tok)
    chat = write_jsonl(
        conversations(bundled_text_paths(), 40, seed=1, turns=(1, 2), max_chars=150),
        d / "chat.jsonl",
    )
    assert (
        main(
            [
                "prep",
                str(bundled_text_paths()[1]),
                "--out",
                str(d / "t.bin"),
                "--tokenizer",
                str(gguf),
            ]
        )
        == 0
    )
    return {"gguf": gguf, "chat": chat, "tokens": d / "t.bin", "dir": d}


@pytest.fixture(scope="module")
def donor(tmp_path_factory):
    from helpers.donor import make_donor

    return make_donor(tmp_path_factory.mktemp("warm"))


LORA = [
    "--recipe",
    "lora",
    "--seq-len",
    "128",
    "--eval-batches",
    "2",
    "--lr",
    "1e-2",
    "--warmup",
    "0",
    "--steps",
    "4",
]
FSDP_CASES = {
    "gpt2": lambda c, lb, dn: ["--arch", "gpt2", "--corpus", c, *TINY, "--batch-size", "2"],
    "warm-start": lambda c, lb, dn: [
        "--recipe",
        "warm-start",
        "--donor",
        dn["gguf"],
        "--corpus",
        dn["corpus"],
        "--preset",
        "tiny",
        "--seq-len",
        "32",
        "--eval-batches",
        "2",
        "--steps",
        "4",
        "--batch-size",
        "2",
    ],
    "lora-tokens": lambda c, lb, dn: [
        *LORA,
        "--model",
        lb["gguf"],
        "--corpus",
        lb["tokens"],
        "--batch-size",
        "2",
    ],
    "lora-chat": lambda c, lb, dn: [
        *LORA,
        "--model",
        lb["gguf"],
        "--data",
        lb["chat"],
        "--batch-size",
        "2",
    ],
    "vit-tiny": lambda c, lb, dn: [
        "--recipe",
        "vit-tiny",
        "--preset",
        "tiny",
        "--batch-size",
        "8",
        "--steps",
        "4",
        "--eval-batches",
        "2",
    ],
}


@pytest.mark.parametrize("case", list(FSDP_CASES))
def test_fsdp_trains_every_architecture_and_recipe(
    case, corpus, lora_base, donor, tmp_path, toy_run
):
    """FSDP2 on 2 gloo processes: the run finishes with its final/ (GPT-2's head used to be
    re-tied through a llama-only name after the last step) and its losses are the
    one-process run's on the same global batch."""
    argv = FSDP_CASES[case](corpus, lora_base, donor)
    argv = [*argv, "--precision", "float32"]  # 2 processes and 1 agree to 1e-4 in float32
    r = torchrun("train", *argv, "--fsdp", "--json", "--out", tmp_path, "--run-id", "f")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "f" / "final").is_dir() and any((tmp_path / "f" / "final").iterdir())
    batch = argv[argv.index("--batch-size") + 1]
    one = [*argv]
    one[one.index("--batch-size") + 1] = str(2 * int(batch))
    if case == "lora-chat":  # a chat batch is a whole length-grouped batch: 2 per step on 1 process
        one = [*argv, "--grad-accum", "2"]
    s = toy_run("train", *one, "--json", "--out", tmp_path, "--run-id", "s")  # one process
    assert s.returncode == 0, s.stderr[-3000:]
    close(losses(r.stdout), losses(s.stdout), rel=1e-4)


def test_chat_lora_under_ddp_matches_one_process_and_resumes_on_another_world_size(
    lora_base, tmp_path, toy_run
):
    import shutil

    args = [
        *LORA,
        "--model",
        lora_base["gguf"],
        "--data",
        lora_base["chat"],
        "--batch-size",
        "2",
        "--dropout",
        "0.0",
    ]
    r = torchrun(
        "train", *args, "--json", "--out", tmp_path, "--run-id", "two", "--save-every", "2"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    two = losses(r.stdout)
    s = toy_run(  # one process: this one
        "train", *args, "--grad-accum", "2", "--json", "--out", tmp_path, "--run-id", "one"
    )
    assert s.returncode == 0, s.stderr[-3000:]
    close(two, losses(s.stdout))
    # The 2-process run, cut after step 2, resumed on ONE process: the same global batches
    # (2 chat batches a step, now as 2 micro-steps), the same losses.
    shutil.copytree(tmp_path / "two", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step-000004")
    shutil.rmtree(tmp_path / "cut" / "final")
    r = toy_run("train", "--resume", tmp_path / "cut", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = [
        e["loss"]
        for e in map(json.loads, (tmp_path / "cut" / "events.jsonl").read_text().splitlines())
        if e["event"] == "step"
    ][-2:]
    close(resumed, two[2:])
