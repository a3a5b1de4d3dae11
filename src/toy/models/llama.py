"""Llama: RMSNorm, rotary positions, grouped-query attention, SwiGLU, tied embeddings.

Parameter names follow HF's LlamaForCausalLM minus its `model.` prefix
(`layers.0.self_attn.q_proj.weight`, ...), so PEFT adapters and HF checkpoints map
onto it by a fixed rename.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from toy.models.layers import Attention, KVCache, RMSNorm, Rotary, SwiGLU


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
        self.self_attn = Attention(cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.head_dim, bias=cfg.qkv_bias)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x, rope, mask=None, cache=None, layer=0):
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, cache, layer)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.reset_parameters()

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

    def hidden(self, idx: torch.Tensor, pos: torch.Tensor | None = None, mask: torch.Tensor | None = None,
               cache: KVCache | None = None) -> torch.Tensor:
        """Final normalised hidden states (B, T, C) for token ids idx (B, T)."""
        B, T = idx.shape
        start = cache.pos if cache is not None else 0
        x = self.embed_tokens(idx)  # (B, T, C)
        rope = self.rotary.tables(start, T, pos)  # once for every layer
        for i, block in enumerate(self.layers):
            x = block(x, rope, mask, cache, i)
        if cache is not None:
            cache.pos += T
        return self.norm(x)

    def forward(self, idx: torch.Tensor, pos: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        return self.lm_head(self.hidden(idx, pos, mask, cache))  # (B, T, vocab)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.embed_tokens.weight
        return KVCache(self.cfg.n_layer, batch, self.cfg.n_kv_head, max_len, self.cfg.head_dim, p.device, p.dtype)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights counted once
