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

A head over GGUF blocks (a QuantLinear: a quantized base's tied or untied output) is
never dequantized whole: `linear_cross_entropy` then walks the VOCABULARY in chunks
instead, once (an online log-sum-exp that carries the gradient along, as flash attention
carries its output), dequantizing each chunk of rows as it goes. `softcap` (Gemma 2) caps
the logits as cap * tanh(z / cap) first.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from toy.models.ordered import ordered, ordered_mm
from toy.models.quant import QuantLinear

IGNORE = -100
CHUNK_BYTES = 16 << 20  # float32 logits per chunk on a CPU: small enough to stay near the caches
# On CUDA a chunk is a few kernel launches and their Python: 16 MB chunks made GPT-2 124M's
# head (V 50304, 16k rows a step) 198 chunks, CPU-bound at 55k tokens/s on an H100.
CUDA_CHUNK_BYTES = 1 << 30
# Under autocast, the trained head's weight gradient in the compute dtype (bench/ab_levers.py
# turns it off to measure what it gives).
HEAD_GRAD_IN_COMPUTE_DTYPE = True
# The logits' gradients a trained head's weight gradient takes in one matmul (_chunked_head_loss)
W_GRAD_BYTES = 64 << 20


def chunk_bytes(device: torch.device | None) -> int:
    return CUDA_CHUNK_BYTES if device is not None and device.type == "cuda" else CHUNK_BYTES


def chunk_rows(vocab: int, device: torch.device | None = None) -> int:
    return max(16, chunk_bytes(device) // (4 * vocab))


def _capped(z: torch.Tensor, softcap: float) -> torch.Tensor:
    """Logits soft-capped where the model caps them (Gemma 2's final soft-cap)."""
    return softcap * torch.tanh(z / softcap) if softcap else z


def _cap(logits: torch.Tensor, softcap: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Capped logits and d(capped)/d(logits), or the logits as they are."""
    if not softcap:
        return logits, None
    t = torch.tanh(logits / softcap)
    return t * softcap, 1 - t * t


def compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmuls run in: autocast's (bf16 on CUDA) when it is on,
    else h's own."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return h.dtype


def _takes_bf16_softmax(dt: torch.dtype, acc: torch.dtype, softcap: float, scale: float) -> bool:
    """Whether a head's chunks take _bf16_softmax: bf16 matmuls, a float32 loss, and no
    soft-cap or temperature on the logits (their float32 path keeps those)."""
    return dt == torch.bfloat16 and acc == torch.float32 and not softcap and scale == 1.0


def _less_one_at(p: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """p[i, at[i]] -= 1 in place (p contiguous): the same bits as scatter_add_ of -1, which
    for bf16 on the CPU copied the whole chunk (512 x 8192: 1.0 ms a call against 0.05 ms,
    eight a 6x384 gpt2 step; docs/performance.md)."""
    flat = p.view(-1)
    idx = torch.arange(p.shape[0], device=p.device) * p.shape[1] + at
    flat[idx] = flat[idx] - 1
    return p


def _mm(a: torch.Tensor, b: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """a @ b; in float32 on the CPU by `ordered_mm`, whose long sums (a vocabulary's rows, a
    chunk's tokens) are the same bytes at any thread count (bf16's products are not: oneDNN
    blocks by thread count even where the sum is short, models/ordered.py)."""
    if dt == torch.float32 and ordered(a):
        return ordered_mm(a, b)
    return a @ b


def _vocab_step(N: int, C: int, device: torch.device) -> int:
    """Rows of a chunked head per chunk: the (N, rows) logits and the (rows, C) dequantized
    weights each within about chunk_bytes (a wide model's head would otherwise dequantize
    100s of MB)."""
    budget = chunk_bytes(device)
    return max(256, min(budget // (4 * max(1, N)), budget // (4 * C)))


def _chunked(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    want_h: bool,
    want_w: bool,
    softcap: float = 0.0,
    scale: float = 1.0,
    per_row: bool = False,
):
    """(loss, grad of loss wrt h or None, wrt weight in float32 or None); float64 stays float64.
    `scale` multiplies the (capped) logits (GRPO: 1 / the sampling temperature); `per_row`:
    the loss of each row (N,) rather than their sum.

    Under autocast the vocabulary matrix is cast to the compute dtype ONCE, here, and the
    matmuls run with autocast off: autocast does not cache the casts of a view (`w.T`) or
    of a frozen tensor, so each chunk's `hc @ w.T` and `g @ w` would cast all of it again
    (a 49k x 576 head is 57 MB a cast, tens of chunks a step)."""
    dt = compute_dtype(h)
    w = weight.to(dt)  # the one cast (a no-op without autocast)
    step = chunk_rows(w.shape[0], h.device)
    acc = torch.promote_types(h.dtype, torch.float32)  # float32, or float64 for gradcheck
    loss = torch.zeros(h.shape[0] if per_row else (), dtype=acc, device=h.device)
    grad_h = torch.empty_like(h) if want_h else None
    grad_w = torch.zeros(w.shape, dtype=acc, device=h.device) if want_w else None
    # bf16: each chunk's softmax in one fused pass over its bf16 logits (_bf16_softmax)
    fused = _takes_bf16_softmax(dt, acc, softcap, scale)
    with torch.autocast(h.device.type, enabled=False):
        for i in range(0, h.shape[0], step):
            hc, tc = h[i : i + step], targets[i : i + step]
            valid = tc != IGNORE
            safe = torch.where(valid, tc, 0)
            if fused:
                logits = hc.to(dt) @ w.T  # (c, V) bf16
                p, lse = _bf16_softmax(logits)
                picked = logits.gather(1, safe[:, None]).squeeze(1).float()
            else:
                logits, dcap = _cap((hc.to(dt) @ w.T).to(acc), softcap)  # (c, V)
                if scale != 1.0:
                    logits = logits * scale
                picked = logits.gather(1, safe[:, None]).squeeze(1)
                # exp(logit - max) once, in place: the log-sum-exp and the softmax both come
                # out of it (logsumexp and then exp(logits - lse) took two passes of exp and
                # a copy)
                m = logits.amax(dim=-1)  # (c,)
                e = logits.sub_(m[:, None]).exp_()
                total = e.sum(dim=-1)
                lse = m + torch.log(total)
            row_loss = torch.where(valid, lse - picked, 0.0)
            if per_row:
                loss[i : i + step] = row_loss
            else:
                loss += row_loss.sum()
            if not (want_h or want_w):
                continue
            # d loss / d logits = softmax - onehot(target), zero on ignored rows; in place.
            if fused:  # (g: the float32 branch below takes it, bench/ab_levers' -headgrad)
                gd = g = _less_one_at(p, safe).mul_(valid[:, None])
            else:
                g = e.div_(total[:, None])
                g.scatter_add_(1, safe[:, None], torch.full_like(picked[:, None], -1.0))
                g.mul_(valid[:, None])
                if dcap is not None:
                    g.mul_(dcap)
                if scale != 1.0:
                    g.mul_(scale)
                gd = g.to(dt)  # once for both products (a no-op without autocast)
            if grad_h is not None:  # a vocabulary-long sum: in fixed runs (models/ordered.py)
                grad_h[i : i + step] = _mm(gd, w, dt).to(h.dtype)
            if grad_w is None:
                continue
            if dt != acc and HEAD_GRAD_IN_COMPUTE_DTYPE:
                # Under autocast the head's gradient matmul runs in the compute dtype too
                # (as autocast runs a peer's), summed into the float32 gradient per chunk:
                # on a CPU with bf16 units a float32 matmul here was a third of the head.
                grad_w.add_(gd.T @ hc.to(dt))
            else:
                grad_w.add_(_mm(g.T.to(acc), hc.to(acc), acc))  # float32: the head's own
    return loss, grad_h, grad_w


def _vocab_chunked(
    h: torch.Tensor,
    head,
    targets: torch.Tensor,
    want_h: bool,
    softcap: float = 0.0,
    logit_scale: float = 1.0,
    per_row: bool = False,
):
    """(loss, grad wrt h or None) for a frozen head whose rows come in chunks
    (`head.rows(i, j, dtype)`, e.g. dequantized GGUF blocks), in ONE pass over the
    vocabulary, as flash attention does: each row's running max m and sum s of exp(logit - m)
    are carried, and so is the gradient's softmax part, sum exp(logit - m) W, rescaled by
    exp(m_old - m_new) whenever the max grows and divided by s at the end; the target's
    part, -W[target], is gathered from the chunk that holds it. Each chunk of the head is
    dequantized and multiplied once for the loss and once for the gradient, never held
    whole."""
    V = head.out_features
    dt = compute_dtype(h)
    acc = torch.promote_types(h.dtype, torch.float32)
    if _takes_bf16_softmax(dt, acc, softcap, logit_scale):
        return _vocab_chunked_bf16(h, head, targets, want_h, per_row)
    N, C = h.shape
    step = _vocab_step(N, C, h.device)
    valid = targets != IGNORE
    safe = torch.where(valid, targets, 0)
    hd = h.to(dt)  # once; each chunk of rows is dequantized straight into dt, autocast off
    off = torch.autocast(h.device.type, enabled=False)
    m = torch.full((N,), float("-inf"), dtype=acc, device=h.device)
    s = torch.zeros(N, dtype=acc, device=h.device)
    picked = torch.zeros(N, dtype=acc, device=h.device)
    soft = (
        torch.zeros(h.shape, dtype=acc, device=h.device) if want_h else None
    )  # sum exp(l - m) dcap W
    target = torch.zeros(h.shape, dtype=acc, device=h.device) if want_h else None  # dcap[t] W[t]
    for v0 in range(0, V, step):
        w = head.rows(v0, min(V, v0 + step), dt)  # (c, C)
        with off:
            logits, dcap = _cap((hd @ w.T).to(acc), softcap)  # (N, c)
        if logit_scale != 1.0:
            logits = logits * logit_scale
        inside = (safe >= v0) & (safe < v0 + w.shape[0])
        at = (safe - v0).clamp(0, w.shape[0] - 1)
        picked += torch.where(inside, logits.gather(1, at[:, None]).squeeze(1), 0.0)
        new_m = torch.maximum(m, logits.max(dim=1).values)
        scale = torch.exp(m - new_m)  # 0 on the first chunk (m = -inf)
        e = logits.sub_(new_m[:, None]).exp_()  # (N, c)
        s = s * scale + e.sum(dim=1)
        m = new_m
        if want_h:
            if dcap is not None:
                e.mul_(dcap)
            with off:
                soft.mul_(scale[:, None]).add_(_mm(e.to(dt), w, dt).to(acc))
            d_t = (
                inside.to(acc)
                if dcap is None
                else torch.where(inside, dcap.gather(1, at[:, None]).squeeze(1), 0.0)
            )
            target.add_(w[at].to(acc) * d_t[:, None])
    lse = m + torch.log(s)
    loss = torch.where(valid, lse - picked, 0.0)
    loss = loss if per_row else loss.sum()
    if not want_h:
        return loss, None
    grad_h = soft.div_(s[:, None]).sub_(target).mul_(valid[:, None])
    if logit_scale != 1.0:
        grad_h.mul_(logit_scale)
    return loss, grad_h.to(h.dtype)


def _bf16_softmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax, log-sum-exp) of each row of bf16 logits (n, c): the softmax in bf16, from
    torch's fused kernel (float32 inside, rounded once, the same bits as a float32 softmax
    cast down); the log-sum-exp in float32, max - log(largest probability), since that
    probability is 1 / sum exp(logit - max) (rounded to bf16: 2^-9 relative, an error below
    0.002 in the log-sum-exp, under the bf16 rounding of the logits themselves). The float32
    way cast the logits up, took the max, subtracted, exponentiated, summed and cast back:
    six passes over the chunk where this takes three."""
    p = torch.softmax(logits, dim=-1)
    return p, logits.amax(dim=-1).float() - torch.log(p.amax(dim=-1).float())


def _vocab_chunked_bf16(
    h: torch.Tensor, head, targets: torch.Tensor, want_h: bool, per_row: bool = False
):
    """_vocab_chunked under bf16 autocast, each chunk's softmax and log-sum-exp from
    _bf16_softmax (the float32 way took 60 ms of a SmolLM2 LoRA step on a Zen 4,
    docs/performance.md). Chunks combine as an online log-sum-exp L; the gradient's
    softmax part sum_c exp(lse_c - L) p_c W_c is rescaled when L grows, as _vocab_chunked
    rescales."""
    V = head.out_features
    dt, acc = torch.bfloat16, torch.float32
    N, C = h.shape
    step = _vocab_step(N, C, h.device)
    valid = targets != IGNORE
    safe = torch.where(valid, targets, 0)
    hd = h.to(dt)
    off = torch.autocast(h.device.type, enabled=False)
    lse = torch.full((N,), float("-inf"), dtype=acc, device=h.device)
    picked = torch.zeros(N, dtype=acc, device=h.device)
    soft = torch.zeros(h.shape, dtype=acc, device=h.device) if want_h else None
    target = torch.zeros(h.shape, dtype=acc, device=h.device) if want_h else None
    for v0 in range(0, V, step):
        w = head.rows(v0, min(V, v0 + step), dt)  # (c, C)
        c = w.shape[0]
        with off:
            logits = hd @ w.T  # (N, c) bf16
            p, chunk = _bf16_softmax(logits)
        inside = (safe >= v0) & (safe < v0 + c)
        at = (safe - v0).clamp(0, c - 1)
        picked += torch.where(inside, logits.gather(1, at[:, None]).squeeze(1).float(), 0.0)
        new = torch.logaddexp(lse, chunk)
        if want_h:
            with off:
                part = (p @ w).float().mul_(torch.exp(chunk - new)[:, None])
            soft.mul_(torch.exp(lse - new)[:, None]).add_(part)
            target.add_(w[at].to(acc) * inside.to(acc)[:, None])
        lse = new
    loss = torch.where(valid, lse - picked, 0.0)
    loss = loss if per_row else loss.sum()
    if not want_h:
        return loss, None
    return loss, soft.sub_(target).mul_(valid[:, None]).to(h.dtype)


class _HeadRowsCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, targets: torch.Tensor, head, softcap: float) -> torch.Tensor:
        loss, grad_h = _vocab_chunked(h, head, targets, ctx.needs_input_grad[0], softcap)
        ctx.save_for_backward(grad_h if grad_h is not None else torch.empty(0))
        return loss

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (grad_h,) = ctx.saved_tensors
        return (
            (grad_h * grad_out.to(grad_h.dtype) if ctx.needs_input_grad[0] else None),
            None,
            None,
            None,
        )


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, softcap: float
    ) -> torch.Tensor:
        loss, grad_h, grad_w = _chunked(
            h, weight, targets, ctx.needs_input_grad[0], ctx.needs_input_grad[1], softcap
        )
        empty = torch.empty(0)
        ctx.save_for_backward(
            empty if grad_h is None else grad_h, empty if grad_w is None else grad_w
        )
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if ctx.needs_input_grad[0] else None
        gw = (grad_w * grad_out).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None


def head_cross_entropy(
    h: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, softcap: float = 0.0
) -> torch.Tensor:
    """linear_cross_entropy through a decoder's output head: its weight, or, for a head
    over quantized blocks (QuantLinear), its rows chunk by chunk (never dequantized whole)."""
    return linear_cross_entropy(
        h, head if isinstance(head, QuantLinear) else head.weight, targets, softcap
    )


def linear_cross_entropy(
    h: torch.Tensor, weight, targets: torch.Tensor, softcap: float = 0.0
) -> torch.Tensor:
    """Summed next-token cross-entropy of logits h @ weight.T against targets (-100:
    ignored), in float32, chunked over the rows (see the module docstring). `weight` is a
    tensor, or a frozen head that gives its rows in chunks (`.rows(i, j)`, a QuantLinear)."""
    if isinstance(weight, QuantLinear):
        if torch.is_grad_enabled() and h.requires_grad:
            return _HeadRowsCrossEntropy.apply(h, targets, weight, softcap)
        return _vocab_chunked(h, weight, targets, False, softcap)[0]
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h, weight, targets, softcap)
    return _chunked(h, weight, targets, False, False, softcap)[0]  # evaluation: the loss alone


class _TokenLogprobs(torch.autograd.Function):
    """Per-token log p(target) (N,) of a frozen head, chunked as the cross-entropy: each
    row's gradient wrt its hidden state is made in the forward pass (it depends on that
    row alone), and backward scales it by the row's incoming gradient."""

    @staticmethod
    def forward(ctx, h, targets, head, softcap: float, scale: float):
        if isinstance(head, QuantLinear):
            ce, grad_h = _vocab_chunked(
                h, head, targets, ctx.needs_input_grad[0], softcap, scale, per_row=True
            )
        else:
            ce, grad_h, _ = _chunked(
                h, head.weight, targets, ctx.needs_input_grad[0], False, softcap, scale, True
            )
        ctx.save_for_backward(grad_h if grad_h is not None else torch.empty(0))
        return -ce

    @staticmethod
    def backward(ctx, grad_out):
        (grad_h,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        return -grad_h * grad_out.to(grad_h.dtype)[:, None], None, None, None, None


def token_logprobs(
    h: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    softcap: float = 0.0,
    temperature: float = 1.0,
) -> torch.Tensor:
    """(N,) log p(target) of each row of h (N, C) through a FROZEN output head, the logits
    capped then divided by `temperature` (as TRL's GRPO scores the tokens it sampled at
    that temperature), 0 where the target is IGNORE; differentiable wrt h. Chunked: the
    (N, vocab) logits never exist whole, and what backward needs is (N, C)."""
    w = head if isinstance(head, QuantLinear) else head.weight
    if isinstance(w, torch.Tensor) and w.requires_grad:
        raise ValueError("token_logprobs takes a frozen head (an adapter recipe's)")
    return _TokenLogprobs.apply(h, targets, head, softcap, 1.0 / temperature)


# ------------------------------------------------------------------ preference losses


def sequence_logprobs(
    h: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, softcap: float = 0.0
) -> torch.Tensor:
    """(S,) sums of log p(target) over each row of targets (S, A) (IGNORE: not counted),
    from hidden states h (S, A, C): a preference loss's per-sequence log-probabilities,
    one chunked head pass a sequence (no (S, A, vocab) logits)."""
    return torch.stack(
        [-head_cross_entropy(h[j], head, targets[j], softcap) for j in range(h.shape[0])]
    )


def dpo_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO's sigmoid loss per pair, with the rewards beta * (log pi - log ref) of the chosen
    and rejected answers (sequence log-probs, each (B,)). label_smoothing e > 0 is
    conservative DPO: the label is taken as flipped with probability e."""
    logits = (chosen - ref_chosen) - (rejected - ref_rejected)
    z = beta * logits
    losses = -F.logsigmoid(z) * (1 - label_smoothing) - F.logsigmoid(-z) * label_smoothing
    return losses, beta * (chosen - ref_chosen).detach(), beta * (rejected - ref_rejected).detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation (branch at -log 2)."""
    return torch.where(
        x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x))
    )


def orpo_loss(
    chosen_mean: torch.Tensor, rejected_mean: torch.Tensor, chosen_nll: torch.Tensor, lam: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO per pair: the chosen NLL minus lam * log sigmoid(log odds ratio), the odds of
    an answer p / (1 - p) taken on its mean token log-probability (as TRL's ORPOTrainer);
    the rewards are lam * those means."""
    c, r = chosen_mean.float(), rejected_mean.float()
    log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
    losses = chosen_nll - lam * F.logsigmoid(log_odds)
    return losses, lam * c.detach(), lam * r.detach()


# ------------------------------------------------------------------ GRPO (rewards)
#
# Matches TRL 1.16's GRPOTrainer (importance_sampling_level "token", one reward
# aggregation "sum_then_normalize"). Shapes: N completions (num_generations per prompt,
# consecutive), T completion positions; mask (N, T) is 1 on the completion's tokens up to
# and including its EOS, 0 after it and on padding.

GRPO_SCALES = ("group", "batch", "none")
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # dapo: TRL 1.16's default
GRPO_STD_EPS = 1e-4  # TRL's: (r - mean) / (std + 1e-4), so a group of equal rewards gives 0


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Standard deviation with Bessel's correction (n - 1, as TRL's nanstd) over the
    non-NaN values; NaN where fewer than two."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    n = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * n / (n - 1)
    var = torch.where(n > 1, var, torch.nan)
    return var.sqrt() if dim is None else var.sqrt().squeeze(dim)


def group_advantages(
    rewards: torch.Tensor, group: int, scale: str = "group", batch: torch.Tensor | None = None
) -> torch.Tensor:
    """(N,) advantages of rewards (N,) in groups of `group` consecutive completions (one
    prompt's): the reward minus its GROUP's mean, divided (scale) by the group's std
    ("group", TRL's default), by the whole batch's std ("batch": the mean stays the
    group's), or not at all ("none"); std unbiased (n - 1), plus 1e-4, as TRL. A NaN
    reward (no reward function scored the completion) is left out of its group's mean and
    std and gets advantage 0, as TRL does for rewards that are all None. The batch is the
    whole step's completions, all processes' (TRL gathers them before this): `batch`, every
    reward of the step where `rewards` is one micro-batch's (default: `rewards` itself)."""
    if scale not in GRPO_SCALES:
        raise ValueError(f"scale {scale!r}: use one of {', '.join(GRPO_SCALES)}")
    r = rewards.float()
    grouped = r.view(-1, group)  # (prompts, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)  # (N,)
    adv = r - mean
    if scale != "none":
        if scale == "group":
            # One completion a group has no spread: TRL takes its std as 0 (not NaN).
            std = _nanstd(grouped, 1) if group > 1 else r.new_zeros(len(grouped))
            std = std.repeat_interleave(group)
        else:
            every = r if batch is None else batch.float()
            std = _nanstd(every) if every.numel() > 1 else r.new_zeros(())
        adv = adv / (std + GRPO_STD_EPS)
    return torch.nan_to_num(adv, nan=0.0)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def grpo_token_losses(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    kl_bias_correction: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(per-token loss (N, T), stats) of GRPO's clipped surrogate, as TRL's:

        ratio = exp(logps - old_logps)
        loss  = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
                + beta * ratio * (exp(ref - logps) - (ref - logps) - 1)   (k3 KL, beta > 0)

    The KL is weighted by the ratio (TRL 1.16's use_bias_correction_kl, on by default;
    kl_bias_correction=False drops it): the unbiased reverse-KL gradient on samples of the
    old policy (DeepSeek-V3.2). It changes the gradient even on-policy, where the ratio is 1
    in value but not in derivative.

    logps (N, T) are the trained policy's log p of the completion tokens (with grad);
    old_logps those of the policy that sampled them (None: the same policy, num_iterations
    1, so ratio = 1 in value and the gradient is A * grad log p), ref_logps the reference's
    (the base with the adapter off; needed when beta > 0); advantages (N,) or (N, T).

    Positions where mask is 0 carry 0: their log-probs are replaced by 0 before anything
    is computed (TRL's fused head leaves 0 there too), so a huge or infinite value after an
    EOS can neither show in the loss nor turn its gradient into NaN (0 * inf).

    stats (detached, masked means over this batch's tokens, TRL's names): clip_ratio/low
    (ratio < 1 - eps_low with A < 0), clip_ratio/high (ratio > 1 + eps_high with A > 0),
    clip_ratio/region (either), kl (beta > 0), and tokens (mask.sum(), to weight the means
    of several micro-batches as TRL's (sum, count) reduction does)."""
    keep = mask.bool()
    m = mask.to(logps.dtype)
    logps = torch.where(keep, logps, 0.0)
    old = logps.detach() if old_logps is None else torch.where(keep, old_logps, 0.0)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages  # (N, 1) or (N, T)
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * adv, clipped * adv)
    stats: dict[str, torch.Tensor] = {}
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference log-probs (ref_logps)")
        d = torch.where(keep, ref_logps, 0.0) - logps
        kl = torch.exp(d) - d - 1  # k3: >= 0 on every token, unbiased on samples of pi
        if kl_bias_correction:
            kl = kl * ratio  # logged so too, as TRL
        loss = loss + beta * kl
        stats["kl"] = _masked_mean(kl.detach(), m)
    with torch.no_grad():
        low = (ratio < 1 - epsilon_low) & (adv < 0)
        high = (ratio > 1 + epsilon_high) & (adv > 0)
        stats["clip_ratio/low"] = _masked_mean(low.to(m.dtype), m)
        stats["clip_ratio/high"] = _masked_mean(high.to(m.dtype), m)
        stats["clip_ratio/region"] = _masked_mean((low | high).to(m.dtype), m)
        stats["tokens"] = m.sum()
    return loss * m, stats


def grpo_loss_sum(
    per_token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, count) of one micro-batch; sum / max(count, 1) is TRL's loss for ONE
    process and ONE micro-batch:

        grpo     sum of each sequence's token mean       count: sequences
        bnpo     sum over tokens                         count: tokens
        dapo     sum over tokens                         count: tokens
        dr_grpo  sum over tokens                         count: sequences * max_completion_length

    toy's loop divides the sums of a whole accumulation step, over all processes, by the
    summed counts. Against TRL, with G micro-batches a step and W processes (TRL divides
    each micro-batch's loss by G and DDP averages the W processes' gradients):

    - dapo: equal. TRL divides every token sum by the generation batch's token count over
      all processes (num_items_in_batch, scaled by G / steps_per_generation and by W
      against DDP's averaging): the step's token sum / the step's tokens, as here, when a
      generation batch is one optimizer step (steps_per_generation = G, TRL's default).
      Otherwise TRL divides by the generation batch's AVERAGE tokens per step, toy by the
      step's own.
    - grpo and dr_grpo: equal whenever every micro-batch holds the same number of
      sequences (TRL's always do): a mean of per-micro-batch sequence means is then the
      mean over all sequences, and B * L is the same for each.
    - bnpo: TRL averages the G * W micro-batches' own token means, each weighted 1 / (G W);
      toy weights each by its share of the step's tokens, tokens_i / sum(tokens). They
      differ when micro-batches hold different numbers of tokens: TRL gives each token of
      a micro-batch of short completions more weight (the per-micro-batch averaging that
      changes the objective under accumulation). toy's bnpo is thus dapo's normalisation;
      with G = W = 1 the two are TRL's bnpo exactly."""
    m = mask.to(per_token_loss.dtype)
    x = per_token_loss * m
    if loss_type == "grpo":
        return (x.sum(-1) / m.sum(-1).clamp(min=1)).sum(), x.new_tensor(float(len(x)))
    if loss_type in ("bnpo", "dapo"):
        return x.sum(), m.sum()
    if loss_type == "dr_grpo":
        return x.sum(), x.new_tensor(float(len(x) * max_completion_length))
    raise ValueError(f"loss_type {loss_type!r}: use one of {', '.join(GRPO_LOSS_TYPES)}")


# ------------------------------------------------------------------ distillation


def generalized_jsd(
    student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float = 1.0
) -> torch.Tensor:
    """(N,) the generalized Jensen-Shannon divergence of each row of logits (N, V), summed
    over the vocabulary, at `temperature`, in float32: TRL's
    GKDTrainer.generalized_jsd_loss per token (Agarwal et al., 2023, eq. 1). beta 0:
    the forward KL(teacher || student) (classic knowledge distillation); 1: the reverse
    KL(student || teacher); between: beta KL(teacher || M) + (1 - beta) KL(student || M)
    with the mixture M = beta teacher + (1 - beta) student (0.5: the JSD)."""
    s = torch.log_softmax(student.float() / temperature, -1)
    t = torch.log_softmax(teacher.float() / temperature, -1)
    return jsd_of_logprobs(s, t, beta)


def jsd_of_logprobs(s: torch.Tensor, t: torch.Tensor, beta: float) -> torch.Tensor:
    """(N,) generalized_jsd of two rows of normalised log-probs (N, B), over any B buckets:
    the vocabulary, or a teacher's top K and the rest of its mass (topk_divergence)."""
    return _jsd_terms(s, t, beta, False)[0]


def _jsd_terms(s: torch.Tensor, t: torch.Tensor, beta: float, want: bool):
    """(N,) jsd_of_logprobs of the student's s = log_softmax(x) against the teacher's t,
    and where `want` its gradient wrt x (N, B) in closed form, no autograd graph (a
    chunk's temporaries are a few (N, B) tensors where autograd's JSD kept about twenty):
    with p = exp(s), g = dL/ds, dL/dx = p * (g - sum(p * g)). Forward KL: p - exp(t);
    reverse KL: g = s - t, whose sum(p * g) is the loss itself; between, with the
    mixture m: g = (1 - beta) (s - m), the teacher's term having none (its derivatives
    through m cancel)."""
    if beta == 0:
        q = t.exp()
        loss = (q * (t - s)).sum(-1)
        return loss, (s.exp().sub_(q) if want else None)
    if beta == 1:
        p, g = s.exp(), s - t
        loss = (p * g).sum(-1)
        return loss, (g.sub_(loss[:, None]).mul_(p) if want else None)
    ls = s - torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))  # s - m
    lt = ls.sub(s).add_(t)  # t - m
    p = s.exp()
    loss = beta * (t.exp() * lt).sum(-1) + (1 - beta) * (p * ls).sum(-1)
    if not want:
        return loss, None
    g = ls.mul_(1 - beta)
    return loss, g.sub_((p * g).sum(-1, keepdim=True)).mul_(p)


def head_matrix(head: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A decoder head's (V, C) weight: the parameter itself (a trained head keeps its
    gradient), or a frozen quantized head's rows dequantized once."""
    if isinstance(head, QuantLinear):
        return head.rows(0, head.out_features, dtype)
    return head.weight


def _logits(h: torch.Tensor, w: torch.Tensor, softcap: float) -> torch.Tensor:
    """float32 logits of rows h through weight w (the matmul in autocast's dtype where it
    is on), soft-capped where the model caps them."""
    z = (h @ w.T if torch.is_autocast_enabled(h.device.type) else h @ w.T.to(h.dtype)).float()
    return _capped(z, softcap)


def _chunked_head_loss(h, w, softcap, per_chunk, want_h: bool, want_w: bool):
    """(sum over chunks of rows of `per_chunk(rows, capped student logits)`, the summed
    count, its gradient wrt h or None, wrt w in float32 or None): the student's logits
    h @ w.T made one chunk at a time and the gradient taken there, as head_cross_entropy's
    are (_chunked_ce): a chunk's logits are made once (a checkpointed chunk made both
    models' logits again in backward), w is cast to autocast's dtype once (autocast casts
    `w.T` again at every chunk: 28M values each for SmolLM2's head), and w's gradient is
    summed in float32 in place. `per_chunk(sl, z, want) -> (loss, count, dloss/dz or
    None)`: z (c, V) the capped logits in float32 (float64 for gradcheck), the gradient
    asked for where `want`; the count (e.g. agreeing positions) carries none."""
    dt = compute_dtype(h)
    acc = torch.promote_types(h.dtype, torch.float32)
    wd = w.detach().to(dt)  # the one cast
    n_rows, vocab = h.shape[0], int(w.shape[0])
    grad_h = torch.zeros_like(h) if want_h else None
    grad_w = None  # the first group's gradient, then the sum (no zeroed (V, C) first)
    total = torch.zeros((), dtype=acc, device=h.device)
    count = torch.zeros((), dtype=torch.long, device=h.device)
    step = chunk_rows(vocab, h.device)
    want = want_h or want_w
    hd = h.detach().to(dt)
    # w's gradient is one matmul over a group of chunks: their logits' gradients kept in
    # the compute dtype (W_GRAD_BYTES at most), so the float32 (V, C) sum is written once
    # a group, not read and written again at every chunk (SmolLM2's 113 MB six times a
    # distill step at batch 4 x 128).
    group = min(n_rows, max(step, W_GRAD_BYTES // (vocab * wd.element_size())))
    held = torch.empty(group, vocab, dtype=dt, device=h.device) if want_w else None
    start = 0  # the first row of the group `held` holds
    with torch.autocast(h.device.type, enabled=False):
        for i in range(0, n_rows, step):
            sl = slice(i, i + step)
            hc = hd[sl]
            z = _capped((hc @ wd.T).to(acc), softcap)
            loss, n, g = per_chunk(sl, z, want)
            total += loss.detach()
            count += n
            if not want:
                continue
            if softcap:  # d(cap tanh(x / cap))/dx = 1 - (capped / cap)^2
                g = g * (1 - (z / softcap).square())
            gd = held[i - start : i - start + hc.shape[0]].copy_(g) if want_w else g.to(dt)
            if grad_h is not None:
                grad_h[sl] = (gd @ wd).to(h.dtype)
            end = i + hc.shape[0]
            if want_w and (end - start + min(step, n_rows - end) > group or end == n_rows):
                part = held[: end - start].T @ hd[start:end]
                grad_w = part.to(acc) if grad_w is None else grad_w.add_(part)
                start = end
    if want_w and grad_w is None:  # no rows
        grad_w = torch.zeros(w.shape, dtype=acc, device=w.device)
    return total, count, grad_h, grad_w


class _ChunkedHeadLoss(torch.autograd.Function):
    """_chunked_head_loss's sum as an autograd node: its gradients are made in forward and
    scaled by the incoming gradient in backward."""

    @staticmethod
    def forward(ctx, h, w, softcap, per_chunk):
        total, count, grad_h, grad_w = _chunked_head_loss(
            h, w, softcap, per_chunk, *ctx.needs_input_grad[:2]
        )
        # Held on ctx, not saved for backward: handed back in backward with no other
        # reference, so autograd takes w's gradient as the parameter's .grad instead of
        # copying it (113 MB for SmolLM2's tied head, a copy each step).
        ctx.grads = (grad_h, grad_w)
        ctx.w_dtype = w.dtype
        ctx.mark_non_differentiable(count)
        return total, count

    @staticmethod
    def backward(ctx, grad_total, _):
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        # in place: each is used once, and w's float32 gradient is the head's size
        gh = grad_h.mul_(grad_total) if grad_h is not None else None
        gw = grad_w.mul_(grad_total).to(ctx.w_dtype) if grad_w is not None else None
        del grad_h, grad_w
        return gh, gw, None, None


def _head_loss(h, w, softcap, per_chunk) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss in float32 (float64 stays), count) of _chunked_head_loss, its gradient
    reaching h and w where autograd asks for them."""
    if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
        total, count = _ChunkedHeadLoss.apply(h, w, softcap, per_chunk)
    else:
        total, count, _, _ = _chunked_head_loss(h, w, softcap, per_chunk, False, False)
    return total, count


def distill_divergence(
    h_s: torch.Tensor,
    head_s: torch.nn.Module,
    h_t: torch.Tensor,
    head_t: torch.nn.Module,
    beta: float,
    temperature: float = 1.0,
    caps: tuple[float, float] = (0.0, 0.0),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed generalized JSD, positions where the two top-1 tokens agree) over N
    positions: the student's hidden states h_s (N, C_s) through its head, the teacher's
    h_t (N, C_t) through its own (the teacher frozen: no gradient), with each model's
    final soft-cap `caps`. The (N, V) logits of the two never exist whole: rows run in
    chunks of about CHUNK_BYTES of float32 logits (SmolLM2's V 49,152: 85 rows a chunk on
    a CPU; Gemma 3's 262,144: 16), each made once, its gradient taken there
    (_ChunkedHeadLoss)."""
    dt = compute_dtype(h_s)
    with torch.no_grad():
        w_t = head_matrix(head_t, dt).to(dt)

    def chunk(sl, z, want):
        with torch.no_grad(), torch.autocast(h_t.device.type, enabled=False):
            t = _capped((h_t[sl].to(dt) @ w_t.T).float(), caps[1])
            agree = (z.argmax(-1) == t.argmax(-1)).sum()
            s = torch.log_softmax(z / temperature, -1)
            t = torch.log_softmax(t.div_(temperature), -1)
            loss, g = _jsd_terms(s, t, beta, want)
        return loss.sum(), agree, (g.div_(temperature) if want else None)

    return _head_loss(h_s, head_matrix(head_s, dt), caps[0], chunk)


# ------------------------------------------------------------------ a teacher's top K


def _topk_chunk(h_t, w_t, cap: float, k: int, temp: float):
    z = _logits(h_t, w_t, cap) / temp
    lse = torch.logsumexp(z, -1, keepdim=True)
    top, ids = z.topk(k, -1)  # sorted: the teacher's top-1 first
    rest = torch.logsumexp(z.scatter(-1, ids, float("-inf")), -1) - lse[:, 0]
    return ids.to(torch.int32), top - lse, rest


@torch.no_grad()
def teacher_topk(
    h_t: torch.Tensor, head_t: torch.nn.Module, k: int, temperature: float = 1.0, cap: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A teacher's K most likely next tokens at each of N positions, at `temperature`: their
    ids (N, K) int32, highest first, their log-probs (N, K) and the log of the mass of
    all the others (N,), in float32, the logits made chunk by chunk (distill_divergence's
    chunks). K < V: the rest always holds some mass."""
    w_t = head_matrix(head_t, compute_dtype(h_t))
    n = chunk_rows(int(w_t.shape[0]), h_t.device)
    parts = [_topk_chunk(h_t[i : i + n], w_t, cap, k, temperature) for i in range(0, len(h_t), n)]
    if not parts:
        e = h_t.new_zeros((0, k), dtype=torch.float32)
        return e.to(torch.int32), e, e[:, 0]
    return tuple(torch.cat(p) for p in zip(*parts))


def topk_divergence(
    h_s: torch.Tensor,
    head_s: torch.nn.Module,
    ids: torch.Tensor,
    t_lp: torch.Tensor,
    t_rest: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
    cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """distill_divergence against a teacher kept as its top K (teacher_topk): the
    generalized JSD over K + 1 buckets, the teacher's K tokens and the rest of the
    vocabulary, the student's distribution gathered into the same buckets (its log-probs
    at those K ids and the log of its mass elsewhere); and the positions where the
    student's top-1 token is the teacher's. In chunks of rows, each made once, as
    distill_divergence's."""

    def chunk(sl, z, want):
        # the buckets' own logits x: the top K's, and the log of the rest's summed mass;
        # s = log_softmax(x), and a rest token's share of dL/dx_rest is its softmax there
        z = z / temperature
        idx = ids[sl].long()
        others = z.scatter(-1, idx, float("-inf"))
        x_rest = torch.logsumexp(others, -1, keepdim=True)
        s = torch.log_softmax(torch.cat([z.gather(-1, idx), x_rest], -1), -1)
        t = torch.cat([t_lp[sl].to(z.dtype), t_rest[sl].to(z.dtype)[:, None]], -1)
        loss, g = _jsd_terms(s, t, beta, want)
        agree = (z.argmax(-1) == idx[:, 0]).sum()
        if not want:
            return loss.sum(), agree, None
        dz = others.sub_(x_rest).exp_().mul_(g[:, -1:]).scatter_(-1, idx, g[:, :-1])
        return loss.sum(), agree, dz.div_(temperature)

    return _head_loss(h_s, head_matrix(head_s, compute_dtype(h_s)), cap, chunk)
