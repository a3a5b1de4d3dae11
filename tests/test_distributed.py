"""Training across processes on torch.distributed (gloo on CPU): 2 processes with a
per-process batch b give the losses of 1 process with batch 2b; torchrun and
`toy train --nproc 2` both work; a DDP run resumes exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_toy
from toy.data.prep import bundled_text_paths

TINY = ["--preset", "tiny", "--seq-len", "32", "--eval-batches", "2", "--steps", "6", "--eval-every", "3",
        "--warmup", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from toy.cli.main import main

    d = tmp_path_factory.mktemp("corpus")
    assert main(["prep", str(bundled_text_paths()[0]), "--out", str(d / "c.bin"), "--vocab-size", "400"]) == 0
    return d / "c.bin"


def torchrun(*argv, nproc=2, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOY_DIST_TIMEOUT": "60"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           "--standalone", "-m", "toy", *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def losses(stdout: str) -> list[float]:
    return [x["loss"] for x in json.loads(stdout.strip().splitlines()[-1])["losses"]]


def close(a, b, rel=1e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert abs(x - y) <= rel * abs(y), (a, b)


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    r = run_toy("train", "--corpus", corpus, "--out", out, *TINY, "--batch-size", "4", "--json", "--run-id", "one",
                env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    return losses(r.stdout), json.loads(r.stdout.strip())


def test_torchrun_two_processes_match_one(corpus, single, tmp_path):
    r = torchrun("train", "--corpus", corpus, "--out", tmp_path, *TINY, "--batch-size", "2", "--json",
                 "--run-id", "two")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])  # rank 0 alone prints
    assert len([ln for ln in r.stdout.splitlines() if ln.startswith("{")]) == 1
    close(losses(r.stdout), single[0])
    close([v["loss"] for v in out["val_losses"]], [v["loss"] for v in single[1]["val_losses"]])
    info = json.loads((tmp_path / "two" / "run.json").read_text())
    assert info["distributed"] == {"world_size": 2, "backend": "gloo", "global_batch": 4, "fsdp": False}
    started = json.loads((tmp_path / "two" / "events.jsonl").read_text().splitlines()[0])
    assert started["world_size"] == 2 and started["global_batch"] == 4


def test_nproc_flag_matches_one(corpus, single, tmp_path):
    r = run_toy("train", "--nproc", "2", "--corpus", corpus, "--out", tmp_path, *TINY, "--batch-size", "2",
                "--json", "--run-id", "n2", env={"OMP_NUM_THREADS": "1", "TOY_DIST_TIMEOUT": "60"})
    assert r.returncode == 0, r.stderr[-3000:]
    close(losses(r.stdout), single[0])


def test_grad_accum_across_processes(corpus, single, tmp_path):
    # 2 processes x batch 1 x 2 micro-steps = the same global batch of 4.
    r = torchrun("train", "--corpus", corpus, "--out", tmp_path, *TINY, "--batch-size", "1", "--grad-accum", "2",
                 "--json", "--run-id", "acc")
    assert r.returncode == 0, r.stderr[-3000:]
    close(losses(r.stdout), single[0])


def test_ddp_resume_is_exact(corpus, tmp_path):
    import shutil

    r = torchrun("train", "--corpus", corpus, "--out", tmp_path, *TINY, "--batch-size", "2", "--json",
                 "--run-id", "full", "--save-every", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    full = losses(r.stdout)
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step-000006")
    shutil.rmtree(tmp_path / "cut" / "final")
    r = torchrun("train", "--resume", tmp_path / "cut", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(r.stdout) == full


def test_fsdp_on_gloo_matches_and_resumes(corpus, single, tmp_path):
    import shutil

    r = torchrun("train", "--corpus", corpus, "--out", tmp_path, *TINY, "--batch-size", "2", "--json",
                 "--run-id", "fsdp", "--fsdp", "--save-every", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    full = losses(r.stdout)
    close(full, single[0], rel=1e-4)  # reduce-scatter sums in another order than one process
    assert json.loads((tmp_path / "fsdp" / "run.json").read_text())["distributed"]["fsdp"] is True
    assert (tmp_path / "fsdp" / "final" / "model.safetensors").is_file()
    # The sharded run's checkpoint holds whole tensors keyed by name: it resumes on another
    # number of processes (here one, no FSDP) and continues the same curve.
    shutil.copytree(tmp_path / "fsdp", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step-000006")
    shutil.rmtree(tmp_path / "cut" / "final")
    r = run_toy("train", "--resume", tmp_path / "cut", "--json", env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    close(losses(r.stdout), full, rel=1e-4)
    r = run_toy("infer", "--run", tmp_path / "fsdp", "--prompt", "the", "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr


def test_nproc_refuses_bad_values(toy_cli, capsys):
    with pytest.raises(SystemExit) as e:
        toy_cli("train", "--nproc", "0")
    assert e.value.code == 2 and "--nproc" in capsys.readouterr().err
