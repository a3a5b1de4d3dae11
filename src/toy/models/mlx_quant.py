"""MLX "affine" quantization in plain torch, bit-identical to `mx.dequantize` / `mx.quantize` (CPU).

An MLX quantized matrix (what `mlx_lm.convert -q` writes for a Linear or an Embedding) is three
tensors per module, all with the same leading dims as the float weight W (out, in):

    weight  uint32 (out, in * bits / 32)   the integers q, packed
    scales  (out, in / group_size)         float16 / bfloat16 / float32 (the model's dtype)
    biases  (out, in / group_size)         same dtype as scales

and W[r, c] = scales[r, c // group_size] * q[r, c] + biases[r, c // group_size]. Bits 2, 3, 4, 5,
6, 8 (1 also works here), group sizes 32, 64, 128.

Packing (found by experiment with mx.dequantize, and as MLX's CPU kernel writes it): a row is one
little-endian bit stream: q[c] occupies bits c*bits .. c*bits + bits - 1 of the row's bytes, lowest
bit first. For bits 1, 2, 4, 8 that is "8/bits values per byte, low bits first"; for 3, 5, 6 a value
may straddle a byte (and a uint32 word): every `bits` bytes hold 8 values, so we unpack in units of
`bits` bytes read as one little-endian integer of at most 48 bits.

Rounding, and why the results match MLX to the bit:
- dequantize: MLX on the CPU multiplies q (cast to the scales' dtype, exact: q <= 255) by the scale,
  rounding to that dtype, then adds the bias, rounding again; torch does the same two ops. (Metal's
  kernel may fuse them into an FMA; we match the CPU.)
- quantize: MLX's CPU kernel works in float32 per group of `group_size`:
      s = max((max - min) / (2^bits - 1), 1e-7), negated unless |min| > |max|
      edge = min if |min| > |max| else max;  q0 = rint(edge / s)
      if q0 != 0: s = edge / q0, b = edge   else: b = 0
      q = clip(rint((w - b) / s), 0, 2^bits - 1)
  so the edge value (the one of larger magnitude) is exactly representable, and only then are s, b
  rounded to the weight's dtype. The q use the float32 s, b, not the rounded ones.
"""

from __future__ import annotations

import torch

BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize accepts in affine mode
GROUP_SIZES = (32, 64, 128)


def _check(bits: int, group_size: int) -> None:
    if bits not in BITS and bits != 1:  # mx.dequantize also reads 1-bit; mx.quantize refuses it
        raise ValueError(f"MLX affine quantization has bits in {BITS}, not {bits}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"MLX affine quantization has group sizes {GROUP_SIZES}, not {group_size}")


def unpack(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """The integers q (int32, shape (..., n)) of a packed uint32 (or int32) tensor
    (..., n * bits / 32)."""
    if weight.dtype not in (torch.uint32, torch.int32):
        raise ValueError(f"packed MLX weights are uint32, not {weight.dtype}")
    lead = weight.shape[:-1]
    raw = weight.contiguous().view(
        torch.uint8
    )  # the row's bytes, little-endian (as MLX and safetensors)
    if bits == 8:
        return raw.to(torch.int32)
    if bits in (1, 2, 4):  # whole values per byte: shift and mask the bytes, no wide words
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=raw.device)
        return (
            ((raw.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(*lead, -1).to(torch.int32)
        )
    units = raw.reshape(*lead, -1, bits).to(
        torch.int64
    )  # `bits` bytes = 8 values = 8 * bits <= 56 bits
    word = (units << torch.arange(0, 8 * bits, 8, device=raw.device)).sum(-1, keepdim=True)
    q = (word >> torch.arange(0, 8 * bits, bits, device=raw.device)) & ((1 << bits) - 1)
    return q.reshape(*lead, -1).to(torch.int32)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `unpack`: integers in [0, 2^bits) of shape (..., n), n a multiple of
    32, to uint32."""
    lead = q.shape[:-1]
    if q.shape[-1] % 32:
        raise ValueError(
            f"the last dim ({q.shape[-1]}) must be a multiple of 32 to pack into uint32"
        )
    if bits == 8:
        raw = q.to(torch.uint8)
    else:
        vals = q.reshape(*lead, -1, 8).to(torch.int64)
        word = (vals << torch.arange(0, 8 * bits, bits, device=q.device)).sum(-1, keepdim=True)
        raw = ((word >> torch.arange(0, 8 * bits, 8, device=q.device)) & 0xFF).to(torch.uint8)
    return raw.reshape(*lead, -1).contiguous().view(torch.uint32)


def dequantize(
    weight: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    group_size: int = 64,
    bits: int = 4,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """W = scales * q + biases per group, in the scales' dtype, as mx.dequantize(mode="affine").
    Defaults are MLX's (group size 64, 4 bits). `dtype`: the result written straight in
    that dtype (the same bits as the scales' dtype's result cast to it, no copy between)."""
    _check(bits, group_size)
    if scales.shape != biases.shape or scales.dtype != biases.dtype:
        raise ValueError(
            f"scales {tuple(scales.shape)} {scales.dtype} and biases {tuple(biases.shape)} "
            f"{biases.dtype} differ"
        )
    n = weight.shape[-1] * 32 // bits
    if weight.shape[:-1] != scales.shape[:-1] or n != scales.shape[-1] * group_size:
        raise ValueError(
            f"weight {tuple(weight.shape)} and scales {tuple(scales.shape)} do not fit "
            f"bits={bits} group_size={group_size}"
        )
    q = unpack(weight, bits).to(scales.dtype).reshape(*scales.shape, group_size)
    w = q * scales.unsqueeze(
        -1
    )  # rounded to the dtype, then the add rounds again: as MLX's CPU path
    if dtype is None or dtype == w.dtype:
        w = w + biases.unsqueeze(-1)
    else:
        w = torch.add(
            w, biases.unsqueeze(-1), out=torch.empty(w.shape, dtype=dtype, device=w.device)
        )
    return w.reshape(*weight.shape[:-1], n)


def quantize(
    w: torch.Tensor, group_size: int = 64, bits: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight uint32, scales, biases) as mx.quantize(w, group_size, bits) on the CPU, bit for bit;
    scales and biases take w's dtype."""
    _check(bits, group_size)
    if bits == 1:
        raise ValueError("mx.quantize has no 1-bit affine mode")
    if not w.is_floating_point() or w.dim() < 2 or w.shape[-1] % group_size:
        raise ValueError(
            f"quantize needs a float tensor of >= 2 dims whose last dim is a multiple of "
            f"{group_size}, not {w.dtype} {tuple(w.shape)}"
        )
    g = w.float().reshape(*w.shape[:-1], -1, group_size)
    n_bins = float((1 << bits) - 1)
    w_max = g.amax(-1, keepdim=True)
    w_min = g.amin(-1, keepdim=True)
    neg_edge = w_min.abs() > w_max.abs()
    scale = ((w_max - w_min) / n_bins).clamp_min(1e-7)
    scale = torch.where(neg_edge, scale, -scale)
    edge = torch.where(neg_edge, w_min, w_max)
    q0 = torch.round(edge / scale)  # torch.round is round-half-even, as C's rint
    exact = q0 != 0
    scale = torch.where(exact, edge / q0, scale)
    bias = torch.where(exact, edge, torch.zeros_like(edge))
    q = torch.round((g - bias) / scale).clamp(0, n_bins).to(torch.int32)
    return (
        pack(q.reshape(w.shape), bits),
        scale.squeeze(-1).to(w.dtype),
        bias.squeeze(-1).to(w.dtype),
    )
