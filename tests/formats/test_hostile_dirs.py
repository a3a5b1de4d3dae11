"""Hostile model directories: config.json, generation_config.json and the chat template
are untrusted downloads. Every field is checked for its type and range where it is read
(models/family.py's readers, each family's, formats/hf_dir.py), and every size field
against the tensors present before anything is allocated: a bad one is exit 2 with one
line naming the file and the field, never a traceback, a hang or all the memory."""

from __future__ import annotations

import contextlib
import io
import json
import math
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import model_dirs  # noqa: E402
from helpers.common import ROOT  # noqa: E402
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toy.cli.main import main  # noqa: E402
from toy.errors import InputError  # noqa: E402
from toy.formats.base_readers import read_base  # noqa: E402


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile-dirs")
    model_dirs.set_root(root / "models")
    (root / "models").mkdir()
    for t in ("qwen3", "phi3", "gemma3"):
        model_dirs.tiny_dir(t)  # made here, where transformers' progress bars are not the test's
    return root


def copy_of(dirs: Path, model_type: str, name: str) -> Path:
    """A fresh copy of a tiny directory (a few hundred kB) to spoil."""
    d = dirs / name
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(model_dirs.tiny_dir(model_type), d)
    return d


def edit_config(d: Path, **fields) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(fields)
    (d / "config.json").write_text(json.dumps(cfg))  # NaN and Infinity as Python writes them


def cli(*argv) -> tuple[int, str, str]:
    """The CLI in-process (hypothesis calls this many times in one test)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def assert_refused(code: int, err: str, *words: str) -> None:
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err


GEN = ["--prompt", "To be", "--max-new-tokens", "3", "--temperature", "0"]


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"rope_theta": math.nan}, ["config.json", "'rope_theta'", "nan"]),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": math.inf}}, ["rope_theta"]),
        ({"rms_norm_eps": -1}, ["config.json", "'rms_norm_eps'", "-1"]),
        ({"model_type": ["qwen3"]}, ["config.json", "model_type ['qwen3'] is not supported"]),
        ({"num_attention_heads": "4"}, ["config.json", "'num_attention_heads'"]),
        ({"use_sliding_window": True, "sliding_window": 1.5}, ["'sliding_window'"]),
        ({"eos_token_id": 10**12}, ["config.json", "eos_token_id", "not a token id"]),
    ],
    ids=["nan-theta", "inf-theta", "negative-eps", "list-type", "str-heads", "float-window", "eos"],
)
def test_a_bad_config_field_is_one_line_naming_it(dirs, toy_cli, fields, words):
    d = copy_of(dirs, "qwen3", "bad")
    if "eos_token_id" in fields:  # config.json's ids are read where generation_config has none
        (d / "generation_config.json").unlink()
    edit_config(d, **fields)
    for argv in (["describe", d], ["infer", "--model", d, *GEN]):
        code, _, err = toy_cli(*argv)
        assert_refused(code, err, *words)


def test_the_other_files_of_a_directory_are_checked_too(dirs, toy_cli):
    d = copy_of(dirs, "qwen3", "files")
    (d / "generation_config.json").write_text('"a JSON string"')
    code, _, err = toy_cli("infer", "--model", d, *GEN)
    assert_refused(code, err, "generation_config.json", "expected a JSON object")
    (d / "generation_config.json").unlink()
    (d / "tokenizer_config.json").write_text("[1, 2]")
    code, _, err = toy_cli("infer", "--model", d, *GEN)
    assert_refused(code, err, "tokenizer_config.json", "expected a JSON object")
    (d / "tokenizer_config.json").write_text("{}")
    (d / "chat_template.jinja").write_bytes(b"{{ messages }}\xff\xfe")
    code, _, err = toy_cli("infer", "--model", d, *GEN)
    assert_refused(code, err, "chat_template.jinja", "not UTF-8")


def test_a_billion_layers_is_refused_at_once_in_bounded_memory(dirs):
    """A subprocess with 3 GiB of address space: the old reader planned a billion layers
    and ran out of memory (a MemoryError traceback here, the OOM killer without a limit)."""
    d = copy_of(dirs, "qwen3", "layers")
    edit_config(d, num_hidden_layers=1_000_000_000)

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    for argv in (["describe", d], ["infer", "--model", d, *GEN]):
        t = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-m", "toy", *map(str, argv)],
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=limit,
            cwd=ROOT,
        )
        assert time.monotonic() - t < 60
        assert_refused(r.returncode, r.stderr, "'num_hidden_layers' is 1000000000", "2 layers")


# ------------------------------------------------------------------ fuzzing config.json

VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.sampled_from([0, 1, 2, 4, 64, 10**9, 10**18, 2**64, -(2**63)]),
    st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e-300, 0.5, 1.5, 1e300]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.just([]),
    st.lists(st.integers(-2, 2), max_size=3),
    st.just({}),
    st.just({"rope_type": "default", "rope_theta": math.nan}),
)
FUZZ = settings(
    max_examples=40,
    deadline=10_000,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _leaves(cfg: dict, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a config, nested objects (text_config, rope_parameters) included."""
    out = []
    for k, v in cfg.items():
        out.append((*prefix, k))
        if isinstance(v, dict):
            out += _leaves(v, (*prefix, k))
    return out


@pytest.mark.parametrize("value", ["\r", "yarn\nlinear", "\x1b[2J"])
def test_a_rope_type_that_does_not_print_is_refused_on_one_line(tmp_path, value):
    """The fuzzing below once drew rope_parameters.rope_type "\r": the refusal printed it as
    it was and split its one line in two. Values that do not print are shown as their repr."""
    d = tmp_path / "phi3"
    shutil.copytree(model_dirs.tiny_dir("phi3"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": value, "rope_theta": 10000.0}
    (d / "config.json").write_text(json.dumps(cfg))
    code, _, err = cli("describe", d)
    assert_refused(code, err, "rope scaling (", repr(value))


@pytest.mark.parametrize("model_type", ["qwen3", "phi3", "gemma3"])
@FUZZ
@given(data=st.data())
def test_fuzz_config_json(dirs, model_type, data):
    """Random types, ranges and missing keys in config.json (1 to 3 fields at once, at any
    depth): `toy describe` exits 0 or 2 with one line, never a traceback, each in a few
    seconds; a directory it accepts loads, and its logits are finite."""
    d = dirs / f"fuzz-{model_type}"
    if not d.exists():
        shutil.copytree(model_dirs.tiny_dir(model_type), d)
        shutil.copy(d / "config.json", d / "config.orig")
    cfg = json.loads((d / "config.orig").read_text())
    paths = _leaves(cfg)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        parent = cfg
        for k in path[:-1]:
            parent = parent.get(k) if isinstance(parent, dict) else None
        if not isinstance(parent, dict):
            continue  # an earlier change replaced the object this key was in
        if data.draw(st.booleans()):
            parent.pop(path[-1], None)
        else:
            parent[path[-1]] = data.draw(VALUES)
    (d / "config.json").write_text(json.dumps(cfg))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code, _, err = cli("describe", d)
    if code == 0:
        base = read_base(d, "quantized")
        model = base.build_model()
        n = min(8, base.config.max_seq_len)
        with torch.no_grad():
            logits = model(torch.arange(3, 3 + n).unsqueeze(0))
        assert torch.isfinite(logits).all(), cfg
    else:
        assert_refused(code, err)
        with pytest.raises(InputError):
            read_base(d, "quantized")
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # kB
    assert grown < 1 << 20, f"peak memory grew by {grown} kB"
