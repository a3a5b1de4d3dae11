"""GRPO (`toy train --recipe grpo`, issue 45) through the command line on a tiny llama GGUF:
the figures on every step line, in events, --json and `toy plot`; the held-out reward
rising under a reward the tiny model can meet (the completion's length); the same seed
giving the same lines, and SIGKILL then --resume giving the unbroken run's lines (with
--num-iterations 2, whose reused generation rides in the checkpoint); a reward function
that fails, before the first step (exit 2) and later (run_failed, the checkpoint kept);
final/ read by infer and every export; token_logprobs (the per-token head) against a
plain log-softmax, on a float and a quantized head."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.common import run_toy
from helpers.gguf_fixtures import tiny_model, write_llama_gguf  # noqa: E402
from helpers.runs import step_lines, wait_for_checkpoint  # noqa: E402

from toy.data.arith import make_arith  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402
from toy.tokenizer import train_bpe  # noqa: E402

# The tiny model can learn to end early: the length reward at a 4-token target. Eight
# completions a prompt: with four, a stop (the only signal at first) came rarely enough
# that half of the seeds tried had not learnt by step 30.
SHORT = ["--reward", "length", "--target-length", "4", "--num-generations", "8"]
RUN = ["--max-completion-length", "16", "--seq-len", "96", "--lr", "5e-2"]


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo")
    text = bundled_text_paths()[0].read_text()[:40000] + " 0 1 2 3 4 5 6 7 8 9 + - x = ?"
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    model = tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True), max_seq_len=256)
    make_arith(d / "arith", 40, 8, seed=0)
    return {"gguf": write_llama_gguf(d / "base.gguf", model, tok), "data": d / "arith", "d": d}


def train(kit, out, run_id, *extra, timeout=600, run=run_toy):
    """A GRPO run on the kit: in a process of its own (run_toy), or `run=toy_run`, in this one."""
    r = run(
        "train", "--recipe", "grpo", "--model", kit["gguf"], "--data", kit["data"], *SHORT,
        *RUN, "--out", out, "--run-id", run_id, *extra, timeout=timeout,
    )  # fmt: skip
    return r


def test_grpo_learns_and_shows_its_figures(kit, tmp_path, toy_cli, toy_run):
    r = train(kit, tmp_path, "a", "--steps", "30", "--eval-every", "10", "--json", run=toy_run)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    vals = res["val_rewards"]
    assert [v["step"] for v in vals] == [0, 10, 20, 30]
    assert vals[0]["reward"] == pytest.approx(-3.0)  # every greedy completion cut at 16
    # Learnt: the sampled completions' reward over the last five steps, and the best
    # held-out evaluation after step 0. Not the last evaluation alone: it is greedy, and
    # where the stop token and another are near even, rounding decides it. A change of
    # bf16 rounding (issue 46) left seed 0's sampled reward at -0.39 by step 30, as before,
    # and its greedy one at -2.1 (before: -0.5); seeds 1-3 ended at -0.44 to -0.97.
    steps = res["losses"]
    early, late = (sum(r["reward"] for r in rows) / 5 for rows in (steps[:5], steps[-5:]))
    assert late > early + 1.0, (early, late)
    assert max(v["reward"] for v in vals[1:]) > vals[0]["reward"] + 1.0, vals
    assert vals[-1]["length"] == vals[-1]["reward"] and "completion_length" in vals[-1]
    first = res["losses"][0]
    for key in ("reward", "reward_std", "length", "completion_length", "completion_length_min",
                "completion_length_max", "clipped_share", "clip_ratio"):  # fmt: skip
        assert key in first, key
    assert "kl" not in first  # --beta 0: no reference pass, no KL
    assert res["val_losses"] == []  # GRPO's evaluation is its rewards
    run = Path(res["run_dir"])
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "eval"] == [0, 10, 20, 30]
    assert all("reward" in e for e in events if e["event"] == "step")
    code, out, err = toy_cli("plot", run, "--out", tmp_path / "p.png")
    assert code == 0, err
    # final/ is an adapter like any other: infer and every export take it.
    code, out, err = toy_cli(
        "infer", "--run", run, "--chat", "What is 2 + 2?", "--max-new-tokens", "4"
    )
    assert code == 0, err
    for fmt, dest in (("gguf-lora", "a.gguf"), ("peft", "peft"), ("mlx", "mlx")):
        code, _, err = toy_cli("export", run, "--format", fmt, "--out", tmp_path / dest)
        assert code == 0, err
    info = json.loads((run / "run.json").read_text())
    assert info["config"]["reward"] == ["length"] and info["job"]["num_generations"] == 8


@pytest.mark.parametrize("mu", ["1", "2"])
def test_same_seed_same_lines_and_sigkill_resumes_exactly(kit, tmp_path, mu, toy_run):
    # 16 steps: the first checkpoint (step 4), where the run is killed, leaves it 12 to go
    steps = ["--steps", "16", "--save-every", "4", "--num-iterations", mu, "--beta", "0.05"]
    ref = train(kit, tmp_path, "ref", *steps)
    assert ref.returncode == 0, ref.stderr[-3000:]
    lines = step_lines(ref.stdout)
    assert len(lines) == 16 and any(" kl " in ln for ln in lines)
    again = train(kit, tmp_path, "again", *steps, run=toy_run)  # ref: its own process
    assert step_lines(again.stdout) == lines  # the same completions, the same bytes
    argv = [sys.executable, "-m", "toy", "train", "--recipe", "grpo", "--model", str(kit["gguf"])]
    argv += ["--data", str(kit["data"]), *SHORT, *RUN, "--out", str(tmp_path), "--run-id", "k"]
    p = subprocess.Popen([*argv, *steps], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_checkpoint(tmp_path / "k", p)
    p.send_signal(signal.SIGKILL)
    before, _ = p.communicate()
    r = run_toy("train", "--resume", tmp_path / "k")
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = step_lines(r.stdout)
    first = int(resumed[0].split()[1])
    assert first > 1
    kept = [ln for ln in step_lines(before) if int(ln.split()[1]) < first]
    assert kept + resumed == lines


def test_a_reward_that_fails_names_itself_the_sample_and_the_fix(kit, tmp_path, toy_run):
    f = tmp_path / "rw.py"
    f.write_text(
        "def boom(prompts, completions, **kw):\n"
        "    return [1 / 0 for _ in completions]\n"
        "def later(prompts, completions, trainer_state=None, **kw):\n"
        "    if trainer_state.global_step >= 6:\n"
        "        raise RuntimeError('the judge went away')\n"
        "    return [0.0 for _ in completions]\n"
        "def short(prompts, completions, **kw):\n"
        "    return [1.0]\n"
    )
    r = train(kit, tmp_path, "b", "--reward", f"{f}:boom", "--steps", "3", run=toy_run)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{f}:boom" in lines[-1] and "ZeroDivisionError" in lines[-1] and "sample" in lines[-1]
    r = train(kit, tmp_path, "s", "--reward", f"{f}:short", "--steps", "3", run=toy_run)
    assert r.returncode == 2 and "short" in r.stderr.splitlines()[-1], r.stderr
    r = train(kit, tmp_path, "l", "--reward", f"{f}:later", "--steps", "12", "--save-every", "5",
              run=toy_run)  # fmt: skip
    assert r.returncode == 1 and "the judge went away" in r.stderr, r.stderr
    events = [json.loads(x) for x in (tmp_path / "l" / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "run_failed" and events[-1]["step"] == 7
    assert (tmp_path / "l" / "checkpoints" / "step-000005" / "state.json").is_file()
    r = train(kit, tmp_path, "n", "--reward", "bogus", "--steps", "3", run=toy_run)
    assert r.returncode == 2 and "--reward bogus" in r.stderr and "accuracy" in r.stderr


def test_a_flag_and_a_file_checked_before_anything_runs(kit, tmp_path, toy_run):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "What is 1 + 1?"}\nnot json\n{"question": "?"}\n')
    r = toy_run(
        "train", "--recipe", "grpo", "--model", kit["gguf"], "--data", bad, "--reward",
        "accuracy", "--out", tmp_path,
    )  # fmt: skip
    assert r.returncode == 2 and "'answer' column" in r.stderr, r.stderr
    r = toy_run(
        "train", "--recipe", "grpo", "--model", kit["gguf"], "--data", bad, "--reward", "length",
        "--out", tmp_path, "--steps", "1", "--num-generations", "2", "--max-completion-length",
        "4", "--seq-len", "64",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "not valid JSON (line 2)" in r.stdout and "no prompt (line 3)" in r.stdout, r.stdout
    r = toy_run(
        "train", "--recipe", "grpo", "--model", kit["gguf"], "--data", kit["data"], "--reward",
        "length", "--num-generations", "1", "--loss-type", "ppo", "--out", tmp_path,
    )  # fmt: skip
    assert r.returncode == 2 and "--loss-type" in r.stderr, r.stderr
    r = toy_run(
        "train", "--recipe", "grpo", "--model", kit["gguf"], "--data", kit["data"], "--reward",
        "length", "--num-generations", "1", "--out", tmp_path,
    )  # fmt: skip
    assert r.returncode == 2 and "--num-generations must be an integer >= 2" in r.stderr


@pytest.mark.parametrize("quantized", [False, True])
def test_token_logprobs_equal_a_plain_log_softmax(quantized):
    """The per-token head GRPO scores completions with: log p(target) at a temperature
    (after the soft-cap), its gradient wrt the hidden states, on a float head and on one
    over GGUF blocks (Q8_0)."""
    import torch.nn as nn

    from toy.models.losses import IGNORE, token_logprobs
    from toy.models.quant import QuantLinear, QuantSpec

    torch.manual_seed(0)
    N, C, V = 29, 32, 96
    lin = nn.Linear(C, V, bias=False).requires_grad_(False)
    head, w = lin, lin.weight
    if quantized:
        import gguf

        q = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
        spec = QuantSpec(int(gguf.GGMLQuantizationType.Q8_0), (V, C))
        head = QuantLinear(torch.from_numpy(q), spec)
        w = head.rows(0, V, torch.float32)
    h = torch.randn(N, C, requires_grad=True)
    t = torch.randint(0, V, (N,))
    t[3] = IGNORE
    for cap, temp in ((0.0, 1.0), (0.0, 0.6), (8.0, 1.4)):
        lp = token_logprobs(h, head, t, cap, temp)
        z = h @ w.T
        z = cap * torch.tanh(z / cap) if cap else z
        ref = torch.log_softmax(z / temp, -1).gather(1, t.clamp(min=0)[:, None]).squeeze(1)
        ref = torch.where(t != IGNORE, ref, 0.0)
        torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
        g = torch.randn(N)
        (a,) = torch.autograd.grad((lp * g).sum(), h)
        (b,) = torch.autograd.grad((ref * g).sum(), h)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def completion_batch(rows):
    """completion_rows' layout of (prompt, completion) pairs, by hand."""
    from toy.models.losses import IGNORE

    L, T = max(len(p) + len(c) for p, c in rows), max(len(c) for _, c in rows)
    ids = torch.zeros((len(rows), L), dtype=torch.long)
    pos = torch.zeros((len(rows), T), dtype=torch.long)
    tgt = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    for r, (p, c) in enumerate(rows):
        ids[r, : len(p) + len(c)] = torch.tensor(p + c)
        pos[r, : len(c)] = torch.arange(len(p) - 1, len(p) - 1 + len(c))
        tgt[r, : len(c)] = torch.tensor(c, dtype=torch.long)
    return {"ids": ids, "pos": pos, "tgt": tgt, "mask": (tgt != IGNORE).float()}


def test_chunked_completion_logprobs_equal_one_padded_forward():
    """GRPO's log-prob forward runs its rows shortest first, in chunks each cut to its own
    longest row: the log-probs and their gradients are those of one forward over the whole
    right-padded batch, in the rows' own order, whatever the chunk size."""
    from toy.models.losses import IGNORE
    from toy.recipes.scoring import completion_logps

    model = tiny_model()  # float32
    model.lm_head.weight.requires_grad_(False)  # as an adapter recipe's head (frozen)
    g = torch.Generator().manual_seed(0)
    prompts = [[5, 17, 42], [3, 1, 4, 1, 5, 9], [2, 7], [11, 12, 13, 14]]
    comps = [int(n) for n in torch.randint(1, 20, (len(prompts) * 2,), generator=g)]
    rows = [(prompts[i // 2], torch.randint(3, 90, (n,), generator=g).tolist())
            for i, n in enumerate(comps)]  # fmt: skip
    b = completion_batch(rows)
    ids, pos, tgt = b["ids"], b["pos"], b["tgt"]
    weights = torch.randn(pos.shape, generator=g)

    def run(chunk):
        model.zero_grad()
        lp = completion_logps(model, b, 0.8, chunk)
        (lp * weights).sum().backward()
        return lp.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]

    # The reference: one forward over the padded batch, by hand.
    with torch.no_grad():
        z = model(ids)[torch.arange(len(rows))[:, None], pos] / 0.8  # (N, T, V)
        ref = torch.log_softmax(z, -1).gather(2, tgt.clamp(min=0)[..., None]).squeeze(2)
        ref = torch.where(tgt != IGNORE, ref, 0.0)
    whole, grads = run(len(rows))
    torch.testing.assert_close(whole, ref, atol=1e-5, rtol=1e-5)
    for chunk in (1, 3):
        lp, gs = run(chunk)
        torch.testing.assert_close(lp, whole, atol=1e-5, rtol=1e-5)
        for a, w in zip(gs, grads):
            torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "gpt2", "phi3", "gemma"])
def test_each_prompt_runs_once_and_every_row_gets_its_own_logprobs(name, monkeypatch):
    """Under bf16 GRPO's log-prob pass runs each distinct prompt through the blocks once and
    its completions after it, over its kept keys and values (PrefixKV). In float32 that is
    within rounding of every row run whole, log-probs and gradients, for every family
    (gemma's tiny: a sliding window of 8 that the longer rows pass, capped scores):
    prompts of different lengths, a group's rows apart in the batch, a completion of no
    tokens and one of one, in chunks of 1, 3 or every row."""
    from toy.models import registry
    from toy.recipes.scoring import completion_logps

    fam = registry.family(name)
    cfg = fam.config(**fam.tiny)
    torch.manual_seed(0)
    model = fam.model(cfg)
    model.lm_head.weight.requires_grad_(False)  # as an adapter recipe's head (frozen)
    g = torch.Generator().manual_seed(1)
    prompts = [[5, 17, 42], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7]]
    lengths = [0, 1, 2, 7, 19, 4, 12, 1, 9]
    rows = [(prompts[i % 3], torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist())
            for i, n in enumerate(lengths)]  # fmt: skip
    b = completion_batch(rows)
    weights = torch.randn(b["pos"].shape, generator=g)
    seen = []
    real_hidden = model.hidden
    monkeypatch.setattr(
        model, "hidden", lambda ids, *a: seen.append(ids.shape) or real_hidden(ids, *a)
    )

    def run(share, chunk):
        model.zero_grad()
        seen.clear()
        lp = completion_logps(model, b, 0.8, chunk, share=share)
        (lp * weights).sum().backward()
        return lp.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]

    whole, grads = run(False, len(rows))
    assert (whole[0] == 0).all() and (whole[1, 1:] == 0).all() and whole[1, 0] < 0
    for chunk in (1, 3, len(rows)):
        lp, gs = run(True, chunk)
        assert seen[0] == (3, 11)  # the three prompts, once, as one batch
        # then the completions alone: each row once at most (one of a token needs none), no
        # longer than its longest completion but the last token
        assert sum(s[0] for s in seen[1:]) <= 8 and max(s[1] for s in seen[1:]) == 18
        torch.testing.assert_close(lp, whole, atol=1e-5, rtol=1e-5)
        for a, w in zip(gs, grads):
            torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-4)


def test_shared_prompts_under_bf16_are_as_near_float32_as_whole_rows():
    """Under bf16 autocast the shared pass (its completions' attention by matmuls after
    their prompts' keys, cpu_attention.causal_attention with `past`) is as near the float32
    log-probs and gradients as every row run whole under bf16 is."""
    from toy.recipes.scoring import completion_logps

    model = tiny_model()
    model.lm_head.weight.requires_grad_(False)
    g = torch.Generator().manual_seed(3)
    prompts = [[5, 17, 42, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
    rows = [(prompts[i % 2], torch.randint(3, 290, (n,), generator=g).tolist())
            for i, n in enumerate([6, 30, 17, 3, 25, 40])]  # fmt: skip
    b = completion_batch(rows)
    weights = torch.randn(b["pos"].shape, generator=g)

    def run(share, bf16):
        model.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            lp = completion_logps(model, b, 1.0, 8, share=share)
        (lp * weights).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
        return lp.detach(), grads

    ref_lp, ref_g = run(False, False)
    errors = {}
    for share in (False, True):
        lp, gr = run(share, True)
        errors[share] = ((lp - ref_lp).abs().max(), (gr - ref_g).norm() / ref_g.norm())
    assert 0 < errors[False][1] < 0.05  # bf16's own rounding, a few parts in a thousand
    assert errors[True][0] <= 1.5 * errors[False][0] + 1e-3, errors
    assert errors[True][1] <= 1.5 * errors[False][1] + 1e-3, errors


def test_prompts_are_shared_by_default_under_bf16_only(monkeypatch):
    """float32 scores every row whole, to the bytes it always had (the reference losses,
    scripts/same_losses.py); bf16 autocast shares the prompts; --checkpointing (whose
    backward runs a block again) keeps every row whole."""
    from toy.recipes import scoring

    model = tiny_model()
    model.lm_head.weight.requires_grad_(False)
    b = completion_batch([([5, 17, 42], [7, 8, 9]), ([5, 17, 42], [10, 11]), ([2, 7], [3, 4])])
    calls = []
    real = scoring.shared_logps
    monkeypatch.setattr(scoring, "shared_logps", lambda *a: calls.append(1) or real(*a))
    assert torch.equal(
        scoring.completion_logps(model, b, 1.0),
        scoring.completion_logps(model, b, 1.0, share=False),
    )
    assert calls == []
    with torch.autocast("cpu", torch.bfloat16):
        scoring.completion_logps(model, b, 1.0)
        assert calls == [1]
        model.checkpointing = True
        scoring.completion_logps(model, b, 1.0)
    assert calls == [1]


@pytest.mark.skipif(
    __import__("toy.train.device", fromlist=["x"]).cpu_bf16_units() is None,
    reason="bf16 sampling needs a cpu with bf16 units",
)
def test_sampling_on_compiled_decode_steps_is_deterministic(kit, tmp_path):
    """TOY_DECODE_STEPS=1 (the tiny model is under the size they are chosen from): GRPO's
    sampling under bf16 on the compiled batched steps (models/decode.py), said once in the
    log; two runs in processes of their own give the same lines byte for byte, and a run
    without them (TOY_DECODE_STEPS=0) samples eagerly, saying nothing of them."""
    steps = ["--steps", "4", "--precision", "bf16"]
    on = {"TOY_DECODE_STEPS": "1"}
    a = train(kit, tmp_path, "a", *steps, run=lambda *x, **k: run_toy(*x, **k, env=on))
    assert a.returncode == 0, a.stderr[-3000:]
    assert a.stdout.count("sampling on compiled decode steps") == 1, a.stdout[-2000:]
    assert "compiling failed" not in a.stderr, a.stderr[-2000:]  # not eager after all
    b = train(kit, tmp_path, "b", *steps, run=lambda *x, **k: run_toy(*x, **k, env=on))
    assert b.returncode == 0, b.stderr[-3000:]
    assert step_lines(a.stdout) == step_lines(b.stdout) and len(step_lines(a.stdout)) == 4
    off = {"TOY_DECODE_STEPS": "0"}
    c = train(kit, tmp_path, "c", *steps, run=lambda *x, **k: run_toy(*x, **k, env=off))
    assert c.returncode == 0 and "compiled decode steps" not in c.stdout + c.stderr
    assert len(step_lines(c.stdout)) == 4
