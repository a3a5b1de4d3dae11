"""--optimizer-state: AdamW's moments in bf16 (issue 56's memory goal). HalfStateAdamW
updates them in toy's C kernel (train/adamw_bf16.c, built by models/native.py's builder), or where
none builds, torch's fused AdamW piece by piece on float32 copies rounded back to bf16:
both the bits of one fused call on the whole tensor, the kernel's the same for any number
of threads, AdamW's update within bf16's rounding, the fallback when no compiler works,
auto's rule, and a run that resumes from a bf16 state to the byte."""

from __future__ import annotations

import json
import os
import platform
import shutil

import pytest
import torch
from helpers.runs import TINY, corpus, step_lines  # noqa: F401
from safetensors import safe_open
from torch.optim.adamw import adamw as adamw_functional

from toy.errors import UsageError
from toy.models import native as builder
from toy.train import native, schedule
from toy.train.schedule import HalfStateAdamW, make_adamw, resolve_optimizer_state


def params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 11), (50,), (3, 5), (1,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def grads(ps, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) * 0.01 for p in ps]


needs_cc = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler here"
)
# The kernel repeats torch's arithmetic in torch's order: the same bits where torch's own
# CPU kernel is the x86 wheel's (GCC's fused multiply-adds); elsewhere within an ulp.
SAME_BITS = platform.machine() in ("x86_64", "AMD64")


@pytest.mark.parametrize("path", ["torch", pytest.param("kernel", marks=needs_cc)])
def test_pieces_give_the_bits_of_one_whole_tensor_update(monkeypatch, path):
    """torch's path, CHUNK = 16: the 77-value matrix is cut into 5 pieces, small tensors
    share a call; the C kernel: every tensor in one call. Each tensor's result must be one
    fused call on the whole tensor, moments rounded to bf16 after each step."""
    monkeypatch.setattr(HalfStateAdamW, "CHUNK", 16)
    if path == "torch":
        monkeypatch.setattr(native, "adamw_bf16", lambda: None)
    else:
        assert native.adamw_bf16() is not None  # a compiler is here: the kernel must build
    ps = params()
    ref = [p.detach().clone() for p in ps]
    m = [torch.zeros_like(p, dtype=torch.bfloat16) for p in ps]
    v = [torch.zeros_like(p, dtype=torch.bfloat16) for p in ps]
    opt = make_adamw(
        [(str(i), p) for i, p in enumerate(ps)],
        1e-2,
        0.1,
        lambda n, p: p.dim() >= 2,  # two groups: the matrices decay, the vectors do not
        state_dtype=torch.bfloat16,
    )
    assert isinstance(opt, HalfStateAdamW)
    for step in range(1, 6):
        gs = grads(ps, step)
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
        for i, (r, g) in enumerate(zip(ref, gs)):
            m32, v32 = m[i].float(), v[i].float()
            adamw_functional(
                [r], [g], [m32], [v32], [], [torch.tensor(float(step - 1))], fused=True,
                amsgrad=False, beta1=0.9, beta2=0.95, lr=1e-2,
                weight_decay=0.1 if r.dim() >= 2 else 0.0, eps=1e-8, maximize=False,
            )  # fmt: skip
            m[i], v[i] = m32.bfloat16(), v32.bfloat16()
    for i, p in enumerate(ps):
        st = opt.state[p]
        assert st["exp_avg"].dtype == torch.bfloat16 and float(st["step"]) == 5
        if path == "torch" or SAME_BITS:
            assert torch.equal(p.detach(), ref[i]), i
            assert torch.equal(st["exp_avg"], m[i]) and torch.equal(st["exp_avg_sq"], v[i]), i
        else:
            torch.testing.assert_close(p.detach(), ref[i], rtol=1e-6, atol=1e-9)


@needs_cc
def test_the_kernel_gives_the_same_bits_on_any_number_of_threads(monkeypatch):
    """The kernel cuts the tensors laid end to end into one range a thread, cutting
    tensors anywhere (here 70,001 + 13 + 977 values, in 1, 2 and 3 parts): every value
    must come out the same, the ranges' tails and vector loops rounding alike. And it runs
    where torch's path would: the same bits as torch's fused AdamW over the widened
    moments, over 6 steps."""
    assert native.adamw_bf16() is not None
    g = torch.Generator().manual_seed(3)
    shapes = [(70001,), (13,), (977,)]
    start = [torch.randn(s, generator=g) * 0.02 for s in shapes]
    steps = [[torch.randn(s, generator=g) * 1e-3 for s in shapes] for _ in range(6)]
    results = {}
    for parts in (1, 2, 3, "torch"):
        if parts == "torch":
            monkeypatch.setattr(native, "adamw_bf16", lambda: None)
        else:
            monkeypatch.setattr(native, "threads", lambda parts=parts: parts)
        ps = [torch.nn.Parameter(s.clone()) for s in start]
        opt = HalfStateAdamW([{"params": ps, "weight_decay": 0.1}], 1e-3, (0.9, 0.95), 1e-8)
        for gs in steps:
            for p, gr in zip(ps, gs):
                p.grad = gr.clone()
            opt.step()
        results[parts] = [
            t for p in ps for t in (p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])
        ]
    for parts in (2, 3) + (("torch",) if SAME_BITS else ()):
        for a, b in zip(results[1], results[parts]):
            assert torch.equal(a, b), parts


def test_without_a_compiler_the_torch_path_runs_and_says_so_once(monkeypatch, tmp_path, capsys):
    """CC names no compiler: the kernel is None, one note on stderr (for the first call of
    the process only), and HalfStateAdamW still steps, through torch; a library built
    earlier is loaded without a compiler, a damaged one is built again."""
    monkeypatch.setattr(builder, "_loaded", {})
    monkeypatch.setattr(builder, "_noted", False)
    monkeypatch.setenv("TOY_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert native.adamw_bf16() is None
    monkeypatch.setattr(builder, "_loaded", {})
    assert native.adamw_bf16() is None
    err = capsys.readouterr().err
    assert err.count("toy: note:") == 1 and "no-such-cc" in err and "C compiler" in err
    ps = params()
    before = [p.detach().clone() for p in ps]
    opt = HalfStateAdamW(ps, 1e-2, (0.9, 0.95), 1e-8)
    for p, gr in zip(ps, grads(ps, 1)):
        p.grad = gr
    opt.step()
    assert all(not torch.equal(p.detach(), b) for p, b in zip(ps, before))
    assert not list((tmp_path / "native").glob("*"))  # no half-built file left behind
    if shutil.which("cc"):  # built once with a compiler, then loaded with none
        monkeypatch.setenv("CC", "cc")
        monkeypatch.setattr(builder, "_loaded", {})
        assert native.adamw_bf16() is not None
        built = list((tmp_path / "native").glob("*.so"))
        good = built[0].read_bytes()
        damaged = tmp_path / "damaged.so"  # a new file over the name (the loaded one stays mapped)
        damaged.write_bytes(good[: len(good) // 2])
        os.replace(damaged, built[0])  # damaged: built again, not loaded
        monkeypatch.setattr(builder, "_loaded", {})
        assert native.adamw_bf16() is not None
        assert built[0].read_bytes() == good
        monkeypatch.setattr(builder, "_loaded", {})
        monkeypatch.setattr(builder.subprocess, "run", None)  # any build would fail now
        assert native.adamw_bf16() is not None
        assert list((tmp_path / "native").glob("*.so")) == built


def test_the_update_is_adamws_within_bf16_rounding():
    """Against torch's float32 AdamW: step 1's update (bias correction of step 1: a step of
    lr a value) and after 20 steps, the distance moved within 1% (a wrong step count or a
    moment lost to rounding moves it by far more)."""
    ps, qs = params(), params()
    start = [p.detach().clone() for p in ps]
    rule = lambda n, p: p.dim() >= 2  # noqa: E731
    full = make_adamw([(str(i), p) for i, p in enumerate(ps)], 1e-3, 0.1, rule)
    half = make_adamw(
        [(str(i), q) for i, q in enumerate(qs)], 1e-3, 0.1, rule, state_dtype=torch.bfloat16
    )
    for step in range(1, 21):
        for p, q, g in zip(ps, qs, grads(ps, step)):
            p.grad, q.grad = g.clone(), g.clone()
        full.step()
        half.step()
        if step in (1, 20):
            for p, q, s in zip(ps, qs, start):
                moved, diff = (p.detach() - s).norm(), (p.detach() - q.detach()).norm()
                assert diff <= 0.01 * moved, (step, float(diff), float(moved))


def test_auto_halves_a_whole_models_state_under_bf16_only():
    big, small = schedule.HALF_STATE_FROM, schedule.HALF_STATE_FROM - 1
    assert resolve_optimizer_state("auto", "bf16", big, False) == "bfloat16"
    assert resolve_optimizer_state("auto", "bf16", small, False) == "float32"  # an adapter's
    assert resolve_optimizer_state("auto", "float32", big, False) == "float32"
    assert resolve_optimizer_state("auto", "bf16", big, True) == "float32"  # FSDP's shards
    assert resolve_optimizer_state("bfloat16", "float32", 10, False) == "bfloat16"
    with pytest.raises(UsageError, match="--fsdp"):
        resolve_optimizer_state("bfloat16", "bf16", big, True)
    with pytest.raises(UsageError, match="valid: auto, float32, bfloat16"):
        resolve_optimizer_state("bf16", "bf16", big, False)


def test_a_bf16_state_run_records_it_saves_it_and_resumes_to_the_byte(corpus, tmp_path, toy_cli):
    args = ["train", "--corpus", corpus, "--out", tmp_path, *TINY, "--steps", "8"]
    code, ref, err = toy_cli(*args, "--run-id", "r", "--save-every", "4",
                             "--optimizer-state", "bfloat16")  # fmt: skip
    assert code == 0, err
    run = tmp_path / "r"
    assert json.loads((run / "run.json").read_text())["config"]["optimizer_state"] == "bfloat16"
    with safe_open(run / "checkpoints" / "step-000004" / "optimizer.safetensors", "pt") as f:
        moments = [k for k in f.keys() if k.endswith(("exp_avg", "exp_avg_sq"))]
        assert moments and all(f.get_tensor(k).dtype == torch.bfloat16 for k in moments)
    # a resume keeps the recorded state; another one is refused, auto is the record
    code, _, err = toy_cli("train", "--resume", run / "checkpoints" / "step-000004",
                           "--optimizer-state", "float32")  # fmt: skip
    assert code == 2 and "--optimizer-state" in err and "bfloat16" in err, err
    code, out, err = toy_cli("train", "--resume", run / "checkpoints" / "step-000004",
                             "--optimizer-state", "auto")  # fmt: skip
    assert code == 0, err
    resumed = step_lines(out)
    assert resumed[0].startswith("step 5 ") and resumed == step_lines(ref)[4:]
    # auto on this tiny run (float32 here, or bf16 with few values): float32 moments,
    # recorded, and another path than bf16's after step 1
    code, f32, err = toy_cli(*args, "--run-id", "f")
    assert code == 0, err
    assert step_lines(f32)[0] == step_lines(ref)[0] and step_lines(f32) != step_lines(ref)
    cfg = json.loads((tmp_path / "f" / "run.json").read_text())["config"]
    assert cfg["optimizer_state"] == "float32"


def test_a_run_recorded_before_the_flag_resumes_in_float32(corpus, tmp_path, toy_cli):
    code, _, err = toy_cli("train", "--corpus", corpus, "--out", tmp_path, *TINY, "--steps", "4",
                           "--run-id", "old", "--save-every", "2")  # fmt: skip
    assert code == 0, err
    info_path = tmp_path / "old" / "run.json"
    info = json.loads(info_path.read_text())
    del info["config"]["optimizer_state"]  # as run.json was written before --optimizer-state
    info_path.write_text(json.dumps(info))
    code, _, err = toy_cli("train", "--resume", tmp_path / "old", "--steps", "6")
    assert code == 0, err
    assert json.loads(info_path.read_text())["config"]["optimizer_state"] == "float32"


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_toys_adamw_gives_torchs_bits_and_state(fused):
    """make_adamw's AdamW runs torch's methods without their dynamo wrappers (each imported
    torch._dynamo, 1.0-1.2 s of every training process): the weights and the saved state are
    torch.optim.AdamW's to the bit over steps, a state_dict loads back into either, and
    zero_grad clears what torch's does."""
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4)]
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]

    def run(make):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = make(params)
        for step in grads:
            for p, gr in zip(params, step):
                p.grad = gr.clone()
            opt.step()
            opt.zero_grad()
            assert all(p.grad is None for p in params)
        return params, opt

    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    groups = (
        lambda ps: [  # noqa: E731
            {"params": ps[::2], "weight_decay": 0.1, "lr_scale": 1.0},
            {"params": ps[1::2], "weight_decay": 0.0, "lr_scale": 1.0},
        ]
    )
    opts = dict(foreach=None if fused else True, fused=True if fused else None)
    ours, opt = run(lambda ps: schedule.AdamW(groups(ps), **kw, **opts))
    theirs, ref = run(lambda ps: torch.optim.AdamW(groups(ps), **kw, **opts))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    sd, ref_sd = opt.state_dict(), ref.state_dict()
    assert sd["param_groups"] == ref_sd["param_groups"]
    for i in ref_sd["state"]:
        for k, v in ref_sd["state"][i].items():
            assert torch.equal(sd["state"][i][k], v), (i, k)
    back = schedule.AdamW(groups([torch.nn.Parameter(t.clone()) for t in start]), **kw, **opts)
    back.load_state_dict(ref_sd)
    assert torch.equal(back.state_dict()["state"][0]["exp_avg"], ref_sd["state"][0]["exp_avg"])
