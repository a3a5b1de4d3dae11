"""The loop's contract for batches made from the live model (Job.live: GRPO, online DPO,
distillation on a teacher's samples): sampled from the weights each step starts with,
seeded by (seed, micro-batch, rank), so the same seed gives the same losses byte for byte
and a run killed with SIGKILL resumes to its unbroken twin's losses (the sampling state is
the seed and the restored weights). The recipe is tests/helpers/live_recipe.py, registered in the
child process, or for one test's time in this one (the `here` fixture: runs whose process
is not under test)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.runs import TINY, corpus, step_lines, wait_for_checkpoint  # noqa: F401

HERE = Path(__file__).resolve().parents[1]  # tests/, where helpers/live_recipe.py is
LAUNCH = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); from helpers import live_recipe; "
    "live_recipe.register(); from toy.cli.main import entry; sys.argv[0] = 'toy'; entry()"
)


@pytest.fixture
def here(toy_run, monkeypatch):
    """toy_run, with the test recipe registered in this process until the test ends."""
    from helpers import live_recipe

    from toy.recipes import RECIPES

    monkeypatch.setitem(RECIPES, "live-test", live_recipe.__name__)
    return toy_run


def live(corpus, out, run_id, *extra, wait=True, run=None):
    """A live-test run in a process of its own, or `run=here`, in this one."""
    toy = ["train", "--recipe", "live-test", "--corpus", str(corpus), "--out", str(out)]
    toy += ["--run-id", run_id, *TINY, *(str(x) for x in extra)]
    if run is not None:
        r = run(*toy)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout
    argv = [sys.executable, "-c", LAUNCH, str(HERE), *toy]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return p
    out_text, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    return out_text


def test_live_batches_are_seeded_and_resume_exactly_after_sigkill(corpus, tmp_path, here):
    # 16 steps: the first checkpoint (step 4), where the run is killed, leaves it 12 to go
    steps = ["--steps", "16", "--save-every", "4", "--lr", "3e-3"]
    ref = step_lines(live(corpus, tmp_path, "ref", *steps, run=here))
    assert len(ref) == 16
    # Same seed: the same sampled batches and losses, byte for byte (in another process).
    assert step_lines(live(corpus, tmp_path, "again", *steps)) == ref
    # Another seed samples other batches (the batches really come from the sampler).
    other = step_lines(live(corpus, tmp_path, "seed1", *steps, "--seed", "1", run=here))
    assert other != ref
    p = live(corpus, tmp_path, "killed", *steps, wait=False)
    wait_for_checkpoint(tmp_path / "killed", p)
    p.send_signal(signal.SIGKILL)
    before, _ = p.communicate()
    assert p.returncode == -signal.SIGKILL
    r = subprocess.run(
        [sys.executable, "-c", LAUNCH, str(HERE), "train", "--resume", str(tmp_path / "killed")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = step_lines(r.stdout)
    first = int(resumed[0].split()[1])
    assert first > 1  # it resumed from a checkpoint, not from the start
    kept = [line for line in step_lines(before) if int(line.split()[1]) < first]
    assert kept + resumed == ref


def test_live_batches_depend_on_the_weights(corpus, tmp_path, here):
    """The batch of a step is sampled from the model as that step finds it: a run whose
    earlier steps train at another LR samples other batches at the same step (a batch
    that were a pure function of k would give step 1 the same loss and differ only later
    through the weights; here step 2's batch itself differs)."""
    import json

    a = live(
        corpus, tmp_path, "a", "--steps", "3", "--lr", "3e-3", "--warmup", "0", "--json", run=here
    )
    b = live(
        corpus, tmp_path, "b", "--steps", "3", "--lr", "3e-2", "--warmup", "0", "--json", run=here
    )
    la = [x["loss"] for x in json.loads(a)["losses"]]
    lb = [x["loss"] for x in json.loads(b)["losses"]]
    assert la[0] == lb[0]  # step 1: the same weights, the same sampled batch
    assert la[1] != lb[1]
