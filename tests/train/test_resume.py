"""Checkpoints and exact resume: a run killed after a checkpoint and resumed prints the
same loss bytes as one that was never interrupted; SIGINT checkpoints and exits 130."""

import json
import signal
import subprocess
import sys
import time

import pytest
from helpers.common import run_toy
from helpers.runs import TINY, corpus, step_lines, wait_for_checkpoint  # noqa: F401


def start(corpus, out, run_id, steps, *extra):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "toy",
            "train",
            "--corpus",
            str(corpus),
            "--out",
            str(out),
            "--run-id",
            run_id,
            "--steps",
            str(steps),
            *TINY,
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigkill_then_resume_gives_the_same_loss_bytes(corpus, tmp_path, toy_run):
    steps = 120
    ref = toy_run(  # the unbroken run in this process; the killed and resumed ones in their own
        "train",
        "--corpus",
        corpus,
        "--out",
        tmp_path,
        "--run-id",
        "ref",
        "--steps",
        steps,
        *TINY,
        "--save-every",
        "10",
    )
    assert ref.returncode == 0, ref.stderr

    p = start(corpus, tmp_path, "killed", steps, "--save-every", "10")
    wait_for_checkpoint(tmp_path / "killed", p)
    p.send_signal(signal.SIGKILL)
    out_before, _ = p.communicate()
    assert p.returncode == -signal.SIGKILL
    res = run_toy("train", "--resume", tmp_path / "killed")
    assert res.returncode == 0, res.stderr
    resumed = step_lines(res.stdout)
    first = int(resumed[0].split()[1])
    assert first > 1  # it did resume, not restart
    before = [line for line in step_lines(out_before) if int(line.split()[1]) < first]
    assert before + resumed == step_lines(ref.stdout)  # byte for byte
    events = [
        json.loads(x) for x in (tmp_path / "killed" / "events.jsonl").read_text().splitlines()
    ]
    assert (
        any(e["event"] == "run_resumed" for e in events) and events[-1]["event"] == "run_finished"
    )
    assert (tmp_path / "killed" / "final" / "model.safetensors").is_file()


def test_sigint_checkpoints_records_and_exits_130(corpus, tmp_path):
    p = start(corpus, tmp_path, "int", 100000, "--save-every", "1000")
    run_dir = tmp_path / "int"
    t0 = time.time()
    while not (
        (run_dir / "events.jsonl").is_file() and '"step"' in (run_dir / "events.jsonl").read_text()
    ):
        assert time.time() - t0 < 120 and p.poll() is None
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert "interrupted" in err and "--resume" in err and "Traceback" not in err
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "interrupted" and events[-1]["signal"] == "SIGINT"
    step = events[-1]["step"]
    # Stopping on request is not an error: the last line says the step, where the
    # checkpoint is and how to resume, without "error:".
    last = err.strip().splitlines()[-1]
    assert "error" not in last and f"after step {step}" in last and f"step-{step:06d}" in last, last
    assert f"toy train --resume {run_dir}" in last, last
    assert (run_dir / "checkpoints" / f"step-{step:06d}" / "state.json").is_file()
    assert step_lines(out)[-1].startswith(f"step {step} ")


def test_resume_refuses_a_changed_config(corpus, tmp_path, toy_cli):
    code, _, err = toy_cli(
        "train",
        "--corpus",
        corpus,
        "--out",
        tmp_path,
        "--run-id",
        "r",
        "--steps",
        "4",
        *TINY,
        "--save-every",
        "2",
    )
    assert code == 0, err
    code, _, err = toy_cli("train", "--resume", tmp_path / "r", "--d-model", "128")
    assert code == 2 and "--d-model" in err
    code, _, err = toy_cli("train", "--resume", tmp_path / "r")
    assert code == 2 and "raise --steps" in err
    code, _, err = toy_cli("train", "--resume", tmp_path / "r", "--steps", "2")
    assert code == 2 and "only be raised" in err
    code, out, err = toy_cli("train", "--resume", tmp_path / "r", "--steps", "6", "--json")
    assert code == 0, err
    assert [x["step"] for x in json.loads(out)["losses"]] == [1, 2, 3, 4, 5, 6]


def test_optimizer_groups_must_match_by_their_parameters():
    # Group settings (weight decay, LR multiplier) are restored by position: a checkpoint
    # whose groups hold other parameters is refused, not half-applied.
    import torch

    from toy.errors import InputError
    from toy.formats.checkpoint import load_optimizer, optimizer_tensors
    from toy.train.schedule import make_adamw

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4))
    named = list(model.named_parameters())
    names = {id(p): n for n, p in named}
    decay = lambda n, p: p.dim() >= 2  # noqa: E731
    split = make_adamw(
        named, 1e-3, 0.1, decay, lr_scale=lambda n: 3.0 if n.startswith("0.") else 1.0
    )
    plain = make_adamw(named, 1e-3, 0.1, decay)
    assert [g["lr_scale"] for g in split.param_groups] == [
        1.0,
        3.0,
        1.0,
    ]  # decay x1, decay x3, no decay
    assert [g["weight_decay"] for g in split.param_groups] == [0.1, 0.1, 0.0]
    tensors, meta = optimizer_tensors(split, names)
    load_optimizer(
        make_adamw(named, 1e-3, 0.1, decay, lr_scale=lambda n: 3.0 if n.startswith("0.") else 1.0),
        tensors,
        meta,
        names,
    )  # the same layout loads
    with pytest.raises(InputError, match="optimizer groups"):
        load_optimizer(plain, tensors, meta, names)


@pytest.mark.parametrize("presses, save_every", [(1, 0), (2, 0), (2, 2)])
def test_ctrl_c_says_what_is_saved(corpus, tmp_path, presses, save_every):
    """Issue 35 item 5: a second Ctrl-C said "resume from the last checkpoint" when
    --save-every 0 had left none. It now says what is saved and what is not; the first
    Ctrl-C always writes a checkpoint, --save-every 0 or not."""
    slow = ["--batch-size", "16", "--seq-len", "256"]  # steps long enough to press twice in one
    p = start(corpus, tmp_path, "c", 100000, "--save-every", str(save_every), *slow)
    try:
        run_dir, events = tmp_path / "c", tmp_path / "c" / "events.jsonl"
        t0 = time.time()
        while '"step": 3,' not in (events.read_text() if events.is_file() else ""):
            assert time.time() - t0 < 180 and p.poll() is None
            time.sleep(0.02)
        p.send_signal(signal.SIGINT)
        said = []
        while not any("finishing step" in line for line in said):
            said.append(p.stderr.readline())
            assert said[-1], "".join(said)
        if presses == 2:
            p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    last = err.strip().splitlines()[-1]
    kept = sorted((run_dir / "checkpoints").glob("step-*"))
    if presses == 1:  # the first Ctrl-C's checkpoint, whatever --save-every says
        step = json.loads(events.read_text().splitlines()[-1])["step"]
        assert [k.name for k in kept] == [f"step-{step:06d}"] and "saved in" in last, last
        return
    assert "second Ctrl-C" in last and "Traceback" not in err, err
    if save_every == 0:
        assert not kept and "nothing is saved" in last and "--resume" not in last, last
    else:
        step = int(kept[-1].name.removeprefix("step-"))
        assert step % 2 == 0 and f"saved: the checkpoint of step {step} ({kept[-1]})" in last
        assert f"toy train --resume {run_dir}" in last, last


def test_a_damaged_checkpoint_is_named_with_the_newest_intact_one(corpus, tmp_path, toy_run):
    """Random bytes written into the middle of the latest checkpoint's model.safetensors
    (its sha256, recorded when it was written, no longer matches): --resume is one line
    naming it and the newest intact checkpoint, exit 2, nothing trained; `--resume
    RUN/checkpoints/step-N` takes that one, sets the later ones aside (kept, renamed) and
    gives the unbroken run's lines from there."""
    base = ["--corpus", corpus, "--out", tmp_path, *TINY, "--save-every", "4", "--keep-last", "5"]
    ref = toy_run("train", *base, "--run-id", "ref", "--steps", "12")
    assert ref.returncode == 0, ref.stderr
    cut = toy_run("train", *base, "--run-id", "cut", "--steps", "12")
    assert cut.returncode == 0, cut.stderr
    run = tmp_path / "cut"
    import shutil

    shutil.rmtree(run / "checkpoints" / "step-000012")
    model = run / "checkpoints" / "step-000008" / "model.safetensors"
    raw = bytearray(model.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 16] = bytes(range(16))
    model.write_bytes(bytes(raw))
    r = run_toy("train", "--resume", run)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "step-000008 is damaged" in lines[0] and "model.safetensors" in lines[0]
    assert f"toy train --resume {run / 'checkpoints' / 'step-000004'}" in lines[0]
    r = toy_run("train", "--resume", run / "checkpoints" / "step-000004")
    assert r.returncode == 0, r.stderr
    assert step_lines(r.stdout) == step_lines(ref.stdout)[4:]
    aside = [p.name for p in (run / "checkpoints").iterdir() if ".set-aside-" in p.name]
    assert len(aside) == 1 and aside[0].startswith("step-000008.set-aside-")
