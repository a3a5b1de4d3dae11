"""Gemma 2 and Gemma 3 (text), as their GGUF files hold them.

What differs from llama, top to bottom:
- the token embedding is scaled by sqrt(d_model) on the way in (not on the tied head);
- every block has four norms: before and after attention, before and after the MLP
  ("sandwich" norms), each output normalised before it joins the residual stream;
- the MLP is GELU (tanh approximation) gated: down(gelu(gate(x)) * up(x));
- layers alternate local and global attention: local layers see a sliding window of
  `sliding_window` tokens and (Gemma 3) rotate with their own base `rope_local_theta`;
  one layer in `global_every` is global (Gemma 3: every 6th, Gemma 2: every 2nd);
- Gemma 3 normalises each head's queries and keys (RMSNorm, as Qwen 3);
- Gemma 2 soft-caps attention scores and final logits: cap * tanh(x / cap); Gemma 3
  files may declare the final one;
- queries are scaled by 1/sqrt(query_pre_attn_scalar), which is the head size except in
  the 27B models (d_model / n_head).

Norm weights: HF's Gemma computes x * (1 + w); llama.cpp's converter stores 1 + w, and
toy keeps the file's convention, so every norm here is the plain RMSNorm x * w. Names
follow HF's Gemma{2,3}ForCausalLM minus `model.`, so PEFT adapters map onto it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from toy.models.family import (
    Arch,
    BadConfig,
    Family,
    HFType,
    Keys,
    Planned,
    gguf_common,
    gguf_linears,
    gguf_top,
    hf_common,
    hf_from_plan,
    rope_dims,
    rope_theta_of,
)
from toy.models.layers import Attention, KVCache, RMSNorm, Rotary, gelu_tanh, run_block


@dataclass
class GemmaConfig:
    vocab_size: int = 4096
    n_layer: int = 6
    d_model: int = 256
    n_head: int = 4
    n_kv_head: int = 1
    head_dim: int = 64
    d_ff: int = 1024
    max_seq_len: int = 2048
    rope_theta: float = 1_000_000.0  # global layers
    rope_local_theta: float = 10_000.0  # local (sliding-window) layers
    sliding_window: int = 512
    global_every: int = 6  # layer i is global when i % global_every == global_every - 1
    norm_eps: float = 1e-6
    qk_norm: bool = True  # Gemma 3
    attn_softcap: float = 0.0  # Gemma 2: 50
    final_softcap: float = 0.0  # Gemma 2: 30
    tie_embeddings: bool = True
    # Queries are scaled by 1/sqrt(query_pre_attn_scalar): the head size, except in the 27B
    # models (d_model / n_head: 144 for Gemma 2, 168 for Gemma 3, where heads are 128 wide).
    query_pre_attn_scalar: int = 0  # 0: head_dim
    arch: str = field(default="gemma")

    def __post_init__(self) -> None:
        if self.query_pre_attn_scalar == 0:
            self.query_pre_attn_scalar = self.head_dim

    def is_global(self, layer: int) -> bool:
        return layer % self.global_every == self.global_every - 1

    def to_dict(self) -> dict:
        return asdict(self)


class GeluGated(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)): Gemma's MLP."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: GemmaConfig, layer: int):
        super().__init__()
        self.is_global = cfg.is_global(layer)
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # None where the scalar is the head size: SDPA's own default, the same bits as before.
        scale = (
            None if cfg.query_pre_attn_scalar == cfg.head_dim else cfg.query_pre_attn_scalar**-0.5
        )
        self.self_attn = Attention(
            cfg.d_model,
            cfg.n_head,
            cfg.n_kv_head,
            cfg.head_dim,
            qk_norm=cfg.qk_norm,
            norm_eps=cfg.norm_eps,
            window=0 if self.is_global else cfg.sliding_window,
            scale=scale,
            softcap=cfg.attn_softcap,
        )
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = GeluGated(cfg.d_model, cfg.d_ff)
        self.post_feedforward_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, x, ropes, cache=None, layer=0):
        rope = ropes[0] if self.is_global else ropes[1]
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), rope, cache, layer)
        )
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x


class Gemma(nn.Module):
    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.rotary_local = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_local_theta)
        self.checkpointing = False
        # The loss caps the final logits the same way (models.losses reads this).
        self.final_softcap = cfg.final_softcap
        self.reset_parameters()

    @property
    def blocks(self) -> nn.ModuleList:
        return self.layers

    def tie_weights(self) -> None:
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def reset_parameters(self) -> None:
        # Only for a model not loaded from a file (tests): N(0, 0.02), norms at identity.
        for _name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Final normalised hidden states (B, T, C) for token ids idx (B, T)."""
        B, T = idx.shape
        start = cache.pos if cache is not None else 0
        x = self.embed_tokens(idx)  # (B, T, C)
        # sqrt(d_model) rounded to the activations' dtype first, as HF and llama.cpp do.
        x = x * torch.tensor(math.sqrt(self.cfg.d_model), dtype=x.dtype)
        pad = cache and cache.pad
        ropes = (self.rotary.tables(start, T, pad), self.rotary_local.tables(start, T, pad))
        for i, block in enumerate(self.layers):
            x = run_block(block, x, ropes, cache, i, checkpointing=self.checkpointing)
        if cache is not None:
            cache.pos += T
        return self.norm(x)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        logits = self.lm_head(self.hidden(idx, cache))  # (B, T, vocab)
        if self.final_softcap:
            logits = self.final_softcap * torch.tanh(logits / self.final_softcap)
        return logits

    def new_cache(self, batch: int, max_len: int, lazy: bool = False) -> KVCache:
        p = self.norm.weight
        return KVCache(
            self.cfg.n_layer,
            batch,
            self.cfg.n_kv_head,
            max_len,
            self.cfg.head_dim,
            p.device,
            p.dtype,
            lazy=lazy,
        )

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


# ------------------------------------------------------------------ GGUF: gemma2, gemma3

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# llama.cpp's LLM_TYPE_27B for each architecture (src/models/gemma2.cpp, gemma3.cpp).
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def gguf_config(k: Keys, arch: str) -> GemmaConfig:
    c = gguf_common(k, arch, eps_default=1e-6)
    if rope_dims(k, c) != c.head_dim:
        raise BadConfig(f"partial rotary is not supported for {arch}")
    window = int(k.float_or(arch + ".attention.sliding_window", 0))
    if window < 1:
        raise BadConfig(
            f"GGUF key '{arch}.attention.sliding_window' is missing or 0; "
            f"{arch}'s local layers need it"
        )
    g3 = arch == "gemma3"
    theta = k.float(arch + ".rope.freq_base", 1_000_000.0 if g3 else 10000.0)
    # The 27B models scale queries by d_model / n_head, not by the head size. The file does
    # not say so (llama.cpp's converter drops query_pre_attn_scalar): llama.cpp takes it from
    # the layer count that marks the 27B model, and so does toy, to run the model llama.cpp runs.
    scalar = c.d_model // c.n_head if c.n_layer == GEMMA_27B_LAYERS[arch] else c.head_dim
    return GemmaConfig(
        vocab_size=c.vocab,
        n_layer=c.n_layer,
        d_model=c.d_model,
        n_head=c.n_head,
        n_kv_head=c.n_kv_head,
        head_dim=c.head_dim,
        d_ff=c.d_ff,
        max_seq_len=c.context,
        rope_theta=theta,
        # Gemma 3's local layers rotate with their own base (10000 unless the file says);
        # Gemma 2 has one base for all.
        rope_local_theta=k.float(arch + ".rope.freq_base_swa", 10000.0) if g3 else theta,
        sliding_window=window,
        global_every=6 if g3 else 2,
        norm_eps=c.eps,
        qk_norm=g3,
        attn_softcap=k.float_or(arch + ".attn_logit_softcapping", 0.0),
        final_softcap=k.float_or(arch + ".final_logit_softcapping", 0.0),
        tie_embeddings=c.tied,
        query_pre_attn_scalar=scalar,
    )


def gguf_plan(cfg: GemmaConfig) -> dict[str, Planned]:
    C = cfg.d_model
    m = gguf_top(cfg, cfg.tie_embeddings)
    for i in range(cfg.n_layer):
        b, t = f"blk.{i}.", f"layers.{i}."
        m.update(
            {  # the sandwich norms around attention and the MLP
                b + "attn_norm.weight": Planned(t + "input_layernorm.weight", (C,)),
                b + "post_attention_norm.weight": Planned(
                    t + "post_attention_layernorm.weight", (C,)
                ),
                b + "ffn_norm.weight": Planned(t + "pre_feedforward_layernorm.weight", (C,)),
                b + "post_ffw_norm.weight": Planned(t + "post_feedforward_layernorm.weight", (C,)),
            }
        )
        m.update(gguf_linears(cfg, i))
    return m


# ------------------------------------------------------ transformers: gemma2, gemma3_text, gemma3


def hf_config(k: Keys, model_type: str) -> GemmaConfig:
    if model_type == "gemma3":  # the multimodal config: the text model's config is its text_config
        text = k.get("text_config")
        if not isinstance(text, dict):
            raise BadConfig(
                "config.json key 'text_config' is missing; the file is not a complete gemma3 model"
            )
        k = Keys(text, k.shapes, k.label)
    c = hf_common(k)
    if k.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise BadConfig(
            f"hidden_activation {k.get('hidden_activation')!r} is not supported (toy's Gemma uses "
            "gelu_pytorch_tanh)"
        )
    g2 = model_type == "gemma2"
    # Which layers are global: toy's rule is one in `global_every`, the last of each run.
    every = 2 if g2 else k.count("sliding_window_pattern", k.count("_sliding_window_pattern")) or 6
    types = k.get("layer_types")
    if isinstance(types, list) and types:
        if "full_attention" in types:
            every = types.index("full_attention") + 1
        want = [
            "full_attention" if i % every == every - 1 else "sliding_attention"
            for i in range(len(types))
        ]
        if types != want:
            raise BadConfig(
                f"layer_types {types[:8]}... is not one global layer in every {every}; toy's Gemma "
                "cannot run this layout"
            )
    theta = rope_theta_of(k, "full_attention") or (10000.0 if g2 else 1_000_000.0)
    local = (
        theta
        if g2
        else (
            rope_theta_of(k, "sliding_attention") or k.number("rope_local_base_freq", 10000.0, 1.0)
        )
    )
    return GemmaConfig(
        vocab_size=c.vocab,
        n_layer=c.n_layer,
        d_model=c.d_model,
        n_head=c.n_head,
        n_kv_head=c.n_kv_head,
        head_dim=c.head_dim,
        d_ff=c.d_ff,
        max_seq_len=c.context,
        rope_theta=theta,
        rope_local_theta=local,
        sliding_window=k.int("sliding_window"),
        global_every=every,
        norm_eps=c.eps,
        qk_norm=not g2,
        attn_softcap=k.float_or("attn_logit_softcapping", 0.0),
        final_softcap=k.float_or("final_logit_softcapping", 0.0),
        tie_embeddings=c.tied,
        query_pre_attn_scalar=k.int("query_pre_attn_scalar", default=c.head_dim),
    )


def hf_plan(cfg: GemmaConfig) -> dict[str, Planned]:
    # HF stores each norm's w of x * (1 + w); toy's norms hold 1 + w, as llama.cpp's files do.
    return hf_from_plan(gguf_plan(cfg), norm_offset=1.0)


FAMILY = Family(
    "gemma",
    GemmaConfig,
    Gemma,
    hf_types={
        t: HFType(t, lambda k, t=t: hf_config(k, t), "gemma", gguf=t.removesuffix("_text"))
        for t in ("gemma2", "gemma3_text", "gemma3")
    },
    hf_plan=hf_plan,
    archs={
        "gemma2": Arch("gemma2", lambda k: gguf_config(k, "gemma2"), gguf_plan, "gemma"),
        "gemma3": Arch("gemma3", lambda k: gguf_config(k, "gemma3"), gguf_plan, "gemma"),
    },
    targets=TARGETS,
    default_targets="q_proj,v_proj",
    tiny=dict(
        vocab_size=96,
        n_layer=2,
        d_model=64,
        n_head=4,
        n_kv_head=1,
        head_dim=16,
        d_ff=128,
        max_seq_len=64,
        sliding_window=8,
        global_every=2,
        attn_softcap=50.0,
        final_softcap=30.0,
    ),
)
