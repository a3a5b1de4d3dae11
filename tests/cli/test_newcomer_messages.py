"""A user's first hour (issue 35): what a new user trips on, each through the command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import model_dirs  # noqa: E402
from helpers.common import needs_mlx  # noqa: E402
from helpers.model_dirs import hf_model, mlx_dir, mlx_logits, tiny_dir  # noqa: E402

from toy.data.dialogue import conversations, write_jsonl  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402

IDS = torch.randint(3, model_dirs.VOCAB, (1, 30), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("first-hour")
    model_dirs.set_root(root / "models")
    (root / "models").mkdir()
    return write_jsonl(
        conversations(bundled_text_paths(), 60, seed=3, turns=(1, 1), max_chars=80),
        root / "chat.jsonl",
    )


def lora_run(toy_cli, base: Path, chat: Path, out: Path, lr: str = "2e-3") -> Path:
    """A short LoRA run on a directory base with a small, realistic update (a LoRA update is
    about 1e-3 of a weight: far below a 4-bit quantization step)."""
    code, o, err = toy_cli(
        "train",
        "--recipe",
        "lora",
        "--model-path",
        base,
        "--data",
        chat,
        "--out",
        out,
        "--seq-len",
        "384",
        "--batch-size",
        "4",
        "--eval-batches",
        "1",
        "--lr",
        lr,
        "--warmup",
        "0",
        "--steps",
        "4",
        "--targets",
        "q_proj,v_proj,down_proj",
        "--json",
    )
    assert code == 0, err
    return Path(json.loads(o.strip().splitlines()[-1])["run_dir"])


def adapted_logits(run: Path) -> torch.Tensor:
    """toy's own logits for IDS with the run's adapter on its base (float32)."""
    from toy.formats.base_readers import read_base
    from toy.formats.peft import load_peft_adapter
    from toy.lora import apply_lora, load_lora_state_dict

    sd, cfg = load_peft_adapter(run / "final")
    model = read_base(cfg["base_model_name_or_path"], "float32").build_model()
    apply_lora(
        model, sorted({k.rsplit(".", 2)[-2] for k in sd}), cfg["r"], cfg["lora_alpha"], 0.0, seed=0
    )
    load_lora_state_dict(model, sd)
    with torch.no_grad():
        return model(IDS)


# ---------------------------------------------------------------- 35.1: a merge keeps the update


@needs_mlx
def test_an_mlx_merge_keeps_the_fine_tune_by_default(chat, toy_cli, tmp_path):
    base = mlx_dir("llama", 4, 32)
    run = lora_run(toy_cli, base, chat, tmp_path)
    ours, plain = adapted_logits(run), mlx_logits(base, IDS)
    gap = (ours - plain).abs().mean()
    code, out, err = toy_cli("export", run, "--format", "mlx", "--merge", "--out", tmp_path / "m")
    assert code == 0, err
    assert "keep 100% of the adapter's update" in out and "unquantized" in out, out
    merged = mlx_logits(tmp_path / "m", IDS)  # mlx-lm's own loader on the merged directory
    assert (merged - ours).abs().mean() < 0.05 * gap  # the adapted model, not the base
    from mlx_lm import load

    load(str(tmp_path / "m"))  # mlx_lm.load (model and tokenizer) takes it as it is
    # The lossy form, on request: re-quantized to the base's 4 bits, as mlx_lm.fuse does.
    code, out, err = toy_cli(
        "export", run, "--format", "mlx", "--merge", "--dtype", "base", "--out", tmp_path / "q",
        "--json",
    )  # fmt: skip
    assert code == 0, err
    r = json.loads(out)
    assert r["dtype"] == "base" and r["update_kept"] < 0.5, r
    assert any("--dtype base" in n and "4 bits" in n for n in r["notes"]), r["notes"]
    lossy = mlx_logits(tmp_path / "q", IDS)
    assert (lossy - ours).abs().mean() > 0.3 * gap  # much of the update rounded away


def test_a_transformers_merge_on_a_bf16_base_keeps_the_fine_tune(chat, toy_cli, tmp_path):
    base = tiny_dir("llama", dtype="bfloat16")
    run = lora_run(toy_cli, base, chat, tmp_path, lr="2e-4")  # an update bf16 rounds away
    ours = adapted_logits(run)
    with torch.no_grad():
        plain = hf_model(base)(IDS).logits
    gap = (ours - plain).abs().mean()
    code, out, err = toy_cli(
        "export", run, "--format", "transformers", "--merge", "--out", tmp_path / "m", "--json"
    )
    assert code == 0, err
    r = json.loads(out)
    assert r["update_kept"] > 0.99 and r["update_error"] < 0.05, r
    import transformers

    # As a user loads it: the dtype config.json names (float32 now, where the update survives).
    m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype="auto").eval()
    with torch.no_grad():
        merged = m(IDS).logits.float()
    assert (merged - ours).abs().mean() < 0.05 * gap
    code, out, err = toy_cli(
        "export", run, "--format", "transformers", "--merge", "--dtype", "base",
        "--out", tmp_path / "b",
    )  # fmt: skip
    assert code == 0 and "--dtype base" in out and "rounds part of the update away" in out, out


# ---------------------------------------------------------------- 35.8 and 35.9: what a run says

TINY = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    from toy.cli.main import main

    assert main(["prep", str(bundled_text_paths()[0]), "--out", str(d / "c.bin"),
                 "--vocab-size", "400"]) == 0  # fmt: skip
    return d / "c.bin"


def scratch(toy_cli, corpus, out, *extra):
    return toy_cli("train", "--corpus", corpus, "--out", out, *TINY, *extra)


def test_toy_new_suggests_a_run_that_learns(toy_cli, tmp_path):
    from toy.train.run import SHORT_RUN

    code, out, err = toy_cli("new", tmp_path / "p")
    assert code == 0, err
    nxt = next(line for line in out.splitlines() if line.startswith("next:"))
    assert "--steps" in nxt, nxt
    assert int(nxt.split("--steps")[1].split()[0]) >= 10 * SHORT_RUN


def test_the_warmup_cut_is_said_only_of_a_warmup_given(toy_cli, corpus, tmp_path):
    code, out, err = scratch(toy_cli, corpus, tmp_path, "--steps", "4", "--run-id", "a")
    assert code == 0 and "cut to" not in out, out  # the default warmup: nothing to say
    code, out, err = scratch(
        toy_cli, corpus, tmp_path, "--steps", "4", "--warmup", "10", "--run-id", "b"
    )
    assert code == 0 and "--warmup 10 cut to 0" in out, out


def test_infer_base_dtype_help_speaks_of_every_base(toy_cli, capsys):
    with pytest.raises(SystemExit):
        toy_cli("infer", "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "how a GGUF model is held" not in text and "a GGUF file or a model directory" in text
    with pytest.raises(SystemExit):
        toy_cli("train", "--help")
    assert "a token budget" in " ".join(capsys.readouterr().out.split())


def test_a_chat_run_says_its_batch_is_a_token_budget_and_a_bf16_base_is_kept_so(
    chat, toy_cli, tmp_path
):
    code, out, err = toy_cli(
        "train", "--recipe", "lora", "--model-path", tiny_dir("llama", dtype="bfloat16"),
        "--data", chat, "--out", tmp_path, "--seq-len", "128", "--batch-size", "2",
        "--eval-batches", "1", "--steps", "1",
    )  # fmt: skip
    assert code == 0, err
    lines = out.splitlines()
    assert "micro-batches of up to 258 tokens" in lines[0] and "token budget" in lines[0], lines[0]
    base = next(line for line in lines if "base " in line and "GB resident" in line)
    assert "kept in bf16" in base and "held quantized" not in base, base


def test_a_resume_refusal_names_the_file_that_changed(toy_cli, corpus, tmp_path):
    from toy.data.tokens import read_tokens, write_tokens

    mine = tmp_path / "mine.bin"
    for suffix in (".bin", ".val.bin", ".tokenizer.json"):
        src = corpus.with_name("c" + suffix)
        mine.with_name("mine" + suffix).write_bytes(src.read_bytes())
    code, _, err = scratch(toy_cli, mine, tmp_path, "--steps", "2", "--run-id", "r")
    assert code == 0, err
    tf = read_tokens(mine)
    tokens = tf.tokens.copy()
    tokens[:10] = tokens[10:20]
    write_tokens(mine, tokens, tf.vocab_size, tf.tokenizer_hash)
    code, _, err = toy_cli("train", "--resume", tmp_path / "r", "--steps", "4")
    assert code == 2 and str(mine) in err and "corpus_sha256" not in err, err


def test_a_corpus_changed_past_4_mib_is_refused_and_an_older_run_still_resumes(
    toy_cli, corpus, tmp_path
):
    """A run records its corpus's every byte (corpus_sha256, one digest): a token changed
    past 4 MiB, the file's size kept (a corpus re-made in place), is refused on resume
    with one line naming the file. Runs recorded before kept the first 4 MiB's digest,
    some beside every byte's (corpus_sha256_full): those resume on every byte, and the
    oldest on the first 4 MiB alone."""
    import numpy as np

    from toy.data.tokens import read_tokens, write_tokens
    from toy.runs import fingerprint

    big = tmp_path / "big.bin"
    for suffix in (".val.bin", ".tokenizer.json"):
        big.with_name("big" + suffix).write_bytes(corpus.with_name("c" + suffix).read_bytes())
    tf = read_tokens(corpus)
    past = (1 << 22) + 4096  # inside the tokens (an even offset: a low byte), beyond 4 MiB
    write_tokens(big, np.resize(tf.tokens, past // 2 + 64), tf.vocab_size, tf.tokenizer_hash)
    code, _, err = scratch(toy_cli, big, tmp_path, "--steps", "2", "--run-id", "r")
    assert code == 0, err
    run = tmp_path / "r"
    job = json.loads((run / "run.json").read_text())["job"]
    assert len(job["corpus_sha256"]) == 64 and "corpus_sha256_full" not in job

    def flip() -> None:  # one bit of one token id, in place: the size is kept
        with open(big, "r+b") as fh:
            fh.seek(past)
            b = fh.read(1)[0]
            fh.seek(past)
            fh.write(bytes([b ^ 1]))

    def refused() -> None:
        code, _, err = toy_cli("train", "--resume", run, "--steps", "4")
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert str(big) in err and "changed since the run started" in err, err
        assert "sha256" in err and "corpus_sha256" not in err, err

    flip()
    refused()
    info = json.loads((run / "run.json").read_text())
    flip()  # the bytes the run started on again
    full, first = info["job"]["corpus_sha256"], fingerprint(big)
    # As a run recorded with both digests: compared on every byte.
    info["job"].update(corpus_sha256=first, corpus_sha256_full=full)
    (run / "run.json").write_text(json.dumps(info))
    flip()
    refused()
    flip()
    # As a run recorded before every byte was: resumes on its first 4 MiB.
    del info["job"]["corpus_sha256_full"]
    (run / "run.json").write_text(json.dumps(info))
    code, _, err = toy_cli("train", "--resume", run, "--steps", "3")
    assert code == 0, err


def test_prep_says_when_the_vocabulary_falls_short(toy_cli, tmp_path):
    (tmp_path / "t.txt").write_text("the cat sat on the mat. " * 20)
    code, out, err = toy_cli(
        "prep", tmp_path / "t.txt", "--out", tmp_path / "t.bin", "--vocab-size", "1000"
    )
    assert code == 0, err
    assert "--vocab-size 1,000 asked" in out and "only " in out, out


def test_a_mixed_format_file_is_named_in_plain_words(chat, toy_cli, tmp_path):
    data = tmp_path / "mixed.jsonl"
    data.write_text(
        json.dumps({"prompt": "hi", "completion": "there"})
        + "\n"
        + json.dumps(
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
        )  # fmt: skip
        + "\n"
    )
    code, _, err = toy_cli(
        "train", "--recipe", "lora", "--model-path", tiny_dir("llama"), "--data", data,
        "--out", tmp_path, "--steps", "1",
    )  # fmt: skip
    assert code == 2 and 'in a file of {"prompt", "completion"} pairs' in err, err


def test_warm_start_says_which_parameter_count_is_which(toy_cli, tmp_path):
    from helpers.donor import make_donor

    donor = make_donor(tmp_path)
    code, out, err = toy_cli(
        "train", "--recipe", "warm-start", "--donor", donor["gguf"], "--corpus", donor["corpus"],
        "--out", tmp_path, *TINY, "--d-model", "32", "--n-head", "4", "--n-kv-head", "2",
        "--steps", "1",
    )  # fmt: skip
    assert code == 0, err
    note = next(line for line in out.splitlines() if "of the final model's" in line)
    first = next(line for line in out.splitlines() if line.startswith("run "))
    trained = first.split(", ")[1].split()[0]  # "run X: warm-start llama, N parameters, ..."
    assert f"the model trained has {trained}" in note, (first, note)


def test_chat_dash_reads_the_message_from_stdin(toy_cli, monkeypatch):
    import io

    base = tiny_dir("llama")
    opts = ["--temperature", "0", "--max-new-tokens", "8"]
    code, said, err = toy_cli("infer", "--model", base, "--chat", "Who goes there?", *opts)
    assert code == 0, err
    monkeypatch.setattr(sys, "stdin", io.StringIO("Who goes there?\n"))
    code, out, err = toy_cli("infer", "--model", base, "--chat", "-", *opts)
    assert code == 0 and out == said, (out, said)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code, out, err = toy_cli("infer", "--model", base, "--chat", "-", *opts)
    assert code == 2 and "--chat -" in err


def test_a_generation_cut_at_the_context_says_so(toy_cli, corpus, tmp_path):
    code, _, err = scratch(toy_cli, corpus, tmp_path, "--steps", "1", "--run-id", "r")
    assert code == 0, err
    code, out, err = toy_cli(
        "infer", "--run", tmp_path / "r", "--prompt", "To be", "--max-new-tokens", "100",
        "--temperature", "0",
    )  # fmt: skip
    assert code == 0 and "the model's context of 64 tokens is full" in err, err  # tiny: 64


# ---------------------------------------------------------------- 35.7: where models come from


def test_describe_takes_peft_and_mlx_adapter_directories(chat, toy_cli, tmp_path):
    run = lora_run(toy_cli, tiny_dir("llama"), chat, tmp_path)
    for fmt in ("peft", "mlx"):
        code, _, err = toy_cli("export", run, "--format", fmt, "--out", tmp_path / fmt)
        assert code == 0, err
        code, out, err = toy_cli("describe", tmp_path / fmt)
        assert code == 0, err
        assert "rank 8" in out and "self_attn.q_proj x2" in out and "mlp.down_proj x2" in out, out
        code, out, err = toy_cli("describe", tmp_path / fmt, "--json")
        d = json.loads(out)
        assert code == 0 and d["type"] == "adapter" and d["n_matrices"] == 6, d
