"""Streaming one-row generation with a KV cache (`toy infer`): prefill the prompt once,
then one token per forward, each token yielded as it comes.

The tokens are drawn by models/sample.py's one sampler (`pick`: temperature, then top-k,
then top-p; temperature <= 0 is greedy; `draw`'s inverse-CDF draw), from a generator that
`sample.seeded` makes as GRPO's are made (on the model's device, seeded once), so the same
seed and prompt give the same tokens here as `sample_groups(..., n=1)` gives at batch
size 1. What this adds to that sampler: a token at a time, and a cache carried across
calls (an interactive chat's turns)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn

from toy.models.sample import last_logits, pick, seeded


def next_logits(model: nn.Module, ids: torch.Tensor, cache) -> torch.Tensor:
    """The logits (V,) after the last of ids (1, T): `sample.last_logits` of the one row
    (the head on the last position only, soft-capped where the model caps)."""
    return last_logits(model, ids, cache)[0]


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
    the model's context is full). Sampled by `sample.pick` from `sample.seeded(device,
    seed)`: one draw a token, in order, as `sample_groups` draws for one row.

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
    gen = seeded(device, seed) if temperature > 0 else None
    ids = torch.tensor([prompt_ids[-room:]], device=device)
    logits = last_logits(model, ids, cache)  # (1, V)
    for _ in range(max_new_tokens):
        nxt = int(pick(logits, temperature, top_k, top_p, gen))
        if stop_ids and nxt in stop_ids:
            return
        yield nxt
        if cache.pos >= limit:
            return  # context full
        logits = last_logits(model, torch.tensor([[nxt]], device=device), cache)
