"""GGUF block dequantization in plain torch, bit-identical to `gguf.quants.dequantize`.

`dequantize(raw, qtype, n_cols)` turns the bytes of a GGUF tensor, a uint8 tensor of
shape (rows, row_bytes), into (rows, n_cols) floats on whatever device `raw` lives on.
Only elementwise torch ops are used (shifts, masks, dtype views, mul/add), vectorised
over all blocks at once, so the same code runs on cpu, cuda and mps.

A row is n_cols / block_size blocks laid end to end. Block layouts (f16 = one IEEE half,
QK_K = 256; "q" below is the unpacked integer, "sub" a sub-block of the block):

    Q4_0  (32, 18)   d:f16 qs[16]                 x = d * (q - 8)     low nibbles first
    Q4_1  (32, 20)   d:f16 m:f16 qs[16]           x = d * q + m
    Q5_0  (32, 22)   d:f16 qh[4] qs[16]           x = d * (q - 16)    bit 4 of q in qh
    Q5_1  (32, 24)   d:f16 m:f16 qh[4] qs[16]     x = d * q + m
    Q8_0  (32, 34)   d:f16 qs[32] int8            x = q * d
    Q2_K  (256, 84)  scales[16] qs[64] d dmin     x = (d*sc) * q - (dmin*m)  16 subs of 16
    Q3_K  (256, 110) hmask[32] qs[64] scales[12] d  x = (d*(sc-32)) * q    q = 2 bits - 4*!hbit
    Q4_K  (256, 144) d dmin scales[12] qs[128]    x = (d*sc) * q - (dmin*m)  8 subs of 32
    Q5_K  (256, 176) d dmin scales[12] qh[32] qs[128]   as Q4_K with a 5th bit from qh
    Q6_K  (256, 210) ql[128] qh[64] scales[16] int8 d   x = (d*sc) * (q - 32)  16 subs of 16

Packed fields of a byte are unpacked lowest bits first, and the j-th field of every byte
of a group comes as one run (`_fields`): e.g. Q4_0's 16 bytes give the 16 low nibbles,
then the 16 high ones.

Bit-exactness: every product here is exact in float32. An f16 scale has at most 11
significant bits and the integers it meets at most 12 together (Q6_K: an int8 sub-scale
times q - 32), and the results stay far from float32's overflow and subnormals. So only
the one addition per element (`+ m`, `- dmin*m`) rounds, as in gguf-py, and for the same
reason an FMA (which torch.compile may fuse the two into) gives the same bits. The
grouping of the products is still kept as gguf-py has it ((d * sc) * q, not d * (sc * q))
because it decides the sign of a zero: with sc = 0 and q < 0, gguf gives (d * 0.0) * q =
-0.0 for d > 0, where an integer sc * q = 0 would give +0.0. Only NaN payloads may differ
(scales that are inf or NaN; signalling f16 NaNs come out quieted).

Other output dtypes (bf16/f16 compute) are made by dequantizing in float32 then casting
once, so they equal `gguf` rounded to that dtype.
"""

from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils.weak import WeakTensorKeyDictionary

from toy.models import mlx_quant, native
from toy.models.quant_types import (  # noqa: F401
    BF16,
    F16,
    F32,
    OTHER_TYPE_NAMES,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    QK_K,
    QUANT_TYPES,
)


def _check_type(qtype: int) -> tuple[int, int, str]:
    if qtype not in QUANT_TYPES:
        name = OTHER_TYPE_NAMES.get(qtype, "unknown")
        known = ", ".join(name for _, _, name in QUANT_TYPES.values())
        raise ValueError(
            f"unsupported GGUF tensor type {name} (id {qtype}); toy dequantizes {known}"
        )
    return QUANT_TYPES[qtype]


def row_bytes(qtype: int, n_cols: int) -> int:
    """Bytes one row of n_cols elements takes in type qtype."""
    block_size, type_size, name = _check_type(qtype)
    if n_cols % block_size:
        raise ValueError(
            f"a {name} row holds whole blocks of {block_size}; {n_cols} columns is not one"
        )
    return n_cols // block_size * type_size


def dequantize(
    raw: torch.Tensor,
    qtype: int,
    n_cols: int,
    dtype: torch.dtype = torch.float32,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(rows, row_bytes) uint8 GGUF data of type `qtype` -> (rows, n_cols) in `dtype`.

    Any leading shape works: (..., row_bytes) -> (..., n_cols). The float32 result equals
    `gguf.quants.dequantize` bit for bit; other dtypes are that result cast once. An F32
    tensor asked for in float32 comes back as a view of `raw` (no copy). `out`: a
    contiguous tensor of that shape and dtype written instead of a new one (returned).
    """
    block_size, type_size, name = _check_type(qtype)
    if raw.dtype != torch.uint8:
        raise ValueError(f"raw GGUF data must be uint8, got {raw.dtype}")
    if raw.dim() == 0 or raw.shape[-1] != row_bytes(qtype, n_cols):
        raise ValueError(
            f"a {name} row of {n_cols} columns takes {row_bytes(qtype, n_cols)} bytes; "
            f"raw has shape {tuple(raw.shape)}"
        )
    lead = raw.shape[:-1]
    raw = raw.contiguous()
    if not torch.compiler.is_compiling() and raw.storage_offset() % 4:
        raw = raw.clone()  # the f16 / int32 views need an aligned start, as GGUF tensors have
    if out is not None and (
        tuple(out.shape) != (*lead, n_cols) or out.dtype != dtype or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of shape {(*lead, n_cols)}, got "
            f"{out.dtype} {tuple(out.shape)}"
        )
    if block_size == 1:  # plain floats: reinterpret the bytes
        w = raw.view(_FLOATS[qtype]).reshape(*lead, n_cols)
        return w.to(dtype) if out is None else out.copy_(w)
    fast = _native(raw, qtype, n_cols, dtype, out)
    if fast is not None:
        return fast
    flat = None if out is None else out.view(-1, block_size)
    return _KERNELS[qtype](raw.view(-1, type_size), dtype, flat).reshape(*lead, n_cols)


_FLOATS = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}
NATIVE_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)  # what models/dequant.c reads


def _native(
    raw: torch.Tensor,
    qtype: int,
    n_cols: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    head_dim: int = 0,
) -> torch.Tensor | None:
    """dequantize's result through models/dequant.c (the same bits, one pass over the codes
    instead of five), with Q/K rows put in half-split order where head_dim > 0; None where
    the kernel does not serve: another type, dtype or device, a traced or compiled graph, or
    no C compiler (TOY_NATIVE=0)."""
    if (
        qtype not in NATIVE_TYPES
        or dtype not in (torch.bfloat16, torch.float32)
        or raw.device.type != "cpu"
        or is_fake(raw)
        or torch.compiler.is_compiling()
        or raw.numel() == 0
    ):
        return None
    fns = native.dequant()
    if fns is None:
        return None
    rows = raw.numel() // raw.shape[-1]
    if out is None:
        out = torch.empty((*raw.shape[:-1], n_cols), dtype=dtype)
    raw = raw.contiguous()
    done = fns["toy_dequantize"](
        raw.data_ptr(), out.data_ptr(), rows, n_cols, qtype, dtype == torch.bfloat16, head_dim
    )
    return out if done == 0 else None


# ---- helpers ----------------------------------------------------------------------------
# Speed (CPU, one thread): ops on contiguous uint8 tensors are several times cheaper than
# float ops, and ops over short strided runs several times slower than flat ones. So the
# quants are unpacked with flat uint8 ops, offsets included (uint8 arithmetic wraps, so
# q - 8 read as int8 is the signed value; high bits are joined by add(lo, hi, alpha=16),
# one op where lo | (hi << 4) is two), converted to float once, then scaled in place. The
# few bytes of sub-block scales are unpacked four at a time as int32 words with byte-wise
# masks, as ggml's own C code does.


def _view(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes x read as dtype, copied first only where the block size is not a multiple of
    the new item size (Q3_K's 110-byte blocks read as int32)."""
    if x.stride(0) % dtype.itemsize:
        x = x.contiguous()
    return x.view(dtype)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 at byte `at` of every block, as float32 of shape (n_blocks, 1)."""
    return _view(blocks[:, at : at + 2], torch.float16).float()


def _words(blocks: torch.Tensor, at: int, count: int) -> torch.Tensor:
    """`count` little-endian int32 words (every torch host is little-endian) from byte `at`
    of every block: (n_blocks, count)."""
    return _view(blocks[:, at : at + 4 * count], torch.int32)


def _fields(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., k) bytes -> (..., 8 // bits, k) uint8: field j (bits j*bits and up) of every byte.

    The j-th fields of the k bytes form one run, which is how ggml orders them.
    """
    packed = packed.contiguous()
    mask = (1 << bits) - 1

    def field(shift: int) -> torch.Tensor:
        x = packed >> shift if shift else packed
        return x & mask if shift + bits < 8 else x  # the top field needs no mask

    return torch.stack([field(shift) for shift in range(0, 8, bits)], dim=-2)


def _signed(q: torch.Tensor, offset: int) -> torch.Tensor:
    """uint8 q (consumed) -> float32 q - offset, via int8: q - offset fits in int8 here."""
    return q.sub_(offset).view(torch.int8).float()


# ---- the codes: every type is w = s * q + z per sub-block ------------------------------------
# Each _codes_* returns (q, s, z): integer codes q (n, subs, sub_len), uint8 or int8 (an
# offset already taken off, where the type has one), and float32 scales s and offsets z
# (n, subs, 1); z is None where the type has none. dequantize computes q * s (+ z) in
# float32 (exact products, one rounding at the addition; x + (-y) is x - y in IEEE, zeros'
# signs included), and models/decode.py packs the same codes for generation.


def _codes_q4_0(b: torch.Tensor):
    q = _fields(b[:, 2:], 4).view(-1, 1, 32)
    return q.sub_(8).view(torch.int8), _f16(b, 0).unsqueeze(-1), None  # gguf: d * float(q - 8)


def _codes_q4_1(b: torch.Tensor):
    q = _fields(b[:, 4:], 4).view(-1, 1, 32)
    return q, _f16(b, 0).unsqueeze(-1), _f16(b, 2).unsqueeze(-1)  # (d * q) + m


def _codes_q5_0(b: torch.Tensor):
    # bit j of the little-endian uint32 qh is the 5th bit of q[j]: bit j % 8 of byte j // 8
    qh = _fields(b[:, 2:6].reshape(-1, 4, 1), 1).view(-1, 32)
    q = torch.add(_fields(b[:, 6:], 4).view(-1, 32), qh, alpha=16)
    return q.sub_(16).view(torch.int8).view(-1, 1, 32), _f16(b, 0).unsqueeze(-1), None


def _codes_q5_1(b: torch.Tensor):
    qh = _fields(b[:, 4:8].reshape(-1, 4, 1), 1).view(-1, 32)
    q = torch.add(_fields(b[:, 8:], 4).view(-1, 32), qh, alpha=16)
    return q.view(-1, 1, 32), _f16(b, 0).unsqueeze(-1), _f16(b, 2).unsqueeze(-1)


def _codes_q8_0(b: torch.Tensor):
    return b[:, 2:].view(torch.int8).view(-1, 1, 32), _f16(b, 0).unsqueeze(-1), None


# ---- K-quants: 256-element super-blocks of 8 or 16 sub-blocks, each with its own scale -----


def _codes_q2_k(b: torch.Tensor):
    n = b.shape[0]
    sc = b[:, :16].contiguous()  # low nibble: sub-block scale, high nibble: its minimum
    dl = (_f16(b, 80) * (sc & 0xF).float()).unsqueeze(-1)  # (n, 16, 1)
    ml = (_f16(b, 82) * (sc >> 4).float()).unsqueeze(-1)
    q = _fields(b[:, 16:80].view(n, 2, 32), 2).view(n, 16, 16)  # 2 halves x 4 shifts x 32
    return q, dl, ml.neg_()  # (d * sc) * q - dmin * m


def _q3_k_scales(b: torch.Tensor) -> torch.Tensor:
    """Q3_K's 16 6-bit scales (uint8, offset 32) from bytes 96..107 (three words a0 a1 t).

    Scales 0-7 take their low 4 bits from the low nibbles of a0 a1, scales 8-15 from the
    high nibbles; the top 2 bits of scales 4k..4k+3 are bits 2k, 2k+1 of t's four bytes.
    """
    w = _words(b, 96, 3)
    a, t = w[:, :2], w[:, 2:]
    low = torch.cat([a & 0x0F0F0F0F, (a >> 4) & 0x0F0F0F0F], dim=1)  # (n, 4) words
    top = torch.cat([t, t >> 2, t >> 4, t >> 6], dim=1) & 0x03030303
    return (low | (top << 4)).view(torch.uint8)  # (n, 16)


def _codes_q3_k(b: torch.Tensor):
    n = b.shape[0]
    dl = (_f16(b, 108) * _signed(_q3_k_scales(b), 32)).unsqueeze(-1)  # (n, 16, 1)
    ql = _fields(b[:, 32:96].view(n, 2, 32), 2).view(n, 16, 16)
    hbit = _fields(b[:, :32], 1).view(n, 16, 16)  # bit j of the 32 bytes: elements 32j..32j+31
    # q = ql - 4 where the hmask bit is 0 (sic: a set bit means no offset), that is
    # (ql + 4*hbit) - 4
    return torch.add(ql, hbit, alpha=4).sub_(4).view(torch.int8), dl, None  # (d * sc) * q


def _k_scale_min(b: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: bytes 4..15 -> (n, 2, 8) uint8, eight 6-bit scales then eight minimums.

    Word 0 holds scales 0-3 in the low 6 bits of its bytes and the top 2 bits of scales
    4-7 in the high 2; word 1 the same for the minimums; word 2 the low 4 bits of scales
    4-7 (low nibbles) and of minimums 4-7 (high nibbles).
    """
    w = _words(b, 4, 3)
    sm, md = w[:, :2], w[:, 2:]  # (n, 2): scales, minimums; (n, 1)
    first = sm & 0x3F3F3F3F
    last = torch.cat([md & 0x0F0F0F0F, (md >> 4) & 0x0F0F0F0F], dim=1) | ((sm >> 2) & 0x30303030)
    return torch.stack([first, last], dim=-1).view(torch.uint8)  # (n, 2, 2) words -> (n, 2, 8)


def _k_affine(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: d * sc and -(dmin * m), (n, 8, 1) each."""
    sc, mn = _k_scale_min(b).float().unbind(1)  # (n, 8) each
    return (_f16(b, 0) * sc).unsqueeze(-1), (_f16(b, 2) * mn).neg_().unsqueeze(-1)


def _codes_q4_k(b: torch.Tensor):
    n = b.shape[0]
    q = _fields(b[:, 16:].view(n, 4, 32), 4).view(n, 8, 32)  # 4 x (low, high) x 32
    return (q, *_k_affine(b))  # (d * sc) * q - (dmin * m)


def _codes_q5_k(b: torch.Tensor):
    n = b.shape[0]
    ql = _fields(b[:, 48:].view(n, 4, 32), 4).view(n, 8, 32)
    qh = _fields(b[:, 16:48], 1).view(n, 8, 32)  # bit j of the 32 bytes: sub-block j
    return (torch.add(ql, qh, alpha=16), *_k_affine(b))


def _codes_q6_k(b: torch.Tensor):
    n = b.shape[0]
    sc = b[:, 192:208].view(torch.int8).float()
    dl = (_f16(b, 208) * sc).unsqueeze(-1)  # (n, 16, 1)
    ql = _fields(b[:, :128].view(n, 2, 64), 4).view(n, QK_K)  # 2 halves x (low, high) x 64
    qh = _fields(b[:, 128:192].view(n, 2, 32), 2).view(n, QK_K)  # 2 halves x 4 shifts x 32
    q = torch.add(ql, qh, alpha=16).sub_(32).view(torch.int8).view(n, 16, 16)
    return q, dl, None  # (d * sc) * (q - 32)


CODES = {
    Q4_0: _codes_q4_0,
    Q4_1: _codes_q4_1,
    Q5_0: _codes_q5_0,
    Q5_1: _codes_q5_1,
    Q8_0: _codes_q8_0,
    Q2_K: _codes_q2_k,
    Q3_K: _codes_q3_k,
    Q4_K: _codes_q4_k,
    Q5_K: _codes_q5_k,
    Q6_K: _codes_q6_k,
}


def codes(raw: torch.Tensor, qtype: int):
    """A block type's bytes (..., row_bytes) -> its codes (q, s, z) over all blocks, as
    the _codes_* functions give them: w = q * s (+ z), (n_blocks, subs, sub_len)."""
    _, type_size, _ = _check_type(qtype)
    raw = raw.contiguous()
    if not torch.compiler.is_compiling() and raw.storage_offset() % 4:
        raw = raw.clone()  # the f16 / int32 views need an aligned start, as GGUF tensors have
    return CODES[qtype](raw.view(-1, type_size))


def _from_codes(qtype: int):
    block = QUANT_TYPES[qtype][0]

    def kernel(
        b: torch.Tensor, dtype: torch.dtype = torch.float32, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        # q * s (+ z) computed in float32 and written once, straight in `dtype` (bf16 under
        # autocast: no float32 copy of the weight is made): the same bits as the float32
        # weight cast to dtype, one pass over the codes instead of four. `into`: the
        # (n, block) tensor to write (dequantize's out).
        q, s, z = CODES[qtype](b)
        if into is None:
            out = torch.empty(q.shape, dtype=dtype, device=b.device)
        else:
            out = into.view(q.shape)
        if z is None:
            torch.mul(q, s, out=out)
        else:
            torch.addcmul(z, q, s, out=out)
        return out.view(b.shape[0], block)

    return kernel


# type -> (blocks (n, type_size), dtype) -> floats (n, block)
_KERNELS = {t: _from_codes(t) for t in CODES}


# ---- frozen layers over the blocks ------------------------------------------------------
# A LoRA base stays in the GGUF's own blocks: a uint8 tensor (out, row_bytes), zero-copy
# over the file's memory map (nothing is read until used), dequantized inside forward
# and again inside backward for the input gradient; the float weight is never kept.


class QuantSpec:
    """GGUF blocks (one uint8 tensor, `weight`, (out, row_bytes)) and what turns them back
    into the float weight: the type, the float shape (out, in), and `qk_heads`: when
    llama.cpp's converter interleaved the rows of each head for its rope (llama Q/K), the
    heads to un-interleave at dequantization time, so the file's bytes are used as they are.

    A spec names the tensors it needs (`parts`) and turns them into floats: QuantLinear,
    QuantEmbedding and LoRALinear hold the parts as buffers under those names and ask the
    spec (MLXSpec is the other kind)."""

    __slots__ = ("qtype", "shape", "qk_heads")
    parts = ("weight",)
    matvec_ready = False  # models/decode.py's PackedSpec computes one row on the codes

    def __init__(self, qtype: int, shape: tuple[int, int], qk_heads: int = 0):
        self.qtype, self.shape, self.qk_heads = (
            int(qtype),
            (int(shape[0]), int(shape[1])),
            int(qk_heads),
        )

    @property
    def name(self) -> str:
        return QUANT_TYPES[self.qtype][2]

    def dequantize(
        self,
        parts: tuple[torch.Tensor, ...],
        dtype: torch.dtype = torch.float32,
        rows: slice | None = None,
    ) -> torch.Tensor:
        return dequantize_weight(parts[0], self, dtype, rows)

    def gather(
        self, parts: tuple[torch.Tensor, ...], idx: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """Rows `idx` (1-D) of the float weight (an embedding's lookup)."""
        return dequantize(parts[0][idx], self.qtype, self.shape[1], dtype)

    def __repr__(self) -> str:
        return f"QuantSpec({self.name}, {self.shape}, qk_heads={self.qk_heads})"


class MLXSpec:
    """MLX affine-quantized weights (what `mlx_lm.convert -q` writes): `weight` uint32 (out,
    in * bits / 32), `scales` and `biases` (out, in / group_size); models/mlx_quant.py
    dequantizes them, bit-identical to mx.dequantize, then casts to the compute dtype."""

    __slots__ = ("bits", "group_size", "shape")
    parts = ("weight", "scales", "biases")
    matvec_ready = False

    def __init__(self, bits: int, group_size: int, shape: tuple[int, int]):
        self.bits, self.group_size, self.shape = (
            int(bits),
            int(group_size),
            (int(shape[0]), int(shape[1])),
        )

    @property
    def name(self) -> str:
        return f"MLX_Q{self.bits}_G{self.group_size}"

    def dequantize(
        self,
        parts: tuple[torch.Tensor, ...],
        dtype: torch.dtype = torch.float32,
        rows: slice | None = None,
    ) -> torch.Tensor:
        with torch.profiler.record_function("toy::dequantize"):
            w, s, b = parts if rows is None else (p[rows] for p in parts)
            return mlx_quant.dequantize(w, s, b, self.group_size, self.bits, dtype)

    def gather(
        self, parts: tuple[torch.Tensor, ...], idx: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        with torch.profiler.record_function("toy::dequantize"):
            w, s, b = (p[idx] for p in parts)
            return mlx_quant.dequantize(w, s, b, self.group_size, self.bits, dtype)

    def __repr__(self) -> str:
        return f"MLXSpec({self.bits} bits, group {self.group_size}, {self.shape})"


def half_split_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of each head from llama.cpp's interleaved order (2i, 2i+1 = HF's i, i + D/2)
    back to HF's half-split order, which toy's rotary uses."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize_weight(
    blocks: torch.Tensor,
    spec: QuantSpec,
    dtype: torch.dtype = torch.float32,
    rows: slice | None = None,
) -> torch.Tensor:
    """The float weight (out, in) of a block tensor, or the rows `rows` of it (a slice of
    whole rows: GGUF rows are independent, so a slice of the blocks is a slice of W).
    Labelled `toy::dequantize` for the profiler (bench/profile_step.py sums it)."""
    with torch.profiler.record_function("toy::dequantize"):
        if rows is not None:
            if spec.qk_heads:
                raise ValueError(
                    "row slices of Q/K weights are not supported "
                    "(their rows are interleaved per head)"
                )
            return dequantize(blocks[rows], spec.qtype, spec.shape[1], dtype)
        if spec.qk_heads:  # the reorder folded into the kernel's writes, where it serves
            d = spec.shape[0] // spec.qk_heads
            w = _native(blocks, spec.qtype, spec.shape[1], dtype, head_dim=d)
            if w is not None:
                return w
        w = dequantize(blocks, spec.qtype, spec.shape[1], dtype)
        return half_split_rows(w, spec.qk_heads) if spec.qk_heads else w


# A weight dequantized once at load (a base held in float32 or bfloat16) is made this much
# float32 at a time: on SmolLM2's float32 load, pieces of 4 or 16 MiB still left 75-97 MiB
# of heap holes, 1 MiB 8-11 MiB, at the same speed (one thread, 2026-11-28).
LOAD_PIECE_BYTES = 1 << 20


def dequantize_held(
    blocks: torch.Tensor,
    spec: QuantSpec,
    dtype: torch.dtype = torch.float32,
    piece_bytes: int | None = None,
) -> torch.Tensor:
    """dequantize_weight's whole weight, bit for bit, for a base held dequantized. The one
    tensor returned is allocated first and written in place piece by piece: whole rows of
    about `piece_bytes` (default LOAD_PIECE_BYTES) of float32; Q/K: whole heads, whose
    rows are un-interleaved within the head. Made whole, each weight's transients (its
    unpacked codes, its own result, Q/K's un-interleaved copy) were freed between the
    weights kept after them, and glibc's heap kept those holes resident for the whole run
    (57-80 MiB of SmolLM2's float32 load; docs/performance.md); a piece's transients are
    the next piece's memory."""
    rows, cols = spec.shape
    unit = rows // spec.qk_heads if spec.qk_heads else 1
    step = max(1, (piece_bytes or LOAD_PIECE_BYTES) // (4 * cols * unit)) * unit
    out = torch.empty(rows, cols, dtype=dtype, device=blocks.device)
    with torch.profiler.record_function("toy::dequantize"):
        for r in range(0, rows, step):
            piece = blocks[r : r + step]
            if spec.qk_heads:
                w = dequantize(piece, spec.qtype, cols, dtype)
                out[r : r + step] = half_split_rows(w, w.shape[0] // unit)
            else:
                dequantize(piece, spec.qtype, cols, dtype, out=out[r : r + step])
    return out


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


WEIGHT_CHUNK_BYTES = 16 << 20  # a float weight bigger than this is dequantized in pieces of rows


def _row_chunks(spec) -> list[slice] | None:
    """Slices of whole rows whose float32 weight is about WEIGHT_CHUNK_BYTES each, for a
    weight larger than that (a 1.07B llama's 5632 x 2048 MLP matrices are 44 MB as float32:
    dequantizing one whole is a 44 MB transient at the step's peak); None: in one piece
    (Q/K rows are interleaved per head in the file: those stay whole)."""
    rows, cols = spec.shape
    if 4 * rows * cols <= WEIGHT_CHUNK_BYTES or getattr(spec, "qk_heads", 0):
        return None
    step = max(1, WEIGHT_CHUNK_BYTES // (4 * cols))
    return [slice(r, min(rows, r + step)) for r in range(0, rows, step)]


class _QuantLinearFn(torch.autograd.Function):
    """y = x W^T (+ b) with W dequantized here and again in backward: what is saved for
    backward is the quantized parts (already resident), never a float copy of W. A large
    W is dequantized a piece of rows at a time (its outputs in forward, its share of the
    input gradient in backward), so no whole float copy of it exists even for a moment."""

    @staticmethod
    def forward(ctx, x, bias, spec, *parts):
        ctx.save_for_backward(*parts)
        ctx.spec = spec
        chunks = _row_chunks(spec)
        if chunks is None:
            return torch.nn.functional.linear(x, spec.dequantize(parts, x.dtype), bias)
        y = torch.cat([x @ spec.dequantize(parts, x.dtype, rows=r).T for r in chunks], dim=-1)
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad):
        parts = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            chunks = _row_chunks(ctx.spec)
            if chunks is None:
                grad_x = grad @ ctx.spec.dequantize(parts, grad.dtype)
            else:
                for r in chunks:
                    part = grad[..., r] @ ctx.spec.dequantize(parts, grad.dtype, rows=r)
                    grad_x = part if grad_x is None else grad_x.add_(part)
        return (grad_x, None, None) + (None,) * len(parts)


Spec = QuantSpec | MLXSpec


def frozen_linear(
    x: torch.Tensor,
    weight: torch.Tensor | tuple[torch.Tensor, ...],
    bias: torch.Tensor | None,
    spec: Spec | None,
) -> torch.Tensor:
    """A frozen base linear: plain F.linear for a float weight, or, with a spec, its
    quantized parts dequantized per use (in the autocast dtype where autocast is on)."""
    if spec is None:
        return torch.nn.functional.linear(x, weight, bias)
    if (
        spec.matvec_ready
        and x.shape[:-1].numel() == 1
        and x.dtype == torch.float32
        and not torch.is_grad_enabled()
    ):
        y = spec.matvec(x.reshape(-1), weight)  # one token of generation, on the packed codes
        y = y if bias is None else y + bias
        return y.view(*x.shape[:-1], -1)
    dtype = _compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        b = bias.to(dtype) if bias is not None else None
        w = _float_weight(weight, spec)
        if w is not None:  # held as floats: the same linear with no node of toy's own
            packed = _packed_weight(x, weight[0], w, dtype)
            if packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x.to(dtype), packed, b, "none", [], "")
            return torch.nn.functional.linear(x.to(dtype), w.to(dtype), b)
        return _QuantLinearFn.apply(x.to(dtype), b, spec, *weight)


def _float_weight(parts: tuple[torch.Tensor, ...], spec: Spec) -> torch.Tensor | None:
    """The float weight of a base held dequantized (GGUF F32 / F16 / BF16 bytes in its row
    order: held_as writes Q/K rows un-interleaved), as a view of its bytes; None for blocks.
    Such a weight went through _QuantLinearFn and dequantize like Q4_1 blocks: ~0.1 ms of
    checks, casts and an autograd node a linear, 211 of them a decode step of SmolLM2,
    which made a 32-row GRPO decode step 150 ms where F.linear makes it 106 (Intel AMX,
    2 threads). Bits: the same F.linear of the same tensors, and autograd's input gradient
    is the same grad @ W."""
    if not isinstance(spec, QuantSpec) or spec.qtype not in _FLOATS or spec.qk_heads:
        return None
    raw = parts[0]
    dt = _FLOATS[spec.qtype]
    if not raw.is_contiguous() or raw.storage_offset() % dt.itemsize:
        return None
    return raw.view(dt).view(spec.shape)


# A decode step's few rows (GRPO's sampling, a bf16 reply) against a bf16 weight held as
# floats: oneDNN reorders the weight into its blocked bf16 layout at every call, which at a
# few rows costs more than the product. Reordered once and kept (beside the held bytes, one
# more copy of each weight so used), the product is the same bits (tests/models/test_quant.py)
# and 1.2-1.9x faster a matrix (docs/performance.md, "GRPO on a long-tailed prompt set").
# Only without gradients (training's products keep F.linear: their input gradient needs W
# as it is) and at most PACK_ROWS rows (a prefill or a scoring pass amortizes the reorder);
# 0 turns it off.
PACK_ROWS = 64
_PACKED = WeakTensorKeyDictionary()  # held bytes -> their reordered weight, while they live


@functools.cache
def _pack_ok() -> bool:
    """Whether this torch's oneDNN reorders and multiplies bf16 weights here."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _packed_weight(
    x: torch.Tensor, raw: torch.Tensor, w: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | None:
    """The weight w (a view of the held bytes `raw`) reordered once for oneDNN's bf16
    product, where this product qualifies (above); None where it does not."""
    if (
        dtype != torch.bfloat16
        or x.device.type != "cpu"
        or torch.is_grad_enabled()
        or x.shape[:-1].numel() > PACK_ROWS
        or is_fake(x)  # a compiled step's trace (models/decode.py): its own products
    ):
        return None
    if not _pack_ok():
        return None
    packed = _PACKED.get(raw)
    if packed is None:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), PACK_ROWS)
        _PACKED[raw] = packed
    return packed


def register_parts(module: torch.nn.Module, spec: Spec, parts: tuple[torch.Tensor, ...]) -> None:
    """The quantized tensors as buffers, under the names the spec gives (state_dict keys
    `weight`, and for MLX `scales`, `biases`: the file's own names)."""
    for name, t in zip(spec.parts, parts):
        module.register_buffer(name, t)


def parts_of(module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """The quantized tensors of a QuantLinear / QuantEmbedding / LoRALinear, in the spec's order
    (plain attribute reads: this runs in every forward)."""
    return tuple(getattr(module, name) for name in module.spec.parts)


class QuantLinear(torch.nn.Module):
    """A frozen nn.Linear whose weight stays quantized: `parts` as its spec names them
    (GGUF: `weight`, the block tensor; MLX: `weight`, `scales`, `biases`).

    The state_dict keys are the float layer's (`weight`, `bias`) plus MLX's own, so LoRA
    and PEFT names do not change; `dequantized()` gives the float weight."""

    def __init__(
        self,
        parts: torch.Tensor | tuple[torch.Tensor, ...],
        spec: Spec,
        bias: torch.Tensor | None = None,
    ):
        super().__init__()
        self.spec = spec
        self.out_features, self.in_features = spec.shape
        register_parts(self, spec, parts if isinstance(parts, tuple) else (parts,))
        if bias is not None:
            self.bias = torch.nn.Parameter(bias, requires_grad=False)
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return frozen_linear(x, parts_of(self), self.bias, self.spec)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.spec.dequantize(parts_of(self), dtype)

    def rows(self, start: int, end: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows start..end of the float weight (a chunk of the vocabulary, for a head)."""
        return self.spec.dequantize(parts_of(self), dtype, rows=slice(start, end))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.spec.name}"


class QuantEmbedding(torch.nn.Module):
    """A frozen token embedding over quantized rows: each lookup dequantizes just the rows
    of the tokens asked for (rows are independent). A tied output head reads the same
    parts (`rows(i, j)` for a chunk of the vocabulary)."""

    def __init__(self, parts: torch.Tensor | tuple[torch.Tensor, ...], spec: Spec):
        super().__init__()
        self.spec = spec
        self.num_embeddings, self.embedding_dim = spec.shape
        register_parts(self, spec, parts if isinstance(parts, tuple) else (parts,))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        dtype = (
            _compute_dtype(torch.empty(0, device=idx.device))
            if torch.is_autocast_enabled(idx.device.type)
            else torch.float32
        )
        with torch.profiler.record_function("toy::dequantize"):
            flat = self.spec.gather(parts_of(self), idx.reshape(-1), dtype)
        return flat.view(*idx.shape, self.embedding_dim)

    def rows(self, start: int, end: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.spec.dequantize(parts_of(self), dtype, rows=slice(start, end))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.spec.dequantize(parts_of(self), dtype)


def count_params(model: torch.nn.Module) -> int:
    """Parameters of a model whose base may sit in GGUF blocks: float parameters, plus
    the weights each block tensor stands for (a tied head's blocks counted once)."""
    seen: set[int] = set()
    n = 0
    for m in model.modules():
        spec = getattr(m, "spec", None)
        w = getattr(m, "weight", None)
        if spec is not None and isinstance(w, torch.Tensor) and not w.is_floating_point():
            key = w.untyped_storage().data_ptr() + w.storage_offset()
            if key not in seen:
                seen.add(key)
                n += spec.shape[0] * spec.shape[1]
    return n + sum(p.numel() for p in model.parameters())


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's tensors (parameters and buffers, each storage once): for a
    quantized base, the blocks as they sit in the file's map."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if t.device.type == "meta" or key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total
