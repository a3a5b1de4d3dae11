"""Phi-3 (and Phi-4-mini, which GGUF files also call phi3): llama's math with the
projections fused as the files and HF store them.

- `self_attn.qkv_proj` (H*D + 2*K*D rows: queries, then keys, then values) instead of
  q/k/v projections, and `mlp.gate_up_proj` (2*F rows: gate, then up) instead of two:
  kept fused so a LoRA adapter on them is what HF PEFT (`qkv_proj`, `gate_up_proj`) and
  llama.cpp (`attn_qkv`, `ffn_up`) load;
- rotary in the half-split layout on the first `rope_dim` dims of each head (all of them
  for Phi-3; three quarters for Phi-4-mini);
- an untied output head (Phi-4-mini ties it).
"""

from __future__ import annotations

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
    gguf_top,
    hf_common,
    hf_from_plan,
    in_range,
    rope_dims,
)
from toy.models.layers import KVCache, RMSNorm, Rotary, apply_rotary, attend, run_block, silu_mul


@dataclass
class Phi3Config:
    vocab_size: int = 4096
    n_layer: int = 4
    d_model: int = 256
    n_head: int = 8
    n_kv_head: int = 8
    head_dim: int = 32
    rope_dim: int = 32  # dims of each head that rotate (partial rotary when < head_dim)
    d_ff: int = 1024
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    sliding_window: int = 0
    tie_embeddings: bool = False
    arch: str = field(default="phi3")

    def to_dict(self) -> dict:
        return asdict(self)


class Phi3Attention(nn.Module):
    def __init__(self, cfg: Phi3Config):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim, self.window = (
            cfg.n_head,
            cfg.n_kv_head,
            cfg.head_dim,
            cfg.sliding_window,
        )
        self.qkv_proj = nn.Linear(
            cfg.d_model, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim, bias=False
        )
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)

    def forward(
        self, x: torch.Tensor, rope, cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        B, T, _ = x.shape
        H, K, D = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.qkv_proj(x).split([H * D, K * D, K * D], dim=-1)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, K, D).transpose(1, 2)  # (B, K, T, D)
        v = v.view(B, T, K, D).transpose(1, 2)  # (B, K, T, D)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        y = attend(q, k, v, cache, layer, window=self.window)  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B * T, H * D)).view(B, T, -1)  # see layers.py


class Phi3MLP(nn.Module):
    """down(silu(gate) * up), gate and up from one fused projection."""

    def __init__(self, cfg: Phi3Config):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(silu_mul(gate, up))


class Block(nn.Module):
    def __init__(self, cfg: Phi3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Phi3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = Phi3MLP(cfg)

    def forward(self, x, rope, cache=None, layer=0):
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Phi3(nn.Module):
    final_softcap = 0.0

    def __init__(self, cfg: Phi3Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = Rotary(cfg.rope_dim, cfg.max_seq_len, cfg.rope_theta)
        self.checkpointing = False
        for _name, p in self.named_parameters():  # only for a model not loaded from a file
            nn.init.ones_(p) if p.dim() == 1 else nn.init.normal_(p, 0.0, 0.02)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.layers

    def tie_weights(self) -> None:
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T = idx.shape
        start = cache.pos if cache is not None else 0
        x = self.embed_tokens(idx)  # (B, T, C)
        rope = self.rotary.tables(start, T, cache and cache.pad)
        for i, block in enumerate(self.layers):
            x = run_block(block, x, rope, cache, i, checkpointing=self.checkpointing)
        if cache is not None:
            cache.pos += T
        return self.norm(x)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        return self.lm_head(self.hidden(idx, cache))

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


# ------------------------------------------------------------------ GGUF

TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def gguf_config(k: Keys) -> Phi3Config:
    c = gguf_common(k, "phi3")
    return Phi3Config(
        vocab_size=c.vocab,
        n_layer=c.n_layer,
        d_model=c.d_model,
        n_head=c.n_head,
        n_kv_head=c.n_kv_head,
        head_dim=c.head_dim,
        rope_dim=rope_dims(k, c),
        d_ff=c.d_ff,
        max_seq_len=c.context,
        rope_theta=k.float("phi3.rope.freq_base", 10000.0),
        norm_eps=c.eps,
        # llama.cpp runs phi3 without a sliding window whatever the file says; so does toy.
        sliding_window=0,
        tie_embeddings=c.tied,
    )


def gguf_plan(cfg: Phi3Config) -> dict[str, Planned]:
    D, H, K, C, F = cfg.head_dim, cfg.n_head, cfg.n_kv_head, cfg.d_model, cfg.d_ff
    m = gguf_top(cfg, cfg.tie_embeddings)
    for i in range(cfg.n_layer):
        b, t = f"blk.{i}.", f"layers.{i}."
        m.update(
            {
                b + "attn_norm.weight": Planned(t + "input_layernorm.weight", (C,)),
                b + "attn_qkv.weight": Planned(
                    t + "self_attn.qkv_proj.weight", ((H + 2 * K) * D, C)
                ),
                b + "attn_output.weight": Planned(t + "self_attn.o_proj.weight", (C, H * D)),
                b + "ffn_norm.weight": Planned(t + "post_attention_layernorm.weight", (C,)),
                b + "ffn_up.weight": Planned(
                    t + "mlp.gate_up_proj.weight", (2 * F, C)
                ),  # gate rows, then up rows
                b + "ffn_down.weight": Planned(t + "mlp.down_proj.weight", (C, F)),
            }
        )
    return m


# ------------------------------------------------------------------ transformers


def hf_config(k: Keys) -> Phi3Config:
    c = hf_common(k, head_dim_key=False)
    params = k.get("rope_parameters") if isinstance(k.get("rope_parameters"), dict) else {}
    factor = params.get("partial_rotary_factor", k.get("partial_rotary_factor", 1.0)) or 1.0
    factor = in_range(factor, f"{k.label} 'partial_rotary_factor'", 0.0, 1.0)
    rope_dim = int(c.head_dim * factor)
    if rope_dim % 2 or not 0 < rope_dim <= c.head_dim:
        raise BadConfig(f"partial_rotary_factor {factor} does not fit head size {c.head_dim}")
    return Phi3Config(
        vocab_size=c.vocab,
        n_layer=c.n_layer,
        d_model=c.d_model,
        n_head=c.n_head,
        n_kv_head=c.n_kv_head,
        head_dim=c.head_dim,
        rope_dim=rope_dim,
        d_ff=c.d_ff,
        max_seq_len=c.context,
        rope_theta=c.rope_theta or 10000.0,
        norm_eps=c.eps,
        sliding_window=k.count("sliding_window"),
        tie_embeddings=c.tied,
    )


def hf_plan(cfg: Phi3Config) -> dict[str, Planned]:
    return hf_from_plan(gguf_plan(cfg))


FAMILY = Family(
    "phi3",
    Phi3Config,
    Phi3,
    archs={"phi3": Arch("phi3", gguf_config, gguf_plan)},
    hf_types={"phi3": HFType("phi3", hf_config, gguf="phi3")},
    hf_plan=hf_plan,
    targets=TARGETS,
    default_targets="qkv_proj",
    tiny=dict(
        vocab_size=96,
        n_layer=2,
        d_model=64,
        n_head=4,
        n_kv_head=2,
        head_dim=16,
        rope_dim=12,
        d_ff=128,
        max_seq_len=64,
    ),
)
