"""--report-to tensorboard: the run's figures as TensorBoard scalars, read back with
TensorBoard's own event reader, the same numbers as events.jsonl; a resume purges what an
earlier life wrote past its checkpoint; the gradient norm on every step; a missing package
is one line, exit 2, before any work. --report-to trackio: the same, read back with trackio's
own storage, and nothing sent anywhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers.common import run_toy

TINY = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "1"]


@pytest.fixture
def corpus(small_corpus):
    return small_corpus


def scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_reads_the_runs_figures_and_a_resume_purges(corpus, tmp_path, toy_run):
    argv = ["train", "--corpus", corpus, *TINY, "--out", tmp_path, "--run-id", "tb"]
    r = toy_run(*argv, "--steps", "4", "--eval-every", "2", "--report-to", "tensorboard",
                "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    run = tmp_path / "tb"
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert all(e["grad_norm"] > 0 for e in steps)  # logged every step
    assert [x["grad_norm"] for x in res["losses"]] == [e["grad_norm"] for e in steps]
    got = scalars(run)
    for key in ("loss", "lr", "grad_norm"):
        want = [(e["step"], e[key]) for e in steps]
        assert [s for s, _ in got[f"train/{key}"]] == [s for s, _ in want]
        assert [v for _, v in got[f"train/{key}"]] == pytest.approx([v for _, v in want], 1e-6)
    assert "train/peak_mem_gb" in got and "train/tokens_per_s" in got
    assert [s for s, _ in got["eval/loss"]] == [0, 2, 4]
    # Resume from step 2's checkpoint is not possible once finished; extend instead: the
    # curves hold each step once, 1..6.
    r = toy_run("train", "--resume", run, "--steps", "6")
    assert r.returncode == 0, r.stderr[-2000:]
    got = scalars(run)
    assert [s for s, _ in got["train/loss"]] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("package", ["tensorboard", "trackio"])
def test_without_the_package_one_line_and_nothing_made(corpus, tmp_path, package):
    fake = tmp_path / "fake"
    fake.mkdir()
    # None in sys.modules: `import PACKAGE` fails and importlib finds no such package
    (fake / "sitecustomize.py").write_text(f"import sys\nsys.modules[{package!r}] = None\n")
    path = os.pathsep.join([str(fake), *filter(None, [os.environ.get("PYTHONPATH")])])
    r = run_toy("train", "--corpus", corpus, *TINY, "--steps", "1", "--out", tmp_path / "runs",
                "--report-to", package, env={"PYTHONPATH": path})  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"pip install {package}" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_an_unknown_tracker_is_refused():
    r = run_toy("train", "--report-to", "wandb")
    assert r.returncode == 2 and "--report-to" in r.stderr


def trackio_logs(run_dir) -> dict[str, list[tuple[int, float]]]:
    """The run's figures as trackio's own storage reads them, a list a name. In a process of
    its own: trackio takes its storage directory from TRACKIO_DIR once, when first imported."""
    code = (
        "import json, sys\n"
        "from trackio.sqlite_storage import SQLiteStorage as S\n"
        "print(json.dumps([S.get_logs(sys.argv[1], sys.argv[2]), S.get_runs(sys.argv[1])]))"
    )
    env = {**os.environ, "TRACKIO_DIR": str(run_dir / "trackio")}
    r = subprocess.run([sys.executable, "-c", code, run_dir.parent.name, run_dir.name],
                       env=env, capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows, runs = json.loads(r.stdout)
    assert runs == [run_dir.name]  # a resume goes on in the same trackio run
    got: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if "/" in key:
                got.setdefault(key, []).append((row["step"], value))
    return got


NET = """import os, socket
def note(what):
    with open(os.environ["TOY_TEST_NETLOG"], "a") as f:
        f.write(what + "\\n")
connect, getaddrinfo = socket.socket.connect, socket.getaddrinfo
def watched_connect(self, addr):
    if self.family != socket.AF_UNIX:
        note(f"connect {addr}")
    return connect(self, addr)
def watched_getaddrinfo(host, *a, **k):
    note(f"getaddrinfo {host}")
    return getaddrinfo(host, *a, **k)
socket.socket.connect, socket.getaddrinfo = watched_connect, watched_getaddrinfo
"""


def test_trackio_logs_the_runs_figures_locally_and_a_resume_purges(corpus, tmp_path):
    """trackio's store under the run directory holds the figures of events.jsonl. Nothing is
    looked up or connected to, though a Hub token (trackio asks the Hub for its user's name)
    and a Space (trackio would send there) are set. A run cut after step 4 before its
    checkpoint, resumed from step 2 with more steps (another LR schedule), holds each step
    once and the numbers of the life that went on."""
    pytest.importorskip("trackio")
    net = tmp_path / "net"
    net.mkdir()
    (net / "sitecustomize.py").write_text(NET)  # every lookup and connection, noted
    env = {
        "PYTHONPATH": os.pathsep.join([str(net), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "TOY_TEST_NETLOG": str(tmp_path / "net.log"),
        "HF_TOKEN": "hf_not_a_real_token",
        "HF_HUB_OFFLINE": "0",  # as a user has it (conftest.py sets it for the suite)
        "TRANSFORMERS_OFFLINE": "0",
        "TRACKIO_SPACE_ID": "nobody/toy-test",
    }
    # The positive control: in a process started with this environment, a lookup and a
    # connection (to a closed port here) are noted, so an empty log below means none was made.
    probe = (
        "import socket\n"
        "socket.getaddrinfo('localhost', 9)\n"
        "s = socket.socket()\n"
        "try:\n    s.connect(('127.0.0.1', 9))\nexcept OSError:\n    pass\n"
    )
    e = {**os.environ, **env}
    c = subprocess.run([sys.executable, "-c", probe], env=e, capture_output=True, text=True)
    assert c.returncode == 0, c.stderr
    seen = (tmp_path / "net.log").read_text().splitlines()
    assert seen == ["getaddrinfo localhost", "connect ('127.0.0.1', 9)"], seen
    (tmp_path / "net.log").unlink()
    out = tmp_path / "runs"
    r = run_toy("train", "--corpus", corpus, *TINY, "--out", out, "--run-id", "tk", "--steps",
                "4", "--eval-every", "2", "--save-every", "2", "--report-to", "trackio",
                "--json", env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["run_id"] == "tk"  # trackio's own lines kept off stdout
    run = out / "tk"

    def by_step(key: str) -> dict[int, float]:  # the last life's numbers, a step
        recs = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
        return {e["step"]: e[key] for e in recs if e["event"] == "step"}

    got = trackio_logs(run)
    for key in ("loss", "lr", "grad_norm"):
        assert [s for s, _ in got[f"train/{key}"]] == [1, 2, 3, 4]
        assert dict(got[f"train/{key}"]) == pytest.approx(by_step(key), 1e-6)
    assert "train/peak_mem_gb" in got and "train/tokens_per_s" in got
    assert [s for s, _ in got["eval/loss"]] == [0, 2, 4]
    shutil.rmtree(run / "checkpoints" / "step-000004")  # as if killed before it was written
    r = run_toy("train", "--resume", run, "--steps", "6", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    got = trackio_logs(run)
    assert [s for s, _ in got["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert dict(got["train/loss"]) == pytest.approx(by_step("loss"), 1e-6)
    assert [s for s, _ in got["eval/loss"]] == [0, 2, 4, 6]
    assert not (tmp_path / "net.log").exists(), (tmp_path / "net.log").read_text()


def test_plot_draws_the_panels_and_watch_redraws_until_the_run_ends(corpus, tmp_path, toy_run):
    """`toy plot` draws, under the loss, a panel each for the LR, the throughput, the peak
    memory and the gradient norm (the figure grows by their rows); --watch on a live run
    redraws until its closing event, then returns."""
    import subprocess
    import sys
    import time

    pytest.importorskip("matplotlib")
    from PIL import Image

    argv = ["train", "--corpus", corpus, *TINY, "--out", tmp_path, "--eval-every", "0"]
    r = toy_run(*argv, "--run-id", "p", "--steps", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    r = toy_run("plot", tmp_path / "p", "--out", tmp_path / "p.png")
    assert r.returncode == 0, r.stderr
    w, h = Image.open(tmp_path / "p.png").size
    assert (w, h) == (960, (5 + 2 * 2.2) * 120)  # the loss and two rows of two panels
    from toy.cli.cmd_plot import PANELS, step_series, unit_of

    for title, keys, scale in PANELS:
        assert step_series(tmp_path / "p", keys, scale), title  # each panel has its curve
    keys = next(k for t, k, _ in PANELS if t.startswith("throughput"))
    assert unit_of([tmp_path / "p"], keys) == "tokens"  # the panel says "throughput (tokens/s)"
    # A live run: --watch draws it again while it goes, and ends when it closes. The run is
    # long and is stopped (Ctrl-C) only once the watch has redrawn, so a fast machine cannot
    # finish it before the first redraw (400 steps once did, under a loaded suite).
    import os
    import signal

    live = subprocess.Popen(
        [sys.executable, "-m", "toy", *map(str, argv), "--run-id", "w", "--steps", "100000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    watch = None
    try:
        events = tmp_path / "w" / "events.jsonl"
        for _ in range(600):
            if events.is_file() and '"event": "step"' in events.read_text():
                break
            time.sleep(0.1)
        watch = subprocess.Popen(
            [sys.executable, "-m", "toy", "plot", tmp_path / "w", "--out", tmp_path / "w.png",
             "--watch", "0.3"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        said = []
        for line in watch.stdout:  # drawn, then drawn again while the run goes on
            said.append(line)
            if "(redraw 1)" in line:
                break
        assert any("(redraw 1)" in x for x in said), said
        assert live.poll() is None  # the run was still going when the watch redrew it
        live.send_signal(signal.SIGINT)
        out, err = watch.communicate(timeout=600)
        assert watch.returncode == 0, err
        # It returned once the run had closed (its last event), not before.
        closing = json.loads(events.read_text().splitlines()[-1])["event"]
        assert closing == "interrupted", closing
    finally:
        for p in (live, watch):
            if p is not None:
                p.kill()
                p.wait()
    r = toy_run("plot", tmp_path / "p", "--out", tmp_path / "x.png", "--watch", "0")
    assert r.returncode == 2 and "--watch" in r.stderr
