"""Three small items, each through the command line: `toy prep` and a lone surrogate
escape in a {"text"} line; a token file where JSONL or text belongs; `toy runs` telling
a live run ("running") from a killed one ("unfinished") by the pid run.json records."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.gguf_fixtures import tiny_model, write_llama_gguf  # noqa: E402

from toy.data.prep import bundled_text_paths  # noqa: E402
from toy.data.tokens import write_tokens  # noqa: E402
from toy.tokenizer import train_bpe  # noqa: E402

SURROGATE_TEXT = '{"text": "abc \\ud800 def"}'  # valid JSON, no UTF-8 string


def one_line(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err)
    assert "Traceback" not in err
    return lines[0]


# ---- (a) a lone surrogate escape in `toy prep`'s {"text"} JSONL


def test_prep_refuses_a_lone_surrogate_naming_its_line(toy_cli, tmp_path):
    # Before: "internal error: UnicodeEncodeError ... surrogates not allowed", a traceback
    # from the BPE trainer, exit 1. Prep stops at any bad line, named: this one too.
    p = tmp_path / "docs.jsonl"
    p.write_text(json.dumps({"text": "a first document, all well"}) + "\n" + SURROGATE_TEXT + "\n")
    code, _, err = toy_cli("prep", p, "--out", tmp_path / "c.bin", "--vocab-size", "300")
    line = one_line(code, err)
    assert f"{p}:2: \\ud800 is half of a UTF-16 surrogate pair" in line, line
    assert "escape the whole pair or write the character itself" in line
    assert not (tmp_path / "c.bin").exists() and not (tmp_path / "c.tokenizer.json").exists()
    # A whole pair (an emoji) is a character, and prep takes it.
    p.write_text('{"text": "hi \\ud83d\\ude00 and more words for a tokenizer"}\n')
    code, _, err = toy_cli("prep", p, "--out", tmp_path / "c.bin", "--vocab-size", "300")
    assert code == 0, err


def test_a_lone_surrogate_in_a_text_line_is_a_named_skip_for_training(tmp_path):
    # toy train's {"text"} reader skips it, named, as it does in conversations and pairs.
    from toy.data.chat import read_chat_jsonl

    p = tmp_path / "t.jsonl"
    p.write_text(SURROGATE_TEXT + "\n" + json.dumps({"text": "a good line"}) + "\n")
    said: list[str] = []
    chat = read_chat_jsonl(p, warn=said.append)
    assert chat.lines == [2] and dict(chat.skipped) == {"lone surrogate escape": 1}
    assert said == [
        f"{p}:1: \\ud800 is half of a UTF-16 surrogate pair, no character; escape the whole "
        "pair or write the character itself; line skipped"
    ]


# ---- (b) a token file where JSONL or text belongs


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    text = bundled_text_paths()[0].read_text()[:20000]
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=300)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    model = tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True), max_seq_len=128)
    tokens = d / "c.bin"
    write_tokens(tokens, list(range(200)) * 20, 300)
    return {"gguf": write_llama_gguf(d / "base.gguf", model, tok), "tokens": tokens, "d": d}


@pytest.mark.parametrize(
    "recipe, flag",
    [
        ("lora", "--data"),
        ("grpo", "--data"),
        ("dpo", "--data"),
        ("lora", "--val-data"),
        ("dpo", "--val-data"),
    ],
)
def test_a_token_file_where_jsonl_belongs_is_one_line(kit, toy_cli, tmp_path, recipe, flag):
    # Before: with --val-data the line told the user to "give --data the JSONL itself".
    data = {"lora": SMALL_CHAT, "dpo": SMALL_PAIRS, "grpo": SMALL_PROMPTS}[recipe]
    src = tmp_path / "d.jsonl"
    src.write_text(data)
    files = ["--data", kit["tokens"]] if flag == "--data" else ["--data", src, flag, kit["tokens"]]
    extra = ["--reward", "length"] if recipe == "grpo" else []
    code, _, err = toy_cli(
        "train", "--recipe", recipe, "--model", kit["gguf"], *files, *extra,
        "--out", tmp_path / "r",
    )  # fmt: skip
    line = one_line(code, err)
    assert f"{kit['tokens']} is a token file from `toy prep`, not JSONL" in line, line
    assert "a token file goes to --corpus or --val-corpus" in line
    assert "--data the JSONL" not in line  # names no flag the user may not have used
    assert not (tmp_path / "r").exists()


SMALL_CHAT = "".join(json.dumps({"text": f"line {i} of some text"}) + "\n" for i in range(8))
SMALL_PAIRS = "".join(
    json.dumps({"prompt": f"q{i}", "chosen": "Aye.", "rejected": "No."}) + "\n" for i in range(8)
)
SMALL_PROMPTS = "".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(8))


def test_prep_names_a_token_file_given_as_text(kit, toy_cli, tmp_path):
    # Before: "c.bin: not UTF-8 text (byte 25); convert it to UTF-8 first".
    for given in (kit["tokens"], kit["d"] / "tokens.jsonl"):
        if given.suffix == ".jsonl":
            given.write_bytes(kit["tokens"].read_bytes())
        code, _, err = toy_cli("prep", given, "--out", tmp_path / "o.bin", "--vocab-size", "300")
        line = one_line(code, err)
        assert f"{given} is a token file from `toy prep` already, not text" in line, line
        assert f"`toy train --corpus {given}`" in line


# ---- (c) `toy runs`: "running" while the run's process lives


def test_process_lives_tells_a_reused_pid_and_another_host():
    from toy.runs import process_lives

    me, host = os.getpid(), socket.gethostname()
    assert process_lives(me, host, time.time())
    assert process_lives(me, host, None)
    # This pid's process began after a segment started at 1970: the pid was reused.
    assert not process_lives(me, host, 0.0) or not Path("/proc/self/stat").exists()
    assert not process_lives(me, host + "-elsewhere", time.time())
    assert not process_lives(2**22 + 12345, host, time.time())  # above Linux's pid_max


def _status(toy_cli, *argv) -> str:
    code, out, err = toy_cli(*argv, "--json")
    assert code == 0, err
    (row,) = json.loads(out)["runs"]
    return row["status"]


def test_runs_says_running_while_the_process_lives_and_unfinished_once_killed(
    small_corpus, toy_cli, tmp_path, monkeypatch
):
    # Before: "unfinished" for both, and run.json named no process.
    monkeypatch.chdir(tmp_path)  # `toy list` reads the runs/ of the folder it runs in
    run = tmp_path / "runs" / "live"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "toy", "train", "--corpus", str(small_corpus),
            "--out", str(tmp_path / "runs"), "--run-id", "live", "--preset", "tiny",
            "--batch-size", "2", "--seq-len", "16", "--steps", "1000000",
            "--eval-every", "1000000", "--threads", "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        t0 = time.time()
        while not (
            (run / "events.jsonl").is_file() and '"step"' in (run / "events.jsonl").read_text()
        ):
            if proc.poll() is not None:
                pytest.fail(f"the run ended early: {proc.stderr.read().decode()}")
            assert time.time() - t0 < 120, "no step after 120 s"
            time.sleep(0.05)
        info = json.loads((run / "run.json").read_text())
        mine = {"pid": proc.pid, "host": socket.gethostname()}
        assert {k: info[k] for k in mine} == {k: info["segments"][-1][k] for k in mine} == mine
        assert _status(toy_cli, "runs", tmp_path / "runs") == "running"
        assert _status(toy_cli, "list") == "running"
        code, _, err = toy_cli("infer", "--run", run, "--prompt", "HAMLET.")
        assert "has no final/ yet (the run is still training" in one_line(code, err)
        code, out, _ = toy_cli("runs", tmp_path / "runs")
        assert next(ln for ln in out.splitlines() if ln.startswith("live")).endswith(" running")
        proc.send_signal(signal.SIGKILL)
        # Not reaped yet (a zombie, as under a parent that never waits): not running either.
        t0 = time.time()
        while _status(toy_cli, "runs", tmp_path / "runs") == "running":
            assert time.time() - t0 < 10, "still 'running' 10 s after SIGKILL"
            time.sleep(0.05)
        proc.wait(timeout=30)
        assert _status(toy_cli, "runs", tmp_path / "runs") == "unfinished"
        assert _status(toy_cli, "list") == "unfinished"
        code, _, err = toy_cli("infer", "--run", run, "--prompt", "HAMLET.")
        assert "has no final/ yet (the run did not finish)" in one_line(code, err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
