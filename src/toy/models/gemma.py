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
import torch
import torch.nn as nn
import torch.nn.functional as F

from toy.models.configs import GemmaConfig
from toy.models.layers import Attention, KVCache, RMSNorm, Rotary, run_block


class GeluGated(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)): Gemma's MLP."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: GemmaConfig, layer: int):
        super().__init__()
        self.is_global = cfg.is_global(layer)
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # None where the scalar is the head size: SDPA's own default, the same bits as before.
        scale = None if cfg.query_pre_attn_scalar == cfg.head_dim else cfg.query_pre_attn_scalar ** -0.5
        self.self_attn = Attention(cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.head_dim, qk_norm=cfg.qk_norm,
                                   norm_eps=cfg.norm_eps, window=0 if self.is_global else cfg.sliding_window,
                                   scale=scale, softcap=cfg.attn_softcap)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = GeluGated(cfg.d_model, cfg.d_ff)
        self.post_feedforward_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, x, ropes, cache=None, layer=0):
        rope = ropes[0] if self.is_global else ropes[1]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, cache, layer))
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

    def tie_weights(self) -> None:
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def reset_parameters(self) -> None:
        # Only for a model not loaded from a file (tests): N(0, 0.02), norms at identity.
        for name, p in self.named_parameters():
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
        ropes = (self.rotary.tables(start, T), self.rotary_local.tables(start, T))
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

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.norm.weight
        return KVCache(self.cfg.n_layer, batch, self.cfg.n_kv_head, max_len, self.cfg.head_dim, p.device, p.dtype)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
