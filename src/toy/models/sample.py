"""Batched sampling for on-policy recipes (GRPO): n completions of each prompt at once.

    gen = seeded(model_device, seed)  # torch.Generator(device=...).manual_seed(seed)
    groups = sample_groups(model, prompts, n=8, max_new_tokens=128, generator=gen,
                           stop_ids={eos})

Every prompt's n rows decode as one batch (up to `max_rows` rows), one token per forward,
the head on the last position only (`last_logits`, soft-capped where the model caps).
Each prompt is prefilled once (batch 1, at its own positions) and its keys/values copied
to its n rows, right-aligned: the prompts end at the same slot, a shorter one's
rows left-padded (`KVCache.pad`: those slots are never attended to, and each row's
rotary positions count from its own first token), so rows of prompts of any lengths share
every decode step. A row that samples a stop id is dropped from the batch (its cache rows
too), so later steps compute only the rows still going; except where the blocks have their
compiled batched steps (models/decode.py compile_steps(rows=True)): each batch size is a
graph of its own there, so ended rows stay in the batch until the live ones fit in half of
it, which then goes on as a power of two of rows (_fewer_rows: 32, 16, 8, 4), the cache is
a power of two positions long (its strides are the graph's), and the head runs on the live
rows only, in the same order (so their draws are the same). The
model runs as it is: a LoRA adapter applied unmerged (base + scale * B(A x)), on a float or
a quantized base, under the caller's autocast if one is on (no dtype is forced).

`pick` and `draw` are toy's one sampler: GRPO's rows here and `toy infer`'s tokens
(models/generate.py, a generator from `seeded`) go through them, so the same seed and
prompt give the same tokens in both at batch size 1. Per row: temperature, then top-k,
then top-p, vectorised over the rows; temperature <= 0 is greedy (argmax, no draw).

Determinism: every draw comes from the `generator` given (`seeded`: on the logits'
device, a cpu one for mps), none from torch's global RNG (the model runs in eval mode while
sampling, so dropout draws nothing). Each decode step makes exactly one draw call (`draw`:
one float64 uniform a row, against the live rows' probabilities (R, V), rows in their
original order minus the dropped ones). Steps run in order, batches in the order of the
prompts. So the completions are a pure function of the seed, the model, the prompts, n and
the sampling options (on one torch build and device): the same seed gives the same ids,
byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from toy.models import decode


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
    """One token per row of logits (R, V): (R,) ids. Temperature <= 0: each row's argmax
    (no draw). Else the logits over temperature (in float32); top_k > 0 keeps each row's k
    largest (ties with the k-th kept too); 0 < top_p < 1 keeps each row's smallest prefix,
    most likely first, whose mass reaches top_p (at least one token); one `draw`."""
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
    return draw(probs, generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One id per row of probs (R, V), each with its row's probability (normalised here):
    inverse-CDF sampling, one uniform a row against the row's running sum (in float64, so
    49k small probabilities add up without loss). torch.multinomial draws R x V exponentials
    instead: 24 ms a step for 32 rows of SmolLM2's 49,152 ids, a third of a batched decode
    step on a 2-core Zen 4, against 0.8 ms here. A zero-probability id is never drawn (the
    running sum does not rise there), but at float64's last bit. The draw runs on the
    generator's device (a cpu one for an mps model: `seeded`), the ids come back on probs'."""
    home = probs.device
    if generator is not None and generator.device.type != home.type:
        probs = probs.to(generator.device)
    cdf = probs.double().cumsum(-1)  # (R, V)
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device)
    ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    return ids.clamp_(max=probs.shape[-1] - 1).to(home)


def seeded(device: torch.device | str, seed: int) -> torch.Generator:
    """The generator `draw` draws from for a model on `device`, seeded with `seed`: on that
    device, as the training loop makes GRPO's, except on Apple's mps (no float64 there for
    `draw`'s running sum), where it is a cpu one."""
    device = torch.device(device)
    return torch.Generator(device="cpu" if device.type == "mps" else device).manual_seed(seed)


def last_logits(
    model: nn.Module, ids: torch.Tensor, cache, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """The logits (B, V) after the last position of ids (B, T): the head on that position
    only, soft-capped (final_softcap * tanh(logits / final_softcap)) where the model caps.
    `rows` (an index): the head on those rows only, in that order ((len(rows), V)): a
    batch whose ended rows still decode (compiled steps) spends no head on them."""
    h = model.hidden(ids, cache)[:, -1]
    logits = model.lm_head(h if rows is None else h.index_select(0, rows))
    if model.final_softcap:
        logits = model.final_softcap * torch.tanh(logits / model.final_softcap)
    return logits


def _keep_rows(cache, rows: torch.Tensor) -> None:
    """Only the cache rows `rows` (a (R',) index) from now on, in that order."""
    for store in (cache.k, cache.v):
        for i, t in enumerate(store):
            store[i] = t.index_select(0, rows)
    if cache.pad is not None:
        cache.pad = cache.pad.index_select(0, rows)


def _check(model, prompts, n, max_new_tokens, temperature, generator) -> int:
    """The model's context, after refusing what cannot be sampled."""
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"n and max_new_tokens must be >= 1, got {n} and {max_new_tokens}")
    if temperature > 0 and generator is None:
        raise ValueError("sampling at temperature > 0 needs a generator (seeded by the caller)")
    limit = getattr(model.cfg, "max_seq_len", 2048)  # the model's context
    for p in prompts:
        if not p:
            raise ValueError("empty prompt")
        if len(p) > limit:
            raise ValueError(f"the prompt's {len(p)} tokens exceed the model's context of {limit}")
    return limit


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
    return sample_groups(
        model,
        [prompt_ids],
        n,
        max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        generator=generator,
        stop_ids=stop_ids,
    )[0]


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
    max_rows: int = 64,
) -> list[list[Completion]]:
    """n completions of each prompt, in the prompts' order: the prompts' groups decoded
    together, as few batches of at most `max_rows` rows as whole groups allow (a group
    larger than max_rows is one batch), the batches in order and all drawing from the one
    generator: a step's completions are a pure function of the seed."""
    limit = _check(model, prompts, n, max_new_tokens, temperature, generator)
    per = max(1, max_rows // n)  # prompts a batch
    was_training = model.training
    model.eval()  # no dropout: its draws would come from torch's global RNG, not `generator`
    out: list[list[Completion]] = []
    try:
        with torch.no_grad():
            for i in range(0, len(prompts), per):
                rows = _decode(
                    model,
                    prompts[i : i + per],
                    n,
                    max_new_tokens,
                    limit,
                    (temperature, top_k, top_p),
                    generator,
                    stop_ids,
                )
                out += [rows[j : j + n] for j in range(0, len(rows), n)]
    finally:
        model.train(was_training)
    return out


def _decode(model, prompts, n, max_new_tokens, limit, opts, generator, stop_ids):
    """len(prompts) * n completions, prompt by prompt, as one batch."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)  # the prompts end together, at slot `width`
    size = width + max_new_tokens
    stepped = decode.row_steps(model)  # compiled batched steps: every row stays (module docstring)
    if stepped:
        size = max(decode.ROW_SPAN, 1 << (size - 1).bit_length())
    cache = model.new_cache(len(prompts) * n, size)
    if stepped and torch.is_autocast_enabled(device.type):
        # Under autocast a block's keys and values are its projections in the autocast
        # dtype (rotary and the norms write that dtype too): held so, the cache keeps them
        # exactly and a step reads half the bytes (a 32-row SmolLM2 step at 192 positions:
        # 283 MB of float32 keys and values, more than its bf16 weights).
        cache.hold_as(torch.get_autocast_dtype(device.type))
    pad = [width - len(p) for p in prompts for _ in range(n)]
    firsts = []
    for j, p in enumerate(prompts):
        # Each prompt prefilled alone (batch 1, at positions 0..), its keys/values copied
        # right-aligned to its n rows; the first token of each row is drawn from the one
        # prefill's logits.
        one = model.new_cache(1, len(p))
        firsts.append(last_logits(model, torch.tensor([p], device=device), one).expand(n, -1))
        rows = slice(j * n, (j + 1) * n)
        for new, old in ((cache.k, one.k), (cache.v, one.v)):
            for dst, src in zip(new, old):
                dst[rows, :, width - len(p) : width] = src[:, :, : len(p)]
        del one
    cache.pos = width
    if any(pad):
        cache.pad = torch.tensor(pad, device=device)
    logits = torch.cat(firsts) if len(firsts) > 1 else firsts[0]
    # A row stops at its stop id, at max_new_tokens, or where the next position would pass
    # the model's context (as generate: a prompt of L tokens gets limit - L + 1 at most).
    cap = [min(max_new_tokens, limit - len(p) + 1) for p in prompts for _ in range(n)]
    out: list[list[int]] = [[] for _ in cap]
    live = list(range(len(cap)))  # the rows of `out` still going, in batch order
    done = [False] * len(cap)
    feed = torch.zeros(len(cap), dtype=torch.long, device=device) if stepped else None
    places = list(live)  # stepped: each live row's place in the batch
    at = None  # stepped: those places as an index, where some rows have ended
    while True:
        nxt = pick(logits, *opts, generator)  # the live rows' logits, in their order
        toks = nxt.tolist()  # the one transfer to the host a step
        ends = []
        for row, t in zip(live, toks):
            out[row].append(t)
            done[row] = t in stop_ids
            ends.append(done[row] or len(out[row]) == cap[row])
        if feed is not None and at is None:  # every row is fed
            feed.copy_(nxt)
        elif feed is not None:  # the live rows' places; the ended ones' tokens are never read
            feed.index_copy_(0, at, nxt)
        if any(ends):
            keep = [i for i, e in enumerate(ends) if not e]
            if not keep:
                break
            live = [live[i] for i in keep]
            if stepped:
                places = [places[i] for i in keep]
                fewer = _fewer_rows(len(live), len(feed))
                if fewer:  # the live rows to the front of a smaller batch (module docstring)
                    idx = torch.tensor(places + places[:1] * (fewer - len(places)), device=device)
                    _keep_rows(cache, idx)
                    feed = feed.index_select(0, idx)
                    places = list(range(len(live)))
                at = None if len(places) == len(feed) else torch.tensor(places, device=device)
            else:
                rows = torch.tensor(keep, device=device)
                _keep_rows(cache, rows)
                nxt = nxt.index_select(0, rows)
        logits = last_logits(model, (nxt if feed is None else feed).view(-1, 1), cache, at)
    return [Completion(ids, stopped) for ids, stopped in zip(out, done)]


# Compiled batched steps: a batch whose live rows fit in half of it goes on as the smallest
# power of two of rows that holds them, FEWEST_ROWS at least. A bf16 decode step of SmolLM2
# costs about its rows' FLOPs at 32 rows (63 ms on a 2-core Zen 4) and its weights' reading
# below 8 (31 ms at 8 rows, 26 at 4): a long-tailed prompt set decodes most of its steps
# with 2-4 rows alive, which kept at 32 paid 2.5x. Each batch size is a graph of its own,
# built once a machine (~8 s each there); fewer than 4 rows would save little for another.
FEWEST_ROWS = 4


def _fewer_rows(live: int, rows: int) -> int:
    """The rows a batch of `rows` with `live` rows alive goes on with, or 0 to stay."""
    fewer = max(FEWEST_ROWS, 1 << max(0, live - 1).bit_length())
    return fewer if 2 * fewer <= rows else 0
