"""The tanh GELU on bf16 values through toy's C kernel (models/gelu_bf16.c, layers.gelu_tanh):
every finite bf16 value against torch's kernel and a float64 reference, forward and
gradient; the same bits at any thread count; float32 and a machine without a compiler keep
torch's op to the bit; a GPT-2 MLP trains the same under bf16 autocast within bf16's
rounding."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from toy.models import layers, native
from toy.runs import cache_dir

needs_cc = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler here"
)


def every_bf16() -> torch.Tensor:
    """All 65,536 bf16 bit patterns that are finite numbers."""
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return x[torch.isfinite(x)].contiguous()


def truth(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh in float64 as x * sigmoid(2u): 0.5 x (1 + tanh(u)) cancels in float64 too
    for x below about -6."""
    xd = x if x.dtype == torch.float64 else x.double()
    return xd * torch.sigmoid(2 * 0.7978845608028654 * (xd + 0.044715 * xd**3))


def ulp(v: torch.Tensor) -> torch.Tensor:
    """One bf16 rounding step at v's magnitude (2^-8 relative; subnormals' step below)."""
    return (v.abs().double() * 2.0**-8).clamp(min=2.0**-133)


@needs_cc
def test_forward_every_bf16_value_as_torch_or_nearer_the_truth():
    assert native.gelu_bf16() is not None  # a compiler is here: the kernel must build
    x = every_bf16()
    mine = layers.gelu_tanh(x)
    theirs = F.gelu(x, approximate="tanh")
    true = truth(x)
    same = mine == theirs
    assert same.float().mean() > 0.997  # 149 of 65,280 differ on a Zen 4
    err_mine = (mine.double() - true).abs()
    err_theirs = (theirs.double() - true).abs()
    # where they differ, toy's value is within one rounding of the truth, never further
    # from it than torch's by more than one rounding (torch's 1 + tanh(u) cancels to 0 for
    # x in [-10, -4]; toy's sigmoid form keeps those tiny negative values)
    # (below 2e-37 the kernel gives -0, as torch does: sigmoid(2u) past float's exp range)
    assert bool((err_mine <= ulp(true) + 2e-37).all())
    assert bool((err_mine <= err_theirs + ulp(true)).all())
    moderate = x.abs() < 4
    assert (mine[moderate] != theirs[moderate]).sum() <= 2


@needs_cc
def test_gradient_every_bf16_value_within_one_rounding():
    x = every_bf16()
    x = x[x.abs() < 1e18]  # torch's own gradient is NaN past ~1.8e19 (x^2 overflows)
    g = torch.ones_like(x)
    mine = torch.ops.aten.gelu_backward(g, x, approximate="tanh")  # torch's, for the count
    xr = x.clone().requires_grad_()
    layers.gelu_tanh(xr).backward(g)
    xd = x.double().requires_grad_()
    truth(xd).backward(g.double())
    true = xd.grad
    err = (xr.grad.double() - true).abs()
    assert bool((err <= 2 * ulp(true) + 1e-35).all())  # below: 0, as torch gives
    assert (xr.grad == mine).float().mean() > 0.995
    # a gradient that is not 1: the chain rule's product rounded once
    g2 = torch.randn(x.shape, generator=torch.Generator().manual_seed(0)).bfloat16()
    xr.grad = None
    layers.gelu_tanh(xr).backward(g2)
    ref = torch.ops.aten.gelu_backward(g2, x, approximate="tanh")
    close = (xr.grad.double() - ref.double()).abs() <= 2 * ulp(ref) + 1e-30
    assert close.float().mean() > 0.995


@needs_cc
def test_the_same_bits_at_any_thread_count():
    x = (torch.randn(3, 70_000, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    before = torch.get_num_threads()
    out = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            xr = x.clone().requires_grad_()
            y = layers.gelu_tanh(xr)
            y.backward(g)
            out.append((y, xr.grad))
    finally:
        torch.set_num_threads(before)
    for y, gx in out[1:]:
        assert torch.equal(y, out[0][0]) and torch.equal(gx, out[0][1])


def test_float32_and_no_kernel_keep_torchs_op(monkeypatch):
    x = torch.randn(4, 33, generator=torch.Generator().manual_seed(3)) * 3
    assert torch.equal(layers.gelu_tanh(x), F.gelu(x, approximate="tanh"))
    monkeypatch.setattr(native, "gelu_bf16", lambda: None)  # no compiler here
    xb = x.bfloat16()
    assert torch.equal(layers.gelu_tanh(xb), F.gelu(xb, approximate="tanh"))


def test_a_traced_graph_keeps_torchs_op():
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(layers.gelu_tanh, tracing_mode="fake")(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert "gelu" in graph.code


@needs_cc
def test_a_gpt2_mlp_under_bf16_autocast_trains_as_with_torchs_gelu(monkeypatch):
    """The MLP's loss and every gradient with the kernel against torch's gelu, bf16 autocast
    on a cpu: within bf16's rounding of each other."""

    def run():
        torch.manual_seed(0)
        mlp = layers.GeluMLP(64, 256)
        x = torch.randn(4, 16, 64)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = mlp(x).float().pow(2).mean()
        loss.backward()
        return loss.detach(), [p.grad for p in mlp.parameters()]

    loss_k, grads_k = run()
    monkeypatch.setattr(native, "gelu_bf16", lambda: None)
    loss_t, grads_t = run()
    assert abs(loss_k.item() - loss_t.item()) <= 0.005 * abs(loss_t.item())
    for a, b in zip(grads_k, grads_t):
        assert torch.allclose(a, b, rtol=0.02, atol=0.02 * b.abs().max().item())


def test_the_builders_cache_folder_is_toys(monkeypatch, tmp_path):
    """models/native.py reads toy's cache folder itself (models/ imports nothing lower):
    the same folder runs.cache_dir gives, however it is set."""
    for env in ({}, {"XDG_CACHE_HOME": str(tmp_path / "x")}, {"TOY_CACHE": str(tmp_path / "t")}):
        monkeypatch.delenv("TOY_CACHE", raising=False)
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert native.cache_dir() == cache_dir()


@needs_cc
def test_a_changed_header_builds_its_users_again(monkeypatch, tmp_path):
    """A built library is keyed by its source and the local headers it includes (bf16.h):
    a header changed under an unchanged source is a new build, never the old library."""
    monkeypatch.setenv("TOY_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(native.GELU_SOURCE, src / "gelu_bf16.c")
    shutil.copy(native.GELU_SOURCE.with_name("bf16.h"), src / "bf16.h")
    shutil.copy(native.GELU_SOURCE.with_name("exp.h"), src / "exp.h")
    first = native._build(src / "gelu_bf16.c", "gelu_bf16")
    assert first is not None and native._build(src / "gelu_bf16.c", "gelu_bf16") == first
    header = src / "bf16.h"
    header.write_text(header.read_text() + "\n/* changed */\n")
    second = native._build(src / "gelu_bf16.c", "gelu_bf16")
    assert second is not None and second != first
