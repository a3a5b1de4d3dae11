"""GPT-2: LayerNorm, learned absolute positions, causal multi-head attention through
SDPA, a GELU (tanh) MLP, and a head tied to the token embedding.

Parameter names follow HF's GPT2LMHeadModel minus its `transformer.` prefix
(`wte`, `wpe`, `h.0.ln_1`, `h.0.attn.c_attn`, `h.0.mlp.c_fc`, `ln_f`, `lm_head`), so an
HF checkpoint maps onto this model by a fixed rename. HF stores its projections as
`Conv1D` with (in, out) weights: transpose `c_attn`, `c_proj`, `c_fc` when converting.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from toy.models.family import Family
from toy.models.layers import GeluMLP, KVCache, attend, run_block


@dataclass
class GPT2Config:
    vocab_size: int = 4096
    n_layer: int = 4
    d_model: int = 256
    n_head: int = 8
    d_ff: int = 0  # 0: GPT-2's 4 * d_model
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    bias: bool = True  # GPT-2 has biases on every Linear and LayerNorm; False drops them all
    tie_embeddings: bool = True
    arch: str = field(default="gpt2")

    def __post_init__(self) -> None:
        if self.d_ff == 0:
            self.d_ff = 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    """Fused q/k/v projection (`c_attn`, as GPT-2 stores it) and an output `c_proj`."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        y = attend(q, k, v, cache, layer)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    """Pre-norm: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.mlp = GeluMLP(cfg.d_model, cfg.d_ff, bias=cfg.bias)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT2(nn.Module):
    final_softcap = 0.0  # the decoder contract (models/family.py)

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.checkpointing = False  # activation checkpointing per block (--checkpointing)
        self.reset_parameters()

    @property
    def blocks(self) -> nn.ModuleList:
        return self.h

    def tie_weights(self) -> None:
        """The head IS the token embedding when the config ties them (one tensor)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def reset_parameters(self) -> None:
        # GPT-2's init: N(0, 0.02) for matrices and embeddings, and the two projections
        # that write into the residual stream (attn.c_proj, mlp.c_proj) scaled by
        # 1/sqrt(2 * n_layer): each block adds two such terms, so the stream's variance
        # stays O(1) with depth.
        std = 0.02
        for name, p in self.named_parameters():
            if ".ln_" in name or name.startswith("ln_"):
                nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.cfg.n_layer))
            else:
                nn.init.normal_(p, 0.0, std)

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Final normalised hidden states (B, T, C) for token ids idx (B, T), at positions
        0..T-1 or continuing from the cache."""
        B, T = idx.shape
        start = cache.pos if cache is not None else 0
        pad = cache.pad if cache is not None else None
        if start + T - (0 if pad is None else int(pad.min())) > self.cfg.max_seq_len:
            # Learned positions stop at max_seq_len: unlike rotary there is nothing to extrapolate.
            raise ValueError(
                f"position {start + T - 1} is past the model's context {self.cfg.max_seq_len}"
            )
        pos = torch.arange(start, start + T, device=idx.device)  # (T,)
        if pad is not None:  # rows at their own positions
            pos = (pos - pad[:, None]).clamp_(min=0)  # (B, T)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C) + (T, C) or (B, T, C)
        for i, block in enumerate(self.h):
            x = run_block(block, x, cache, i, checkpointing=self.checkpointing)
        if cache is not None:
            cache.pos += T
        return self.ln_f(x)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        return self.lm_head(self.hidden(idx, cache))  # (B, T, vocab)

    def new_cache(self, batch: int, max_len: int, lazy: bool = False) -> KVCache:
        p = self.wte.weight
        max_len = min(max_len, self.cfg.max_seq_len)  # no position embedding exists beyond it
        return KVCache(
            self.cfg.n_layer,
            batch,
            self.cfg.n_head,
            max_len,
            self.cfg.head_dim,
            p.device,
            p.dtype,
            lazy=lazy,
        )

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights counted once


# Trained from scratch only (toy writes it to GGUF; it reads none).
FAMILY = Family(
    "gpt2",
    GPT2Config,
    GPT2,
    presets={
        "tiny": dict(n_layer=2, d_model=64, n_head=4, max_seq_len=64),
        "small": dict(n_layer=4, d_model=256, n_head=8, max_seq_len=256),
        # GPT-2 small's shape (HF `gpt2`).
        "gpt2-124m": dict(n_layer=12, d_model=768, n_head=12, max_seq_len=1024),
    },
    default_preset="small",
    tiny=dict(vocab_size=96, n_layer=2, d_model=64, n_head=4, max_seq_len=64),
)
