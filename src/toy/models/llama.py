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

import torch
import torch.nn as nn

from toy.models.configs import LlamaConfig  # noqa: F401  (the config lives with the others, torch-free)
from toy.models.layers import Attention, KVCache, RMSNorm, Rotary, SwiGLU, run_block


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.head_dim, bias=cfg.qkv_bias,
                                   qk_norm=cfg.qk_norm, norm_eps=cfg.norm_eps, window=cfg.sliding_window)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x, rope, cache=None, layer=0):
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, layer)
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
        self.tie_weights()
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.checkpointing = False  # activation checkpointing per block (--checkpointing)
        self.reset_parameters()

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
        rope = self.rotary.tables(start, T)  # once for every layer
        for i, block in enumerate(self.layers):
            x = run_block(block, x, rope, cache, i, checkpointing=self.checkpointing)
        if cache is not None:
            cache.pos += T
        return self.norm(x)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        return self.lm_head(self.hidden(idx, cache))  # (B, T, vocab)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.norm.weight  # the embedding may be GGUF blocks (uint8): the norm has the float dtype
        return KVCache(self.cfg.n_layer, batch, self.cfg.n_kv_head, max_len, self.cfg.head_dim, p.device, p.dtype)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights counted once
