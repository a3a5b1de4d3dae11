"""`toy train --nproc N` starts its N processes itself (train/dist.py: launch), without
torchrun's agent: a user's mistake is toy's one line and exit 2 (torchrun printed its
banner, a ChildFailedError traceback and exited 1), a run trains to torchrun's losses,
and a Ctrl-C still lets the processes checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from toy.data.prep import bundled_text_paths

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the launcher's signals are POSIX")

TINY = [
    "--precision",
    "float32",
    "--preset",
    "tiny",
    "--seq-len",
    "32",
    "--eval-batches",
    "1",
    "--steps",
    "3",
    "--warmup",
    "1",
    "--batch-size",
    "2",
]
BANNER = "Setting OMP_NUM_THREADS environment variable"


def _env(**extra) -> dict:
    """The test's environment with OMP_NUM_THREADS unset (the launcher sets 1, as torchrun
    did) and a short collective timeout (a broken launch fails instead of hanging)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return {**env, "TOY_DIST_TIMEOUT": "120", **extra}


def _toy(*argv, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "toy", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
    )


def _losses(stdout: str) -> list[float]:
    return [x["loss"] for x in json.loads(stdout.strip().splitlines()[-1])["losses"]]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from toy.cli.main import main

    d = tmp_path_factory.mktemp("corpus")
    args = ["prep", str(bundled_text_paths()[0]), "--out", str(d / "c.bin")]
    assert main([*args, "--vocab-size", "300"]) == 0
    return d / "c.bin"


def _launch_run(corpus, out):
    return _toy(
        "train", "--nproc", "2", "--corpus", corpus, "--out", out, *TINY, "--json", "--run-id", "n2"
    )


def _why(r) -> str:
    """A failed launch's stderr less torch's C++ stack frames, which pushed the error itself
    out of a 3000-character message (one CI run's gloo failure showed frames alone)."""
    return "\n".join(ln for ln in r.stderr.splitlines() if "frame #" not in ln)[-3000:]


@pytest.fixture(scope="module")
def run_n2(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("launched")
    return out / "n2", _launch_run(corpus, out)


def test_nproc_run_trains_to_torchruns_losses(corpus, run_n2, tmp_path):
    run_dir, r = run_n2
    assert r.returncode == 0, _why(r)
    assert BANNER not in r.stderr and "Traceback" not in r.stderr
    assert len([ln for ln in r.stdout.splitlines() if ln.startswith("{")]) == 1  # rank 0 alone
    info = json.loads((run_dir / "run.json").read_text())
    assert info["distributed"]["world_size"] == 2 and info["distributed"]["backend"] == "gloo"
    assert info["device"]["torch_threads"] == 1  # OMP_NUM_THREADS=1 where unset, as torchrun
    t = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "toy",
            "train",
            *map(str, ["--corpus", corpus, "--out", tmp_path, *TINY, "--json", "--run-id", "t"]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert t.returncode == 0, t.stderr[-3000:]
    assert _losses(r.stdout) == _losses(t.stdout)


def test_a_resume_without_nproc_starts_the_runs_processes_again(corpus, tmp_path):
    """A run `--nproc 2` started, cut after step 2 and resumed with no --nproc, runs on 2
    processes again (a note says so): the unbroken run's losses, byte for byte. Resumed on
    one process instead (what it did before, silently), KTO's KL estimate and every sum's
    order change with the world size."""
    import shutil

    r = _toy("train", "--nproc", "2", "--corpus", corpus, "--out", tmp_path, *TINY, "--json",
             "--run-id", "full", "--save-every", "2")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads((tmp_path / "full" / "run.json").read_text())
    assert info["distributed"]["launcher"] == "nproc"
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step-000003")
    shutil.rmtree(tmp_path / "cut" / "final")
    m = _toy("train", "--resume", tmp_path / "cut", "--json")
    assert m.returncode == 0, m.stderr[-3000:]
    assert "resuming on 2 processes, as the run was trained" in m.stderr
    assert _losses(m.stdout) == _losses(r.stdout)
    info = json.loads((tmp_path / "cut" / "run.json").read_text())
    assert [g["world_size"] for g in info["segments"]] == [2, 2]
    assert info["segments"][-1]["launcher"] == "nproc"


def test_a_mistake_every_rank_makes_is_one_line_and_exit_2(run_n2):
    # Every process finds it (before the process group): toy's one line, once.
    run_dir, r = run_n2
    assert r.returncode == 0, _why(r)
    m = _toy("train", "--resume", run_dir, "--nproc", "2")
    assert m.returncode == 2, m.stderr
    assert m.stderr.splitlines() == [
        f"toy train: error: --resume {run_dir}: its checkpoint is at step 3 of 3; "
        "raise --steps to train further"
    ]
    assert m.stdout == ""


def test_a_mistake_rank_0_alone_makes_is_one_line_and_exit_2(corpus, run_n2):
    # Rank 0 alone checks --run-id; rank 1, waiting on it, is stopped without a word.
    run_dir, r = run_n2
    assert r.returncode == 0, _why(r)
    m = _launch_run(corpus, run_dir.parent)
    assert m.returncode == 2, m.stderr
    assert m.stderr.splitlines() == [
        f"toy train: error: --run-id n2: {run_dir} already exists; pick another id"
    ]


def test_ctrl_c_reaches_every_process_once_and_they_checkpoint(corpus, tmp_path):
    """A terminal's Ctrl-C reaches the launcher alone (the processes have their own process
    group); it hands one SIGINT to each: they finish the step, checkpoint and stop, 130."""
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "toy",
            "train",
            "--nproc",
            "2",
            "--corpus",
            str(corpus),
            "--out",
            str(tmp_path),
            *TINY,
            "--steps",
            "2000",
            "--run-id",
            "cut",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(PYTHONUNBUFFERED="1"),  # each step's line as it comes
        start_new_session=True,  # a terminal of its own: the signal goes to its group
    )
    try:
        for line in p.stdout:  # text mode: a line per step
            if line.startswith("step 2 "):
                break
        os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err[-3000:]
    said = [ln for ln in err.splitlines() if ln.startswith("toy train:")]
    assert len(said) == 1 and said[0].startswith("toy train: interrupted by SIGINT after step"), err
    assert "Ctrl-C again" in err  # the first Ctrl-C only: a second would stop without a save
    step = int(said[0].split("after step ")[1].split(";")[0])
    assert (tmp_path / "cut" / "checkpoints" / f"step-{step:06d}").is_dir()
    events = [json.loads(x) for x in (tmp_path / "cut" / "events.jsonl").read_text().splitlines()]
    assert events[-1] == {**events[-1], "event": "interrupted", "step": step, "signal": "SIGINT"}
