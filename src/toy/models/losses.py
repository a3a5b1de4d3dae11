"""Cross-entropy through the output head without the (N, vocab) logits.

`linear_cross_entropy(h, W, targets)` equals

    F.cross_entropy((h @ W.T).float(), targets, ignore_index=-100, reduction="sum")

but walks the rows in chunks. Each chunk's logits are made, turned into the loss and,
when gradients are wanted, straight into the gradients for h and W (softmax minus the
one-hot target, times W or h), then dropped. The full logits, their log-softmax and
the gradient of both never exist at once: with a 49k vocabulary and 1,024 tokens that
is 200 MB per copy, and the biggest tensors of a LoRA step. No work is repeated: the
backward pass only scales the gradients made here by the incoming gradient.

Shapes: h (N, C), W (V, C), targets (N,) with -100 for positions that carry no loss.
"""

from __future__ import annotations

import torch

IGNORE = -100
CHUNK_BYTES = 16 << 20  # float32 logits per chunk: small enough to stay near the caches


def chunk_rows(vocab: int) -> int:
    return max(16, CHUNK_BYTES // (4 * vocab))


def _chunked(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, want_h: bool, want_w: bool):
    """(loss, grad of loss wrt h or None, wrt weight in float32 or None); float64 stays float64."""
    w = weight.to(h.dtype)  # a no-op in float32; the bf16 copy under CUDA autocast
    step = chunk_rows(w.shape[0])
    acc = torch.promote_types(h.dtype, torch.float32)  # float32, or float64 for gradcheck
    loss = torch.zeros((), dtype=acc, device=h.device)
    grad_h = torch.empty_like(h) if want_h else None
    grad_w = torch.zeros(w.shape, dtype=acc, device=h.device) if want_w else None
    for i in range(0, h.shape[0], step):
        hc, tc = h[i : i + step], targets[i : i + step]
        logits = (hc @ w.T).to(acc)  # (c, V)
        lse = torch.logsumexp(logits, dim=-1)  # (c,)
        valid = tc != IGNORE
        safe = torch.where(valid, tc, 0)
        picked = logits.gather(1, safe[:, None]).squeeze(1)
        loss += torch.where(valid, lse - picked, 0.0).sum()
        if not (want_h or want_w):
            continue
        # d loss / d logits = softmax - onehot(target), zero on ignored rows; in place.
        g = logits.sub_(lse[:, None]).exp_()
        g.scatter_add_(1, safe[:, None], torch.full_like(picked[:, None], -1.0))
        g.mul_(valid[:, None])
        if grad_h is not None:
            grad_h[i : i + step] = (g.to(w.dtype) @ w).to(h.dtype)
        if grad_w is not None:
            grad_w.addmm_(g.T, hc.to(acc))
    return loss, grad_h, grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss, grad_h, grad_w = _chunked(h, weight, targets, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        empty = torch.empty(0)
        ctx.save_for_backward(empty if grad_h is None else grad_h, empty if grad_w is None else grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if ctx.needs_input_grad[0] else None
        gw = (grad_w * grad_out).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of logits h @ weight.T against targets (-100:
    ignored), in float32, chunked over the rows (see the module docstring)."""
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h, weight, targets)
    return _chunked(h, weight, targets, False, False)[0]  # evaluation: the loss alone
