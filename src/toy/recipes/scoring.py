"""Log-probs of answers after their prompts, each prompt's blocks run once where the rows
share it: what GRPO's loss reads of its completions (completion_logps) and the preference
recipes of their answers (recipes/pairs.py answer_sums). Not a recipe."""

from __future__ import annotations

import torch

from toy.models.layers import PrefixKV, compute_dtype
from toy.models.losses import token_logprobs

# Rows a chunk of the log-prob forward and backward (token_logps): on SmolLM2's 32-row
# batches on a 2-core Zen 4 (bf16), a step took 12.8 s as one chunk, 10.1 s in chunks of 8,
# 10.3 s in chunks of 4.
CHUNK = 8


def completion_logps(
    m, b: dict[str, torch.Tensor], temp: float, chunk: int = CHUNK, share: bool | None = None
) -> torch.Tensor:
    """(N, T) log-probs of each completion token of batch b at temperature temp (0 where
    padded): b's "ids" (N, L) right-padded prompt + completion rows, "pos" (N, T) the
    position whose hidden state predicts each completion token "tgt" (N, T), "mask".

    The rows run shortest first in chunks of `chunk`, each cut to its own longest row:
    completions of one batch differ a lot in length (5 to 128 tokens is common), and a
    batch padded to its longest row spent about half its forward and backward on padding
    (SmolLM2, 32 rows of 38 tokens on average). Right padding is never seen by the
    positions before it, so a row's log-probs do not depend on where it is cut.

    share (None: as shares says, where the blocks compute in bf16, without --checkpointing
    or --compile): each distinct prompt runs through the blocks once, its G completions
    after it (shared_logps). In float32 every row runs whole, as it always has: the
    reference bytes."""
    if share if share is not None else shares(m):
        return shared_logps(m, b, temp, chunk)
    pos, mask = b["pos"], b["mask"]  # (N, T)
    need = (pos * mask.long()).amax(1) + 1  # inputs a row needs: up to its last position
    order = torch.argsort(need, stable=True)
    parts = []
    for rows in order.split(chunk):
        n = int(need[rows].max())
        h = m.hidden(b["ids"][rows, :n])  # (R, n, C)
        p = pos[rows]
        hg = h.gather(1, p[..., None].expand(-1, -1, h.shape[-1]))  # (R, T, C)
        lp = token_logprobs(
            hg.flatten(0, 1), m.lm_head, b["tgt"][rows].flatten(), m.final_softcap, temp
        )
        parts.append(lp.view(p.shape))
    return torch.cat(parts).index_select(0, torch.argsort(order))


def shares(m) -> bool:
    """Whether m's rows share their prompts' blocks by default: where the blocks compute in
    bf16 (float32 runs every row whole, the reference bytes), m does not recompute its
    blocks in backward (checkpointing), and its blocks are not compiled (--compile: a
    block built for a batch's shape would meet the prompts' and the answers' passes, each
    of its own lengths, and be built again for each until dynamo's limit)."""
    p = next(p for p in m.parameters() if p.is_floating_point())
    compiled = any(getattr(x, "_compiled_call_impl", None) is not None for x in m.modules())
    return compute_dtype(p) == torch.bfloat16 and not checkpointing(m) and not compiled


def checkpointing(m) -> bool:
    """Whether m (or the model under its adapter) recomputes its blocks in backward: a
    recomputed block would meet PrefixKV turned to the continuations."""
    return any(getattr(x, "checkpointing", False) for x in m.modules())


def shared_logps(m, b: dict[str, torch.Tensor], temp: float, chunk: int) -> torch.Tensor:
    """completion_logps with each distinct prompt's blocks run once (models.layers.PrefixKV):
    the prompts as one right-padded batch, then the completions shortest first in chunks,
    each attending over its prompt's kept keys and values. The hidden state at a prompt's
    last token predicts its rows' first tokens; a completion's own tokens, but its last,
    predict the rest. A GRPO step of 4 prompts x 8 completions of SmolLM2 (prompts of ~35
    tokens, completions of 10-128) ran its blocks over 27% fewer tokens this way."""
    pos, tgt = b["pos"], b["tgt"]  # (N, T)
    N, T = pos.shape
    n = b["mask"].sum(1).long()  # each row's completion tokens
    live = (n > 0).nonzero().flatten()  # a row of none has nothing to score
    prompts: dict[tuple[int, ...], int] = {}
    of = []  # each live row's prompt
    for r in live.tolist():
        p = tuple(b["ids"][r, : int(pos[r, 0]) + 1].tolist())
        of.append(prompts.setdefault(p, len(prompts)))
    dev = pos.device
    out = torch.zeros(N, T, device=dev)
    if not prompts:
        return out
    lengths = torch.tensor([len(p) for p in prompts], device=dev)
    ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
    for j, p in enumerate(prompts):
        ids[j, : len(p)] = torch.tensor(p)
    kv = PrefixKV(lengths)
    hp = m.hidden(ids.to(dev), kv)  # (P, W, C)
    last = hp[torch.arange(len(prompts), device=dev), lengths - 1]  # (P, C)
    of = torch.tensor(of, device=dev)
    order = torch.argsort(n[live], stable=True)
    parts = []
    for rows in order.split(chunk):
        who, r = of[rows], live[rows]
        k = int(n[r].max())  # the chunk's positions: its prompts' last, k - 1 of its own
        h = last.index_select(0, who)[:, None]  # (R, 1, C)
        if k > 1:
            kv.continue_rows(who)
            own = m.hidden(tgt[r, : k - 1].clamp(min=0), kv)  # right padding: never read
            h = torch.cat([h, own], 1)  # (R, k, C)
        lp = token_logprobs(h.flatten(0, 1), m.lm_head, tgt[r, :k].flatten(), m.final_softcap, temp)
        parts.append(torch.nn.functional.pad(lp.view(len(r), k), (0, T - k)))
    return out.index_copy(0, live[order], torch.cat(parts).to(out.dtype))
