"""Gemma 2 / Gemma 3 27B scale their queries by 1/sqrt(query_pre_attn_scalar), where the
scalar (d_model / n_head: 144 for Gemma 2 27B, 168 for Gemma 3 27B) is not the head size
(128). transformers reads the scalar from config.json; llama.cpp's converter does not
write it, and llama.cpp keys it on the model type from the layer count: a gemma2 file of
46 layers or a gemma3 file of 62 (the 27B models) is scaled by d_model / n_head, every
other file by its head size (src/models/gemma2.cpp, gemma3.cpp `f_attention_scale`).

Here: tiny Gemma 2 (46 layers) and Gemma 3 (62 layers) built in transformers with
query_pre_attn_scalar = d_model / n_head = 16 and head_dim 32, converted by llama.cpp's
own converter. toy's logits equal transformers' on the same weights, and llama.cpp's
equal them too."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_families import (
    GEMMA_IDS,
    SLIDING_WINDOW,
    _randomize,
    convert,
    converter_dir,  # noqa: E402
    save_gemma_tokenizer,
)

from toy.formats.gguf import read_gguf  # noqa: E402

pytestmark = pytest.mark.slow

LAYERS_27B = {"gemma2": 46, "gemma3": 62}  # what llama.cpp takes for the 27B models
D_MODEL, N_HEAD, HEAD_DIM = 64, 4, 32
SCALAR = D_MODEL // N_HEAD  # 16, not HEAD_DIM: queries scaled by 1/4, not 1/sqrt(32)


def hf_config(family: str, vocab_size: int):
    import transformers as tf

    shape = dict(
        hidden_size=D_MODEL,
        intermediate_size=64,
        num_hidden_layers=LAYERS_27B[family],
        num_attention_heads=N_HEAD,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        query_pre_attn_scalar=SCALAR,
        rms_norm_eps=1e-6,
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        sliding_window=SLIDING_WINDOW,
        tie_word_embeddings=True,
        **GEMMA_IDS,
    )
    if family == "gemma2":
        return tf.Gemma2Config(
            **shape, rope_theta=10_000.0, attn_logit_softcapping=4.0, final_logit_softcapping=3.0
        )
    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    return tf.Gemma3TextConfig(
        **shape,
        rope_parameters=rope,
        final_logit_softcapping=3.0,
        attn_logit_softcapping=None,
        architectures=["Gemma3ForCausalLM"],
    )


@pytest.fixture(scope="module")
def tiny27b(tmp_path_factory):
    """family -> (GGUF path, the transformers model it was converted from)."""
    import shutil

    from transformers import AutoModelForCausalLM

    converter = converter_dir()
    work = tmp_path_factory.mktemp("gemma27b")
    tok = save_gemma_tokenizer(work / "tokenizer")
    out = {}
    for family in LAYERS_27B:
        hf_dir = work / family
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_config(family, 1024), dtype=torch.float32)
        _randomize(model, family, 0)
        model.eval().save_pretrained(hf_dir)
        for f in tok.iterdir():
            shutil.copy(f, hf_dir / f.name)
        gguf = convert(converter, hf_dir, work / f"{family}.gguf", "f32", name=f"tiny-{family}-27b")
        out[family] = (
            gguf,
            AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval(),
        )
    return out


def input_ids(n: int = 40) -> torch.Tensor:
    return torch.randint(8, 1024, (1, n), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", list(LAYERS_27B))
def test_the_file_is_read_with_the_27b_query_scalar(family, tiny27b):
    from toy.formats.gguf_header import read_gguf_header
    from toy.formats.gguf_plan import family_of

    h = read_gguf_header(tiny27b[family][0])
    assert (
        h.metadata[f"{family}.attention.key_length"] == HEAD_DIM
    )  # the file's head size, not the scalar
    cfg = family_of(h).config(h)
    assert cfg.head_dim == HEAD_DIM and cfg.query_pre_attn_scalar == SCALAR


@pytest.mark.parametrize("family", list(LAYERS_27B))
def test_toy_logits_equal_transformers(family, tiny27b):
    from toy.models.generate import generate

    gguf, hf = tiny27b[family]
    ids = input_ids()
    with torch.no_grad():
        want = hf(ids).logits
        for dtype in ("float32", "quantized"):
            got = read_gguf(gguf, dtype).build_model()(ids)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    m = read_gguf(gguf).build_model()
    ref = hf.generate(ids[:, :8], max_new_tokens=8, do_sample=False)[0, 8:].tolist()
    assert list(generate(m, ids[0, :8].tolist(), max_new_tokens=8, temperature=0.0)) == ref


@pytest.mark.llamacpp
@pytest.mark.parametrize("family", list(LAYERS_27B))
def test_llamacpp_logits_equal_transformers(family, tiny27b):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from helpers.llamacpp import _llama

    gguf, hf = tiny27b[family]
    ids = input_ids()[0].tolist()
    llm = _llama(gguf, n_ctx=64, logits_all=True)
    try:
        llm.eval(ids)
        cpp = torch.tensor(llm.scores[: len(ids)], dtype=torch.float32)
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
            toy = read_gguf(gguf).build_model()(torch.tensor([ids]))[0]
        # ggml's CPU GELU reads an f16 table: ~1e-3 off at position 0 already (one key, so
        # no attention scale involved), ~1e-2 after 62 layers. Scaling queries by the head
        # size instead is off by more than 2 (logits within +-3 here).
        torch.testing.assert_close(cpp, want, rtol=0, atol=2e-2)
        torch.testing.assert_close(cpp, toy, rtol=0, atol=2e-2)
        llm.reset()
        greedy = []
        for t in llm.generate(ids[:8], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            greedy.append(t)
            if len(greedy) == 8:
                break
        ref = hf.generate(torch.tensor([ids[:8]]), max_new_tokens=8, do_sample=False)[
            0, 8:
        ].tolist()
        assert greedy == ref
    finally:
        llm.close()
