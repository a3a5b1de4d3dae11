"""The speed levers of issue 8 keep the maths: the chunked head + cross-entropy equals
the plain one (loss and both gradients), and --compile trains to the eager losses and
falls back to eager, with a note, where inductor cannot run."""

import json

import pytest
import torch
import torch.nn.functional as F

from toy.models import losses
from toy.models.losses import linear_cross_entropy


def _reference(h, w, t):
    return F.cross_entropy(h @ w.T, t, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize(
    "chunk_bytes", [losses.CHUNK_BYTES, 4 * 700 * 40]
)  # one chunk / many, ragged last
def test_linear_cross_entropy_matches_cross_entropy_and_its_gradients(monkeypatch, chunk_bytes):
    monkeypatch.setattr(losses, "CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(301, 24, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(700, 24, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 700, (301,), generator=g)
    t[::4] = -100  # ignored positions carry neither loss nor gradient
    got = linear_cross_entropy(h, w, t)
    (got * 2.5).backward()  # the incoming gradient scales both
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    want = _reference(h, w, t)
    (want * 2.5).backward()
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-10)
    assert torch.allclose(gh, h.grad, rtol=1e-10, atol=1e-12)
    assert torch.allclose(gw, w.grad, rtol=1e-10, atol=1e-12)
    assert gh[::4].abs().max() == 0


@pytest.mark.parametrize("chunk_bytes", [losses.CHUNK_BYTES, 4 * 700 * 40])
def test_linear_cross_entropy_under_bf16_is_the_float_loss_of_its_bf16_logits(
    monkeypatch, chunk_bytes
):
    """Under bf16 autocast a trained head's chunks take their softmax in one fused bf16
    pass (losses._bf16_softmax): per-row losses and both gradients are those of float64
    cross-entropy over the same bf16-rounded logits, within bf16's rounding."""
    monkeypatch.setattr(losses, "CHUNK_BYTES", chunk_bytes)
    taken = []
    fused = losses._bf16_softmax
    monkeypatch.setattr(losses, "_bf16_softmax", lambda x: taken.append(1) or fused(x))
    g = torch.Generator().manual_seed(4)
    h = torch.randn(301, 24, generator=g, requires_grad=True)
    w = (torch.randn(700, 24, generator=g) * 0.7).requires_grad_()
    t = torch.randint(0, 700, (301,), generator=g)
    t[::4] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(h, w, t)
        rows = losses._chunked(h.detach(), w.detach(), t, False, False, per_row=True)[0]
    got.backward()
    assert taken
    hb, wb = h.detach().bfloat16().double(), w.detach().bfloat16().double()
    hb.requires_grad_(), wb.requires_grad_()
    z = (hb @ wb.T).bfloat16().double()  # the logits as bf16 makes them
    want = F.cross_entropy(z, t, ignore_index=-100, reduction="none")
    assert (rows - want).abs().max() < 4e-3, (rows - want).abs().max()
    assert abs(got.item() - want.sum().item()) < 4e-3 * len(t)
    want.sum().backward()
    for mine, ref in ((h.grad, hb.grad), (w.grad, wb.grad)):
        assert ((mine.double() - ref).norm() / ref.norm()) < 1e-2
    assert h.grad[::4].abs().max() == 0


def test_linear_cross_entropy_frozen_head_and_no_grad():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(40, 8, generator=g, requires_grad=True)
    w = torch.randn(50, 8, generator=g)  # a frozen (tied) head: no gradient for it is made
    t = torch.randint(0, 50, (40,), generator=g)
    got = linear_cross_entropy(h, w, t)
    got.backward()
    gh = h.grad.clone()
    h.grad = None
    want = _reference(h, w, t)
    want.backward()
    assert torch.allclose(got, want, rtol=1e-5) and torch.allclose(gh, h.grad, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        assert torch.allclose(linear_cross_entropy(h, w, t), want, rtol=1e-5)


TINY = [
    "--n-layer",
    "2",
    "--d-model",
    "64",
    "--n-head",
    "4",
    "--n-kv-head",
    "2",
    "--seq-len",
    "64",
    "--batch-size",
    "4",
    "--steps",
    "3",
    "--eval-batches",
    "1",
    "--json",
]


def _losses(out: str) -> list[float]:
    return [r["loss"] for r in json.loads(out.strip().splitlines()[-1])["losses"]]


def test_compile_trains_to_the_eager_losses_and_is_deterministic(toy_cli, tmp_path):
    from toy.models.decode import compile_unavailable

    why = compile_unavailable(torch.device("cpu"))
    if why:
        pytest.skip(why)
    code, out, err = toy_cli("train", *TINY, "--out", tmp_path)
    assert code == 0, err
    eager = _losses(out)
    runs = []
    for _ in range(2):
        code, out, err = toy_cli("train", *TINY, "--out", tmp_path, "--compile")
        assert code == 0, err
        runs.append(_losses(out))
    assert runs[0] == runs[1]  # same seed, data and machine: the same loss bytes
    # On a CPU with bf16 units both run bf16, and eager attention is then cpu_attention's
    # matmuls where the compiled graph keeps torch's kernel: the same math in other
    # roundings (1.2e-5 apart after 3 steps on a Zen 4), far inside bf16's 4e-3.
    assert runs[0] == pytest.approx(eager, rel=1e-4)
    run_dirs = sorted(tmp_path.iterdir())
    info = json.loads((run_dirs[-1] / "run.json").read_text())
    assert info["config"]["compile"] is True
    # In-place compilation keeps the checkpoint and export names of the eager model.
    from safetensors.torch import load_file

    keys = set(load_file(str(run_dirs[-1] / "final" / "model.safetensors")))
    assert keys == set(load_file(str(run_dirs[0] / "final" / "model.safetensors")))


def test_compile_without_a_compiler_falls_back_to_eager_with_a_note(toy_cli, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    code, out, err = toy_cli("train", *TINY[:-1], "--out", tmp_path, "--compile")
    assert code == 0, err
    assert "no C++ compiler" in out + err and "training eagerly" in out + err


def test_compile_stays_off_on_apple_mps():
    from toy.models.decode import compile_unavailable

    assert "MPS" in compile_unavailable(torch.device("mps"))


class _RowsHead:
    """A frozen head that gives its rows in chunks, as a QuantLinear over GGUF blocks does."""

    def __init__(self, w):
        self.w, self.out_features = w, w.shape[0]
        self.chunks = 0

    def rows(self, i, j, dtype):
        self.chunks += 1
        return self.w[i:j].to(dtype)


@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_vocab_chunked_head_is_one_pass_and_matches_cross_entropy(monkeypatch, softcap):
    """A head read in vocabulary chunks (a quantized head): the online log-sum-exp that
    carries the gradient along gives the plain cross-entropy's loss and gradient for h, with
    each chunk read once (it was read twice before: once for the loss, once for the gradient)."""
    monkeypatch.setattr(
        losses, "CHUNK_BYTES", 4 * 16 * 256
    )  # 256-row chunks: 4 of them, ragged last
    g = torch.Generator().manual_seed(2)
    h = torch.randn(16, 24, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(900, 24, dtype=torch.float64, generator=g) * 3
    t = torch.randint(0, 900, (16,), generator=g)
    t[::5] = -100
    head = _RowsHead(w)
    got, grad = losses._vocab_chunked(h.detach(), head, t, True, softcap)
    assert head.chunks == 4
    z = h @ w.T
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    want = F.cross_entropy(z, t, ignore_index=-100, reduction="sum")
    want.backward()
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-10)
    assert torch.allclose(grad, h.grad, rtol=1e-10, atol=1e-12)
    assert grad[::5].abs().max() == 0
    loss_only, none = losses._vocab_chunked(h.detach(), head, t, False, softcap)
    assert none is None and torch.allclose(loss_only, want, rtol=1e-12)


def test_vocab_chunked_head_under_bf16_is_the_float_loss_of_its_bf16_logits(monkeypatch):
    """Under bf16 autocast a chunked head takes each chunk's softmax in one fused bf16 pass
    (losses._vocab_chunked_bf16) and carries each chunk's log-sum-exp from its largest
    probability. Its per-row losses and gradient are those of float64 cross-entropy over
    the same bf16-rounded logits within bf16's rounding; rows ignored stay zero."""
    monkeypatch.setattr(losses, "CHUNK_BYTES", 4 * 64 * 300)  # 300-row chunks: 4, ragged last
    taken = []
    fused = losses._vocab_chunked_bf16
    monkeypatch.setattr(
        losses, "_vocab_chunked_bf16", lambda *a, **k: taken.append(1) or fused(*a, **k)
    )
    g = torch.Generator().manual_seed(5)
    h = torch.randn(64, 48, generator=g)
    w = (torch.randn(1000, 48, generator=g) * 0.6).bfloat16()
    t = torch.randint(0, 1000, (64,), generator=g)
    t[::7] = -100
    head = _RowsHead(w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rows, grad = losses._vocab_chunked(h, head, t, True, per_row=True)
        total, _ = losses._vocab_chunked(h, head, t, False)
    assert taken and head.chunks == 8
    z = (h.bfloat16() @ w.T).double().requires_grad_()  # the logits as bf16 makes them
    want = F.cross_entropy(z, t, ignore_index=-100, reduction="none")
    want.sum().backward()
    assert (rows - want).abs().max() < 4e-3, (rows - want).abs().max()
    assert abs(total.item() - want.sum().item()) < 4e-3 * len(t)
    want_grad = z.grad @ w.double()  # d loss / d h through the bf16 head
    err = (grad.double() - want_grad).norm() / want_grad.norm()
    assert err < 1e-2, err
    assert grad[::7].abs().max() == 0 and rows[::7].abs().max() == 0


def test_silu_mul_keeps_two_tensors_and_autograds_gradients_to_the_bit():
    """SwiGLU's gate through _SiluMul: the same output and gradients, bit for bit, as
    autograd's silu(g) * u, with two saved tensors instead of three."""
    from toy.models.layers import silu_mul

    g0 = torch.Generator().manual_seed(3)
    g, u = torch.randn(4, 7, 33, generator=g0), torch.randn(4, 7, 33, generator=g0)
    grad = torch.randn(4, 7, 33, generator=g0)
    outs = []
    for fn in (silu_mul, lambda a, b: F.silu(a) * b):
        a, b = g.clone().requires_grad_(), u.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, saved=saved: saved.append(t) or t, lambda t: t
        ):
            y = fn(a, b)
        y.backward(grad)
        outs.append((y.detach(), a.grad, b.grad, len(saved)))
    (y1, ga1, gb1, n1), (y2, ga2, gb2, n2) = outs
    assert torch.equal(y1, y2) and torch.equal(ga1, ga2) and torch.equal(gb1, gb2)
    assert (n1, n2) == (2, 3)


def test_a_large_quantized_weight_is_dequantized_in_pieces(monkeypatch):
    """Above WEIGHT_CHUNK_BYTES a frozen quantized linear works a piece of rows at a time,
    forward and backward, and gives the whole weight's results (float32 rounding aside)."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType as T
    from gguf.quants import quantize

    from toy.models import quant
    from toy.models.quant import QuantLinear, QuantSpec

    rng = np.random.default_rng(0)
    raw = torch.from_numpy(quantize(rng.standard_normal((96, 64)).astype(np.float32), T.Q4_0))
    lin = QuantLinear(raw, QuantSpec(int(T.Q4_0), (96, 64)))
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(4))
    results = []
    real = QuantSpec.dequantize
    for limit in (quant.WEIGHT_CHUNK_BYTES, 4 * 64 * 40):  # whole; pieces of 40, 40 and 16 rows
        monkeypatch.setattr(quant, "WEIGHT_CHUNK_BYTES", limit)
        xi = x.clone().requires_grad_()
        calls = []
        monkeypatch.setattr(
            QuantSpec,
            "dequantize",
            lambda s, *a, calls=calls, **k: calls.append(k.get("rows")) or real(s, *a, **k),
        )
        y = lin(xi)
        y.backward(torch.ones_like(y))
        results.append((y.detach(), xi.grad, calls))
    (y1, g1, c1), (y2, g2, c2) = results
    assert c1 == [None, None] and c2 == [slice(0, 40), slice(40, 80), slice(80, 96)] * 2
    assert torch.allclose(y1, y2, rtol=1e-6, atol=1e-6) and torch.allclose(
        g1, g2, rtol=1e-6, atol=1e-6
    )
