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


@pytest.mark.parametrize("chunk_bytes", [losses.CHUNK_BYTES, 4 * 700 * 40])  # one chunk / many, ragged last
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


TINY = ["--n-layer", "2", "--d-model", "64", "--n-head", "4", "--n-kv-head", "2", "--seq-len", "64",
        "--batch-size", "4", "--steps", "3", "--eval-batches", "1", "--json"]


def _losses(out: str) -> list[float]:
    return [r["loss"] for r in json.loads(out.strip().splitlines()[-1])["losses"]]


def test_compile_trains_to_the_eager_losses_and_is_deterministic(toy_cli, tmp_path):
    from toy.train.loop import compile_unavailable

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
    assert runs[0] == pytest.approx(eager, rel=1e-5)
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
    from toy.train.loop import compile_unavailable

    assert "MPS" in compile_unavailable(torch.device("mps"))
