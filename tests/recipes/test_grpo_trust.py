"""GRPO results that can be trusted (issue 54), each through the command line on a tiny
llama GGUF and `toy new`'s arithmetic prompts: one process and two give the same steps,
and a two-process run killed with SIGKILL resumes to its unbroken twin's lines (on two
processes or one); a reward that edits what it is given changes nothing; a completion
length the model's context cannot hold is one line before any run folder; a reward that
ends the process is a failed run; --epochs reaches every prompt with --num-iterations;
--scale-rewards batch divides by the whole step's spread; a resume refuses a changed
reward file (unless --reward-changed) or validation file; toy.toml's one reward; --json
with no scored completion; --compile's sampling runs eagerly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers.common import run_toy
from helpers.gguf_fixtures import tiny_model, write_llama_gguf  # noqa: E402
from helpers.runs import step_lines  # noqa: E402

from toy.data.arith import make_arith  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402
from toy.tokenizer import train_bpe  # noqa: E402

RUN = ["--num-generations", "8", "--max-completion-length", "16", "--seq-len", "96"]
RUN += ["--lr", "5e-2", "--threads", "1"]

# A reward of the completion's length, which kills its own process (SIGKILL, nothing
# saved) when it scores the batch of global step KILL_AT: a kill -9 at a known step.
KILLER = """
import os
import signal


def length4(completion_ids, trainer_state=None, **kw):
    if trainer_state.global_step == int(os.environ.get("KILL_AT", "-1")):
        os.kill(os.getpid(), signal.SIGKILL)
    return [-abs(len(c) - 4) / 4 for c in completion_ids]
"""


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo-trust")
    text = bundled_text_paths()[0].read_text()[:40000] + " 0 1 2 3 4 5 6 7 8 9 + - x = ?"
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    vocab = tok.get_vocab_size(with_added_tokens=True)
    make_arith(d / "arith", 40, 8, seed=0)
    (d / "killer.py").write_text(KILLER)
    return {
        "gguf": write_llama_gguf(
            d / "base.gguf", tiny_model(vocab_size=vocab, max_seq_len=256), tok
        ),
        "short": write_llama_gguf(d / "short.gguf", tiny_model(vocab_size=vocab), tok),  # 64
        "data": d / "arith",
        "killer": f"{d / 'killer.py'}:length4",
        "d": d,
    }


def grpo(kit, out, run_id, *extra, env=None, model=None, run=None):
    """A GRPO run on the kit: in a process of its own, or `run=toy_run`, in this one."""
    argv = ["train", "--recipe", "grpo", "--model", model or kit["gguf"], "--data", kit["data"],
            *RUN, "--out", out, "--run-id", run_id, *extra]  # fmt: skip
    return run_toy(*argv, env=env) if run is None else run(*argv)


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


def step_records(run_dir: Path) -> list[dict]:
    return [e for e in events(run_dir) if e["event"] == "step"]


def test_two_processes_give_one_process_steps_and_a_killed_run_resumes(kit, tmp_path, toy_run):
    """A step's global batch is the same on one process accumulating two micro-batches
    and on two processes of one each: the same completions (the live seeds and prompt
    batches follow the global micro-batch), the same advantages (--scale-rewards batch:
    the std of every process's rewards), the same figures (every process's completions).
    Killed with SIGKILL after step 3 (--num-iterations 2: step 4 reuses step 3's
    generation, kept in the checkpoint by each rank), the run resumes to the unbroken
    run's lines, on two processes and on one."""
    common = ["--reward", kit["killer"], "--steps", "6", "--num-iterations", "2",
              "--batch-size", "2", "--scale-rewards", "batch", "--save-every", "3"]  # fmt: skip
    one = grpo(kit, tmp_path, "one", *common, "--grad-accum", "2", run=toy_run)
    two = grpo(kit, tmp_path, "two", *common, "--nproc", "2")
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = step_records(tmp_path / "one"), step_records(tmp_path / "two")
    assert len(a) == len(b) == 6
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "reward", "reward_std", "completion_length"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), (key, x, y)
        assert x["completion_length_max"] == y["completion_length_max"]
    lines = step_lines(two.stdout)
    killed = grpo(kit, tmp_path, "k", *common, "--nproc", "2", env={"KILL_AT": "4"})
    assert killed.returncode != 0
    saved = sorted(p.name for p in (tmp_path / "k" / "checkpoints").iterdir())
    assert saved == ["step-000003"], saved
    assert step_lines(killed.stdout) == lines[:4]  # killed making step 5's generation
    kept = lines[:3]
    os.system(f"cp -r {tmp_path / 'k'} {tmp_path / 'k1'}")
    r = run_toy("train", "--resume", tmp_path / "k", "--nproc", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert kept + step_lines(r.stdout) == lines
    # On one process: each micro-batch of the reused generation from the rank that made it.
    r = toy_run("train", "--resume", tmp_path / "k1", "--nproc", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert kept + step_lines(r.stdout) == lines


def test_a_reward_that_edits_its_arguments_changes_nothing(kit, tmp_path, toy_run):
    f = tmp_path / "rw.py"
    f.write_text(
        "def zeros(completion_ids, **kw):\n"
        "    return [0.0 for _ in completion_ids]\n"
        "def pops(prompts, completions, completion_ids, answer=None, **kw):\n"
        "    out = [0.0 for _ in completion_ids]\n"
        "    for ids in completion_ids:\n"
        "        ids.pop()\n"
        "    completions[0] = 'x'\n"
        "    answer[0] = 'y'\n"
        "    return out\n"
        "def clears(completion_ids, **kw):\n"
        "    out = [0.0 for _ in completion_ids]\n"
        "    for ids in completion_ids:\n"
        "        ids.clear()\n"
        "    return out\n"
    )
    runs = {}
    for name in ("zeros", "pops", "clears"):
        r = grpo(kit, tmp_path, name, "--reward", f"{f}:{name}", "--reward", "length",
                 "--target-length", "4", "--steps", "3", "--eval-every", "3",
                 run=toy_run)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = [ln.replace(name, "R") for ln in r.stdout.splitlines()
                      if ln.startswith(("step ", "eval "))]  # fmt: skip
    assert runs["pops"] == runs["zeros"]
    assert runs["clears"] == runs["zeros"]


def test_a_completion_length_the_context_cannot_hold_is_one_line(kit, tmp_path, toy_run):
    """The 64-token model: GRPO's defaults (--max-completion-length 256) and 80 tokens are
    refused against the length used (--seq-len lowered to the context), before any run
    folder; 48 leaves a prompt 16 tokens and trains."""
    for extra in ([], ["--max-completion-length", "80"]):
        r = run_toy(
            "train", "--recipe", "grpo", "--model", kit["short"], "--data", kit["data"],
            "--reward", "length", "--out", tmp_path / "runs", "--steps", "1", *extra,
        )  # fmt: skip
        assert r.returncode == 2, r.stderr[-2000:]
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "--max-completion-length" in lines[0], r.stderr
        assert "64" in lines[0] and "context" in lines[0], lines
        assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    r = toy_run(
        "train", "--recipe", "grpo", "--model", kit["short"], "--data", kit["data"],
        "--reward", "length", "--out", tmp_path / "runs", "--steps", "1",
        "--max-completion-length", "48", "--num-generations", "2",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "cut from the left to 16 tokens" in r.stdout, r.stdout


@pytest.mark.parametrize("how", ["exit", "interrupt"])
def test_a_reward_that_ends_the_process_is_a_failed_run(kit, tmp_path, how):
    f = tmp_path / "rw.py"
    stop = "sys.exit(0)" if how == "exit" else "raise KeyboardInterrupt"
    f.write_text(
        "import sys\n"
        "def stop(completion_ids, trainer_state=None, **kw):\n"
        "    if trainer_state.global_step >= 2:\n"
        f"        {stop}\n"
        "    return [0.0 for _ in completion_ids]\n"
    )
    r = grpo(kit, tmp_path, "x", "--reward", f"{f}:stop", "--steps", "5", "--save-every", "1")
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr and "Ctrl-C" not in r.stderr, r.stderr
    assert f"{f}:stop" in last and ("sys.exit(0)" if how == "exit" else "KeyboardInterrupt") in last
    ev = events(tmp_path / "x")
    assert ev[-1]["event"] == "run_failed" and ev[-1]["step"] == 3, ev[-1]
    assert (tmp_path / "x" / "checkpoints" / "step-000002").is_dir()
    assert not (tmp_path / "x" / "final").exists()


def test_an_epoch_reaches_every_prompt_with_num_iterations(kit, tmp_path, toy_run):
    f = tmp_path / "rw.py"
    seen = tmp_path / "seen.txt"
    f.write_text(
        "def log(prompts, completion_ids, trainer_state=None, **kw):\n"
        f"    with open({str(seen)!r}, 'a') as fh:\n"
        "        fh.writelines(p + '\\n' for p in prompts)\n"
        "    return [0.0 for _ in completion_ids]\n"
    )
    r = grpo(kit, tmp_path, "e", "--reward", f"{f}:log", "--epochs", "1", "--batch-size", "4",
             "--num-iterations", "2", "--num-generations", "2", run=toy_run)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert (
        "1 epoch of 10 batches of prompts, 1 a step, each used for 2 steps = 20 steps" in r.stdout
    )
    train = {
        json.loads(x)["prompt"] for x in (kit["data"] / "train.jsonl").read_text().splitlines()
    }
    assert set(seen.read_text().splitlines()) >= train and len(train) == 40


def test_batch_scale_divides_by_the_whole_steps_spread(kit, tmp_path):
    """--scale-rewards batch: each micro-batch's advantages are its rewards less their
    group's mean, over the std of every reward of the step (here two micro-batches), the
    same as one micro-batch holding both would get."""
    from toy.models.losses import group_advantages
    from toy.recipes.grpo import RECIPE
    from toy.runs import Project
    from toy.train.job import Live

    f = tmp_path / "rw.py"  # rewards that differ between prompts and within each group
    f.write_text(
        "def spread(completion_ids, answer=None, **kw):\n"
        "    return [float(a) / 10 + i % 3 for i, a in enumerate(answer)]\n"
    )
    cfg = RECIPE.config(
        model=str(kit["gguf"]), data=str(kit["data"]), reward=[f"{f}:spread"],
        num_generations=4, max_completion_length=8, seq_len=96, batch_size=2, grad_accum=2,
        scale_rewards="batch", steps=2, precision="float32",
    )  # fmt: skip
    job = RECIPE.build(cfg, Project(root=None)).job
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        made = [
            job.micro_batch(k, Live(job.model.eval(), gen, torch.device("cpu"))) for k in (0, 1)
        ]
    rewards = [b["fig.reward"].float() for b in made]
    assert not torch.equal(rewards[0], rewards[1])
    job.whole_step(made)
    every = torch.cat(rewards)
    for b, r in zip(made, rewards):
        want = group_advantages(r, 4, "batch", every)
        torch.testing.assert_close(b["adv"], want)
        assert not torch.allclose(want, group_advantages(r, 4, "batch")) or r.std() == 0
    whole = group_advantages(every, 4, "batch")
    torch.testing.assert_close(torch.cat([b["adv"] for b in made]), whole)


def test_a_resume_refuses_a_changed_reward_or_validation_file(kit, tmp_path, toy_run):
    f = tmp_path / "rw.py"
    f.write_text(
        "def r(completion_ids, **kw):\n    return [-len(c) / 16 for c in completion_ids]\n"
    )
    val = tmp_path / "val.jsonl"
    val.write_text((kit["data"] / "valid.jsonl").read_text())
    r = grpo(kit, tmp_path, "c", "--reward", f"{f}:r", "--val-data", val, "--steps", "2",
             "--save-every", "1", run=toy_run)  # fmt: skip
    # (the resumes below, which must read the file as edited, each in a process of its own)
    assert r.returncode == 0, r.stderr[-3000:]
    f.write_text("def r(completion_ids, **kw):\n    return [len(c) / 16 for c in completion_ids]\n")
    r = run_toy("train", "--resume", tmp_path / "c", "--steps", "3")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "rw.py" in r.stderr and "--reward-changed" in r.stderr, r.stderr
    r = run_toy("train", "--resume", tmp_path / "c", "--steps", "3", "--reward-changed")
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads((tmp_path / "c" / "run.json").read_text())
    change = info["segments"][-1]["changed"]["reward_files"]
    assert change["was"] != change["now"] and str(f) in change["now"]
    assert info["config"]["reward_changed"] is False  # the next resume checks again
    val.write_text(val.read_text().replace("?", "??", 1))  # edited in place
    r = run_toy("train", "--resume", tmp_path / "c", "--steps", "4")
    assert r.returncode == 2 and "val.jsonl" in r.stderr, r.stderr


def test_toml_reward_and_json_with_nothing_scored(kit, tmp_path, toy_run):
    """toy.toml's `reward = "length"` is one reward; a step whose completions no reward
    scored (every function returned None) writes null in --json and events.jsonl, never a
    bare NaN."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "toy.toml").write_text('[train.grpo]\nreward = "length"\ntarget_length = 4\n')
    r = run_toy(
        "train", "--recipe", "grpo", "--model", kit["gguf"], "--data", kit["data"], *RUN,
        "--steps", "1", "--out", "runs", "--run-id", "t", "--json", cwd=proj,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads((proj / "runs" / "t" / "run.json").read_text())
    assert info["config"]["reward"] == ["length"]
    f = tmp_path / "rw.py"
    f.write_text("def none(completion_ids, **kw):\n    return [None for _ in completion_ids]\n")
    r = grpo(kit, tmp_path, "n", "--reward", f"{f}:none", "--steps", "2", "--json", run=toy_run)
    assert r.returncode == 0, r.stderr[-3000:]

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))

    out = strict(r.stdout)
    assert out["losses"][0]["reward"] is None and out["val_rewards"][0]["reward"] is None
    for line in (tmp_path / "n" / "events.jsonl").read_text().splitlines():
        strict(line)


def test_a_live_jobs_sampling_runs_eagerly_under_compile(kit, tmp_path):
    """GRPO with --compile: the blocks are built once for any shape (dynamic) and the
    sampling runs eagerly, so decode's changing shapes never reach dynamo (a shape-
    specialised build hit dynamo's recompile limit: 3 tiny steps 52 s against 0.6 s)."""
    import torch._dynamo

    from toy.recipes.grpo import RECIPE
    from toy.runs import EventLog, Project
    from toy.train.loop import Trainer
    from toy.train.progress import Reporter

    cfg = RECIPE.config(
        model=str(kit["gguf"]), data=str(kit["data"]), reward=["length"], target_length=4,
        num_generations=2, max_completion_length=6, seq_len=96, batch_size=2, steps=2,
        precision="float32", compile=True,
    )  # fmt: skip
    job = RECIPE.build(cfg, Project(root=None)).job
    messages = []
    reporter = Reporter()
    reporter.message = messages.append
    tr = Trainer(job, cfg, None, torch.device("cpu"), EventLog(None), reporter)
    assert any("the sampling runs eagerly" in m for m in messages), messages
    torch._dynamo.reset()
    before = dict(torch._dynamo.utils.counters["frames"])
    made = tr._live_batches([0])
    assert made and made[0]["mask"].sum() > 0
    assert dict(torch._dynamo.utils.counters["frames"]) == before  # nothing traced
