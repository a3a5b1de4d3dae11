"""A run's base changed in place (third review, item 2), through the command line: a
byte changed past a base file's first 4 MiB, its size kept (a base re-merged or
re-quantized in place), is refused by `toy train --resume` and `toy infer --run` with one
line naming the file; a copy of the same bytes at another path still resumes. Both for a
GGUF base and for a model directory's safetensors weights, each larger than 4 MiB (what
the fingerprint read before)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import model_dirs  # noqa: E402
from helpers.gguf_fixtures import tiny_model, write_llama_gguf  # noqa: E402

from toy.data.dialogue import conversations, write_jsonl  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402
from toy.tokenizer import train_bpe  # noqa: E402

FAST = ["--seq-len", "128", "--batch-size", "2", "--warmup", "0", "--eval-batches", "1"]
FAST += ["--targets", "q_proj,v_proj", "--save-every", "1"]
PAST_4_MIB = (1 << 22) + 4096  # inside the tensor data, beyond what the old fingerprint read
INFER = ["--prompt", "hi", "--max-new-tokens", "1"]


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """A GGUF base and a transformers directory, each with weights past 4 MiB (a wide
    feed-forward: 2 layers x 3 x 64 x 4096 float32 = 6.3 MB), and a small chat set."""
    import torch
    import transformers as T

    d = tmp_path_factory.mktemp("base-changed")
    text = bundled_text_paths()[0].read_text()[:20000]
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    n_vocab = tok.get_vocab_size(with_added_tokens=True)
    gguf = write_llama_gguf(
        d / "base.gguf", tiny_model(vocab_size=n_vocab, d_ff=4096, max_seq_len=256), tok
    )

    model_dirs.set_root(d / "made")
    small = model_dirs.tiny_dir("llama")
    cfg = T.LlamaConfig.from_pretrained(small)
    cfg.intermediate_size = 4096
    torch.manual_seed(0)
    hf = d / "tiny-llama"
    T.LlamaForCausalLM(cfg).save_pretrained(hf)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(small / f, hf / f)
    chat = write_jsonl(
        conversations(bundled_text_paths(), 8, seed=1, turns=(1, 1), max_chars=80),
        d / "chat.jsonl",
    )
    assert min(gguf.stat().st_size, (hf / "model.safetensors").stat().st_size) > PAST_4_MIB + 8
    return {"gguf": gguf, "dir": hf, "chat": chat}


def _run(toy_cli, bases, kind: str, tmp_path: Path) -> tuple[Path, Path]:
    """(run dir, base): a 1-step LoRA run on a fresh copy of the `kind` base, with its
    checkpoint to resume from."""
    src = bases[kind]
    base = tmp_path / "models" / src.name
    base.parent.mkdir()
    (shutil.copytree if src.is_dir() else shutil.copy)(src, base)
    code, _, err = toy_cli(
        "train", "--recipe", "lora", "--model", base, "--data", bases["chat"],
        "--out", tmp_path / "runs", "--run-id", "r", "--steps", "1", *FAST,
    )  # fmt: skip
    assert code == 0, err
    return tmp_path / "runs" / "r", base


def _weights(base: Path) -> Path:
    return base / "model.safetensors" if base.is_dir() else base


def _flip(path: Path, pos: int = PAST_4_MIB) -> None:
    """One bit of the byte at `pos` changed in place: the file keeps its size."""
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.seek(pos)
        b = fh.read(1)[0]
        fh.seek(pos)
        fh.write(bytes([b ^ 1]))
    assert path.stat().st_size == size


def _one_line_naming(code: int, err: str, *words) -> None:
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert str(w) in err, (w, err)


@pytest.mark.parametrize("kind", ["gguf", "dir"])
def test_a_base_changed_past_4_mib_is_refused_by_resume_and_infer(kind, bases, toy_cli, tmp_path):
    run, base = _run(toy_cli, bases, kind, tmp_path)
    _flip(_weights(base))
    code, _, err = toy_cli("train", "--resume", run, "--steps", "2")
    _one_line_naming(code, err, base, "changed since the run started")
    assert not (run / "checkpoints" / "step-000002").exists()
    code, _, err = toy_cli("infer", "--run", run, *INFER)
    _one_line_naming(code, err, base, "changed since the run trained")


@pytest.mark.parametrize("kind", ["gguf", "dir"])
def test_a_copy_of_the_base_at_another_path_resumes(kind, bases, toy_cli, tmp_path):
    run, base = _run(toy_cli, bases, kind, tmp_path)
    copy = tmp_path / "elsewhere" / ("copy" + base.suffix)
    copy.parent.mkdir()
    (shutil.copytree if base.is_dir() else shutil.copy)(base, copy)
    _flip(_weights(base))  # the original changed: only the copy holds the run's bytes
    code, _, err = toy_cli("infer", "--run", run, "--model", copy, *INFER)
    assert code == 0, err
    code, _, err = toy_cli("train", "--resume", run, "--steps", "2", "--model", copy)
    assert code == 0, err
    # The run now names the copy, so infer finds it without --model.
    assert json.loads((run / "run.json").read_text())["job"]["model"] == str(copy)
    code, _, err = toy_cli("infer", "--run", run, *INFER)
    assert code == 0, err
    # A base at another path that is not a copy is refused, naming it.
    code, _, err = toy_cli("train", "--resume", run, "--steps", "3", "--model", base)
    _one_line_naming(code, err, base, "is not the base the run started on")


def test_a_run_recorded_with_the_older_fingerprint_still_resumes(bases, toy_cli, tmp_path):
    """Runs made before the fingerprint covered every byte recorded the size and first 4
    MiB: they still resume and infer while that matches (a change past 4 MiB is beyond
    what such a record can see)."""
    from toy.runs import fingerprint

    run, base = _run(toy_cli, bases, "gguf", tmp_path)
    info = json.loads((run / "run.json").read_text())
    info["job"]["model_sha256"] = fingerprint(base)
    (run / "run.json").write_text(json.dumps(info))
    code, _, err = toy_cli("infer", "--run", run, *INFER)
    assert code == 0, err
    code, _, err = toy_cli("train", "--resume", run, "--steps", "2")
    assert code == 0, err
