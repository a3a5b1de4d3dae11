"""The GGUF architectures toy reads, each as two functions of the header:

- `config(h)`: toy's model config from the `<arch>.*` keys (every key checked, a missing
  or odd one named), and
- `plan(cfg)`: every tensor the file must hold, GGUF name -> `Planned` (toy's parameter
  name, torch shape, and whether llama.cpp's converter interleaved its rows).

A reader (formats/gguf.py), the writers of adapters and merged models (gguf_write.py)
and describe all go through these, so a family is added in one place. Layouts are those
llama.cpp's own `convert_hf_to_gguf.py` writes (tests/tiny_families.py builds each
family with it and checks toy against transformers):

    family   general.architecture   toy model    Q/K rows       norms in the file
    llama    llama (also Mistral)   Llama        interleaved*   as HF
    qwen2    qwen2                  Llama        as HF          as HF      (+ q/k/v biases)
    qwen3    qwen3                  Llama        as HF          as HF      (+ q/k norms)
    phi3     phi3                   Phi3         as HF          as HF      (fused qkv, gate_up)
    gemma2   gemma2                 Gemma        as HF          1 + w
    gemma3   gemma3                 Gemma        as HF          1 + w      (+ q/k norms)

    * ggml's llama rope rotates adjacent pairs, HF's rotates i with i + D/2: the converter
      interleaves each head's rows, and toy undoes it (on the float, or on the fly at
      dequantization for a quantized base).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from toy.errors import InputError
from toy.formats.gguf_header import GGUFHeader, _show, meta_float, meta_float_or, meta_int
from toy.models.configs import GemmaConfig, LlamaConfig, Phi3Config

# context_length sizes toy's rotary tables (max_seq_len x head_dim floats); it is the one
# hyper-parameter not bounded by the tensors actually present in the file.
_MAX_CONTEXT = 1 << 20


@dataclass(frozen=True)
class Planned:
    name: str  # toy's parameter name
    shape: tuple[int, ...]  # torch order (out, in)
    qk_heads: int = 0  # rows interleaved per head by llama.cpp's converter: the heads to undo


@dataclass(frozen=True)
class Family:
    name: str
    model: str  # toy's model class (registry arch)
    config: Callable[[GGUFHeader], Any]
    plan: Callable[[Any], dict[str, Planned]]
    # LoRA: the linear layers an adapter may target, and the default targets.
    targets: tuple[str, ...]
    default_targets: str
    chat_format: str | None = None  # built-in chat template when the file has none (data/chat.py)


# ------------------------------------------------------------------ shared keys

@dataclass
class _Common:
    arch: str
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    head_dim: int
    d_ff: int
    context: int
    vocab: int
    eps: float
    tied: bool


def _common(h: GGUFHeader, arch: str, eps_default: float = 1e-5) -> _Common:
    a = arch + "."
    d_model = meta_int(h, a + "embedding_length")
    n_head = meta_int(h, a + "attention.head_count")
    n_kv_head = meta_int(h, a + "attention.head_count_kv", default=n_head)
    if n_head > d_model and a + "attention.key_length" not in h.metadata:
        raise InputError(f"{h.path}: head_count {n_head} exceeds embedding_length {d_model}; the file is damaged")
    head_dim = meta_int(h, a + "attention.key_length", default=d_model // n_head)
    value_len = meta_int(h, a + "attention.value_length", default=head_dim)
    if value_len != head_dim:
        raise InputError(f"{h.path}: key length {head_dim} != value length {value_len}; "
                         "toy's attention needs them equal")
    if n_head % n_kv_head:
        raise InputError(f"{h.path}: head_count {n_head} is not a multiple of head_count_kv {n_kv_head}")
    if head_dim % 2:
        raise InputError(f"{h.path}: head size {head_dim} is odd; rotary positions need an even head size")
    scaling = h.metadata.get(a + "rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in h.tensors:
        raise InputError(f"{h.path}: rope scaling ({scaling if scaling not in ('none', None) else 'rope_freqs.weight'})"
                         " is not supported by toy; use a model without long-context rope scaling")
    n_layer = meta_int(h, a + "block_count")
    if n_layer > len(h.tensors):  # checked before anything loops over the layers
        raise InputError(f"{h.path}: block_count {n_layer} cannot be right: the file holds only "
                         f"{len(h.tensors)} tensors; the file is damaged")
    context = meta_int(h, a + "context_length", default=2048)
    if context > _MAX_CONTEXT:
        raise InputError(f"{h.path}: context_length {context} is beyond toy's limit of {_MAX_CONTEXT}; "
                         "the file is damaged or needs rope scaling toy lacks")
    emb = h.tensors.get("token_embd.weight")
    if emb is None:
        raise InputError(f"{h.path}: missing tensor 'token_embd.weight'; the file is not a complete {arch} model")
    if len(emb.ne) != 2:
        raise InputError(f"{h.path}: misshapen tensor 'token_embd.weight': expected 2 dims [vocab, {d_model}], "
                         f"found {list(emb.shape)}")
    # The embedding's rows are the model's vocabulary; the token list may be shorter
    # (padding rows) but a model cannot have fewer rows than tokens it can emit.
    vocab = emb.shape[0]
    tokens = h.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > vocab:
        raise InputError(f"{h.path}: {len(tokens)} tokens but token_embd.weight has only {vocab} rows; "
                         "the file is damaged")
    return _Common(arch, n_layer, d_model, n_head, n_kv_head, head_dim, meta_int(h, a + "feed_forward_length"),
                   context, vocab, meta_float(h, a + "attention.layer_norm_rms_epsilon", eps_default),
                   "output.weight" not in h.tensors)


def _rope_dims(h: GGUFHeader, c: _Common) -> int:
    dims = meta_int(h, c.arch + ".rope.dimension_count", default=c.head_dim)
    if dims > c.head_dim or dims % 2:
        raise InputError(f"{h.path}: rope.dimension_count {dims} does not fit head size {c.head_dim}")
    return dims


def _top(cfg, tied: bool) -> dict[str, Planned]:
    m = {"token_embd.weight": Planned("embed_tokens.weight", (cfg.vocab_size, cfg.d_model)),
         "output_norm.weight": Planned("norm.weight", (cfg.d_model,))}
    if not tied:
        m["output.weight"] = Planned("lm_head.weight", (cfg.vocab_size, cfg.d_model))
    return m


# ------------------------------------------------------------------ llama, qwen2, qwen3

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _llama_config(h: GGUFHeader, arch: str = "llama") -> LlamaConfig:
    c = _common(h, arch)
    if _rope_dims(h, c) != c.head_dim:
        raise InputError(f"{h.path}: partial rotary ({_rope_dims(h, c)} of {c.head_dim} head dims) is not supported "
                         f"for {arch}")
    return LlamaConfig(
        vocab_size=c.vocab, n_layer=c.n_layer, d_model=c.d_model, n_head=c.n_head, n_kv_head=c.n_kv_head,
        d_ff=c.d_ff, max_seq_len=c.context, rope_theta=meta_float(h, arch + ".rope.freq_base", 10000.0),
        norm_eps=c.eps, tie_embeddings=c.tied, qkv_bias=arch == "qwen2", head_dim=c.head_dim,
        qk_norm=arch == "qwen3",
        sliding_window=int(meta_float_or(h, arch + ".attention.sliding_window", 0)) if arch == "llama" else 0,
        arch="llama",  # toy's model class; the family keeps the file's name
    )


def _llama_plan(cfg: LlamaConfig, interleaved: bool = True) -> dict[str, Planned]:
    D, H, K, C, F = cfg.head_dim, cfg.n_head, cfg.n_kv_head, cfg.d_model, cfg.d_ff
    m = _top(cfg, cfg.tie_embeddings)
    qh, kh = (H, K) if interleaved else (0, 0)
    for i in range(cfg.n_layer):
        b, t = f"blk.{i}.", f"layers.{i}."
        m.update({
            b + "attn_norm.weight": Planned(t + "input_layernorm.weight", (C,)),
            b + "attn_q.weight": Planned(t + "self_attn.q_proj.weight", (H * D, C), qh),
            b + "attn_k.weight": Planned(t + "self_attn.k_proj.weight", (K * D, C), kh),
            b + "attn_v.weight": Planned(t + "self_attn.v_proj.weight", (K * D, C)),
            b + "attn_output.weight": Planned(t + "self_attn.o_proj.weight", (C, H * D)),
            b + "ffn_norm.weight": Planned(t + "post_attention_layernorm.weight", (C,)),
            b + "ffn_gate.weight": Planned(t + "mlp.gate_proj.weight", (F, C)),
            b + "ffn_up.weight": Planned(t + "mlp.up_proj.weight", (F, C)),
            b + "ffn_down.weight": Planned(t + "mlp.down_proj.weight", (C, F)),
        })
        if cfg.qkv_bias:
            m.update({
                b + "attn_q.bias": Planned(t + "self_attn.q_proj.bias", (H * D,), qh),
                b + "attn_k.bias": Planned(t + "self_attn.k_proj.bias", (K * D,), kh),
                b + "attn_v.bias": Planned(t + "self_attn.v_proj.bias", (K * D,)),
            })
        if cfg.qk_norm:
            m.update({
                b + "attn_q_norm.weight": Planned(t + "self_attn.q_norm.weight", (D,)),
                b + "attn_k_norm.weight": Planned(t + "self_attn.k_norm.weight", (D,)),
            })
    return m


# ------------------------------------------------------------------ phi3

PHI3_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _phi3_config(h: GGUFHeader) -> Phi3Config:
    c = _common(h, "phi3")
    return Phi3Config(
        vocab_size=c.vocab, n_layer=c.n_layer, d_model=c.d_model, n_head=c.n_head, n_kv_head=c.n_kv_head,
        head_dim=c.head_dim, rope_dim=_rope_dims(h, c), d_ff=c.d_ff, max_seq_len=c.context,
        rope_theta=meta_float(h, "phi3.rope.freq_base", 10000.0), norm_eps=c.eps,
        # llama.cpp runs phi3 without a sliding window whatever the file says; so does toy.
        sliding_window=0, tie_embeddings=c.tied)


def _phi3_plan(cfg: Phi3Config) -> dict[str, Planned]:
    D, H, K, C, F = cfg.head_dim, cfg.n_head, cfg.n_kv_head, cfg.d_model, cfg.d_ff
    m = _top(cfg, cfg.tie_embeddings)
    for i in range(cfg.n_layer):
        b, t = f"blk.{i}.", f"layers.{i}."
        m.update({
            b + "attn_norm.weight": Planned(t + "input_layernorm.weight", (C,)),
            b + "attn_qkv.weight": Planned(t + "self_attn.qkv_proj.weight", ((H + 2 * K) * D, C)),
            b + "attn_output.weight": Planned(t + "self_attn.o_proj.weight", (C, H * D)),
            b + "ffn_norm.weight": Planned(t + "post_attention_layernorm.weight", (C,)),
            b + "ffn_up.weight": Planned(t + "mlp.gate_up_proj.weight", (2 * F, C)),  # gate rows, then up rows
            b + "ffn_down.weight": Planned(t + "mlp.down_proj.weight", (C, F)),
        })
    return m


# ------------------------------------------------------------------ gemma2, gemma3

# llama.cpp's LLM_TYPE_27B for each family (src/models/gemma2.cpp, gemma3.cpp).
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_config(h: GGUFHeader, arch: str) -> GemmaConfig:
    c = _common(h, arch, eps_default=1e-6)
    if _rope_dims(h, c) != c.head_dim:
        raise InputError(f"{h.path}: partial rotary is not supported for {arch}")
    window = int(meta_float_or(h, arch + ".attention.sliding_window", 0))
    if window < 1:
        raise InputError(f"{h.path}: GGUF key '{arch}.attention.sliding_window' is missing or 0; {arch}'s local "
                         "layers need it")
    g3 = arch == "gemma3"
    theta = meta_float(h, arch + ".rope.freq_base", 1_000_000.0 if g3 else 10000.0)
    # The 27B models scale queries by d_model / n_head, not by the head size. The file does
    # not say so (llama.cpp's converter drops query_pre_attn_scalar): llama.cpp takes it from
    # the layer count that marks the 27B model (46 for gemma2, 62 for gemma3), and so does
    # toy, to give the same model llama.cpp runs.
    scalar = c.d_model // c.n_head if c.n_layer == GEMMA_27B_LAYERS[arch] else c.head_dim
    return GemmaConfig(
        vocab_size=c.vocab, n_layer=c.n_layer, d_model=c.d_model, n_head=c.n_head, n_kv_head=c.n_kv_head,
        head_dim=c.head_dim, d_ff=c.d_ff, max_seq_len=c.context, rope_theta=theta,
        # Gemma 3's local layers rotate with their own base (10000 unless the file says);
        # Gemma 2 has one base for all.
        rope_local_theta=meta_float(h, arch + ".rope.freq_base_swa", 10000.0) if g3 else theta,
        sliding_window=window, global_every=6 if g3 else 2, norm_eps=c.eps, qk_norm=g3,
        attn_softcap=meta_float_or(h, arch + ".attn_logit_softcapping", 0.0),
        final_softcap=meta_float_or(h, arch + ".final_logit_softcapping", 0.0), tie_embeddings=c.tied,
        query_pre_attn_scalar=scalar)


GEMMA_TARGETS = LLAMA_TARGETS


def _gemma_plan(cfg: GemmaConfig) -> dict[str, Planned]:
    D, H, K, C, F = cfg.head_dim, cfg.n_head, cfg.n_kv_head, cfg.d_model, cfg.d_ff
    m = _top(cfg, cfg.tie_embeddings)
    for i in range(cfg.n_layer):
        b, t = f"blk.{i}.", f"layers.{i}."
        m.update({
            b + "attn_norm.weight": Planned(t + "input_layernorm.weight", (C,)),
            b + "attn_q.weight": Planned(t + "self_attn.q_proj.weight", (H * D, C)),
            b + "attn_k.weight": Planned(t + "self_attn.k_proj.weight", (K * D, C)),
            b + "attn_v.weight": Planned(t + "self_attn.v_proj.weight", (K * D, C)),
            b + "attn_output.weight": Planned(t + "self_attn.o_proj.weight", (C, H * D)),
            b + "post_attention_norm.weight": Planned(t + "post_attention_layernorm.weight", (C,)),
            b + "ffn_norm.weight": Planned(t + "pre_feedforward_layernorm.weight", (C,)),
            b + "ffn_gate.weight": Planned(t + "mlp.gate_proj.weight", (F, C)),
            b + "ffn_up.weight": Planned(t + "mlp.up_proj.weight", (F, C)),
            b + "ffn_down.weight": Planned(t + "mlp.down_proj.weight", (C, F)),
            b + "post_ffw_norm.weight": Planned(t + "post_feedforward_layernorm.weight", (C,)),
        })
        if cfg.qk_norm:
            m.update({
                b + "attn_q_norm.weight": Planned(t + "self_attn.q_norm.weight", (D,)),
                b + "attn_k_norm.weight": Planned(t + "self_attn.k_norm.weight", (D,)),
            })
    return m


# ------------------------------------------------------------------ the table

FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "llama", _llama_config, _llama_plan, LLAMA_TARGETS, "q_proj,v_proj"),
    "qwen2": Family("qwen2", "llama", lambda h: _llama_config(h, "qwen2"),
                    lambda cfg: _llama_plan(cfg, interleaved=False), LLAMA_TARGETS, "q_proj,v_proj", "chatml"),
    "qwen3": Family("qwen3", "llama", lambda h: _llama_config(h, "qwen3"),
                    lambda cfg: _llama_plan(cfg, interleaved=False), LLAMA_TARGETS, "q_proj,v_proj", "chatml"),
    "phi3": Family("phi3", "phi3", _phi3_config, _phi3_plan, PHI3_TARGETS, "qkv_proj"),
    "gemma2": Family("gemma2", "gemma", lambda h: _gemma_config(h, "gemma2"), _gemma_plan, GEMMA_TARGETS,
                     "q_proj,v_proj", "gemma"),
    "gemma3": Family("gemma3", "gemma", lambda h: _gemma_config(h, "gemma3"), _gemma_plan, GEMMA_TARGETS,
                     "q_proj,v_proj", "gemma"),
}
SUPPORTED_ARCHS = tuple(FAMILIES)


def family_of(h: GGUFHeader) -> Family:
    """The family of a model GGUF; an InputError naming the architecture and the
    supported ones otherwise (an adapter file is refused here too)."""
    arch = h.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise InputError(f"{h.path}: GGUF key 'general.architecture' is missing; the file is not a GGUF model")
    if h.metadata.get("general.type") == "adapter":
        raise InputError(f"{h.path}: is a LoRA adapter GGUF, not a model; pass the base model's GGUF here")
    if arch not in FAMILIES:
        raise InputError(f"{h.path}: architecture {_show(arch)} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHS)} (`toy describe` still shows what the file holds)")
    return FAMILIES[arch]


def check_plan(h: GGUFHeader, plan: dict[str, Planned], arch: str, n_layer: int) -> None:
    """The header's tensors are exactly the plan's, each with the planned shape (names and
    shapes only: nothing read). The first misfit is named."""
    missing = [g for g in plan if g not in h.tensors]
    if missing:
        more = f" ({len(missing)} missing in all)" if len(missing) > 1 else ""
        raise InputError(f"{h.path}: missing tensor {missing[0]!r}{more}; the file is not a complete {arch} model "
                         f"with {n_layer} layers")
    extra = [n for n in h.tensors if n not in plan]
    if extra:
        raise InputError(f"{h.path}: unexpected tensor {_show(extra[0])} ({len(extra)} in all); toy's {arch} has "
                         "no place for it (a different architecture or an unsupported variant)")
    for gname, p in plan.items():
        found = h.tensors[gname].shape
        if found != p.shape:
            raise InputError(f"{h.path}: misshapen tensor {gname!r}: expected {list(p.shape)}, found {list(found)} "
                             "(torch order, out x in); the header's hyper-parameters do not match the weights")
