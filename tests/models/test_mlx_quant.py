"""toy.models.mlx_quant against MLX itself: for every bits x group size x dtype, what mx.quantize
packs, toy dequantizes to exactly mx.dequantize's bits, and toy's own quantize gives exactly
mx.quantize's (weight, scales, biases). Skipped where mlx is not installed (it is CPU-only here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from toy.models import mlx_quant

mx = pytest.importorskip("mlx.core")

DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_SAME_WIDTH = {
    torch.float16: (torch.int16, np.int16),
    torch.bfloat16: (torch.int16, np.int16),
    torch.float32: (torch.int32, np.int32),
}


def to_mx(t: torch.Tensor):
    """The same bits in MLX (through an integer view: numpy has no bfloat16)."""
    if t.dtype == torch.uint32:
        return mx.array(t.view(torch.int32).numpy()).view(mx.uint32)
    ti, _ = _SAME_WIDTH[t.dtype]
    return mx.array(t.contiguous().view(ti).numpy()).view(getattr(mx, DTYPES[t.dtype]))


def to_torch(a) -> torch.Tensor:
    if a.dtype == mx.uint32:
        return torch.from_numpy(np.array(a.view(mx.int32))).view(torch.uint32)
    dt = {v: k for k, v in DTYPES.items()}[str(a.dtype).split(".")[-1]]
    ni = _SAME_WIDTH[dt][1]
    return torch.from_numpy(np.array(a.view(getattr(mx, np.dtype(ni).name)))).view(dt)


def weights(dtype: torch.dtype, group_size: int, seed: int) -> torch.Tensor:
    """A small matrix with the groups that test the corner cases: ordinary N(0, 0.02) rows, an
    all-positive row, an all-negative row, a zero group, a constant group, and huge/tiny
    magnitudes."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 2 * group_size, generator=g) * 0.02
    w[1] = w[1].abs() + 0.5
    w[2] = -w[2].abs() - 0.25
    w[3, :group_size] = 0.0
    w[4, :group_size] = 0.375
    w[5] *= 1e3
    w[6] *= 1e-3
    return w.to(dtype)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES.values()))
@pytest.mark.parametrize("group_size", mlx_quant.GROUP_SIZES)
@pytest.mark.parametrize("bits", mlx_quant.BITS)
def test_dequantize_and_quantize_match_mlx_bit_for_bit(bits, group_size, dtype):
    w = weights(dtype, group_size, seed=bits * 1000 + group_size)
    wq, scales, biases = mx.quantize(to_mx(w), group_size=group_size, bits=bits)
    want = to_torch(mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits))
    tq, ts, tb = to_torch(wq), to_torch(scales), to_torch(biases)
    assert tq.shape == (8, 2 * group_size * bits // 32) and ts.dtype == dtype

    got = mlx_quant.dequantize(tq, ts, tb, group_size=group_size, bits=bits)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(
        got.view(_SAME_WIDTH[dtype][0]), want.view(_SAME_WIDTH[dtype][0])
    )  # bits, -0.0 too

    q2, s2, b2 = mlx_quant.quantize(w, group_size=group_size, bits=bits)
    assert torch.equal(q2, tq)
    assert torch.equal(s2.view(_SAME_WIDTH[dtype][0]), ts.view(_SAME_WIDTH[dtype][0]))
    assert torch.equal(b2.view(_SAME_WIDTH[dtype][0]), tb.view(_SAME_WIDTH[dtype][0]))


@pytest.mark.parametrize("bits", (1, *mlx_quant.BITS))
def test_unpack_reads_mlx_packing_of_random_words(bits):
    """Any uint32 words (not just what quantize makes): unpack gives the q that mx.dequantize
    sees with scale 1 and bias 0, and pack gives the words back."""
    words = torch.from_numpy(
        np.random.default_rng(bits).integers(0, 2**32, (3, 4 * bits), dtype=np.uint32)
    )
    ones = torch.ones(3, 128 // 64, dtype=torch.float32)
    want = np.array(
        mx.dequantize(to_mx(words), to_mx(ones), to_mx(ones * 0), group_size=64, bits=bits)
    )
    q = mlx_quant.unpack(words, bits)
    assert q.shape == (3, 128) and np.array_equal(q.numpy(), want)
    assert torch.equal(mlx_quant.pack(q, bits), words)


def test_leading_dims_and_bad_shapes():
    """Stacked experts (E, out, in) dequantize per matrix; a mismatched scales shape is refused."""
    w = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, s, b = mlx_quant.quantize(w, group_size=32, bits=4)
    assert q.shape == (2, 4, 8) and s.shape == (2, 4, 2)
    whole = mlx_quant.dequantize(q, s, b, group_size=32, bits=4)
    assert torch.equal(whole[1], mlx_quant.dequantize(q[1], s[1], b[1], group_size=32, bits=4))
    with pytest.raises(ValueError, match="do not fit"):
        mlx_quant.dequantize(q, s, b, group_size=64, bits=4)
    with pytest.raises(ValueError, match="bits"):
        mlx_quant.quantize(w, group_size=32, bits=7)
