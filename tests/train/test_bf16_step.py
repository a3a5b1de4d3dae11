"""The non-matmul half of a bf16 step (issue 46 item 2): RMSNorm under autocast keeps only x
and 1/rms for backward and computes its gradient in float32 from them, a bf16 run's
AdamW is torch's fused kernel, and its causal attention is models/cpu_attention.py's
matmuls rather than torch's flash kernel. All must give the losses of the step before them within
bf16's rounding, and a float32 run must not meet either: its losses stay the same bits.

bf16 is pretended on a CPU without the units (as tests/train/test_precision.py does): correct
anywhere, only slow there."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.precision import SCRATCH, corpus, units  # noqa: E402, F401  (corpus: a fixture)

from toy.models import cpu_attention, layers  # noqa: E402
from toy.train import loop  # noqa: E402


def plain_rmsnorm(x, weight, eps, out_dtype):
    """RMSNorm.forward's float ops as autograd runs them (the path before _RMSNormCast)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(dtype)).to(out_dtype)


@pytest.mark.parametrize("residual", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("trained", [False, True])
def test_rmsnorm_under_autocast_same_output_bits_and_gradients(residual, trained):
    torch.manual_seed(0)
    norm = layers.RMSNorm(96)
    norm.weight.data = torch.rand(96) + 0.5
    norm.weight.requires_grad_(trained)
    x = (torch.randn(3, 40, 96) * 3).to(residual).requires_grad_()
    g = torch.randn(3, 40, 96).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x)
    y.backward(g)
    gx, gw = x.grad.clone(), norm.weight.grad
    x.grad, norm.weight.grad = None, None
    ref = plain_rmsnorm(x, norm.weight, norm.eps, torch.bfloat16)
    ref.backward(g)
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref)  # the same bits forward
    # gradients: the same math in another order, within bf16's rounding of the largest
    err = (gx.float() - x.grad.float()).abs().max() / x.grad.float().abs().max()
    assert err < 2**-6, err
    if trained:
        assert torch.allclose(gw, norm.weight.grad, rtol=1e-5, atol=1e-6)
    else:
        assert gw is None


def test_rmsnorm_without_autocast_is_the_plain_ops_to_the_bit():
    torch.manual_seed(0)
    norm = layers.RMSNorm(64)
    norm.weight.data = torch.rand(64) + 0.5
    x = torch.randn(2, 9, 64, requires_grad=True)
    g = torch.randn(2, 9, 64)
    y = norm(x)
    y.backward(g)
    gx, gw = x.grad.clone(), norm.weight.grad.clone()
    x.grad, norm.weight.grad = None, None
    ref = plain_rmsnorm(x, norm.weight, norm.eps, torch.float32)
    ref.backward(g)
    assert torch.equal(y, ref) and torch.equal(gx, x.grad) and torch.equal(gw, norm.weight.grad)


def the_step_before(monkeypatch):
    """The step as it was before these changes: autograd's RMSNorm, foreach AdamW, torch's
    flash attention kernel."""

    class Plain:
        apply = staticmethod(plain_rmsnorm)

    monkeypatch.setattr(layers, "_RMSNormCast", Plain)
    monkeypatch.setattr(cpu_attention, "wanted", lambda q, k: False)
    adamw = loop.make_adamw
    monkeypatch.setattr(loop, "make_adamw", lambda *a, **k: adamw(*a, **{**k, "fused": False}))


def losses(toy_cli, corpus, out, arch, precision):
    code, text, err = toy_cli(
        "train", "--corpus", corpus, "--out", out, *SCRATCH, "--arch", arch, "--steps", "6",
        "--precision", precision, "--json", "--lr", "3e-3", "--warmup", "0",
    )  # fmt: skip
    assert code == 0, err
    return [r["loss"] for r in json.loads(text)["losses"]]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_bf16_run_keeps_its_losses_within_rounding(toy_cli, corpus, tmp_path, monkeypatch, arch):
    units(monkeypatch, "avx512_bf16")
    now = losses(toy_cli, corpus, tmp_path / "a", arch, "bf16")
    assert now == losses(toy_cli, corpus, tmp_path / "b", arch, "bf16")  # deterministic
    with monkeypatch.context() as m:
        the_step_before(m)
        before = losses(toy_cli, corpus, tmp_path / "c", arch, "bf16")
    assert now != before  # the new kernels ran (else this test compares nothing)
    for a, b in zip(now, before):
        assert abs(a - b) <= 5e-3 * abs(b), (now, before)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_float32_run_is_unchanged_to_the_bit(toy_cli, corpus, tmp_path, monkeypatch, arch):
    units(monkeypatch, "avx512_bf16")
    now = losses(toy_cli, corpus, tmp_path / "a", arch, "float32")
    with monkeypatch.context() as m:
        the_step_before(m)
        assert now == losses(toy_cli, corpus, tmp_path / "b", arch, "float32")


def test_a_bf16_run_resumes_to_the_same_losses_with_the_fused_adamw(
    toy_cli, corpus, tmp_path, monkeypatch
):
    """The fused kernel's state (moments, a step count per parameter) goes through the
    checkpoint as foreach's did: its step-3 checkpoint resumed, a bf16 run repeats steps
    4-6 to the bit."""
    units(monkeypatch, "avx512_bf16")
    code, text, err = toy_cli(
        "train", "--corpus", corpus, "--out", tmp_path, *SCRATCH, "--arch", "llama",
        "--steps", "6", "--precision", "bf16", "--lr", "3e-3", "--warmup", "0",
        "--run-id", "r", "--save-every", "3", "--json",
    )  # fmt: skip
    assert code == 0, err
    whole = [r["loss"] for r in json.loads(text)["losses"]]
    run = tmp_path / "r"
    later = [p for p in (run / "checkpoints").iterdir() if p.name != "step-000003"]
    for p in later:  # as if killed after step 3's checkpoint
        shutil.rmtree(p)
    code, text, err = toy_cli("train", "--resume", run, "--json")
    assert code == 0, err
    assert [r["loss"] for r in json.loads(text)["losses"]][3:] == whole[3:]
