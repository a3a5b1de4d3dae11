"""toy-steps, the folder of built generation steps in inductor's cache (issue "Third review",
items 1 and 4): prune_builds removes only what toy made, never through a link; a library
cut short is never loaded (it is built again), and a killed writer's temporaries go."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.common import run_toy  # noqa: E402
from helpers.quant import quant_gguf  # noqa: E402,F401

from toy.models import decode  # noqa: E402

HOUR_AGO = time.time() - 2 * 3600  # unused for longer than prune_builds waits (UNUSED_S)


def _infer(gguf, cache: Path):
    """A packed reply whose blocks take decode.py's built steps: TOY_NATIVE=0, as where toy's
    C kernels do not build (with them this llama model's reply builds nothing)."""
    args = ["infer", "--model", gguf, "--prompt", "ROMEO. What", "--temperature", "0"]
    args += ["--max-new-tokens", "4", "--base-dtype", "quantized"]
    return run_toy(*args, env={"TORCHINDUCTOR_CACHE_DIR": str(cache), "TOY_NATIVE": "0"})


@pytest.fixture(scope="module")
def linked_build(quant_gguf, tmp_path_factory):  # noqa: F811
    """One packed reply built (the only cold build of this file) with toy-steps a link to a
    folder of the user's, holding names toy used (built/, a build folder's) and others."""
    d = tmp_path_factory.mktemp("linked")
    user = d / "userdata"
    (user / "photos").mkdir(parents=True)
    (user / "photos" / "cat.jpg").write_bytes(b"jpeg")
    (user / "notes.txt").write_text("mine\n")
    (user / "built").mkdir()
    (user / "built" / "draft.txt").write_text("mine too\n")
    (user / "0123456789abcdef").mkdir()
    os.utime(user / "0123456789abcdef", (HOUR_AGO, HOUR_AGO))
    (d / "cache").mkdir()
    (d / "cache" / "toy-steps").symlink_to(user)
    return d, _infer(quant_gguf, d / "cache")


def test_a_linked_toy_steps_keeps_the_users_files(linked_build):
    """The steps are built into the folder the link names, and nothing of the user's there
    goes: toy never prunes through a link, and says so once."""
    d, done = linked_build
    assert done.returncode == 0, done.stderr
    user = d / "userdata"
    assert (user / "notes.txt").read_text() == "mine\n"
    assert (user / "photos" / "cat.jpg").read_bytes() == b"jpeg"
    assert (user / "built" / "draft.txt").is_file()
    assert (user / "0123456789abcdef").is_dir()
    assert list(user.glob("*/built/*.so")), "the steps were built where the link points"
    assert done.stderr.count("old builds are not removed from toy-steps") == 1, done.stderr


def test_a_library_cut_short_is_built_again_not_loaded(linked_build, quant_gguf, tmp_path):  # noqa: F811
    """A built library truncated to 5% of its size (a full disk, a crash, a copy cut short)
    killed every later packed reply with SIGBUS. It fails its digest now: the reply is the
    same, the library is built again in its place, and the run after loads it."""
    d, first = linked_build
    assert first.returncode == 0, first.stderr
    steps = tmp_path / "cache" / "toy-steps"
    build = next(
        p
        for p in (d / "userdata").iterdir()
        if p.name != "0123456789abcdef" and decode._BUILD_DIR.fullmatch(p.name)
    )
    shutil.copytree(build, steps / build.name)
    libs = sorted((steps / build.name / "built").glob("*.so"))
    assert len(libs) >= 2, libs  # one cut short, the others whole (and so not built again)
    cut, whole = libs[0], {p: p.read_bytes() for p in libs[1:]}
    size = cut.stat().st_size
    os.truncate(cut, size // 20)
    again = _infer(quant_gguf, tmp_path / "cache")
    assert again.returncode == 0, (again.returncode, again.stderr)
    assert again.stdout == first.stdout
    assert again.stderr.count("does not match its digest") == 1, again.stderr
    assert cut.stat().st_size > size // 2  # built again, whole, in its place
    assert decode._digest_path(cut).read_bytes() == decode._digest(cut.read_bytes())
    assert all(p.read_bytes() == b for p, b in whole.items())
    third = _infer(quant_gguf, tmp_path / "cache")
    assert third.returncode == 0 and third.stdout == first.stdout, third.stderr
    assert "digest" not in third.stderr and "compiling" not in third.stderr, third.stderr


@pytest.fixture
def steps(tmp_path, monkeypatch):
    """toy-steps under a cache of the test's own, this build's folder in it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(decode, "_SAID", set(), raising=False)
    (decode._steps_root() / "built").mkdir(parents=True)
    return tmp_path / "toy-steps"


def _old_build(steps: Path, name: str, when: float) -> Path:
    (steps / name / "built").mkdir(parents=True)
    (steps / name / "built" / "x.so").write_bytes(b"lib")
    os.utime(steps / name, (when, when))
    return steps / name


def test_prune_removes_only_toys_own_names_and_never_follows_a_link(steps, tmp_path):
    """In toy's own toy-steps, a name toy never wrote stays, and so does a link named like
    a build folder (and what it points to); old build folders go."""
    old = [_old_build(steps, c * 16, HOUR_AGO - i) for i, c in enumerate("abcd")]
    user = tmp_path / "user"
    (user / "photos").mkdir(parents=True)
    (steps / "eeeeeeeeeeeeeeee").symlink_to(user)
    os.utime(steps / "eeeeeeeeeeeeeeee", (HOUR_AGO, HOUR_AGO), follow_symlinks=False)
    assert decode.prune_builds() == old[2:]  # the two used last and this build's stay
    (steps / "notes.txt").write_text("mine\n")
    assert decode.prune_builds() == []
    assert (steps / "notes.txt").is_file() and (user / "photos").is_dir()
    assert (steps / "eeeeeeeeeeeeeeee").is_symlink()


def test_a_toy_steps_toy_did_not_make_is_not_pruned(steps, capsys):
    """A toy-steps without toy's mark that holds a file toy never wrote is not toy's: nothing
    in it goes, with one note."""
    old = [_old_build(steps, c * 16, HOUR_AGO - i) for i, c in enumerate("abcd")]
    (steps / "notes.txt").write_text("mine\n")
    assert decode.prune_builds() == [] and decode.prune_builds() == []
    assert all(p.is_dir() for p in old) and not (steps / decode._HOME_MARK).exists()
    assert capsys.readouterr().err.count("which toy did not write") == 1


def test_build_folders_used_in_the_last_hour_are_kept(steps):
    """Four builds in use at once (venvs, ISA caps): one's build never removes the folder
    another process is building into; only folders unused for an hour go."""
    fresh = [_old_build(steps, c * 16, time.time() - i) for i, c in enumerate("abcd")]
    assert decode.prune_builds() == []
    assert all(p.is_dir() for p in fresh)


def test_a_killed_writers_temporaries_are_removed(steps):
    """A library's temporary left by a writer killed mid-copy goes once its process is gone
    (or an hour old); a live writer's stays."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    built = decode._steps_root() / "built"
    name = "0" * 40 + ".so"
    dead = built / f"{name}.{gone.pid}.x_0.tmp"
    live = built / f"{name}.{os.getpid()}.abc_1.tmp"
    stale = built / f"{name}.sha256.{os.getpid()}.abc_2.tmp"
    for p in (dead, live, stale, built / name):
        p.write_bytes(b"part")
    os.utime(stale, (HOUR_AGO, HOUR_AGO))
    assert sorted(decode.prune_builds()) == sorted([dead, stale])
    assert live.is_file() and (built / name).is_file()


def test_a_library_without_its_digest_is_never_loaded(tmp_path, monkeypatch):
    """_load_built maps a library only where the digest written after it matches its bytes:
    a missing digest (a write that never finished) or a short file is built again."""
    lib = tmp_path / "built" / "step.so"
    lib.parent.mkdir()
    monkeypatch.setattr(decode, "_built_path", lambda key: lib)
    loaded = []
    monkeypatch.setattr(decode, "_runner", lambda path: loaded.append(path) or "step")
    monkeypatch.setattr(decode, "_steps_root", lambda: tmp_path)
    lib.write_bytes(b"\x7fELF" + bytes(range(256)) * 8)  # whole, but no digest after it
    assert decode._load_built(("k",)) is None and loaded == []
    src = tmp_path / "inductor.so"
    src.write_bytes(b"\x7fELF" + bytes(range(256)) * 8)
    decode._keep(src, lib)
    assert decode._load_built(("k",)) == "step" and loaded == [lib]
    assert sorted(p.name for p in lib.parent.iterdir()) == ["step.so", "step.so.sha256"]
    os.truncate(lib, 100)
    assert decode._load_built(("k",)) is None and loaded == [lib]
