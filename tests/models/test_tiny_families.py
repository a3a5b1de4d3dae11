"""The tiny family fixtures (tests/helpers/tiny_families.py) are what they claim: llama.cpp's real
converter wrote each file, transformers' own GGUF loader gives back the HF model's logits,
and the layout each family's file has (tensor names, Q/K row order, norm offsets, fused
tensors, metadata keys) is pinned here, so a reader written against these facts reads
real files. Slow: one converter run (~6 s) and one transformers GGUF load per family, each
kept for later runs (the converter's output by its inputs, the load by the file's bytes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.gguf_fixtures import converter_permute  # noqa: E402
from helpers.tiny_families import (  # noqa: E402,F401
    FAMILIES,
    SLIDING_WINDOW,
    gguf_read,
    one_gguf_reader,
    tiny_family,
)

pytestmark = pytest.mark.slow

ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma3": "gemma3",
    "gemma2": "gemma2",
}

# The per-layer tensors each family's file holds (blk.N.<suffix>.weight), and the top-level ones.
LAYER_TENSORS = {
    "llama": {
        "attn_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_norm",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    },
    "qwen3": {
        "attn_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_q_norm",
        "attn_k_norm",
        "attn_output",
        "ffn_norm",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    },
    "phi3": {"attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"},
    "gemma2": {
        "attn_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "post_attention_norm",
        "ffn_norm",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
        "post_ffw_norm",
    },
}
LAYER_TENSORS["mistral"] = LAYER_TENSORS["llama"]
LAYER_TENSORS["gemma3"] = LAYER_TENSORS["gemma2"] | {"attn_q_norm", "attn_k_norm"}
UNTIED = {
    "mistral",
    "phi3",
}  # the others have no output.weight (gemma's converter drops lm_head always)

# The <arch>.* keys each family's file has.
COMMON_KEYS = {
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
}
ARCH_KEYS = {
    "llama": COMMON_KEYS
    | {
        "rope.freq_base",
        "attention.key_length",
        "attention.value_length",
        "vocab_size",
        "rope.dimension_count",
    },
    "qwen3": COMMON_KEYS | {"rope.freq_base", "attention.key_length", "attention.value_length"},
    "phi3": COMMON_KEYS
    | {
        "rope.scaling.original_context_length",
        "rope.dimension_count",
        "rope.freq_base",
        "attention.sliding_window",
    },
    "gemma3": COMMON_KEYS
    | {
        "rope.freq_base",
        "rope.freq_base_swa",
        "attention.key_length",
        "attention.value_length",
        "final_logit_softcapping",
        "attention.sliding_window",
    },
    "gemma2": COMMON_KEYS
    | {
        "attention.key_length",
        "attention.value_length",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "attention.sliding_window",
    },
}
ARCH_KEYS["mistral"] = ARCH_KEYS[
    "llama"
]  # no sliding window key: MistralForCausalLM converts as plain llama

HF_NAMES = {  # GGUF per-layer suffix -> HF module under model.layers.N (gemma's ffn_norm differs)
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def hf_name(family: str, gguf_name: str) -> str:
    top = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in top:
        return top[gguf_name]
    _, i, suffix, kind = gguf_name.split(".")
    module = HF_NAMES[suffix]
    if family.startswith("gemma") and suffix == "ffn_norm":
        module = "pre_feedforward_layernorm"
    if family == "phi3" and suffix == "ffn_up":
        module = "mlp.gate_up_proj"  # fused: rows [0, d_ff) gate, [d_ff, 2 d_ff) up, as in HF
    return f"model.layers.{i}.{module}.{kind}"


def expected_array(family: str, cfg: dict, hf: dict, name: str) -> np.ndarray:
    """What the converter writes for GGUF tensor `name`, from the HF weights (numpy order)."""
    want = hf[hf_name(family, name)]
    suffix = name.split(".")[-2]
    if family in ("llama", "mistral") and suffix == "attn_q":
        return converter_permute(want, cfg["num_attention_heads"])
    if family in ("llama", "mistral") and suffix == "attn_k":
        return converter_permute(want, cfg["num_key_value_heads"])
    if family.startswith("gemma") and suffix.endswith("norm"):
        return want + np.float32(1.0)
    return want


def transformers_gguf_overrides(family: str, meta: dict) -> dict:
    """Config fields transformers' GGUF loader (5.x) does not read back, each taken from the
    file itself or from the convention llama.cpp applies to it, never from the HF config."""
    arch = ARCH[family]
    if family == "qwen3":  # it derives head_dim = hidden / heads, ignoring attention.key_length
        return {"head_dim": meta[f"{arch}.attention.key_length"]}
    if family in ("gemma2", "gemma3"):
        # llama.cpp scales queries by 1/sqrt(key_length) (only the 27B models differ); the file
        # has no scalar
        out = {
            "query_pre_attn_scalar": meta[f"{arch}.attention.key_length"],
            "final_logit_softcapping": meta[f"{arch}.final_logit_softcapping"],
        }
        if family == "gemma2":
            out["attn_logit_softcapping"] = meta[f"{arch}.attn_logit_softcapping"]
        else:
            out["rope_parameters"] = {
                "full_attention": {
                    "rope_type": "default",
                    "rope_theta": meta[f"{arch}.rope.freq_base"],
                },
                "sliding_attention": {
                    "rope_type": "default",
                    "rope_theta": meta[f"{arch}.rope.freq_base_swa"],
                },
            }
        return out
    return {}


def transformers_from_gguf(tf, **overrides):
    """transformers' own load of the converted file, kept for later runs as the real models'
    are (helpers.gguf_fixtures._reference_dir: its save_pretrained, keyed by the file's bytes
    and the library versions; here also by the overrides): its GGUF reader parses SmolLM2's
    49,152 tokens and merges in Python, 4-5 s a file."""
    import hashlib

    from helpers.gguf_fixtures import _reference_dir, save_gguf_load
    from transformers import AutoModelForCausalLM

    def make(dest):
        with one_gguf_reader():
            model = AutoModelForCausalLM.from_pretrained(
                tf.gguf.parent, gguf_file=tf.gguf.name, dtype=torch.float32, **overrides
            )
        save_gguf_load(model, dest)

    how = hashlib.sha256(repr(sorted(overrides.items())).encode()).hexdigest()[:8]
    folder = _reference_dir(tf.gguf, f"tiny-model-{how}", make, min_bytes=0)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_gguf_load_equals_hf_model(tiny_family, family):
    """transformers, loading the converted F32 file, gives the HF model's logits on SEQ_LEN
    (> SLIDING_WINDOW) tokens. Mistral's window is not in the file: equal up to the window,
    and past it equal to the same weights with full attention (what llama.cpp runs)."""
    tf = tiny_family(family)
    meta, _ = gguf_read(tf.gguf)
    assert meta["general.architecture"] == ARCH[family]
    got = transformers_from_gguf(tf, **transformers_gguf_overrides(family, meta))
    ref = tf.hf_model()
    ids = tf.input_ids()
    if family == "mistral":
        short = ids[:, :SLIDING_WINDOW]
        torch.testing.assert_close(logits(got, short), logits(ref, short), rtol=0, atol=1e-4)
        ref = type(ref).from_pretrained(tf.hf_dir, dtype=torch.float32, sliding_window=None).eval()
    torch.testing.assert_close(logits(got, ids), logits(ref, ids), rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_layout(tiny_family, family):
    """Every tensor and <arch>.* key the converter writes, and how each tensor relates to the
    HF weight: Q/K rows permuted (interleaved rope) for llama/mistral only, every gemma norm
    stored as weight + 1, phi3's fused qkv and gate_up kept as HF has them."""
    from safetensors.numpy import load_file

    tf = tiny_family(family)
    cfg = tf.hf_config()
    arch, n_layer = ARCH[family], cfg["num_hidden_layers"]
    meta, tensors = gguf_read(tf.gguf)
    assert {k[len(arch) + 1 :] for k in meta if k.startswith(arch + ".")} == ARCH_KEYS[family]
    assert meta[f"{arch}.block_count"] == n_layer
    assert meta[f"{arch}.embedding_length"] == cfg["hidden_size"]
    assert meta[f"{arch}.attention.head_count"] == cfg["num_attention_heads"]
    assert meta[f"{arch}.attention.head_count_kv"] == cfg["num_key_value_heads"]
    assert meta["general.file_type"] == 0  # ALL_F32

    top = {"token_embd.weight", "output_norm.weight"} | (
        {"output.weight"} if family in UNTIED else set()
    )
    layer = {f"blk.{i}.{s}.weight" for i in range(n_layer) for s in LAYER_TENSORS[family]}
    assert set(tensors) == top | layer
    assert all(kind == "F32" for kind, _ in tensors.values())

    hf = load_file(str(tf.hf_dir / "model.safetensors"))
    for name, (_, a) in tensors.items():
        want = expected_array(family, cfg, hf, name)
        assert a.shape == want.shape, name
        np.testing.assert_array_equal(a, want, err_msg=name)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_sliding_window_changes_the_logits(tiny_family, family):
    """The window is really exercised: full attention gives other logits past it. Gemma3's
    file carries no layer types; llama.cpp makes layer i global when i % 6 == 5, as here."""
    tf = tiny_family(family)
    cfg = tf.hf_config()
    ref = tf.hf_model()
    if family != "mistral":
        want = [
            "full_attention"
            if (family == "gemma2" and i % 2 == 1) or (family == "gemma3" and i % 6 == 5)
            else "sliding_attention"
            for i in range(cfg["num_hidden_layers"])
        ]
        assert cfg["layer_types"] == want
    # a window wider than the input (layer types kept: gemma3's local layers keep their rope base)
    full = type(ref).from_pretrained(tf.hf_dir, dtype=torch.float32, sliding_window=4096).eval()
    ids = tf.input_ids()
    diff = (logits(full, ids) - logits(ref, ids)).abs().amax(dim=-1)[0]
    assert diff[:SLIDING_WINDOW].max() < 1e-5 and diff[SLIDING_WINDOW:].max() > 1e-2


@pytest.mark.parametrize("family,outtype", [("llama", "q8_0"), ("gemma3", "f16")])
def test_other_outtypes(tiny_family, family, outtype):
    """--outtype f16 / q8_0: matrices stored in that type, norms (1-D) stay F32; each tensor
    dequantizes to the F32 layout within the type's rounding; transformers' logits stay close."""
    import gguf
    from safetensors.numpy import load_file

    tf = tiny_family(family, outtype)
    cfg = tf.hf_config()
    meta, tensors = gguf_read(tf.gguf)
    file_type = {"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[
        outtype
    ]
    assert meta["general.file_type"] == file_type
    hf = load_file(str(tf.hf_dir / "model.safetensors"))
    for name, (kind, raw) in tensors.items():
        want = expected_array(family, cfg, hf, name)
        assert kind == ("F32" if want.ndim == 1 else outtype.upper()), name
        got = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32)
        # f16: relative 2^-11; q8_0: half a step of each 32-block's scale max|w|/127
        tol = 0.0 if kind == "F32" else 1e-3 if kind == "F16" else np.abs(want).max() / 127
        np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=name)
    got = transformers_from_gguf(tf, **transformers_gguf_overrides(family, meta))
    ids = tf.input_ids()
    ref = logits(tf.hf_model(), ids)
    err = (logits(got, ids) - ref).abs().max() / ref.abs().max()
    assert err < {"f16": 1e-2, "q8_0": 0.1}[outtype], err
