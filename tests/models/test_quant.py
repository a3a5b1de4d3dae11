"""toy.models.quant.dequantize against gguf.quants.dequantize, bit for bit.

Blocks come from gguf's own quantizer where it has one, and from random bytes with the
f16 scale fields set on purpose otherwise (gguf-py cannot quantize the K-quants), with
extreme scales too: max finite, subnormals, zeros of both signs, negatives.
"""

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from helpers.quant import BLOCK_TYPES, T, random_blocks  # noqa: F401

from toy.models import quant
from toy.models.quant import dequantize, row_bytes

FLOAT_TYPES = [T.F32, T.F16, T.BF16]
QUANTIZABLE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16, T.F16, T.F32]
EXTREME_F16 = np.array(
    [
        0x7BFF,
        0xFBFF,
        0x0001,
        0x8001,
        0x03FF,
        0x83FF,
        0x0400,
        0x0000,
        0x8000,
        0x3C00,
        0xBC00,
        0x1234,
        0x9234,
    ],
    dtype=np.uint16,
)  # 65504, -65504, 2^-24, ...
NONFINITE_F16 = np.array([0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7C01], dtype=np.uint16)  # +-inf, NaNs


def same_bits(ours: torch.Tensor, ref: np.ndarray, nan_aware: bool = False) -> None:
    ref_t = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))
    assert ours.dtype == torch.float32 and ours.shape == ref_t.shape
    a, b = ours.view(torch.int32), ref_t.view(torch.int32)
    if nan_aware:  # a NaN's payload may differ between two NaN-producing ops; NaN-ness may not
        both_nan = ours.isnan() & ref_t.isnan()
        assert torch.equal(ours.isnan(), ref_t.isnan())
        a, b = a[~both_nan], b[~both_nan]
    bad = (a != b).nonzero()
    assert bad.numel() == 0, (
        f"{bad.shape[0]} values differ, first at {bad[0].tolist()}: "
        f"{ours[tuple(bad[0])].item()!r} vs {ref_t[tuple(bad[0])].item()!r}"
    )


def reference(raw: np.ndarray, qtype) -> np.ndarray:
    with np.errstate(all="ignore"):  # inf * 0 in the non-finite cases
        return gguf_dequantize(raw, qtype)


def check(raw: np.ndarray, qtype, cols: int, nan_aware: bool = False) -> None:
    ours = dequantize(torch.from_numpy(raw), int(qtype), cols)
    same_bits(ours, reference(raw, qtype), nan_aware)


def test_type_table_matches_gguf():
    for qtype, (block, size, name) in quant.QUANT_TYPES.items():
        assert T(qtype).name == name and GGML_QUANT_SIZES[T(qtype)] == (block, size)
    for qtype, name in quant.OTHER_TYPE_NAMES.items():
        assert T(qtype).name == name
    assert set(quant.QUANT_TYPES) == {int(t) for t in BLOCK_TYPES + FLOAT_TYPES}


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_gguf_quantized_data(qtype):
    rng = np.random.default_rng(int(qtype))
    # rows of very different magnitudes, one all-zero row, one constant row
    x = rng.standard_normal((6, 256)).astype(np.float32) * np.float32(
        [[1e-6], [0.02], [1], [300], [0], [1]]
    )
    x[5] = 0.7
    raw = np.asarray(gguf_quantize(x, qtype)).view(np.uint8).reshape(6, -1)
    check(raw, qtype, 256)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_random_blocks(qtype):
    check(random_blocks(qtype, 4, 1024, None, seed=int(qtype)), qtype, 1024)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_extreme_scales(qtype):
    check(random_blocks(qtype, 8, 1024, EXTREME_F16, seed=100 + int(qtype)), qtype, 1024)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_nonfinite_scales(qtype):
    # inf * 0 and NaN scales make NaNs; which NaN bits come out is the hardware's business
    scales = np.concatenate([EXTREME_F16, NONFINITE_F16])
    check(random_blocks(qtype, 4, 1024, scales, seed=200 + int(qtype)), qtype, 1024, nan_aware=True)


@pytest.mark.parametrize("qtype", FLOAT_TYPES, ids=lambda t: t.name)
def test_float_types_every_bit_pattern(qtype):
    # all 2^16 halves / bfloat16s (NaNs included); random bit patterns for F32
    if qtype == T.F32:
        raw = np.random.default_rng(0).integers(0, 256, size=(16, 4096), dtype=np.uint8)
    else:
        raw = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(64, -1)
    cols = raw.shape[1] // GGML_QUANT_SIZES[qtype][1]
    ours = dequantize(torch.from_numpy(raw), int(qtype), cols)
    same_bits(ours, reference(raw, qtype), nan_aware=qtype == T.F16)  # F16: signalling NaNs


def test_shapes_dtypes_and_leading_dims():
    raw = random_blocks(T.Q4_K, 6, 512, None, seed=1)
    ref = gguf_dequantize(raw, T.Q4_K)
    assert row_bytes(int(T.Q4_K), 512) == raw.shape[1] == 288
    out = dequantize(torch.from_numpy(raw), int(T.Q4_K), 512)
    assert out.shape == (6, 512)
    same_bits(dequantize(torch.from_numpy(raw).view(2, 3, -1), int(T.Q4_K), 512).view(6, 512), ref)
    same_bits(dequantize(torch.from_numpy(raw[0]), int(T.Q4_K), 512)[None], ref[:1])
    # non-contiguous input (every other row)
    same_bits(dequantize(torch.from_numpy(raw)[::2], int(T.Q4_K), 512), ref[::2])
    # a start at an odd byte of the storage (not a GGUF layout, but it must still work)
    shifted = torch.zeros(raw.size + 1, dtype=torch.uint8)
    shifted[1:] = torch.from_numpy(raw).view(-1)
    same_bits(dequantize(shifted[1:].view(6, -1), int(T.Q4_K), 512), ref)
    assert dequantize(torch.zeros(0, 288, dtype=torch.uint8), int(T.Q4_K), 512).shape == (0, 512)
    # other dtypes: the float32 result cast once
    for dtype in (torch.bfloat16, torch.float16):
        half = dequantize(torch.from_numpy(raw), int(T.Q4_K), 512, dtype=dtype)
        assert half.dtype == dtype and torch.equal(half, torch.from_numpy(ref).to(dtype))


def test_errors():
    raw = torch.zeros(2, 18, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"IQ2_XXS \(id 16\)"):
        dequantize(raw, 16, 32)
    with pytest.raises(ValueError, match="id 99"):
        dequantize(raw, 99, 32)
    with pytest.raises(ValueError, match="whole blocks of 32"):
        row_bytes(int(T.Q4_0), 48)
    with pytest.raises(ValueError, match="takes 36 bytes"):
        dequantize(raw, int(T.Q4_0), 64)
    with pytest.raises(ValueError, match="uint8"):
        dequantize(raw.to(torch.int8), int(T.Q4_0), 32)


@pytest.mark.parametrize("qtype", [quant.F32, quant.F16, quant.BF16])
@pytest.mark.parametrize("autocast", [False, True])
def test_a_float_held_weight_is_a_plain_linear_with_the_same_bits(qtype, autocast):
    """A base held as floats (GGUF F32/F16/BF16 bytes: held_as's bfloat16 copy) runs as
    F.linear on a view of its bytes, not through _QuantLinearFn: the same output and input
    gradient, bit for bit, as the block path gives, in float32 and under bf16 autocast;
    and blocks still take the block path."""
    dt = {quant.F32: torch.float32, quant.F16: torch.float16, quant.BF16: torch.bfloat16}[qtype]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=g).to(dt)
    raw = w.view(torch.uint8).reshape(24, -1)
    spec = quant.QuantSpec(qtype, (24, 40))
    bias = torch.randn(24, generator=g)
    assert quant._float_weight((raw,), spec) is not None
    x0 = torch.randn(3, 5, 40, generator=g)
    outs = []
    for path in ("plain", "blocks"):
        x = x0.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if path == "plain":
                y = quant.frozen_linear(x, (raw,), bias, spec)
            else:
                d = torch.bfloat16 if autocast else torch.float32
                with torch.autocast("cpu", enabled=False):
                    y = quant._QuantLinearFn.apply(x.to(d), bias.to(d), spec, raw)
        y.float().square().sum().backward()
        outs.append((y.detach(), x.grad))
    assert outs[0][0].dtype == outs[1][0].dtype
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    q4 = quant.QuantSpec(quant.Q4_0, (24, 64))
    assert (
        quant._float_weight(
            (torch.zeros(24, quant.row_bytes(quant.Q4_0, 64), dtype=torch.uint8),), q4
        )
        is None
    )


@pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="oneDNN has no bf16 product on this CPU",
)
@pytest.mark.parametrize("rows", [1, 14, 32, 64, 65])
def test_a_few_rows_without_gradients_use_the_weight_reordered_once(rows, monkeypatch):
    """A decode step's rows against a bf16-held weight under bf16 autocast, without
    gradients: the weight is reordered for oneDNN once and kept (one copy per held tensor),
    and the product is F.linear's to the bit; past PACK_ROWS rows, with gradients, or in
    float32 nothing is reordered."""
    monkeypatch.setattr(quant, "_PACKED", quant.WeakTensorKeyDictionary())
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 40, generator=g).to(torch.bfloat16)
    raw = w.view(torch.uint8).reshape(96, -1)
    spec = quant.QuantSpec(quant.BF16, (96, 40))
    bias = torch.randn(96, generator=g)
    x = torch.randn(rows, 1, 40, generator=g)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = quant.frozen_linear(x, (raw,), bias, spec)
        again = quant.frozen_linear(x, (raw,), bias, spec)
    want = torch.nn.functional.linear(x.bfloat16(), w, bias.bfloat16())
    assert torch.equal(y, want) and torch.equal(again, want)
    assert len(quant._PACKED) == (1 if rows <= quant.PACK_ROWS else 0)
    monkeypatch.setattr(quant, "_PACKED", quant.WeakTensorKeyDictionary())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # gradients on: training's product
        quant.frozen_linear(x.requires_grad_(True), (raw,), bias, spec)
    with torch.no_grad():  # float32
        quant.frozen_linear(x, (raw,), bias, spec)
    assert len(quant._PACKED) == 0


@pytest.mark.skipif(quant.native.dequant() is None, reason="no C compiler builds dequant.c")
@pytest.mark.parametrize(
    "qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name
)
def test_the_c_kernel_gives_the_torch_paths_bits(qtype, monkeypatch):
    """models/dequant.c (what training's products on a base in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
    Q4_K, Q5_K or Q6_K blocks dequantize through) against toy's torch path, bit for bit:
    float32 and bfloat16, extreme scales, leading dims and `out`, a row slice, and a Q/K
    weight put in half-split order."""
    assert int(qtype) in quant.NATIVE_TYPES
    raw = torch.from_numpy(
        np.concatenate(
            [
                random_blocks(qtype, 6, 256, None, seed=300 + int(qtype)),
                random_blocks(qtype, 6, 256, EXTREME_F16, seed=400 + int(qtype)),
            ]
        )
    )
    spec = quant.QuantSpec(int(qtype), (12, 256), qk_heads=3)  # 3 heads of 4 rows
    plain = quant.QuantSpec(int(qtype), (12, 256))
    calls = []
    real = quant.native.dequant
    monkeypatch.setattr(quant.native, "dequant", lambda: calls.append(1) or real())

    def both(fn, *args, **kw):
        calls.clear()
        fast = fn(*args, **kw)
        assert calls, "the kernel was not called"
        with monkeypatch.context() as m:
            m.setattr(quant.native, "dequant", lambda: None)
            slow = fn(*args, **kw)
        assert fast.dtype == slow.dtype and fast.shape == slow.shape
        bits = torch.int16 if fast.dtype == torch.bfloat16 else torch.int32
        assert torch.equal(fast.view(bits), slow.view(bits))

    for dtype in (torch.float32, torch.bfloat16):
        both(dequantize, raw, int(qtype), 256, dtype)
        both(dequantize, raw.view(3, 4, -1), int(qtype), 256, dtype)
        both(quant.dequantize_weight, raw, spec, dtype)
        both(quant.dequantize_weight, raw, plain, dtype, rows=slice(3, 9))
        out = torch.full((12, 256), 7.0, dtype=dtype)
        assert dequantize(raw, int(qtype), 256, dtype, out=out) is out
        both(dequantize, raw, int(qtype), 256, dtype, out=torch.empty_like(out))
        assert torch.equal(out, dequantize(raw, int(qtype), 256, dtype))
