"""Building blocks shared by the architectures: norms, rotary positions, attention
through `scaled_dot_product_attention`, MLPs, and the KV cache.

Shapes in comments: B batch, T time (sequence), C channels (d_model),
H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from toy.models import cpu_attention, native


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type) and not torch.compiler.is_compiling():
            return _RMSNormCast.apply(x, self.weight, self.eps, compute_dtype(x))
        # Normalise in float32 even under autocast: the mean of squares underflows in bf16.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * x.to(dtype)
        # Under autocast the output goes to matmuls that take it in the compute dtype: cast
        # here once, not once per consumer (q, k, v and LoRA's A each cast it again).
        return y.to(compute_dtype(y))


class _RMSNormCast(torch.autograd.Function):
    """RMSNorm under autocast: the forward is RMSNorm.forward's ops (the same bits); the
    backward keeps x and each row's 1/rms only and works in float32 from them, where
    autograd's graph kept the float32 normalised x too and cast the gradient up and down
    around each of the forward's casts (a bf16 residual stream: three each way a norm)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        xn = (xf * r).to(x.dtype)
        ctx.save_for_backward(x, weight, r)
        # (not torch.mul(..., out=) a bf16 tensor: a mixed-dtype out takes TensorIterator's
        # scalar casting loop, ten times slower than the product and a cast)
        return (weight * xn).to(out_dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight, r = ctx.saved_tensors
        xhat = x.float() * r
        gf = g.float()
        grad_w = None
        if ctx.needs_input_grad[1]:  # a trained norm: sum of g * (x / rms, rounded as forward)
            grad_w = (gf * xhat.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            # d/dx of x r, r = (mean(x^2) + eps)^-1/2: r (gn - xhat mean(gn xhat)), gn = g w
            gn = gf.mul_(weight)
            dot = (gn * xhat).mean(-1, keepdim=True)
            grad_x = gn.sub_(xhat.mul_(dot)).mul_(r).to(x.dtype)
        return grad_x, grad_w, None, None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """autocast's dtype on x's device where autocast is on, else x's own."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class Rotary(nn.Module):
    """Rotary position embedding in the "half-split" layout (HF's `rotate_half`):
    dimension i is paired with i + D/2, not with its neighbour.

    llama.cpp's GGUF stores Q/K rows permuted for the interleaved layout; the GGUF
    reader undoes that permutation so these weights and this rotary agree.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        # The table grows on demand (tables()), so a 32k-context model does not start
        # with 32k rows it may never use.
        self._build(min(max_seq_len, 4096))

    def _build(self, n: int) -> None:
        # Always real CPU tensors (moved with the module): a function of the config, never
        # weights, even when the model is built on the meta device to be loaded.
        inv_freq = 1.0 / (
            self.theta
            ** (
                torch.arange(0, self.head_dim, 2, dtype=torch.float64, device="cpu") / self.head_dim
            )
        )
        t = torch.arange(n, dtype=torch.float64, device="cpu")
        freqs = torch.outer(t, inv_freq)  # (n, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (n, D)
        # Buffers are not saved with the model: they are a pure function of the config.
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def tables(
        self, start: int, T: int, pad: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, D) for positions start..start+T-1, computed once per forward and
        shared by every layer; the table grows when a sequence runs past it (no host sync:
        the bound is known on the host). `pad` (B,), a left-padded cache's (KVCache.pad):
        row b's positions are start - pad[b] onwards, the tables (B, 1, T, D)."""
        if start + T > self.cos.shape[0]:
            device = self.cos.device
            self._build(start + T)
            self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        cos, sin = self.cos[start : start + T], self.sin[start : start + T]  # (T, D)
        if pad is not None:  # rows at their own positions: (B, 1, T, D), gathered
            pos = (torch.arange(start, start + T, device=pad.device) - pad[:, None]).clamp_(min=0)
            cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)
        dt = compute_dtype(cos)  # bf16 under autocast: cast once here, not per layer
        return cos.to(dt), sin.to(dt)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, D) by the tables from `Rotary.tables` (half-split layout). Tables
    narrower than D (partial rotary, Phi-4-mini) rotate the first dims and pass the rest."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # no-op in float32; bf16 under autocast
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def run_block(block: nn.Module, *args, checkpointing: bool = False):
    """block(*args), or with activation checkpointing: only the block's input is kept for
    backward and its inside is recomputed there (about a third more compute for the
    blocks; activation memory falls from every intermediate of every block to one
    (B, T, C) tensor per block). RNG state is replayed, so dropout draws the same."""
    if checkpointing and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint

        return checkpoint(block, *args, use_reentrant=False)
    return block(*args)


class KVCache:
    """Keys/values per layer for generation, `max_len` positions allocated.

    Sized by the caller to what a generation needs (prompt + new tokens), never to the
    model's whole context: a 32k-context 7B would take 8.6 GB before the first token.
    `reserve` grows it (an interactive chat, in chunks) and `truncate` drops positions
    past a point (a chat re-rendered after a reply). Only the first
    `pos` positions are ever read, except by a compiled decode step (models/decode.py),
    which attends over a fixed length with the later positions masked: zeros there, so a
    masked value is never a NaN left in the memory. Written with slice assignment (plain
    tensor ops): `index_copy_` in caches has broken on Apple's MPS backend."""

    def __init__(
        self,
        n_layer: int,
        batch: int,
        n_kv_head: int,
        max_len: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
        lazy: bool = False,
    ):
        self._shape = (batch, n_kv_head, head_dim)
        if lazy and torch.device(device).type == "cpu":
            self.k, self.v = self._lazy(n_layer, max_len, dtype)
        else:
            self.k = [self._new(max_len, device, dtype) for _ in range(n_layer)]
            self.v = [self._new(max_len, device, dtype) for _ in range(n_layer)]
        self.pos = 0  # tokens already stored
        self.max_len = max_len  # positions allocated
        # Left padding, (batch,) or None: row b's first pad[b] slots are empty, never
        # attended to, and the token in slot j sits at position j - pad[b]. Rows of prompts
        # of different lengths decode as one batch this way (models/sample.py).
        self.pad: torch.Tensor | None = None

    def _lazy(self, n_layer: int, n: int, dtype) -> tuple[list, list]:
        """Every layer's keys and values in one anonymous memory map: zeros (the OS's), and
        resident only where written or read, so `lazy` caches of a model's whole context
        cost the positions a generation reaches, not the context. models/decode.py's steps
        are compiled for the buffers' strides: a cache of one size for every generation
        needs them built once (cmd_infer gives the compiled path such a cache)."""
        import mmap

        b, h, d = self._shape
        shape = (2, n_layer, b, h, n, d)
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        buf = mmap.mmap(-1, max(size, 1))
        every = torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape)
        return list(every[0].unbind(0)), list(every[1].unbind(0))

    def _new(self, n: int, device, dtype) -> torch.Tensor:
        b, h, d = self._shape
        return torch.zeros((b, h, n, d), device=device, dtype=dtype)

    def reserve(self, n: int) -> None:
        """Room for at least n positions, keeping what is stored (one copy per layer)."""
        if n <= self.max_len:
            return
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                new = self._new(n, old.device, old.dtype)
                new[:, :, : self.pos] = old[:, :, : self.pos]
                store[i] = new
        self.max_len = n

    def hold_as(self, dtype: torch.dtype) -> None:
        """Every layer's buffers as `dtype` from here on, what they hold converted."""
        for store in (self.k, self.v):
            for i, t in enumerate(store):
                store[i] = t.to(dtype)

    def truncate(self, n: int) -> None:
        """Forget every position from n on (the next tokens are written at n)."""
        self.pos = min(self.pos, max(0, n))

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t = k.shape[2]
        end = self.pos + t
        if end > self.max_len:  # a caller that did not reserve: grow rather than fail
            self.reserve(end)
        self.k[layer][:, :, self.pos : end] = k
        self.v[layer][:, :, self.pos : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class PrefixKV:
    """Prompts' keys and values shared by the rows that continue them, gradients kept: what
    scoring many completions of one prompt runs its prompt through the blocks once for
    (GRPO's log-prob pass, recipes/grpo.py). Two passes over one object:

    - the prompts (P, W), right-padded, as a cache at position 0: each layer's keys and
      values are kept as they are (`update` with no rows yet), and the attention is the
      uncached one;
    - the rows' continuations (R, T), prompt `rows[r]` each: each layer attends over that
      prompt's keys, moved to end at slot W (its left padding `pad`, never seen; rotary
      and learned positions read it as KVCache.pad), then its own.

    Nothing is written in place: autograd takes the prompts' gradient from every row."""

    def __init__(self, lengths: torch.Tensor):
        self.lengths = lengths  # (P,) each prompt's tokens
        self.pos = 0
        self.pad: torch.Tensor | None = None
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.rows: torch.Tensor | None = None

    def continue_rows(self, rows: torch.Tensor) -> None:
        """Turn from the prompts' pass to the continuations' of prompts `rows` (R,): every
        layer's kept keys and values are right-aligned at slot W (once, here, for every
        later pass)."""
        W = self.k[0].shape[2]
        if self.rows is None:
            self.k = [self._aligned(k, W) for k in self.k]
            self.v = [self._aligned(v, W) for v in self.v]
        self.rows, self.pos = rows, W
        self.pad = (W - self.lengths).index_select(0, rows)

    def _aligned(self, x: torch.Tensor, W: int) -> torch.Tensor:
        parts = [
            F.pad(x[p : p + 1, :, :n], (0, 0, W - n, 0))
            for p, n in enumerate(self.lengths.tolist())
        ]
        return torch.cat(parts)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.rows is None:
            self.k.append(k)
            self.v.append(v)
            return k, v
        pk, pv = self.k[layer].index_select(0, self.rows), self.v[layer].index_select(0, self.rows)
        return torch.cat([pk.to(k.dtype), k], 2), torch.cat([pv.to(v.dtype), v], 2)


class StepKV:
    """The cache as a compiled decode step (models/decode.py) sees one layer of it: that
    layer's key/value buffers cut to a fixed span of positions, the new token's slot as a
    (1,) tensor, so that one compiled graph serves every position, and the rows' left
    padding (KVCache.pad) where they have any."""

    def __init__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        pos: torch.Tensor,
        pad: torch.Tensor | None = None,
    ):
        self.k, self.v, self.pos, self.pad = k, v, pos, pad

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.k.index_copy_(2, self.pos, k)
        self.v.index_copy_(2, self.pos, v)
        return self.k, self.v


def kv_cache_bytes(cfg, tokens: int, itemsize: int = 4) -> int:
    """Bytes a KV cache of `tokens` positions takes for a model config (keys and values,
    every layer, its K/V heads): what `toy infer` counts beside the weights."""
    heads = getattr(cfg, "n_kv_head", None) or cfg.n_head
    return 2 * cfg.n_layer * heads * cfg.head_dim * tokens * itemsize


class serial:
    """Torch's CPU ops run on one thread inside this block (restored after it). One token's
    attention over a short cache is ~0.1 ms of work; SDPA's CPU kernel still splits it over
    every thread, and each parallel region waits for all of them to be scheduled: measured on
    a 2-core Zen 4 shared with other processes (load 5), SmolLM2-135M's float32 decode took
    366 ms a token with it parallel, 86 ms with it on one thread (same text)."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        if self.n > 1 and not torch.compiler.is_compiling():
            torch.set_num_threads(1)
        return self

    def __exit__(self, *exc):
        if torch.get_num_threads() != self.n:
            torch.set_num_threads(self.n)
        return False


def _one_token_cpu(q, k, v, mask, gqa: bool, scale) -> torch.Tensor:
    """One new token's attention on a CPU (a decode step), `mask` None or (B, 1, 1, S): a
    few microseconds of work, so no parallel region (see serial), and in float32: the CPU's
    bf16 SDPA ran ~8x slower than float32 here (8 rows over 100 keys: 552 against 76 us, a
    Zen 4), and the softmax belongs in float32 anyway (DESIGN: precision)."""
    with serial():
        if q.dtype == torch.float32:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale
            )
        with torch.autocast("cpu", enabled=False):
            o = F.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=gqa, scale=scale
            )
        return o.to(q.dtype)


def _grouped_one_token(q, k, v, mask, scale) -> torch.Tensor:
    """One new token's attention, each K/V head with its H/K query heads, in float32, as a
    compiled batched decode step traces it (models/decode.py compile_steps(rows=True): a
    bf16 step under autocast): q (B, H, 1, D), k and v (B, K, S, D), mask (B, 1, 1, S) or (1, S).
    Written as products and sums, which inductor fuses into loops that read each key and
    value once; SDPA's CPU kernel there repeated k and v for every query head and made a
    matrix-vector call for each (row, head): 30 of a 32-row SmolLM2 step's ~100 ms on a
    2-core Zen 4. The queries are written out before the products (force_stride_order), else
    inductor recomputes their rotary for every key."""
    B, H, _, D = q.shape
    K, S = k.shape[1], k.shape[2]
    qg = q.float().view(B, K, H // K, 1, D) * (scale if scale is not None else D**-0.5)
    if is_fake(qg):  # tracing: a buffer of its own
        from torch._inductor import inductor_prims

        qg = qg.contiguous()
        qg = inductor_prims.force_stride_order(qg, qg.stride())
    s = (qg * k.float().unsqueeze(2)).sum(-1)  # (B, K, H/K, S)
    s = s.masked_fill(~mask.view(-1, 1, 1, S), float("-inf"))  # mask: (B or 1, 1, 1, S)
    p = torch.softmax(s, dim=-1)
    o = (p.unsqueeze(-1) * v.float().unsqueeze(2)).sum(-2)  # (B, K, H/K, D)
    return o.view(B, H, 1, D).to(q.dtype)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVCache | None = None,
    layer: int = 0,
    window: int = 0,
    scale: float | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of q (B, H, T, D) over k, v (B, K, T, D) through SDPA, with the KV
    cache when generating: (B, H, T, D). K divides H (grouped-query attention).

    window > 0: sliding-window attention, a query sees itself and the window - 1 keys
    before it (Mistral, Gemma's local layers). softcap > 0: scores are capped as
    softcap * tanh(score / softcap) before the softmax (Gemma 2), which SDPA cannot do,
    so that path computes the scores itself."""
    T = q.shape[2]
    gqa = k.shape[1] != q.shape[1]
    stepped = isinstance(cache, StepKV)
    if stepped:  # a compiled decode step: the position is a tensor, the keys a fixed span
        k, v = cache.update(layer, k, v)
        qpos, pad = cache.pos.view(1, 1), cache.pad
    else:
        past = cache.pos if cache is not None else 0
        pad = cache.pad if cache is not None else None
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, K, past+T, D)
        S = past + T  # keys
        if (
            isinstance(cache, PrefixKV)
            and past
            and not softcap
            and (window <= 0 or S <= window)
            and cpu_attention.wanted(q, k[:, :, past:])
        ):  # completions after their prompts' keys, bf16 on a CPU: matmuls
            return cpu_attention.causal_attention(q, k, v, scale, past, pad)
        if pad is None and (past == 0 or T == 1) and not softcap and (window <= 0 or S <= window):
            # Every key is seen: a whole prompt causally, or one new token (a decode step) all
            # of them.
            if T == 1 and q.device.type == "cpu":
                return _one_token_cpu(q, k, v, None, gqa, scale)
            uncached = cache is None or isinstance(cache, PrefixKV)  # prompts kept as they are
            if uncached and cpu_attention.wanted(q, k):  # bf16 on a CPU: matmuls
                return cpu_attention.causal_attention(q, k, v, scale)
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=T > 1, enable_gqa=gqa, scale=scale
            )
        # The T queries sit at positions past..past+T-1: each sees the keys up to itself
        # (every cached one after a prefill), and within the window when there is one.
        qpos = past + torch.arange(T, device=q.device)[:, None]
    kpos = torch.arange(k.shape[2], device=q.device)[None, :]
    m = kpos <= qpos  # (T, S)
    if window > 0:
        m = m & (kpos > qpos - window)
    if pad is not None:  # no row sees its empty slots
        m = m & (kpos >= pad[:, None])[:, None, None, :]  # (B, 1, T, S)
    if T == 1 and not softcap and q.device.type == "cpu" and (pad is not None or stepped):
        if stepped and q.dtype != torch.float32:  # a bf16 compiled step; float32 as it was
            return _grouped_one_token(q, k, v, m, scale)
        return _one_token_cpu(q, k, v, m, gqa, scale)
    if softcap:
        if gqa:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        s = (q @ k.transpose(-2, -1)) * (
            scale if scale is not None else q.shape[-1] ** -0.5
        )  # (B, H, T, S)
        s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~m, float("-inf"))
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=gqa, scale=scale)


class Attention(nn.Module):
    """Multi-head attention with grouped-query K/V heads (n_kv_head divides n_head)."""

    def __init__(
        self,
        d_model: int,
        n_head: int,
        n_kv_head: int,
        head_dim: int,
        bias: bool = False,
        out_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        window: int = 0,
        scale: float | None = None,
        softcap: float = 0.0,
    ):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim, self.window = (
            n_head,
            n_kv_head,
            head_dim,
            window,
        )
        self.scale, self.softcap = scale, softcap  # None: 1/sqrt(head_dim); softcap 0: none
        self.q_proj = nn.Linear(d_model, n_head * head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_head * head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_head * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_head * head_dim, d_model, bias=out_bias)
        # Qwen3 / Gemma 3: an RMSNorm over each head's queries and keys, before rotary.
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim)  # (B, T, H, D)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)  # (B, T, K, D)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, K, T, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, D), (B, K, T, D)
        if rope is not None:  # (cos, sin) from Rotary.tables
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        y = attend(
            q, k, v, cache, layer, window=self.window, scale=self.scale, softcap=self.softcap
        )  # (B, H, T, D)
        # (B*T, H*D), two-dimensional: the product is one matrix product. As (B, 1, H*D), a
        # one-token step of B rows traced as B products of one row each (bmm), which inductor
        # turned into a loop of dot products: 10 of a 32-row SmolLM2 step's ~100 ms.
        y = y.transpose(1, 2).reshape(B * T, self.n_head * self.head_dim)
        return self.o_proj(y).view(B, T, -1)


class _SiluMul(torch.autograd.Function):
    """silu(g) * u, keeping only g and u for backward: autograd's own graph keeps silu(g)
    too, a third (tokens x d_ff) tensor a layer (63 MB over the 1.07B llama's 22 layers at
    T128). The backward runs the ops autograd runs, in its order (mul's, then
    aten::silu_backward), so the gradients are the same bits."""

    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(g, u)
        return F.silu(g) * u

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g, u = ctx.saved_tensors
        grad_g = torch.ops.aten.silu_backward(grad * u, g) if ctx.needs_input_grad[0] else None
        grad_u = grad * F.silu(g) if ctx.needs_input_grad[1] else None
        return grad_g, grad_u


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u (SwiGLU's gate), through _SiluMul where a gradient is wanted."""
    if (
        torch.is_grad_enabled()
        and (g.requires_grad or u.requires_grad)
        and not torch.compiler.is_compiling()
    ):
        return _SiluMul.apply(g, u)
    return F.silu(g) * u


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the llama MLP."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class _GeluTanhBF16(torch.autograd.Function):
    """F.gelu(x, approximate="tanh") on bf16 cpu values through toy's C kernel
    (models/gelu_bf16.c: 2.1-2.9x torch's forward and ~2.1x its backward on a Zen 4, results
    within one bf16 rounding of torch's); keeps x only, as autograd's own gelu does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _gelu_call("toy_gelu_bf16", x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        if grad.dtype != torch.bfloat16 or grad.device.type != "cpu":
            return torch.ops.aten.gelu_backward(grad, x, approximate="tanh")
        return _gelu_call("toy_gelu_backward_bf16", x, grad.contiguous())


def _gelu_call(name: str, x: torch.Tensor, grad: torch.Tensor | None = None) -> torch.Tensor:
    """One of the kernel's two functions over x's values (it splits them between torch's
    threads itself)."""
    out = torch.empty_like(x)
    ptrs = (x.data_ptr(),) if grad is None else (grad.data_ptr(), x.data_ptr())
    native.gelu_bf16()[name](*ptrs, out.data_ptr(), x.numel())
    return out


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh form (GPT-2, ViT, Gemma). bf16 values on a cpu go through toy's C kernel where
    one builds (float32 and every other device: torch's F.gelu, the same bytes as before);
    a traced or compiled graph keeps torch's op."""
    if (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and x.is_contiguous()
        and not is_fake(x)
        and not torch.compiler.is_compiling()
        and native.gelu_bf16() is not None
    ):
        return _GeluTanhBF16.apply(x)
    return F.gelu(x, approximate="tanh")


class GeluMLP(nn.Module):
    """fc -> GELU (tanh approximation, as GPT-2) -> proj."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = True):
        super().__init__()
        self.c_fc = nn.Linear(d_model, d_ff, bias=bias)
        self.c_proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(gelu_tanh(self.c_fc(x)))
