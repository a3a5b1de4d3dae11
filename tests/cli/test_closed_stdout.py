"""`toy train ... | head`: a reader that stops reading closes the pipe, and the run must
not fail for it (it used to end in BrokenPipeError, recorded as run_failed)."""

import json
import os
import subprocess
import sys

from toy.data.prep import bundled_corpus


def test_a_closed_stdout_does_not_fail_the_run(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "toy",
            "train",
            "--corpus",
            str(bundled_corpus()),
            "--preset",
            "tiny",
            "--steps",
            "6",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--eval-batches",
            "1",
            "--out",
            str(tmp_path),
            "--run-id",
            "r",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    first = p.stdout.readline()  # what `head -1` reads, then it exits
    p.stdout.close()
    _, err = p.communicate(timeout=300)
    assert first.startswith(b"run r:"), first
    assert p.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
    events = [
        json.loads(line) for line in (tmp_path / "r" / "events.jsonl").read_text().splitlines()
    ]
    assert events[-1]["event"] == "run_finished" and events[-1]["step"] == 6
    assert (tmp_path / "r" / "final" / "model.safetensors").is_file()
