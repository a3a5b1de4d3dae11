"""`toy list` (third review) lists what it can read and never crashes on a folder it may not
look into: a mode-000 folder under data/ and under runs/, a mode-311 model directory (its
files open by name, but it cannot be listed). Run as a user file modes bind: as root, the
real `toy` with CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped (setpriv), so that root
obeys the owner's bits of the files it made here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.fetch import tiny_gguf  # noqa: E402, F401


def _as_a_user() -> list[str]:
    """The argv prefix that runs a command bound by file modes (none where we are no root)."""
    if os.geteuid() != 0:
        return []
    drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
    if shutil.which("setpriv") is None or subprocess.run([*drop, "true"]).returncode != 0:
        pytest.skip("running as root, and setpriv cannot drop the capabilities that skip modes")
    return drop


@pytest.fixture
def project(tiny_gguf, tmp_path):
    from toy.formats.base_readers import read_base
    from toy.formats.dir_write import write_model_dir

    root = tmp_path / "proj"
    (root / "data" / "locked").mkdir(parents=True)
    (root / "toy.toml").write_text("")
    (root / "data" / "locked" / "config.json").write_text("{}")
    write_model_dir(read_base(tiny_gguf["path"], "quantized"), root / "data" / "m311", "mlx")
    (root / "runs" / "r1").mkdir(parents=True)
    (root / "runs" / "r1" / "run.json").write_text('{"recipe": "lora"}')
    (root / "runs" / "r2" / "export").mkdir(parents=True)
    modes = {"data/locked": 0o000, "data/m311": 0o311, "runs/r2": 0o000}
    for d, mode in modes.items():
        (root / d).chmod(mode)
    yield root
    for d in modes:  # so that pytest can remove them
        (root / d).chmod(0o755)


def test_list_skips_what_it_may_not_read_and_lists_the_rest(project):
    argv = [*_as_a_user(), sys.executable, "-m", "toy", "list"]
    r = subprocess.run([*argv, "--json"], cwd=project, capture_output=True, text=True)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    listed = json.loads(r.stdout)
    models = {Path(m["path"]).name: m for m in listed["models"]}
    assert list(models) == ["m311"], models  # data/locked: not looked into
    # Read through its files' names; its size cannot be counted, and is not made up.
    assert models["m311"]["kind"] == "mlx model" and "file_size" not in models["m311"]
    assert [run["run_id"] for run in listed["runs"]] == ["r1"]
    r = subprocess.run(argv, cwd=project, capture_output=True, text=True)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    row = next(ln.split() for ln in r.stdout.splitlines() if ln.startswith("  data/m311/"))
    assert row[1:4] == ["llama", "mlx", "model"] and row[5] == "?", row
