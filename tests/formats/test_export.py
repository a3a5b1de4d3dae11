"""GGUF / PEFT export: round trips through toy's reader (logits, tokenizer ids), the
LoRA adapter GGUF applied the way llama.cpp applies it (proves the Q/K permutation of
B), the merged model, the PEFT adapter in HF peft on transformers' GGUF load, `toy
export` and `toy list` on the command line, and every bad request (exit 2, one line).

Tolerances (stated, and why):
- f32: bit-identical weights, so logits equal exactly (atol 0).
- f16: each weight within 2**-11 relative (half precision's rounding); logits of the
  tiny random model within 3% of the logits' standard deviation (measured ~1%).
- q8_0: each weight within 0.57 * amax/127 of its 32-block (round-to-nearest with a
  half-precision scale: 0.5 * d + 127 * d * 2**-11); logits within 50% of their std on
  this deliberately high-variance random model (measured 23-28%), and the argmax
  agreeing on >= 90% of positions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.gguf_fixtures import tiny_model  # noqa: E402

from toy.formats.gguf import _load_tensor, read_gguf, unpermute_qk  # noqa: E402
from toy.formats.gguf_header import read_gguf_header  # noqa: E402
from toy.formats.gguf_write import (
    read_lora_gguf,
    tokenizer_metadata,
    write_gpt2_gguf,  # noqa: E402
    write_llama_gguf,
    write_lora_gguf,
    write_merged_gguf,
    write_model_gguf,
)
from toy.lora import apply_lora, load_lora_state_dict, lora_state_dict, merge_lora  # noqa: E402
from toy.tokenizer import from_gguf_metadata, train_bpe  # noqa: E402

CORPUS = (
    Path(__file__).resolve().parents[2]
    / "src"
    / "toy"
    / "data"
    / "assets"
    / "shakespeare"
    / "hamlet.txt"
)
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TEXTS = [
    "To be, or not to be: that is the question.",
    "  leading spaces,\ttabs\tand\n\nnewlines \n ",
    "Digits 1 22 333 4444 55555 and 3.14159; don't won't I'll we've they're",
    "Unicode: café naïve Æsir — “quotes” 日本語 emoji 🙂 ünïcödé",
    "<|endoftext|>special<|endoftext|> in the middle",
    "Punctuation!!! ??? ... ;;; (parens) [brackets] {braces} @#$%^&*",
    "trailing spaces   ",
    "\n",
]


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tok():
    text = CORPUS.read_text()[:30000]
    t = train_bpe([text[i : i + 500] for i in range(0, len(text), 500)], vocab_size=300)
    t.add_special_tokens(["<|im_start|>", "<|im_end|>"])  # ChatML controls
    t.add_tokens(["<sep>"])  # a user-defined (non-special) added token
    return t


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True))


def _ids(tok, text: str = CORPUS.read_text()[2000:2400]) -> torch.Tensor:
    return torch.tensor([tok.encode(text).ids])


def _logits(m, ids):
    with torch.no_grad():
        return m(ids)


# ------------------------------------------------------------------ full model round trips


def test_f32_roundtrip_identical(tmp_path, model, tok):
    rep = write_llama_gguf(tmp_path / "m.gguf", model, tok, dtype="f32")
    assert rep.tensor_types == {"F32": 20} and rep.notes == []
    g = read_gguf(rep.path)
    assert g.arch == "llama" and g.config.tie_embeddings
    for k, v in model.state_dict().items():
        if k != "lm_head.weight":
            assert torch.equal(g.state_dict[k], v), k
    ids = _ids(tok)
    assert torch.equal(_logits(g.build_model(), ids), _logits(model, ids))
    meta = g.metadata
    assert meta["general.architecture"] == "llama" and meta["general.file_type"] == 0
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-2"
    assert meta["llama.rope.dimension_count"] == 16 and meta["llama.attention.head_count_kv"] == 2
    assert (
        not (tmp_path / "m.gguf").with_suffix(".tmp").exists()
        and len(list(tmp_path.iterdir())) == 1
    )


def test_untied_output_written(tmp_path, tok):
    m = tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True), tie_embeddings=False)
    rep = write_llama_gguf(tmp_path / "u.gguf", m, tok)
    h = read_gguf_header(rep.path)
    assert "output.weight" in h.tensors
    g = read_gguf(rep.path)
    assert not g.config.tie_embeddings
    ids = _ids(tok)
    assert torch.equal(_logits(g.build_model(), ids), _logits(m, ids))


def test_qk_rows_are_permuted_in_the_file(tmp_path, model, tok):
    """The file holds llama.cpp's interleaved Q/K rows, not toy's: written like the
    converter (tests/helpers/gguf_fixtures.converter_permute, written independently)."""
    from helpers.gguf_fixtures import converter_permute

    rep = write_llama_gguf(tmp_path / "m.gguf", model, tok)
    h = read_gguf_header(rep.path)
    buf = np.memmap(rep.path, dtype=np.uint8, mode="c")
    q = _load_tensor(buf, h.tensors["blk.1.attn_q.weight"]).numpy()
    k = _load_tensor(buf, h.tensors["blk.1.attn_k.weight"]).numpy()
    sd = model.state_dict()
    np.testing.assert_array_equal(
        q, converter_permute(sd["layers.1.self_attn.q_proj.weight"].numpy(), 4)
    )
    np.testing.assert_array_equal(
        k, converter_permute(sd["layers.1.self_attn.k_proj.weight"].numpy(), 2)
    )


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_lossy_dtypes_within_tolerance(tmp_path, model, tok, dtype):
    rep = write_llama_gguf(tmp_path / f"m-{dtype}.gguf", model, tok, dtype=dtype)
    # llama.cpp's convention: every 1-D tensor (norms) stays f32.
    assert rep.tensor_types["F32"] == 5 and rep.tensor_types[dtype.upper()] == 15
    g = read_gguf(rep.path)
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue
        got, want = g.state_dict[k], v.float()
        if v.dim() == 1:
            assert torch.equal(got, want), k
        elif dtype == "f16":
            assert torch.all((got - want).abs() <= want.abs() * 2.0**-11 + 1e-7), k
        else:
            amax = want.reshape(want.shape[0], -1, 32).abs().amax(-1, keepdim=True)
            err = (got - want).reshape(want.shape[0], -1, 32).abs()
            assert torch.all(err <= 0.57 * amax / 127 + 1e-8), k
    ids = _ids(tok)
    ref, out = _logits(model, ids), _logits(g.build_model(), ids)
    rel = float((out - ref).abs().max() / ref.std())
    assert rel < (0.03 if dtype == "f16" else 0.5), rel
    assert float((out.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9


def test_q8_0_falls_back_to_f16_for_short_rows(tmp_path, tok):
    m = tiny_model(
        vocab_size=tok.get_vocab_size(with_added_tokens=True), d_ff=48
    )  # ffn_down rows: 48
    rep = write_llama_gguf(tmp_path / "q.gguf", m, tok, dtype="q8_0")
    assert rep.tensor_types == {"Q8_0": 13, "F32": 5, "F16": 2}
    assert any("ffn_down" in n and "f16" in n for n in rep.notes)
    h = read_gguf_header(rep.path)
    assert h.tensors["blk.0.ffn_down.weight"].qtype.name == "F16"
    assert h.tensors["blk.0.ffn_up.weight"].qtype.name == "Q8_0"


def test_tokenizer_roundtrip_same_ids(tmp_path, model, tok):
    rep = write_llama_gguf(tmp_path / "m.gguf", model, tok)
    meta = read_gguf_header(rep.path).metadata
    back = from_gguf_metadata(meta)
    for text in TEXTS + [CORPUS.read_text()[5000:9000]]:
        assert back.encode(text).ids == tok.encode(text).ids, text
        assert back.decode(tok.encode(text).ids) == tok.decode(tok.encode(text).ids)
    types = meta["tokenizer.ggml.token_type"]
    vocab = tok.get_vocab(with_added_tokens=True)
    assert types[vocab["<|endoftext|>"]] == 3 and types[vocab["<|im_end|>"]] == 3  # control
    assert types[vocab["<sep>"]] == 4  # user-defined
    assert meta["tokenizer.ggml.eos_token_id"] == vocab["<|endoftext|>"]
    assert meta["tokenizer.ggml.add_bos_token"] is False


def test_tokenizer_padded_to_embedding_rows(tok):
    n = tok.get_vocab_size(with_added_tokens=True)
    kv, notes = tokenizer_metadata(tok, n + 5)
    assert len(kv["tokenizer.ggml.tokens"]) == n + 5 and kv["tokenizer.ggml.token_type"][-1] == 5
    assert notes and "padded" in notes[0]
    from toy.errors import UsageError

    with pytest.raises(UsageError, match="embedding rows"):
        tokenizer_metadata(tok, n - 1)


def test_unexportable_tokenizer_is_named(tmp_path, model):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from toy.errors import UsageError

    wp = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(UsageError, match="not BPE"):
        write_llama_gguf(tmp_path / "x.gguf", model, wp)
    assert not any(tmp_path.iterdir())


def test_failed_write_leaves_old_file_and_no_temp(tmp_path, model, tok, monkeypatch):
    import gguf

    path = tmp_path / "m.gguf"
    write_llama_gguf(path, model, tok)
    before = path.read_bytes()

    def boom(self, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", boom)
    with pytest.raises(OSError):
        write_llama_gguf(path, model, tok, dtype="f16")
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_gpt2_roundtrip(tmp_path, tok):
    """toy's GPT2 as llama.cpp's gpt2 architecture: read back tensor by tensor (toy's
    reader runs llama-family files only) and rebuilt: identical logits."""
    from toy.formats.gguf_write import gpt2_tensor_map
    from toy.models.gpt2 import GPT2, GPT2Config

    n = tok.get_vocab_size(with_added_tokens=True)
    for bias in (True, False):
        torch.manual_seed(0)
        m = GPT2(
            GPT2Config(vocab_size=n, n_layer=2, d_model=64, n_head=4, max_seq_len=64, bias=bias)
        ).eval()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        rep = write_model_gguf(tmp_path / f"g{bias}.gguf", m, tok)
        h = read_gguf_header(rep.path)
        assert (
            h.metadata["general.architecture"] == "gpt2" and h.metadata["gpt2.context_length"] == 64
        )
        assert h.tensors["blk.0.attn_qkv.weight"].ne == (64, 192)  # GGUF ne [in, out]
        assert h.tensors["position_embd.weight"].ne == (64, 64) and "output.weight" not in h.tensors
        buf = np.memmap(rep.path, dtype=np.uint8, mode="c")
        sd = {t: _load_tensor(buf, h.tensors[g]) for g, t in gpt2_tensor_map(m.cfg).items()}
        back = GPT2(
            GPT2Config(vocab_size=n, n_layer=2, d_model=64, n_head=4, max_seq_len=64, bias=True)
        ).eval()
        back.load_state_dict(sd, strict=False)
        ids = _ids(tok, "To be, or not to be")
        assert torch.equal(_logits(back, ids), _logits(m, ids))
        if not bias:
            assert any("zero biases" in n for n in rep.notes)


def test_vit_is_refused(tmp_path):
    from toy.errors import UsageError
    from toy.models.registry import build_model

    vit = build_model(_vit_cfg())
    with pytest.raises(UsageError, match="vit"):
        write_model_gguf(tmp_path / "v.gguf", vit, None)
    assert not any(tmp_path.iterdir())


def _vit_cfg():
    from toy.models.vit import VitConfig

    return VitConfig(
        image_size=28, patch_size=7, n_layer=1, d_model=32, n_head=2, d_ff=64, n_classes=3
    )


# ------------------------------------------------------------------ LoRA adapter GGUF


def _adapted(model, rank=4, alpha=8.0, seed=1):
    """A copy of `model` with LoRA on every projection and large random A and B (a
    trained B is small; a big one makes a wrong permutation impossible to miss)."""
    import copy

    m = copy.deepcopy(model)
    apply_lora(m, ALL_TARGETS, rank, alpha, 0.0, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _k, p in lora_state_dict(m).items():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def test_lora_gguf_applied_like_llamacpp_equals_toy_merge(tmp_path, model, tok):
    """llama.cpp computes W x + (alpha/r) B (A x) on the FILE's tensors. Do that on the
    base file's (permuted) weights and the adapter file's A/B, un-permute, and compare
    with toy's own merge: equal only if B's rows were permuted like the base's."""
    base_path = write_llama_gguf(tmp_path / "base.gguf", model, tok).path
    rank, alpha = 4, 8.0
    adapted = _adapted(model, rank, alpha)
    lsd = {k: v.clone() for k, v in lora_state_dict(adapted).items()}
    rep = write_lora_gguf(tmp_path / "a.gguf", lsd, alpha=alpha, base=model.cfg)
    assert rep.tensor_types == {"F32": 2 * 7 * 2}

    h = read_gguf_header(rep.path)
    assert h.metadata["general.type"] == "adapter" and h.metadata["adapter.type"] == "lora"
    assert (
        h.metadata["general.architecture"] == "llama" and h.metadata["adapter.lora.alpha"] == alpha
    )
    base_h = read_gguf_header(base_path)
    for stem in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight"):
        a, b, w = (
            h.tensors[stem + ".lora_a"].ne,
            h.tensors[stem + ".lora_b"].ne,
            base_h.tensors[stem].ne,
        )
        # llama-adapter.cpp's checks, in GGUF ne order.
        assert w[0] == a[0] and w[1] == b[1] and a[1] == b[0] == rank

    ad = read_lora_gguf(rep.path, model.cfg)
    assert ad.rank == rank and ad.alpha == alpha and ad.arch == "llama"
    for k, v in lsd.items():
        assert torch.equal(ad.lora_sd[k], v), k  # reader undoes exactly what the writer did

    merged = merge_lora(_adapted(model, rank, alpha)).state_dict()
    buf = np.memmap(base_path, dtype=np.uint8, mode="r")
    names = {
        "attn_q": ("self_attn.q_proj", 4),
        "attn_k": ("self_attn.k_proj", 2),
        "attn_v": ("self_attn.v_proj", 0),
        "attn_output": ("self_attn.o_proj", 0),
        "ffn_gate": ("mlp.gate_proj", 0),
        "ffn_up": ("mlp.up_proj", 0),
        "ffn_down": ("mlp.down_proj", 0),
    }
    naive_differs = False
    for stem, (a, b) in ad.pairs.items():
        _, i, kind, _ = stem.split(".")
        toy_name, heads = names[kind]
        w_file = _load_tensor(buf, base_h.tensors[stem]).double()
        w_new = w_file + (alpha / rank) * (b.double() @ a.double())  # what llama.cpp computes
        if heads:
            w_new = unpermute_qk(w_new, heads)
        want = merged[f"layers.{i}.{toy_name}.weight"].double()
        torch.testing.assert_close(w_new, want, rtol=0, atol=1e-5, msg=stem)
        if heads:  # the same check with B left in toy's order must fail: the test can tell
            bad = unpermute_qk(
                w_file
                + (alpha / rank) * (lsd[f"layers.{i}.{toy_name}.lora_B"].double() @ a.double()),
                heads,
            )
            naive_differs |= not torch.allclose(bad, want, atol=1e-3)
    assert naive_differs


def test_lora_gguf_refuses_what_llamacpp_cannot_take(tmp_path, model):
    from toy.errors import UsageError

    lsd = lora_state_dict(_adapted(model))
    with pytest.raises(UsageError, match="q8_0"):
        write_lora_gguf(tmp_path / "a.gguf", lsd, alpha=8, base=model.cfg, dtype="q8_0")
    bad = dict(lsd)
    bad["lm_head.lora_A"] = torch.zeros(4, 64)
    bad["lm_head.lora_B"] = torch.zeros(300, 4)
    with pytest.raises(UsageError, match="mishandles an adapter on a tied output"):
        write_lora_gguf(tmp_path / "a.gguf", bad, alpha=8, base=model.cfg)
    wrong = tiny_model(vocab_size=300, d_model=32, n_head=2, n_kv_head=1)
    with pytest.raises(UsageError, match="do not fit"):
        write_lora_gguf(tmp_path / "a.gguf", lsd, alpha=8, base=wrong.cfg)
    assert not any(tmp_path.iterdir())


def test_merged_gguf_equals_toy_base_plus_adapter(tmp_path, model, tok):
    base_path = write_llama_gguf(
        tmp_path / "base.gguf", model, tok, dtype="q8_0"
    ).path  # a quantized base
    base = read_gguf(base_path)
    lsd = lora_state_dict(_adapted(model))
    rep = write_merged_gguf(tmp_path / "merged.gguf", base, lsd, rank=4, alpha=8.0, dtype="f32")
    merged = read_gguf(rep.path)
    assert merged.metadata["tokenizer.ggml.tokens"] == base.metadata["tokenizer.ggml.tokens"]
    assert merged.chat_template == base.chat_template
    ref = base.build_model()
    apply_lora(ref, ALL_TARGETS, 4, 8.0, 0.0, seed=0)
    load_lora_state_dict(ref, lsd)
    ids = _ids(tok)
    # The file holds toy's merged weights bit for bit: merging toy-side gives equal logits.
    assert torch.equal(_logits(merged.build_model(), ids), _logits(merge_lora(ref), ids))
    # Against the unmerged forward (W x + s B A x) only rounding differs; with these
    # deliberately large B (0.3, vs ~1e-3 trained) that is up to ~1e-4 (the CLI test below
    # holds a trained adapter to 1e-5).
    ref = base.build_model()
    apply_lora(ref, ALL_TARGETS, 4, 8.0, 0.0, seed=0)
    load_lora_state_dict(ref, lsd)
    torch.testing.assert_close(
        _logits(merged.build_model(), ids), _logits(ref, ids), rtol=0, atol=3e-4
    )


# ------------------------------------------------------------------ the command line


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tok, model):
    """A real `toy train --recipe lora` run on a tiny GGUF base (ChatML tokenizer and
    template), a few steps at a high rate so B moves well off zero."""
    from helpers.gguf_fixtures import write_llama_gguf as fixture_write

    from toy.cli.main import main
    from toy.data.dialogue import conversations, write_jsonl
    from toy.data.prep import bundled_text_paths

    d = tmp_path_factory.mktemp("lora-run")
    base = fixture_write(
        d / "base.gguf",
        tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True), max_seq_len=256),
        tok,
    )
    chat = write_jsonl(
        conversations(bundled_text_paths(), 30, seed=1, turns=(1, 2), max_chars=150), d / "c.jsonl"
    )
    code = main(
        [
            "train",
            "--recipe",
            "lora",
            "--model",
            str(base),
            "--data",
            str(chat),
            "--out",
            str(d / "runs"),
            "--run-id",
            "l1",
            "--steps",
            "3",
            "--seq-len",
            "128",
            "--batch-size",
            "2",
            "--eval-batches",
            "1",
            "--lr",
            "3e-2",
            "--warmup",
            "0",
            "--targets",
            ",".join(ALL_TARGETS),
            "--rank",
            "4",
            "--json",
        ]
    )
    assert code == 0
    return {"run": d / "runs" / "l1", "base": base}


def _toy_with_adapter(base_path: Path, adapter_dir: Path):
    from toy.formats.peft import load_peft_adapter

    base = read_gguf(base_path)
    m = base.build_model()
    sd, cfg = load_peft_adapter(adapter_dir)
    apply_lora(
        m, sorted({k.rsplit(".", 2)[-2] for k in sd}), cfg["r"], cfg["lora_alpha"], 0.0, seed=0
    )
    load_lora_state_dict(m, sd)
    return m.eval(), sd, cfg


def test_cli_export_lora_run_all_formats(lora_run, toy_cli, tmp_path, tok):
    run = lora_run["run"]
    ref, sd, cfg = _toy_with_adapter(lora_run["base"], run / "final")
    ids = _ids(tok)

    code, out, err = toy_cli("export", run, "--format", "gguf", "--merge", "--json")
    assert code == 0, err
    r = json.loads(out)
    # --merge defaults to keep: the base's bytes, adapted tensors f32 on this f32 base (f16 on
    # others)
    assert r["format"] == "toy/export-v1" and r["dtype"] == "keep" and r["merged"]
    assert Path(r["path"]) == run / "export" / "l1-merged-keep.gguf" and r["tensor_types"] == {
        "F32": 20
    }
    merged = read_gguf(r["path"])
    # Merging rounds W + s*B@A once in float32: agreement to float32 rounding, not bits.
    torch.testing.assert_close(
        _logits(merged.build_model(), ids), _logits(ref, ids), rtol=1e-5, atol=1e-5
    )

    code, out, err = toy_cli("export", run, "--format", "gguf-lora", "--out", tmp_path / "a.gguf")
    assert code == 0, err
    assert f"wrote {tmp_path / 'a.gguf'}" in out and "LoRA adapter" in out
    ad = read_lora_gguf(tmp_path / "a.gguf", merged.config)
    assert ad.alpha == cfg["lora_alpha"] and ad.rank == cfg["r"]
    assert ad.lora_sd.keys() == sd.keys() and all(torch.equal(ad.lora_sd[k], sd[k]) for k in sd)

    code, out, err = toy_cli(
        "export", run / "final", "--format", "peft", "--out", tmp_path / "peft"
    )
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
    ]
    assert (tmp_path / "peft" / "adapter_model.safetensors").read_bytes() == (
        run / "final" / "adapter_model.safetensors"
    ).read_bytes()

    code, out, err = toy_cli(
        "export",
        run,
        "--format",
        "gguf",
        "--merge",
        "--dtype",
        "q8_0",
        "--out",
        tmp_path / "q.gguf",
    )
    assert code == 0, err
    assert read_gguf_header(tmp_path / "q.gguf").metadata["general.file_type"] == 7


def test_an_ollama_modelfile_beside_every_gguf(lora_run, toy_cli, tmp_path):
    """`toy export --format gguf` (merged) and `gguf-lora` write FILE.Modelfile beside the
    GGUF: FROM the model (a LoRA GGUF: FROM its base, ADAPTER the adapter), the base's EOS
    and turn markers as PARAMETER stop, and its ChatML template in Ollama's Go syntax; the
    --json record and the text name it."""
    run, base = lora_run["run"], lora_run["base"]
    code, out, err = toy_cli("export", run, "--format", "gguf", "--merge", "--out",
                             tmp_path / "m.gguf")  # fmt: skip
    assert code == 0 and f"ollama create NAME -f {tmp_path / 'm.Modelfile'}" in out, err
    text = (tmp_path / "m.Modelfile").read_text().splitlines()
    assert text[1] == "FROM ./m.gguf"
    assert 'PARAMETER stop "<|im_end|>"' in text
    assert any(x.startswith('TEMPLATE """{{- range .Messages }}<|im_start|>') for x in text)
    code, out, err = toy_cli("export", run, "--format", "gguf-lora", "--out", tmp_path / "a.gguf",
                             "--json")  # fmt: skip
    assert code == 0, err
    mf = Path(json.loads(out)["modelfile"])
    assert mf == tmp_path / "a.Modelfile"
    text = mf.read_text().splitlines()
    assert text[1:3] == [f"FROM {base.resolve()}", "ADAPTER ./a.gguf"]
    assert 'PARAMETER stop "<|im_end|>"' in text
    mine = tmp_path / "b.Modelfile"  # a user's own file of that name is left alone
    mine.write_text("FROM llama3\n")
    code, out, err = toy_cli("export", run, "--format", "gguf-lora", "--out", tmp_path / "b.gguf")
    assert code == 0 and "not one toy wrote" in out, err
    assert mine.read_text() == "FROM llama3\n"


def test_cli_lora_base_override_and_missing_base(lora_run, toy_cli, tmp_path):
    import shutil

    run = tmp_path / "moved"
    shutil.copytree(lora_run["run"], run)
    cfg_path = run / "final" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = str(tmp_path / "gone.gguf")
    cfg_path.write_text(json.dumps(cfg))
    code, _, err = toy_cli("export", run, "--format", "gguf-lora")
    assert (
        code == 2 and "gone.gguf" in err and "--model" in err and len(err.strip().splitlines()) == 1
    )
    code, out, err = toy_cli("export", run, "--format", "gguf-lora", "--model", lora_run["base"])
    assert code == 0, err
    # A different file as the base: refused when it comes from the run, noted when forced with
    # --model.
    other = tmp_path / "other.gguf"
    other.write_bytes(lora_run["base"].read_bytes()[:-4] + b"\0\0\0\1")
    cfg["base_model_name_or_path"] = str(other)
    cfg_path.write_text(json.dumps(cfg))
    code, _, err = toy_cli("export", run, "--format", "gguf-lora")
    assert code == 2 and "changed since the run trained" in err
    # (the default path holds the export above: replaced only with --force)
    code, out, err = toy_cli("export", run, "--format", "gguf-lora", "--model", other, "--force")
    assert code == 0 and "not the file the adapter was trained on" in out


def test_peft_adapter_loads_in_hf_peft_on_transformers_gguf(lora_run, tmp_path, tok):
    """The exported PEFT directory on transformers' own GGUF load of the base gives
    toy's base+adapter logits."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from toy.cli.main import main

    assert (
        main(["export", str(lora_run["run"]), "--format", "peft", "--out", str(tmp_path / "peft")])
        == 0
    )
    base = lora_run["base"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(base.parent), gguf_file=base.name
    ).eval()
    pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "peft")).eval()
    ref, _, _ = _toy_with_adapter(base, tmp_path / "peft")
    ids = _ids(tok)
    with torch.no_grad():
        got = pm(ids).logits
    want = _logits(ref, ids)
    assert (
        float((want - _logits(read_gguf(base).build_model(), ids)).abs().max()) > 1e-3
    )  # the adapter matters
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def scratch_run(tmp_path_factory):
    """A from-scratch llama run (tiny preset, a few steps) made with the CLI."""
    from toy.cli.main import main
    from toy.data.prep import bundled_text_paths

    d = tmp_path_factory.mktemp("scratch")
    assert (
        main(
            ["prep", str(bundled_text_paths()[0]), "--out", str(d / "c.bin"), "--vocab-size", "400"]
        )
        == 0
    )
    assert (
        main(
            [
                "train",
                "--corpus",
                str(d / "c.bin"),
                "--out",
                str(d / "runs"),
                "--run-id",
                "s1",
                "--preset",
                "tiny",
                "--batch-size",
                "4",
                "--seq-len",
                "32",
                "--eval-batches",
                "1",
                "--steps",
                "4",
            ]
        )
        == 0
    )
    return d / "runs" / "s1"


def test_cli_export_from_scratch_run(scratch_run, toy_cli, tmp_path):
    from toy.formats.model_dir import load_model_dir

    model, _, tok = load_model_dir(scratch_run / "final")
    ids = torch.tensor([tok.encode("Though this be madness, yet there is method in't.").ids])
    for dtype in ("f32", "f16", "q8_0"):
        code, out, err = toy_cli("export", scratch_run, "--format", "gguf", "--dtype", dtype)
        assert code == 0, err
        path = scratch_run / "export" / f"s1-{dtype}.gguf"
        assert f"wrote {path}" in out
        g = read_gguf(path)
        if dtype == "f32":
            assert torch.equal(_logits(g.build_model(), ids), _logits(model, ids))
        back = from_gguf_metadata(g.metadata)
        for text in TEXTS:
            assert back.encode(text).ids == tok.encode(text).ids
    code, out, err = toy_cli("export", scratch_run, "--format", "gguf", "--out", tmp_path, "--json")
    assert code == 0 and json.loads(out)["path"] == str(tmp_path / "s1-f32.gguf")


def _one_line_exit_2(code, err, *needles):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err


def test_bad_requests_exit_2(scratch_run, lora_run, toy_cli, tmp_path, capsys):
    # a vit run (only its config is read before refusing)
    vit = tmp_path / "vit-run" / "final"
    vit.mkdir(parents=True)
    (vit / "config.json").write_text(json.dumps({"model": {"arch": "vit"}, "recipe": "vit-tiny"}))
    (vit / "model.safetensors").write_bytes(b"")
    code, _, err = toy_cli("export", vit.parent, "--format", "gguf")
    _one_line_exit_2(code, err, "vit", "GGUF")
    with pytest.raises(SystemExit) as exc:  # argparse's choices: the parser exits itself
        toy_cli("export", scratch_run, "--format", "onnx")
    _one_line_exit_2(exc.value.code, capsys.readouterr().err, "--format", "onnx", "gguf-lora")
    nofinal = tmp_path / "unfinished"
    (nofinal / "checkpoints").mkdir(parents=True)
    code, _, err = toy_cli("export", nofinal, "--format", "gguf")
    _one_line_exit_2(code, err, "no final/", "--resume")
    code, _, err = toy_cli("export", tmp_path / "missing", "--format", "gguf")
    _one_line_exit_2(code, err, "missing", "no such run")
    code, _, err = toy_cli("export", scratch_run, "--format", "gguf-lora")
    _one_line_exit_2(code, err, "gguf-lora needs a LoRA run")
    code, _, err = toy_cli("export", scratch_run, "--format", "gguf", "--merge")
    _one_line_exit_2(code, err, "--merge")
    code, _, err = toy_cli("export", scratch_run, "--format", "peft")
    _one_line_exit_2(code, err, "peft", "LoRA")
    code, _, err = toy_cli("export", lora_run["run"], "--format", "gguf")
    _one_line_exit_2(code, err, "--format gguf-lora", "--merge")
    code, _, err = toy_cli("export", lora_run["run"], "--format", "gguf-lora", "--dtype", "q8_0")
    _one_line_exit_2(code, err, "q8_0", "f16")
    code, _, err = toy_cli("export", lora_run["run"], "--format", "peft", "--merge")
    _one_line_exit_2(code, err, "--merge")
    with pytest.raises(SystemExit) as exc:
        toy_cli("export", scratch_run, "--format", "gguf", "--dtype", "q4_0")
    _one_line_exit_2(exc.value.code, capsys.readouterr().err, "--dtype", "q8_0")
    assert not (tmp_path / "vit-run" / "export").exists()


# ------------------------------------------------------------------ toy describe


def test_describe_a_lora_adapter_gguf(tmp_path, model, tok, toy_cli):
    """`toy describe adapter.gguf` used to refuse it as a model it could not load."""
    path = tmp_path / "adapter.gguf"
    write_lora_gguf(
        path, lora_state_dict(_adapted(model, rank=4)), alpha=8, base=model.cfg, name="mine"
    )
    code, out, err = toy_cli("describe", path)
    assert code == 0, err
    assert out.endswith("\n") and not out.endswith("\n\n")
    n = model.cfg.n_layer
    assert (
        "adapter       LoRA adapter for a llama base: rank 4, alpha 8 "
        "(update scaled by alpha/rank = 2)" in out
    )
    assert f"attn_q x{n}, attn_v x{n}" in out and f"({7 * n} matrices in {n} layers)" in out
    assert "name          mine" in out and "--lora" in out
    code, out, err = toy_cli("describe", path, "--json")
    d = json.loads(out)
    assert (d["format"], d["type"], d["adapter_type"], d["arch"]) == (
        "toy/describe-v1",
        "adapter",
        "lora",
        "llama",
    )
    assert (d["rank"], d["alpha"], d["n_layers"], d["n_matrices"]) == (4, 8.0, n, 7 * n)
    assert set(d["targets"]) == {
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_output.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
        "ffn_down.weight",
    }
    assert d["problems"] == [] and d["n_tensors"] == 14 * n


def test_describe_an_adapter_llamacpp_could_not_apply(tmp_path, toy_cli):
    import gguf

    path = tmp_path / "half.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_tensor(
        "blk.0.attn_q.weight.lora_a", np.zeros((4, 16), dtype=np.float32)
    )  # no lora_b, no alpha
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    code, out, err = toy_cli("describe", path)
    assert "adapter" in out and "no adapter.lora.alpha" in out  # described first
    _one_line_exit_2(code, err, "blk.0.attn_q.weight has lora_a without lora_b")


def test_describe_a_model_ends_with_a_newline(tmp_path, model, tok, toy_cli):
    write_llama_gguf(tmp_path / "m.gguf", model, tok, name="m")
    code, out, err = toy_cli("describe", tmp_path / "m.gguf")
    assert code == 0, err
    assert out.endswith("chat template yes\n") or out.endswith("chat template no\n")
    assert "LoRA base     " in out  # the label column lines up with the others


# ------------------------------------------------------------------ toy list


def test_toy_list(scratch_run, lora_run, toy_cli, tmp_path, monkeypatch, model, tok):
    import shutil

    proj = tmp_path / "proj"
    (proj / "data" / "sub").mkdir(parents=True)
    (proj / "toy.toml").write_text("")
    write_llama_gguf(proj / "data" / "good.gguf", model, tok, name="good")
    (proj / "data" / "sub" / "broken.gguf").write_bytes(b"GGUF\3\0\0\0" + b"\xff" * 40)
    write_lora_gguf(
        proj / "data" / "adapter.gguf", lora_state_dict(_adapted(model)), alpha=8, base=model.cfg
    )
    write_gpt2_gguf(proj / "data" / "g2.gguf", _tiny_gpt2(tok), tok)
    shutil.copytree(scratch_run, proj / "runs" / "s1")
    failed = proj / "runs" / "f1"
    failed.mkdir(parents=True)
    (failed / "run.json").write_text(json.dumps({"recipe": "lora", "arch": "llama", "params": 10}))
    (failed / "events.jsonl").write_text(
        json.dumps({"event": "run_failed", "error": "non-finite loss at step 3"})
    )
    broken_run = proj / "runs" / "b1"
    broken_run.mkdir()
    (broken_run / "run.json").write_text("{not json")
    monkeypatch.chdir(proj)
    shutil.rmtree(proj / "runs" / "s1" / "export", ignore_errors=True)
    assert toy_cli("export", "runs/s1", "--format", "gguf")[0] == 0  # -> runs/s1/export/s1-f32.gguf

    code, out, err = toy_cli("list")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "models (data, runs/*/export):"
    runs_at = lines.index("runs (runs):")
    models, runs = lines[1:runs_at], lines[runs_at + 1 :]

    def fields(rows, name):
        return next(r for r in rows if r.split()[0] == name).split()

    assert fields(models, "data/good.gguf")[1:3] == ["llama", "model"]
    assert fields(models, "data/sub/broken.gguf")[1:3] == ["?", "unreadable"] and "ERROR:" in out
    assert fields(models, "data/adapter.gguf")[1:5] == ["llama", "lora", "adapter", "r4"]
    assert fields(models, "data/g2.gguf")[1] == "gpt2"
    assert fields(models, "runs/s1/export/s1-f32.gguf")[1:3] == [
        "llama",
        "model",
    ]  # exports are listed
    assert fields(runs, "s1")[1:3] == ["from-scratch", "llama"] and "finished" in fields(runs, "s1")
    assert fields(runs, "f1")[1:3] == ["lora", "llama"] and "failed" in fields(runs, "f1")
    assert "non-finite loss" in out and "unreadable run.json" in fields(runs, "b1")[-1] + " " + out
    # Aligned: every row's cells start where the header's do.
    for table in (models, runs):
        header = table[0]
        starts = [header.index(h) for h in header.split()]
        for row in table[1:]:
            for at in starts[:3]:
                assert row[at - 2 : at] == "  " and row[at] != " ", (row, header)

    extra = tmp_path / "elsewhere"
    extra.mkdir()
    shutil.copy(proj / "data" / "good.gguf", extra / "copy.gguf")
    code, out, err = toy_cli("list", extra, "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["format"] == "toy/list-v1"
    by_name = {Path(m["path"]).name: m for m in r["models"]}
    assert set(by_name) == {
        "good.gguf",
        "broken.gguf",
        "adapter.gguf",
        "g2.gguf",
        "copy.gguf",
        "s1-f32.gguf",
    }
    assert by_name["adapter.gguf"]["rank"] == 4 and by_name["adapter.gguf"]["alpha"] == 8.0
    assert by_name["good.gguf"]["n_params"] == sum(p.numel() for p in model.parameters())
    assert by_name["good.gguf"]["arch"] == "llama" and by_name["good.gguf"]["file_size"] > 0
    assert "error" in by_name["broken.gguf"] and by_name["adapter.gguf"]["kind"] == "lora adapter"
    runs = {x["run_id"]: x for x in r["runs"]}
    assert runs["s1"]["status"] == "finished" and runs["s1"]["recipe"] == "from-scratch"
    assert runs["f1"]["status"] == "failed"
    code, _, err = toy_cli("list", tmp_path / "nope")
    _one_line_exit_2(code, err, "nope")


def _tiny_gpt2(tok):
    from toy.models.gpt2 import GPT2, GPT2Config

    return GPT2(
        GPT2Config(
            vocab_size=tok.get_vocab_size(with_added_tokens=True),
            n_layer=1,
            d_model=32,
            n_head=2,
            max_seq_len=32,
        )
    ).eval()


def test_exports_checkpoints_and_models_are_readable_by_others(tmp_path, toy_cli):
    """Files came out 0600 (mkstemp's mode, and safetensors' own): an exported GGUF or a
    checkpoint was hidden from the machine's other users. They follow the umask now."""
    from toy.data.prep import bundled_text_paths

    old = os.umask(0o022)
    try:
        assert (
            toy_cli(
                "prep", bundled_text_paths()[0], "--out", tmp_path / "c.bin", "--vocab-size", "300"
            )[0]
            == 0
        )
        code, _, err = toy_cli(
            "train",
            "--corpus",
            tmp_path / "c.bin",
            "--out",
            tmp_path / "runs",
            "--run-id",
            "m",
            "--preset",
            "tiny",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--eval-batches",
            "1",
            "--steps",
            "2",
            "--save-every",
            "1",
        )
        assert code == 0, err
        run = tmp_path / "runs" / "m"
        assert toy_cli("export", run, "--format", "gguf")[0] == 0
    finally:
        os.umask(old)
    files = [
        run / "export" / "m-f32.gguf",
        run / "final" / "model.safetensors",
        run / "run.json",
        *sorted((run / "checkpoints").glob("step-*/*")),
        tmp_path / "c.bin",
        tmp_path / "c.tokenizer.json",
    ]
    assert len(files) > 6
    for f in files:
        assert f.stat().st_mode & 0o777 == 0o644, (f, oct(f.stat().st_mode))


def test_exports_stay_out_of_the_run_unless_asked(scratch_run):
    # Exports go to RUN/export/, never into final/ (infer/resume read final/ as it is).
    assert not any(p.suffix == ".gguf" for p in (scratch_run / "final").iterdir())
    assert os.path.isdir(scratch_run / "final")


def test_gguf_exports_say_how_llamacpp_runs_on_amx(
    scratch_run, lora_run, toy_cli, tmp_path, monkeypatch
):
    """On a CPU with AMX, llama.cpp crashes on repacked weights (llama.cpp #20824): every GGUF
    export's note says the setting that avoids it, in llama.cpp's command line and in
    llama-cpp-python; a CPU without AMX gets no such note. The PEFT export (not for llama.cpp)
    never says it."""
    import toy.cores as cores

    cpu_amx = bool({"amx_tile", "amx_bf16"} & set(Path("/proc/cpuinfo").read_text().split()))
    for i, amx in enumerate((cpu_amx, True, False)):
        monkeypatch.setattr(cores, "cpuinfo_flags", lambda amx=amx: {"amx_tile"} if amx else set())
        for run, argv in (
            (scratch_run, ["--format", "gguf"]),
            (lora_run["run"], ["--format", "gguf-lora"]),
            (lora_run["run"], ["--format", "gguf", "--merge"]),
        ):
            out_path = tmp_path / f"{i}-{argv[-1]}.gguf"
            code, out, err = toy_cli("export", run, *argv, "--out", out_path)
            assert code == 0, err
            assert ("--no-repack" in out and "use_extra_bufts=False" in out) == amx, out
            code, out, err = toy_cli("export", run, *argv, "--out", out_path, "--force", "--json")
            assert code == 0, err
            assert any("--no-repack" in n for n in json.loads(out)["notes"]) == amx
        code, out, err = toy_cli(
            "export", lora_run["run"], "--format", "peft", "--out", tmp_path / f"peft-{i}"
        )
        assert code == 0 and "no-repack" not in out, err
