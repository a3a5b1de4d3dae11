"""--threads on train and infer, and the default thread count that follows the cores other
programs leave free (toy/cores.py, train/device.py: Threads): measured from /proc/stat less
toy's own CPU time, at the start and between steps; the losses are the same on any count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from helpers.common import run_toy

from toy import cores
from toy.train import device

TINY = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "1"]
LINUX = pytest.mark.skipif(
    not os.path.exists("/proc/stat") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux's /proc/stat and two cores",
)


@pytest.fixture
def corpus(small_corpus):
    return small_corpus


def test_others_is_busy_time_less_our_own():
    """Two looks: (busy, total, own) jiffies of 2 cores. Cores' worth of the others' work
    is the busy time less our own, over what each core had."""
    c = cores.Cores()
    c.cpus = [0, 1]
    looks = iter([(1000, 200, 50), (1000 + 200 + 190, 200 + 400, 50 + 95)])
    c._look = lambda: next(looks)
    c.last = c._look()
    # 390 busy jiffies of 400 (200 a core), 95 of them ours: 295 / 200 = 1.475 cores.
    assert c.others() == pytest.approx(1.475)
    looks = iter([(0, 0, 0), (390, 400, 380)])  # we take both cores: nobody else
    c.last = c._look()
    assert c.free(2) == 2
    looks = iter([(0, 0, 0), (300, 400, 200), (600, 800, 400)])  # a third of a core: taken
    c.last = c._look()
    assert c.free(2) == 1
    assert c.free(1) == 1  # never above the most asked for
    c.last, c._look = None, lambda: None  # no /proc/stat: nothing known
    assert c.others() is None and c.free(2) is None


def test_the_compilers_toy_runs_are_its_own_work(monkeypatch):
    """A step's first build runs inductor's C++ compiler as a child of the run: its CPU time
    (os.times' children's) is the run's own, not another program's. Counted as another's,
    a GRPO run that built its steps took the compiler for a busy core and sampled on at one
    thread (a 32-row SmolLM2 decode step 148-152 ms against 104-114, a 2-core Zen 4)."""
    import io

    tick = os.sysconf("SC_CLK_TCK")
    before = f"cpu0 0 0 0 {tick}\ncpu1 0 0 0 {tick}\n"  # (user nice system idle) jiffies
    after = f"cpu0 {tick} 0 0 {tick}\ncpu1 0 0 0 {2 * tick}\n"  # cpu0 busy for a second
    stat = iter([before, after])
    zero, one = (0.0,) * 5, (0.0, 0.0, 1.0, 0.0, 1.0)  # user, system, children's, elapsed
    times = iter([os.times_result(t) for t in (zero, one)])
    monkeypatch.setattr(cores, "open", lambda path: io.StringIO(next(stat)), raising=False)
    monkeypatch.setattr(cores.os, "times", lambda: next(times))
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0, 1})
    c = cores.Cores()  # the first look
    # one second of one core of two busy, all of it the compiler this process waited for
    assert c.others() == 0.0


def test_the_count_changes_when_two_looks_agree(monkeypatch):
    class Fake:
        def __init__(self, answers):
            self.answers = iter(answers)

        def free(self, most):
            return next(self.answers)

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(cores, "watching", Fake([2, 1, 2, 1, 1, None]))
        torch.set_num_threads(2)
        t = device.Threads(None)  # the start: 2 free
        assert t.n == 2
        t.EVERY = t.next = 0.0  # every check looks
        seen = []
        for _ in range(5):
            t.check()
            seen.append(t.n)
        # 1 (once: kept), 2 (back), 1, 1 (two in a row: changed), None (nothing known: kept)
        assert seen == [2, 2, 2, 1, 1]
        # --threads N is the user's: no look changes it.
        monkeypatch.setattr(cores, "watching", Fake([1, 1, 1]))
        t = device.Threads(2)
        t.EVERY = t.next = 0.0
        t.check()
        t.check()
        assert t.n == 2 and t.fixed
    finally:
        torch.set_num_threads(before)


def test_threads_flag_reaches_run_json_and_the_losses_do_not_depend_on_it(corpus, tmp_path):
    losses = []
    for n in (1, 2):
        r = run_toy("train", "--corpus", corpus, *TINY, "--steps", "3", "--out", tmp_path,
                    "--run-id", f"t{n}", "--json", "--threads", str(n))  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        info = json.loads((tmp_path / f"t{n}" / "run.json").read_text())
        assert info["config"]["threads"] == n and info["device"]["torch_threads"] == n
        losses.append([x["loss"] for x in json.loads(r.stdout)["losses"]])
    assert losses[0] == losses[1]  # byte for byte: the default may change the count mid-run
    # --resume may change the thread count and where figures go: both take effect, and
    # run.json says so (the config, and the new segment's device).
    r = run_toy("train", "--resume", tmp_path / "t1", "--steps", "4", "--threads", "2",
                "--report-to", "tensorboard")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "(2 threads," in r.stdout, r.stdout
    info = json.loads((tmp_path / "t1" / "run.json").read_text())
    assert info["config"]["threads"] == 2 and info["config"]["report_to"] == "tensorboard"
    assert info["segments"][-1]["device"]["torch_threads"] == 2
    assert list((tmp_path / "t1" / "tensorboard").glob("events.out.tfevents.*"))


@LINUX
def test_a_busy_core_leaves_the_default_fewer_threads(corpus, tmp_path):
    """A process spinning on core 0 (bounded in time): `toy train` with no --threads starts
    with fewer threads than cores, and `toy infer` too (its reply's "threads")."""
    spin = (
        "import os, time\nos.sched_setaffinity(0, {0})\nend = time.time() + 120\n"
        "while time.time() < end:\n    pass\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    p = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)
        r = subprocess.run(
            [sys.executable, "-m", "toy", "train", "--corpus", str(corpus), *TINY, "--steps",
             "1", "--out", str(tmp_path), "--run-id", "b", "--json"],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        info = json.loads((tmp_path / "b" / "run.json").read_text())
        cores_here = len(os.sched_getaffinity(0))
        assert info["config"]["threads"] is None
        assert 1 <= info["device"]["torch_threads"] < cores_here
        r = subprocess.run(
            [sys.executable, "-m", "toy", "infer", "--run", str(tmp_path / "b"), "--prompt",
             "To be", "--max-new-tokens", "2", "--json"],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        assert 1 <= json.loads(r.stdout)["threads"] < cores_here
    finally:
        p.kill()
        p.wait()


def test_infer_threads_and_bad_values(corpus, tmp_path, toy_run):
    # the run infer reads, made in this process (no --threads: the worker's count stays)
    r = toy_run(*["train", "--corpus", corpus, *TINY, "--steps", "1", "--out", tmp_path],
                "--run-id", "m")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_toy("infer", "--run", tmp_path / "m", "--prompt", "To be", "--max-new-tokens", "3",
                "--threads", "1", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["threads"] == 1
    for cmd in (["infer", "--run", tmp_path / "m", "--prompt", "x"], ["train"]):
        r = run_toy(*cmd, "--threads", "0")
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert "--threads" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
