"""Batched sampling for on-policy recipes (GRPO): n completions of one prompt at once.

    gen = torch.Generator(device=model_device).manual_seed(seed)
    groups = sample_groups(model, prompts, n=8, max_new_tokens=128, generator=gen,
                           stop_ids={eos})

The prompt is prefilled once (batch 1, a KV cache of prompt + max_new_tokens positions, at
most the model's context), its keys/values are copied to n rows, and the n rows decode as
one batch, one token per forward, the head on the last position only (the logits
capped as `generate.next_logits` caps them). A row that samples a stop id is dropped from
the batch (its cache rows too), so later steps compute only the rows still going. The
model runs as it is: a LoRA adapter applied unmerged (base + scale * B(A x)), on a float
or a quantized base, under the caller's autocast if one is on (no dtype is forced).

Sampling per row follows `generate.sample_next` (temperature, then top-k, then top-p),
vectorised over the rows; temperature <= 0 is greedy (argmax, no draw).

Determinism: every draw comes from the `generator` given (on the logits' device), none
from torch's global RNG (the model runs in eval mode while sampling, so dropout draws
nothing). Each decode step makes exactly one draw call: `torch.multinomial` over the
live rows' probabilities (R, V), rows in their original order minus the dropped ones;
its single-sample path draws R x V exponentials, row-major. Steps run in order, groups
(`sample_groups`) in the order of the prompts. So the completions are a pure function of
the seed, the model, the prompts, n and the sampling options (on one torch build and
device): the same seed gives the same ids, byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass
class Completion:
    """One sampled completion: `ids` the new tokens, ending with the stop id when one ended
    it (as TRL's completion_ids); `stopped` False when cut at max_new_tokens or at the
    model's context."""

    ids: list[int]
    stopped: bool


def pick(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One token per row of logits (R, V): (R,) ids, by `generate.sample_next`'s rules."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (R, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if 0.0 < top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Keep each row's smallest prefix whose mass reaches top_p (at least one token).
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p > top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def last_logits(model: nn.Module, ids: torch.Tensor, cache) -> torch.Tensor:
    """The logits (B, V) after the last position of ids (B, T): the head on that position
    only, capped as `generate.next_logits` caps them."""
    logits = model.lm_head(model.hidden(ids, cache)[:, -1])
    if model.final_softcap:
        logits = model.final_softcap * torch.tanh(logits / model.final_softcap)
    return logits


def _keep_rows(cache, rows: torch.Tensor) -> None:
    """Only the cache rows `rows` (a (R',) index) from now on, in that order."""
    for store in (cache.k, cache.v):
        for i, t in enumerate(store):
            store[i] = t.index_select(0, rows)


def sample_group(
    model: nn.Module,
    prompt_ids: list[int],
    n: int,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None,
    stop_ids: set[int],
) -> list[Completion]:
    """n completions of one prompt, decoded as one batch (module docstring). `generator`
    (on the model's device) may be None only when greedy (temperature <= 0)."""
    if not prompt_ids:
        raise ValueError("empty prompt")
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"n and max_new_tokens must be >= 1, got {n} and {max_new_tokens}")
    if temperature > 0 and generator is None:
        raise ValueError("sampling at temperature > 0 needs a generator (seeded by the caller)")
    limit = getattr(model.cfg, "max_seq_len", 2048)  # the model's context
    if len(prompt_ids) > limit:
        raise ValueError(
            f"the prompt's {len(prompt_ids)} tokens exceed the model's context of {limit}"
        )
    was_training = model.training
    model.eval()  # no dropout: its draws would come from torch's global RNG, not `generator`
    try:
        with torch.no_grad():
            return _decode(
                model,
                prompt_ids,
                n,
                max_new_tokens,
                limit,
                (temperature, top_k, top_p),
                generator,
                stop_ids,
            )
    finally:
        model.train(was_training)


def _decode(model, prompt_ids, n, max_new_tokens, limit, opts, generator, stop_ids):
    device = next(model.parameters()).device
    size = min(limit, len(prompt_ids) + max_new_tokens)
    one = model.new_cache(1, size)
    logits = last_logits(model, torch.tensor([prompt_ids], device=device), one)  # (1, V)
    # The prompt's keys/values copied to n rows; the first token of each row is drawn from
    # the one prefill's logits.
    cache = model.new_cache(n, size)
    for new, old in ((cache.k, one.k), (cache.v, one.v)):
        for dst, src in zip(new, old):
            dst[:, :, : one.pos] = src[:, :, : one.pos]
    cache.pos = one.pos
    del one
    logits = logits.expand(n, -1)
    out: list[list[int]] = [[] for _ in range(n)]
    live = list(range(n))  # the rows of `out` still in the batch, in batch order
    done = [False] * n
    for step in range(max_new_tokens):
        nxt = pick(logits, *opts, generator)  # (R,)
        toks = nxt.tolist()  # the one transfer to the host a step
        flags = [t in stop_ids for t in toks]
        for row, t, f in zip(live, toks, flags):
            out[row].append(t)
            done[row] = f
        if step + 1 == max_new_tokens or cache.pos >= limit:
            break  # every row cut here: at max_new_tokens, or the context full (as generate)
        if any(flags):
            keep = [i for i, f in enumerate(flags) if not f]
            if not keep:
                break
            rows = torch.tensor(keep, device=device)
            _keep_rows(cache, rows)
            nxt = nxt.index_select(0, rows)
            live = [live[i] for i in keep]
        logits = last_logits(model, nxt.view(-1, 1), cache)
    return [Completion(ids, stopped) for ids, stopped in zip(out, done)]


def sample_groups(
    model: nn.Module,
    prompts: list[list[int]],
    n: int,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None,
    stop_ids: set[int],
) -> list[list[Completion]]:
    """sample_group for each prompt in order, all drawing from the one generator: a step's
    completions are a pure function of the seed."""
    return [
        sample_group(
            model,
            p,
            n,
            max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            generator=generator,
            stop_ids=stop_ids,
        )
        for p in prompts
    ]
