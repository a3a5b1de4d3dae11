"""`toy train --recipe lora` end to end on a tiny GGUF with a ChatML tokenizer, the
adapter it writes, chat inference on it, exact resume, and each bad input."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from helpers.gguf_fixtures import tiny_model, write_llama_gguf  # noqa: E402

from toy.data.dialogue import conversations, write_jsonl  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402
from toy.runs import read_events  # noqa: E402
from toy.tokenizer import train_bpe  # noqa: E402

COMMON = [
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
def base(tmp_path_factory):
    """A tiny llama GGUF whose tokenizer knows ChatML's <|im_start|>/<|im_end|>, plus a
    chat set of real dialogue from the bundled plays."""
    d = tmp_path_factory.mktemp("lora")
    text = bundled_text_paths()[0].read_text()[:40000]
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    model = tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True), max_seq_len=256)
    path = write_llama_gguf(d / "base.gguf", model, tok)
    chat = write_jsonl(
        conversations(bundled_text_paths(), 60, seed=1, turns=(1, 2), max_chars=150),
        d / "chat.jsonl",
    )
    return {"gguf": path, "chat": chat, "dir": d}


def train(toy_cli, base, out, *extra):
    return toy_cli(
        "train", "--recipe", "lora", "--model", base["gguf"], "--out", out, *COMMON, *extra
    )


def test_chat_lora_end_to_end(base, toy_cli, tmp_path):
    code, out, err = train(
        toy_cli,
        base,
        tmp_path,
        "--data",
        base["chat"],
        "--steps",
        "6",
        "--json",
        "--run-id",
        "l1",
        "--output",
        tmp_path / "copy",
        "--targets",
        "q_proj,v_proj,down_proj",
    )
    assert code == 0, err
    r = json.loads(out)
    assert r["recipe"] == "lora" and [v["step"] for v in r["val_losses"]] == [0, 6]
    losses = [x["loss"] for x in r["losses"]]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1  # it learns (lr 1e-2 on a tiny model)
    final = tmp_path / "l1" / "final"
    cfg = json.loads((final / "adapter_config.json").read_text())
    assert (
        cfg["r"] == 8
        and cfg["lora_alpha"] == 16
        and sorted(cfg["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    )
    from safetensors.torch import load_file

    sd = load_file(final / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in sd
    assert not any("lm_head" in k or "embed" in k for k in sd)  # never the tied output
    assert any(float(v.abs().sum()) > 0 for k, v in sd.items() if "lora_B" in k)  # B moved off zero
    assert (tmp_path / "copy" / "adapter_model.safetensors").is_file()
    code, out, err = toy_cli(
        "infer",
        "--run",
        tmp_path / "l1",
        "--chat",
        "Who is there?",
        "--max-new-tokens",
        "5",
        "--temperature",
        "0",
    )
    assert code == 0, err
    # --adapter takes the adapter directory, or the run directory (its final/), as `toy export`
    # does.
    for adapter in (final, tmp_path / "l1"):
        code, out2, err = toy_cli(
            "infer",
            "--model",
            base["gguf"],
            "--adapter",
            adapter,
            "--chat",
            "Who is there?",
            "--max-new-tokens",
            "5",
            "--temperature",
            "0",
        )
        assert code == 0 and out2 == out, err


def test_training_lowers_held_out_loss(base, toy_cli, tmp_path):
    code, out, err = train(
        toy_cli,
        base,
        tmp_path,
        "--data",
        base["chat"],
        "--steps",
        "25",
        "--json",
        "--rank",
        "16",
        "--targets",
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
    )
    assert code == 0, err
    val = json.loads(out)["val_losses"]
    assert val[-1]["loss"] < val[0]["loss"]


def test_token_stream_lora(base, toy_cli, tmp_path):
    code, _, err = toy_cli(
        "prep", bundled_text_paths()[1], "--out", tmp_path / "c.bin", "--tokenizer", base["gguf"]
    )
    assert code == 0, err
    code, out, err = train(
        toy_cli, base, tmp_path, "--corpus", tmp_path / "c.bin", "--steps", "3", "--json",
        "--run-id", "r",
    )  # fmt: skip
    assert code == 0, err
    assert len(json.loads(out)["val_losses"]) == 2
    # The corpus changed in place, its size kept: the resume names it (the run recorded
    # none of its bytes before), and a run recorded without the fingerprints still resumes.
    corpus, run = tmp_path / "c.bin", tmp_path / "r"
    original = corpus.read_bytes()
    changed = bytearray(original)
    changed[-2:] = original[-4:-2]  # the last token id replaced by the one before it
    assert changed != original
    corpus.write_bytes(bytes(changed))
    code, _, err = toy_cli("train", "--resume", run, "--steps", "4")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert str(corpus) in err and "changed since the run started" in err, err
    corpus.write_bytes(original)
    info = json.loads((run / "run.json").read_text())
    del info["job"]["corpus_sha256"]  # as a run made before it was recorded
    (run / "run.json").write_text(json.dumps(info))
    code, _, err = toy_cli("train", "--resume", run, "--steps", "4")
    assert code == 0, err


def test_resume_is_exact(base, toy_cli, tmp_path):
    args = (
        "--data",
        base["chat"],
        "--steps",
        "4",
        "--save-every",
        "2",
        "--json",
        "--dropout",
        "0.1",
    )
    code, out, err = train(toy_cli, base, tmp_path, *args, "--run-id", "full")
    assert code == 0, err
    full = json.loads(out)["losses"]
    # The same run cut after its step-2 checkpoint, then resumed.
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "full", cut)
    shutil.rmtree(cut / "checkpoints" / "step-000004")
    shutil.rmtree(cut / "final")
    code, out, err = toy_cli("train", "--resume", cut, "--json")
    assert code == 0, err
    # Compare what the resumed segment recomputed (events), not the losses it copied from
    # the checkpoint, and the adapter it ends with: float-exact, dropout RNG included.
    resumed = [e for e in read_events(cut) if e["event"] == "step"][-2:]
    assert [(e["step"], e["loss"]) for e in resumed] == [(x["step"], x["loss"]) for x in full[2:]]
    from safetensors.torch import load_file

    a, b = (
        load_file(tmp_path / "full" / "final" / "adapter_model.safetensors"),
        load_file(cut / "final" / "adapter_model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_epochs_sets_steps(base, toy_cli, tmp_path):
    code, out, err = train(
        toy_cli,
        base,
        tmp_path,
        "--data",
        base["chat"],
        "--epochs",
        "2",
        "--json",
        "--seq-len",
        "256",
        "--batch-size",
        "8",
        "--grad-accum",
        "2",
        "--run-id",
        "c",
    )
    assert code == 0, err
    r = json.loads(out)
    batches = json.loads((tmp_path / "c" / "run.json").read_text())["job"]["batches"]
    assert r["steps"] == 2 * math.ceil(batches / 2) and len(r["losses"]) == r["steps"]
    # A token stream: an epoch is every seq_len window of the corpus once, in rows of
    # --batch-size x --grad-accum, counted here from the file itself.
    code, _, err = toy_cli(
        "prep", bundled_text_paths()[1], "--out", tmp_path / "c.bin", "--tokenizer", base["gguf"]
    )
    assert code == 0, err
    from toy.data.tokens import read_tokens

    n_rows = len(read_tokens(tmp_path / "c.bin")) // 128
    code, out, err = train(
        toy_cli,
        base,
        tmp_path,
        "--corpus",
        tmp_path / "c.bin",
        "--epochs",
        "1",
        "--json",
        "--batch-size",
        "16",
        "--grad-accum",
        "3",
        "--eval-batches",
        "1",
    )
    assert code == 0, err
    assert json.loads(out)["steps"] == math.ceil(n_rows / 48)


BAD = [
    (["--model", "missing.gguf", "--data", "x.jsonl"], "missing.gguf"),
    (["--rank", "0"], "--rank must be >= 1"),
    (["--targets", "q_proj,bogus"], "bogus"),
    (["--targets", "lm_head"], "lm_head"),
    (["--steps", "3", "--epochs", "1"], "conflict"),
    (["--corpus", "c.bin"], "conflict"),
]


@pytest.mark.parametrize("extra,needle", BAD, ids=[b[1] for b in BAD])
def test_bad_lora_requests_exit_2(base, toy_cli, tmp_path, extra, needle):
    argv = ["train", "--recipe", "lora", "--out", tmp_path]
    if "--model" not in extra:
        argv += ["--model", base["gguf"]]
    if "--data" not in extra:
        argv += ["--data", base["chat"]]
    code, _, err = toy_cli(*argv, *extra)
    assert code == 2, err
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not any(tmp_path.iterdir())


def test_default_model_missing_says_how_to_get_it(toy_cli, tmp_path, monkeypatch, base):
    monkeypatch.chdir(tmp_path)
    code, _, err = toy_cli("train", "--recipe", "lora", "--data", base["chat"])
    assert code == 2 and "smollm2-135m.gguf" in err and "toy fetch smollm2" in err


def test_bad_model_files_exit_2(toy_cli, tmp_path, base):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(bytes(range(256)) * 40)
    code, _, err = toy_cli("train", "--recipe", "lora", "--model", junk, "--data", base["chat"])
    assert code == 2 and "junk.gguf" in err
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(base["gguf"].read_bytes()[:5000])
    code, _, err = toy_cli("train", "--recipe", "lora", "--model", cut, "--data", base["chat"])
    assert code == 2 and "cut.gguf" in err


def test_corpus_from_another_tokenizer_exits_2(base, toy_cli, tmp_path):
    code, _, err = toy_cli(
        "prep", bundled_text_paths()[1], "--out", tmp_path / "o.bin", "--vocab-size", "300"
    )
    assert code == 0, err
    code, _, err = train(toy_cli, base, tmp_path / "runs", "--corpus", tmp_path / "o.bin")
    assert code == 2 and "another tokenizer" in err


def test_infer_holds_a_quantized_model_quantized_with_the_same_text(
    base, toy_cli, tmp_path, monkeypatch, capsys
):
    # `toy infer --base-dtype quantized` keeps the file's blocks (the memory of a big GGUF);
    # its weights dequantize to exactly the float32 copy's, so greedy text is the same,
    # with an adapter too. auto picks quantized only where float32 would not fit.
    from toy.cli import cmd_infer
    from toy.formats.gguf import read_gguf_tokenizer

    tok = read_gguf_tokenizer(base["gguf"])
    model = tiny_model(
        seed=5, vocab_size=tok.get_vocab_size(with_added_tokens=True), max_seq_len=256
    )
    q = {
        f"blk.{i}.{n}.weight": "Q8_0"
        for i in range(2)
        for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    }
    gguf = write_llama_gguf(
        tmp_path / "q8.gguf", model, tok, qtypes={**q, "token_embd.weight": "Q8_0"}
    )
    code, _, err = toy_cli(
        "train",
        "--recipe",
        "lora",
        "--model",
        gguf,
        "--out",
        tmp_path,
        *COMMON,
        "--data",
        base["chat"],
        "--steps",
        "2",
        "--run-id",
        "q",
    )
    assert code == 0, err
    texts = {}
    for dtype in ("float32", "quantized"):
        for adapter in ((), ("--adapter", tmp_path / "q")):
            code, out, err = toy_cli(
                "infer",
                "--model",
                gguf,
                *adapter,
                "--prompt",
                "ROMEO.",
                "--max-new-tokens",
                "8",
                "--temperature",
                "0",
                "--base-dtype",
                dtype,
            )
            assert code == 0, err
            texts[dtype, bool(adapter)] = out
    assert texts["float32", False] == texts["quantized", False]
    assert texts["float32", True] == texts["quantized", True]
    # auto: float32 where it fits, quantized (with a note) where it does not, bfloat16 on cuda.
    assert cmd_infer.choose_base_dtype("auto", "cpu", 10**9, 4 * 10**9) == ("float32", "")
    dtype, note = cmd_infer.choose_base_dtype("auto", "cpu", 28 * 10**9, 16 * 10**9)
    assert dtype == "quantized" and "28.0 GB" in note and "--base-dtype float32 overrides" in note
    assert cmd_infer.choose_base_dtype("auto", "cuda", 28 * 10**9, 16 * 10**9)[0] == "bfloat16"
    assert cmd_infer.choose_base_dtype("float32", "cpu", 28 * 10**9, 16 * 10**9)[0] == "float32"
    monkeypatch.setattr(
        cmd_infer, "available_memory", lambda: 1000
    )  # nothing fits: auto holds it quantized
    code, out, err = toy_cli(
        "infer",
        "--model",
        gguf,
        "--prompt",
        "ROMEO.",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
    )
    assert (
        code == 0 and "holding the model quantized" in err and out == texts["quantized", False]
    ), err
