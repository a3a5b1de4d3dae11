"""Causal self-attention for bf16 on a CPU, by matmuls, in chunks of queries.

torch's CPU flash-attention kernel runs a bf16 training step's attention far below the
machine's bf16 matmul speed: SmolLM2's shape (B4, 9 heads over 3 K/V heads, T256, head
64) took 13 ms a layer forward and backward on a Zen 4, two thirds of it in backward. The
same attention as batched bf16 matmuls and torch's float32 softmax takes 7-8 ms there,
gpt2's bench shape 10.5 against 18, a T512 chat batch 21 against 44 (docs/performance.md,
"Page faults and attention by matmuls"). The matmuls are big enough for oneDNN's bf16
kernels because the query heads that share a K/V head are stacked into one (B, K, G*T,
D) operand: grouped-query attention costs no copy of K or V.

Memory: the forward keeps q, k, v and the output and, when they are small, the bf16
probabilities (KEEP_BYTES a layer: a SmolLM2 LoRA batch of 4 x 256 tokens keeps 3.1 MB a
layer, and its backward skips the scores' matmul, mask and softmax, 18% of the attention);
otherwise backward makes them again from the scores, as flash attention does, to the same
bits (the same matmul and torch's softmax kernel), so a step's numbers do not depend on
which was done. Queries go in chunks whose float32 scores fit CHUNK_BYTES,
small enough to stay in the caches between the passes over them, and a chunk of causal
queries only meets the keys up to its last row: long sequences neither allocate T x T
per head nor multiply the masked half.

Numerics: the scores come out of a bf16 matmul (rounded to bf16, as an eager
implementation under autocast rounds them), the softmax and the gradient's row sums are
float32, the probabilities and dS meet V, K and Q in bf16 (as in the flash kernel), and
K/V gradients are summed over chunks in float32. Output and gradients are as near a
float32 attention as the flash kernel's (tests/models/test_cpu_attention.py).
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 4 << 20  # float32 scores of one chunk of queries, all heads
# The bf16 probabilities of one attention call (every chunk) are kept for backward up to
# this size: n_layer times it at most, against a recomputation of the scores (2-3 ms a
# layer on a SmolLM2 LoRA batch, a Zen 4). A T512 batch of 4 on SmolLM2 (10.5 MB a layer)
# and any long sequence recompute; `--checkpointing` keeps one layer's at a time.
KEEP_BYTES = 8 << 20


def wanted(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a causal, uncached, whole-sequence attention of q (B, H, T, D) over k takes
    this path: bf16 on a CPU, outside a compiled graph. With or without gradients, so that
    a frozen reference (DPO) or an old policy (GRPO) scores a sequence to the same bits as
    the policy being trained."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and k.dtype == torch.bfloat16
        and q.shape[2] > 1
        and q.shape[2] == k.shape[2]
        and not torch.compiler.is_compiling()
    )


def _chunks(B: int, K: int, G: int, T: int, past: int = 0) -> list[tuple[int, int]]:
    """(i0, i1) ranges of queries of about equal size, each one's float32 scores (B, K, G,
    i1 - i0, past + i1) within CHUNK_BYTES (on a Zen 4, 4 MiB chunks ran SmolLM2's attention
    7.1 ms a layer, whole sequences 9.3, 2 MiB 7.3)."""
    n = -(-4 * B * K * G * T * (past + T) // CHUNK_BYTES)  # chunks
    t = max(16, -(-T // n))
    return [(i0, min(T, i0 + t)) for i0 in range(0, T, t)]


def _probs(qc, k, i0: int, scale: float, past: int = 0, pad: torch.Tensor | None = None):
    """Softmax of the scaled causal scores of the queries i0.. of qc (b, K, G, t, D) over
    the keys up to the last of them, k (b, K, past + T, D): float32 (b, K, G, t, past + i0 +
    t). Query i sits at key slot past + i; row r sees no key before slot pad[r]. The bf16
    scores are scaled, masked and widened to float32 in one pass (a mixed-dtype add) and
    the softmax is torch's fused kernel, so backward makes the same bits again."""
    b, K, G, t, D = qc.shape
    keys = past + i0 + t
    s = torch.matmul(qc.reshape(b, K, G * t, D), k[:, :, :keys].transpose(-1, -2))
    mask = torch.full((t, keys), float("-inf")).triu_(past + i0 + 1)  # this chunk's rows only
    if pad is not None:  # (b, 1, 1, t, keys): each row's empty slots too
        empty = torch.arange(keys) < pad[:, None]  # (b, keys)
        mask = mask.masked_fill(empty[:, None, None, None, :], float("-inf"))
    s = torch.add(mask, s.view(b, K, G, t, keys), alpha=scale)
    return torch.softmax(s, dim=-1)


def _kept_bytes(B: int, K: int, G: int, chunks: list[tuple[int, int]], past: int = 0) -> int:
    """Bytes of the bf16 probabilities of every chunk: (B, K, G, i1 - i0, past + i1) each."""
    return sum(2 * B * K * G * (i1 - i0) * (past + i1) for i0, i1 in chunks)


class CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float, past: int = 0, pad: torch.Tensor | None = None):
        B, H, T, D = q.shape
        K = k.shape[1]
        G = H // K
        qg = q.view(B, K, G, T, D)
        out = torch.empty(B, K, G, T, D, dtype=q.dtype)
        chunks = _chunks(B, K, G, T, past)
        kept = []  # each chunk's bf16 probabilities, when they are kept for backward
        keep = any(ctx.needs_input_grad[:3]) and _kept_bytes(B, K, G, chunks, past) <= KEEP_BYTES
        for i0, i1 in chunks:
            t, keys = i1 - i0, past + i1
            p = _probs(qg[:, :, :, i0:i1], k, i0, scale, past, pad).to(q.dtype)
            o = torch.matmul(p.view(B, K, G * t, keys), v[:, :, :keys])
            out[:, :, :, i0:i1] = o.view(B, K, G, t, D)
            if keep:
                kept.append(p)
        ctx.save_for_backward(q, k, v, out, *kept)
        ctx.scale, ctx.past, ctx.pad = scale, past, pad
        return out.view(B, H, T, D)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, *kept = ctx.saved_tensors
        scale, past, pad = ctx.scale, ctx.past, ctx.pad
        B, H, T, D = q.shape
        K = k.shape[1]
        G = H // K
        qg = q.view(B, K, G, T, D)
        go = grad_out.to(q.dtype).reshape(B, K, G, T, D)
        # each row's sum of dO * O: the softmax's backward without the (t, T) product
        delta = (go.float() * out.float()).sum(dim=-1, keepdim=True)  # (B, K, G, T, 1)
        dq = torch.empty_like(qg)
        dk = torch.zeros(k.shape, dtype=torch.float32)
        dv = torch.zeros(v.shape, dtype=torch.float32)
        for n, (i0, i1) in enumerate(_chunks(B, K, G, T, past)):
            t, keys = i1 - i0, past + i1
            kc, vc = k[:, :, :keys], v[:, :, :keys]
            qc = qg[:, :, :, i0:i1]
            goc = go[:, :, :, i0:i1].reshape(B, K, G * t, D)
            # (B, K, G, t, keys)
            p = kept[n] if kept else _probs(qc, k, i0, scale, past, pad).to(q.dtype)
            pb = p.view(B, K, G * t, keys)
            dv[:, :, :keys] += torch.matmul(pb.transpose(-1, -2), goc)
            dp = torch.matmul(goc, vc.transpose(-1, -2)).view(B, K, G, t, keys)
            # dS = P * (dP - delta), P as the forward rounded it (kept or made again: the
            # same bits); the scale is applied to the (t, D) products below
            ds = torch.sub(dp, delta[:, :, :, i0:i1]).mul_(p).to(q.dtype)
            ds = ds.view(B, K, G * t, keys)
            dq[:, :, :, i0:i1] = torch.matmul(ds, kc).mul_(scale).view(B, K, G, t, D)
            dk[:, :, :keys].add_(
                torch.matmul(ds.transpose(-1, -2), qc.reshape(B, K, G * t, D)), alpha=scale
            )
        return dq.view(B, H, T, D), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def causal_attention(
    q, k, v, scale: float | None = None, past: int = 0, pad: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention of q (B, H, T, D) over k, v (B, K, past + T, D), K dividing H: (B, H,
    T, D) in q's dtype, autocast off inside (every product is bf16 by construction). Query i
    sits at slot past + i; with `pad`, row r sees no slot before pad[r] (its prompt's left
    padding: GRPO's completions over their prompt's kept keys, models.layers.PrefixKV)."""
    with torch.autocast("cpu", enabled=False):
        return CausalAttention.apply(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            scale if scale is not None else q.shape[-1] ** -0.5,
            past,
            pad,
        )
