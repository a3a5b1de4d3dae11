"""Llama: RMSNorm, rotary positions, grouped-query attention, SwiGLU, tied embeddings.

Three small explicit variants read from GGUF share this file, each one config field:
qwen2 (`qkv_bias`), qwen3 (`qk_norm`: an RMSNorm over each head's queries and keys) and
mistral-style files (`sliding_window`). Families whose math differs more (Phi-3's fused
projections, Gemma's norms, scaling and local/global layers) have files of their own.

Parameter names follow HF's LlamaForCausalLM minus its `model.` prefix
(`layers.0.self_attn.q_proj.weight`, ...), so PEFT adapters and HF checkpoints map
onto it by a fixed rename.
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
)
from toy.models.layers import Attention, KVCache, RMSNorm, Rotary, SwiGLU, run_block


@dataclass
class LlamaConfig:
    vocab_size: int = 4096
    n_layer: int = 4
    d_model: int = 256
    n_head: int = 8
    n_kv_head: int = 4
    d_ff: int = 0  # 0: SwiGLU's usual 8/3 * d_model, rounded up to a multiple of 64
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False  # qwen2 has q/k/v biases
    head_dim: int = 0  # 0: d_model // n_head
    qk_norm: bool = False  # qwen3: RMSNorm on each head's queries and keys
    sliding_window: int = (
        0  # mistral-style files that declare one: each token sees this many (0: all)
    )
    arch: str = field(default="llama")

    def __post_init__(self) -> None:
        if self.d_ff == 0:
            self.d_ff = 64 * math.ceil(8 * self.d_model / 3 / 64)
        if self.head_dim == 0:
            self.head_dim = self.d_model // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(
            cfg.d_model,
            cfg.n_head,
            cfg.n_kv_head,
            cfg.head_dim,
            bias=cfg.qkv_bias,
            qk_norm=cfg.qk_norm,
            norm_eps=cfg.norm_eps,
            window=cfg.sliding_window,
        )
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x, rope, cache=None, layer=0):
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, layer)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class Llama(nn.Module):
    final_softcap = 0.0  # the decoder contract (models/family.py): no cap on llama's logits

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.checkpointing = False  # activation checkpointing per block (--checkpointing)
        self.reset_parameters()

    @property
    def blocks(self) -> nn.ModuleList:
        return self.layers

    def tie_weights(self) -> None:
        """The head IS the token embedding when the config ties them (one tensor)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def reset_parameters(self) -> None:
        # GPT-2 style: N(0, 0.02) everywhere, and the two projections that write into
        # the residual stream scaled by 1/sqrt(2 * n_layer) so its variance stays O(1).
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.cfg.n_layer))
            else:
                nn.init.normal_(p, 0.0, std)

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Final normalised hidden states (B, T, C) for token ids idx (B, T)."""
        B, T = idx.shape
        start = cache.pos if cache is not None else 0
        x = self.embed_tokens(idx)  # (B, T, C)
        rope = self.rotary.tables(start, T, cache and cache.pad)  # once for every layer
        for i, block in enumerate(self.layers):
            x = run_block(block, x, rope, cache, i, checkpointing=self.checkpointing)
        if cache is not None:
            cache.pos += T
        return self.norm(x)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        return self.lm_head(self.hidden(idx, cache))  # (B, T, vocab)

    def new_cache(self, batch: int, max_len: int, lazy: bool = False) -> KVCache:
        p = (
            self.norm.weight
        )  # the embedding may be GGUF blocks (uint8): the norm has the float dtype
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
        return sum(p.numel() for p in self.parameters())  # tied weights counted once


# ------------------------------------------------------------------ GGUF: llama, qwen2, qwen3
#
# llama.cpp's converter interleaves the Q/K rows of each llama head for ggml's rope, which
# rotates adjacent pairs where HF (and toy's Rotary) rotate i with i + D/2: `qk_heads`
# tells the reader to undo it. qwen2/qwen3 files keep HF's order.

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def gguf_config(k: Keys, arch: str = "llama") -> LlamaConfig:
    c = gguf_common(k, arch)
    if rope_dims(k, c) != c.head_dim:
        raise BadConfig(
            f"partial rotary ({rope_dims(k, c)} of {c.head_dim} head dims) "
            f"is not supported for {arch}"
        )
    return LlamaConfig(
        vocab_size=c.vocab,
        n_layer=c.n_layer,
        d_model=c.d_model,
        n_head=c.n_head,
        n_kv_head=c.n_kv_head,
        d_ff=c.d_ff,
        max_seq_len=c.context,
        rope_theta=k.float(arch + ".rope.freq_base", 10000.0),
        norm_eps=c.eps,
        tie_embeddings=c.tied,
        qkv_bias=arch == "qwen2",
        head_dim=c.head_dim,
        qk_norm=arch == "qwen3",
        sliding_window=int(k.float_or(arch + ".attention.sliding_window", 0))
        if arch == "llama"
        else 0,
    )


def gguf_plan(cfg: LlamaConfig, interleaved: bool = True) -> dict[str, Planned]:
    D, H, K, C = cfg.head_dim, cfg.n_head, cfg.n_kv_head, cfg.d_model
    m = gguf_top(cfg, cfg.tie_embeddings)
    qh, kh = (H, K) if interleaved else (0, 0)
    for i in range(cfg.n_layer):
        b, t = f"blk.{i}.", f"layers.{i}."
        m[b + "attn_norm.weight"] = Planned(t + "input_layernorm.weight", (C,))
        m[b + "ffn_norm.weight"] = Planned(t + "post_attention_layernorm.weight", (C,))
        m.update(gguf_linears(cfg, i, (qh, kh)))
        if cfg.qkv_bias:
            m.update(
                {
                    b + "attn_q.bias": Planned(t + "self_attn.q_proj.bias", (H * D,), qh),
                    b + "attn_k.bias": Planned(t + "self_attn.k_proj.bias", (K * D,), kh),
                    b + "attn_v.bias": Planned(t + "self_attn.v_proj.bias", (K * D,)),
                }
            )
    return m


# -------------------------------------------------- transformers: llama, mistral, qwen2, qwen3


def hf_config(k: Keys, model_type: str) -> LlamaConfig:
    c = hf_common(
        k, head_dim_key=model_type != "qwen2"
    )  # Qwen2 derives its head size from the width
    for key in (
        "mlp_bias",
        "attention_bias",
    ):  # biases on o_proj / the MLP (Qwen2's q/k/v biases are its own)
        if k.get(key):
            raise BadConfig(f"{key}=true is not supported: toy's {model_type} has no such biases")
    window = 0
    if model_type == "mistral" or (
        model_type in ("qwen2", "qwen3") and k.get("use_sliding_window")
    ):
        window = k.count("sliding_window")
    default_theta = 1_000_000.0 if model_type in ("qwen2", "qwen3") else 10000.0
    return LlamaConfig(
        vocab_size=c.vocab,
        n_layer=c.n_layer,
        d_model=c.d_model,
        n_head=c.n_head,
        n_kv_head=c.n_kv_head,
        d_ff=c.d_ff,
        max_seq_len=c.context,
        rope_theta=c.rope_theta or default_theta,
        norm_eps=c.eps,
        tie_embeddings=c.tied,
        qkv_bias=model_type == "qwen2",
        head_dim=c.head_dim,
        qk_norm=model_type == "qwen3",
        sliding_window=window,
    )


def hf_plan(cfg: LlamaConfig) -> dict[str, Planned]:
    return hf_from_plan(gguf_plan(cfg, interleaved=False))


def hf_config_out(cfg: LlamaConfig, arch: str) -> dict:
    """A transformers config.json for a GGUF `llama` model (what hf_config reads back).
    Top-level rope_theta, as transformers 4 writes it and mlx-lm reads it."""
    if arch != "llama" or cfg.sliding_window or cfg.qkv_bias or cfg.qk_norm:
        raise BadConfig(
            f"a {arch} model{' with a sliding window' if cfg.sliding_window else ''} cannot be "
            "written as a model directory yet (toy writes plain llama models)"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
    }


FAMILY = Family(
    "llama",
    LlamaConfig,
    Llama,
    hf_types={
        t: HFType(
            t,
            lambda k, t=t: hf_config(k, t),
            "chatml" if t.startswith("qwen") else None,
            gguf="llama" if t == "mistral" else t,
        )
        for t in ("llama", "mistral", "qwen2", "qwen3")
    },
    hf_plan=hf_plan,
    hf_config_out=hf_config_out,
    archs={
        "llama": Arch("llama", gguf_config, gguf_plan),  # also Mistral
        "qwen2": Arch(
            "qwen2",
            lambda k: gguf_config(k, "qwen2"),
            lambda c: gguf_plan(c, interleaved=False),
            "chatml",
        ),
        "qwen3": Arch(
            "qwen3",
            lambda k: gguf_config(k, "qwen3"),
            lambda c: gguf_plan(c, interleaved=False),
            "chatml",
        ),
    },
    targets=TARGETS,
    default_targets="q_proj,v_proj",
    presets={
        # 2 layers, tiny widths: for tests.
        "tiny": dict(n_layer=2, d_model=64, n_head=4, n_kv_head=2, max_seq_len=64),
        # The demo and default: trains in minutes on a 2-core CPU.
        "small": dict(n_layer=4, d_model=256, n_head=8, n_kv_head=4, max_seq_len=256),
        "llama-25m": dict(n_layer=8, d_model=512, n_head=8, n_kv_head=4, max_seq_len=512),
        # SmolLM2-135M's shape (30 layers, width 576, 9 query / 3 kv heads).
        "smollm2-135m": dict(
            n_layer=30,
            d_model=576,
            n_head=9,
            n_kv_head=3,
            d_ff=1536,
            max_seq_len=2048,
            rope_theta=100000.0,
        ),
    },
    default_preset="small",
    tiny=dict(vocab_size=96, n_layer=2, d_model=64, n_head=4, n_kv_head=2, max_seq_len=64),
)
