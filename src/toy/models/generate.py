"""Sampling with a KV cache: prefill the prompt once, then one token per forward."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator | None
) -> int:
    """logits: (V,). temperature 0 is greedy."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits.float() / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if 0.0 < top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = sorted_p.cumsum(-1) - sorted_p > top_p
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs /= probs.sum()
    return int(torch.multinomial(probs, 1, generator=gen))


def next_logits(model: nn.Module, ids: torch.Tensor, cache) -> torch.Tensor:
    """The logits (V,) after the last of ids (1, T), through the decoder contract: the head
    runs on the last position only (a prompt's other positions need no logits)."""
    logits = model.lm_head(model.hidden(ids, cache)[0, -1])
    if model.final_softcap:
        logits = model.final_softcap * torch.tanh(logits / model.final_softcap)
    return logits


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: set[int] | None = None,
    cache=None,
) -> Iterator[int]:
    """Yield new token ids one at a time (stops at a stop id, which is not yielded, or when
    the model's context is full).

    The KV cache holds the prompt and the new tokens, no more: len(prompt) + max_new_tokens
    positions (at most the context), not the model's whole context. Pass `cache` (from
    model.new_cache) to continue a conversation: the prompt ids are then only the new
    tokens since the cache's last position, and it grows if it has too little room.
    """
    if not prompt_ids:
        raise ValueError("empty prompt")
    device = next(model.parameters()).device
    limit = getattr(model.cfg, "max_seq_len", 2048)  # the model's context
    if cache is None:
        cache = model.new_cache(1, min(limit, len(prompt_ids) + max_new_tokens))
    else:
        cache.reserve(min(limit, cache.pos + len(prompt_ids) + max_new_tokens))
    room = limit - cache.pos
    if room < 1:
        raise ValueError(f"the cache already holds the model's whole context ({limit} tokens)")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.tensor([prompt_ids[-room:]], device=device)
    logits = next_logits(model, ids, cache)
    for _ in range(max_new_tokens):
        nxt = sample_next(logits.cpu(), temperature, top_k, top_p, gen)
        if stop_ids and nxt in stop_ids:
            return
        yield nxt
        if cache.pos >= limit:
            return  # context full
        logits = next_logits(model, torch.tensor([[nxt]], device=device), cache)
