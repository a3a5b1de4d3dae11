"""Building blocks shared by the architectures: norms, rotary positions, attention
through `scaled_dot_product_attention`, MLPs, and the KV cache.

Shapes in comments: B batch, T time (sequence), C channels (d_model),
H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 even under autocast: the mean of squares underflows in bf16.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


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
        self._build(max_seq_len)

    def _build(self, n: int) -> None:
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        t = torch.arange(n, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # (n, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (n, D)
        # Buffers are not saved with the model: they are a pure function of the config.
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def tables(self, start: int, T: int, pos: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for one forward pass, computed once and shared by every layer.

        pos None: positions start..start+T-1, a slice of the table. pos (T,) or (B, T):
        explicit positions (packed sequences restart them per document), which must lie
        below start + T: a token's position never exceeds its place in the stream. That
        bound is what lets the table grow here, without reading pos back from the device
        (a host sync, and a graph break under torch.compile).
        """
        if start + T > self.cos.shape[0]:
            device = self.cos.device
            self._build(start + T)
            self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        if pos is None:
            cos, sin = self.cos[start : start + T], self.sin[start : start + T]  # (T, D)
        else:
            cos, sin = self.cos[pos], self.sin[pos]  # (T, D) or (B, T, D)
            if pos.dim() == 2:  # per-sample positions: (B, 1, T, D) to broadcast over heads
                cos, sin = cos[:, None], sin[:, None]
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, D) by the tables from `Rotary.tables` (half-split layout)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # no-op in float32; bf16 under autocast
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class KVCache:
    """Preallocated keys/values per layer. Written with slice assignment (plain tensor
    ops): `index_copy_` in caches has broken on Apple's MPS backend."""

    def __init__(self, n_layer: int, batch: int, n_kv_head: int, max_len: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype):
        shape = (batch, n_kv_head, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.pos = 0  # tokens already stored
        self.max_len = max_len

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = k.shape[2]
        self.k[layer][:, :, self.pos : self.pos + t] = k
        self.v[layer][:, :, self.pos : self.pos + t] = v
        end = self.pos + t
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class Attention(nn.Module):
    """Multi-head attention with grouped-query K/V heads (n_kv_head divides n_head)."""

    def __init__(self, d_model: int, n_head: int, n_kv_head: int, head_dim: int, bias: bool = False,
                 out_bias: bool = False):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, head_dim
        self.q_proj = nn.Linear(d_model, n_head * head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_head * head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_head * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_head * head_dim, d_model, bias=out_bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None = None, cache: KVCache | None = None,
                layer: int = 0) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, K, T, D)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, K, T, D)
        if rope is not None:  # (cos, sin) from Rotary.tables
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, K, past+T, D)
        gqa = self.n_kv_head != self.n_head
        if mask is not None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        elif cache is not None and cache.pos > 0:
            # After a prefill the T new queries sit at positions past..past+T-1: each
            # sees every cached key plus the new ones up to itself.
            past = cache.pos
            m = None
            if T > 1:
                kpos = torch.arange(past + T, device=x.device)
                m = kpos[None, :] <= (past + torch.arange(T, device=x.device))[:, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=gqa)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim)  # (B, T, H*D)
        return self.o_proj(y)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the llama MLP."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GeluMLP(nn.Module):
    """fc -> GELU (tanh approximation, as GPT-2) -> proj."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = True):
        super().__init__()
        self.c_fc = nn.Linear(d_model, d_ff, bias=bias)
        self.c_proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))
