"""Reliability guarantees that are not about one reader: no pickle anywhere, the template
sandbox, checkpoints under a full disk, keep-last, and bounded fuzzing of every reader."""

from __future__ import annotations

import errno
import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toy.errors import InputError, ToyError

SRC = Path(__file__).resolve().parents[2] / "src" / "toy"


def test_no_pickle_anywhere():
    """safetensors + JSON only: no pickle import, no torch.save, and torch.load (if ever
    used) only with weights_only=True."""
    bad = []
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        for i, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(
                r"\b(import pickle|from pickle|import cPickle|import dill|import joblib)\b", code
            ):
                bad.append(f"{path.name}:{i}: {line.strip()}")
            if re.search(r"\btorch\.save\(", code):
                bad.append(f"{path.name}:{i}: {line.strip()}")
            if re.search(r"\btorch\.load\(", code) and "weights_only=True" not in code:
                bad.append(f"{path.name}:{i}: {line.strip()}")
            if re.search(r"\bnp\.load\(", code) and "allow_pickle=False" not in code:
                bad.append(f"{path.name}:{i}: {line.strip()}")
    assert bad == []


def test_the_no_pickle_check_can_fail(tmp_path, monkeypatch):
    (tmp_path / "x.py").write_text("import pickle\nimport torch\ntorch.load('m.pt')\n")
    monkeypatch.setattr(__import__(__name__), "SRC", tmp_path)
    with pytest.raises(AssertionError):
        test_no_pickle_anywhere()


def test_template_cannot_reach_the_os(tmp_path):
    from toy.data.chat import render_template

    marker = tmp_path / "pwned"
    attacks = [
        "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}",
        "{{ joiner.__init__.__globals__['os'].popen('touch " + str(marker) + "').read() }}",
        "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{% if c.__name__ == 'Popen' %}"
        "{{ c(['touch', '" + str(marker) + "']) }}{% endif %}{% endfor %}",
        "{{ messages.append.__self__.__class__.__init__.__globals__ }}",
        "{% set x = messages.append({'role': 'user', 'content': 'injected'}) %}{{ messages }}",
    ]
    for t in attacks:
        with pytest.raises(InputError) as e:
            render_template(
                t,
                [{"role": "user", "content": "hi"}],
                add_generation_prompt=True,
                bos_token="",
                eos_token="",
            )
        assert "\n" not in str(e.value)
    assert not marker.exists()


def test_full_disk_during_checkpoint_keeps_the_last_good_one(tmp_path, monkeypatch, toy_cli):
    from toy.data.prep import bundled_text_paths
    from toy.formats import checkpoint as ckpt
    from toy.formats import model_dir  # noqa: F401  imported now, so it binds the real save_tensors, not
    # the flaky one below (the CLI imports modules lazily: the patch would outlive this test)

    code, _, err = toy_cli(
        "prep", bundled_text_paths()[0], "--out", tmp_path / "c.bin", "--vocab-size", "300"
    )
    assert code == 0, err
    real = ckpt.save_tensors
    calls = {"n": 0}

    def flaky(path, tensors, metadata=None):
        calls["n"] += 1
        if calls["n"] > 3:  # the second checkpoint's first file: the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, tensors, metadata)

    monkeypatch.setattr(ckpt, "save_tensors", flaky)
    code, _, err = toy_cli(
        "train",
        "--corpus",
        tmp_path / "c.bin",
        "--out",
        tmp_path / "runs",
        "--run-id",
        "full",
        "--preset",
        "tiny",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--steps",
        "6",
        "--save-every",
        "2",
        "--eval-batches",
        "1",
    )
    assert code == 1 and "No space left" in err and "checkpoint" in err
    root = tmp_path / "runs" / "full" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-000002"]  # no temp dir, no half step-4
    assert (root / "step-000002" / "state.json").is_file()
    events = [
        json.loads(x)
        for x in (tmp_path / "runs" / "full" / "events.jsonl").read_text().splitlines()
    ]
    assert events[-1]["event"] == "run_failed" and events[-1]["step"] == 4


def test_keep_last(tmp_path, toy_cli):
    from toy.data.prep import bundled_text_paths

    code, _, err = toy_cli(
        "prep", bundled_text_paths()[0], "--out", tmp_path / "c.bin", "--vocab-size", "300"
    )
    assert code == 0, err
    code, _, err = toy_cli(
        "train",
        "--corpus",
        tmp_path / "c.bin",
        "--out",
        tmp_path,
        "--run-id",
        "k",
        "--preset",
        "tiny",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--steps",
        "8",
        "--save-every",
        "2",
        "--keep-last",
        "3",
        "--eval-batches",
        "1",
    )
    assert code == 0, err
    names = sorted(p.name for p in (tmp_path / "k" / "checkpoints").iterdir())
    assert names == ["step-000004", "step-000006", "step-000008"]


def test_unwritable_out_is_a_clear_error(tmp_path, toy_cli):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code, _, err = toy_cli(
        "train", "--out", blocker / "runs", "--preset", "tiny", "--steps", "1", "--seq-len", "16"
    )
    assert code == 2 and "cannot create run directory" in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------ fuzzing (bounded)

FUZZ = settings(
    max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _valid_gguf(tmp_path_factory) -> bytes:
    import gguf

    p = tmp_path_factory.mktemp("fz") / "v.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_token_list(["a", "b", "c"])
    w.add_tensor("token_embd.weight", np.zeros((3, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p.read_bytes()


@pytest.fixture(scope="module")
def valid_gguf(tmp_path_factory):
    return _valid_gguf(tmp_path_factory)


@FUZZ
@given(data=st.data())
def test_fuzz_gguf_header(valid_gguf, tmp_path, data):
    from toy.formats.gguf_header import read_gguf_header

    blob = bytearray(valid_gguf)
    choice = data.draw(st.sampled_from(["flip", "truncate", "random", "counts"]))
    if choice == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(blob) - 1))
            blob[i] = data.draw(st.integers(0, 255))
    elif choice == "truncate":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    elif choice == "random":
        blob = bytearray(b"GGUF" + data.draw(st.binary(max_size=400)))
    else:  # absurd tensor / kv counts in an otherwise valid header
        blob[8:24] = struct.pack(
            "<QQ", data.draw(st.integers(0, 2**64 - 1)), data.draw(st.integers(0, 2**64 - 1))
        )
    p = tmp_path / "f.gguf"
    p.write_bytes(bytes(blob))
    try:
        read_gguf_header(p)
    except InputError as e:
        assert "\n" not in str(e)


@FUZZ
@given(blob=st.binary(max_size=300), keep_header=st.booleans())
def test_fuzz_token_file(tmp_path, blob, keep_header):
    from toy.data.tokens import HEADER, MAGIC, read_tokens

    p = tmp_path / "t.bin"
    if keep_header and len(blob) >= 24:
        blob = HEADER.pack(MAGIC, 1, 2, 50, 0, len(blob[24:]) // 2, b"\0" * 32) + blob[24:]
    p.write_bytes(blob)
    try:
        tf = read_tokens(p)
        assert int(np.asarray(tf.tokens).max()) < tf.vocab_size
    except InputError as e:
        assert "\n" not in str(e)


@FUZZ
@given(
    lines=st.lists(
        st.one_of(
            st.binary(max_size=80).map(lambda b: b.decode("latin-1")),
            st.just(
                '{"messages": [{"role": "user", "content": "hi"}, '
                '{"role": "assistant", "content": "yo"}]}'
            ),
            st.just('{"messages": [{"role": "wizard", "content": 1}]}'),
        ),
        max_size=8,
    )
)
def test_fuzz_chat_jsonl(tmp_path, lines):
    from toy.data.chat import read_chat_jsonl

    p = tmp_path / "c.jsonl"
    p.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape"))
    try:
        chat = read_chat_jsonl(p, warn=lambda m: None)
        assert all(
            m["role"] in ("system", "user", "assistant") for c in chat.conversations for m in c
        )
    except ToyError as e:
        assert "\n" not in str(e)
