"""The time to a whole reply (issue 33 item 3, issue 35 item 3): one token's attention runs
on one thread, `auto` picks float32 or packed by the expected work, and `toy infer`
reports the time to its first token and its tokens/s."""

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers.common import no_c_step  # noqa: E402
from helpers.quant import quant_gguf  # noqa: E402,F401

from toy.cli import cmd_infer  # noqa: E402
from toy.models import decode, layers  # noqa: E402


def test_one_tokens_attention_runs_on_one_thread_and_restores_the_count(monkeypatch):
    seen = []
    sdpa = layers.F.scaled_dot_product_attention

    def spy(*a, **k):
        seen.append(torch.get_num_threads())
        return sdpa(*a, **k)

    monkeypatch.setattr(layers.F, "scaled_dot_product_attention", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(0)
        cache = layers.KVCache(1, 1, 2, 16, 8, torch.device("cpu"), torch.float32)
        q, k, v = (torch.randn(1, n, 5, 8, generator=g) for n in (4, 2, 2))
        layers.attend(q, k, v, cache)  # a prompt: every thread
        cache.pos = 5  # the model advances it after every layer has written
        q1, k1, v1 = (torch.randn(1, n, 1, 8, generator=g) for n in (4, 2, 2))
        got = layers.attend(q1, k1, v1, cache)  # one token: one thread
        assert seen == [2, 1]
        assert torch.get_num_threads() == 2
        keys, values = cache.k[0][:, :, :6], cache.v[0][:, :, :6]
        want = sdpa(q1, keys, values, enable_gqa=True)
        assert torch.equal(got, want)
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- auto: float32 or packed

SMOL = 538_000_000  # SmolLM2-135M's float32 bytes
GB = 10**9


@pytest.mark.parametrize(
    "float32_bytes, tokens, cached, pays",
    [
        (SMOL, 5, True, False),  # a few tokens: float32 is as soon
        (SMOL, 43, True, True),  # the lead's 43-token reply: packed, its steps built here
        (SMOL, None, True, True),  # an interactive chat: many replies on one load
        # not built here yet: no reply waits for the build (a background process makes it),
        # however many tokens are asked for (a 10-token reply to 1500 asked waited 22-47 s)
        (SMOL, 100, False, False),
        (SMOL, 1500, False, False),
        (SMOL, None, False, False),
        (10**6, 2_000, True, False),  # a tiny model: float32 tokens are already cheap
        (28 * GB, 1, True, True),  # a 7B float32 copy: 2.2 s a token more
        (28 * GB, 12, False, False),  # ... but not built yet: no reply waits for the build
    ],
)
def test_pack_pays_by_the_expected_work(float32_bytes, tokens, cached, pays):
    assert cmd_infer.pack_pays(float32_bytes, tokens, cached) is pays


@pytest.mark.parametrize(
    "requested, device, packed, tokens, cached, available, want",
    [
        ("auto", "cpu", SMOL // 6, 100, True, 8 * GB, "quantized"),
        ("auto", "cpu", SMOL // 6, 5, True, 8 * GB, "float32"),
        ("auto", "cpu", SMOL // 6, 100, False, 8 * GB, "float32"),
        ("auto", "cpu", None, 1000, True, 8 * GB, "float32"),  # does not pack here
        ("auto", "cpu", SMOL // 6, 5, True, SMOL // 2, "quantized"),  # float32 does not fit
        ("auto", "cuda", SMOL // 6, 1000, True, 8 * GB, "bfloat16"),
        ("float32", "cpu", SMOL // 6, 1000, True, 8 * GB, "float32"),  # asked: as asked
        ("quantized", "cpu", SMOL // 6, 1, False, 8 * GB, "quantized"),
    ],
)
def test_choose_base_dtype_weighs_packing(
    requested, device, packed, tokens, cached, available, want
):
    got, note = cmd_infer.choose_base_dtype(
        requested, device, SMOL, available, 0, packed, tokens, cached
    )
    assert got == want
    assert bool(note) == (available < SMOL)  # a note only where memory decided


def _report(out: str) -> dict:
    lines = out.strip().splitlines()
    assert len(lines) == 1, out  # one JSON object, the text inside it
    return json.loads(lines[0])


def test_infer_json_and_stderr_report_first_token_and_speed(
    quant_gguf, toy_cli, monkeypatch, tmp_path
):
    """`--json` prints one object: the text, the tokens, the time to the first token and the
    tokens/s after it, how the base was held and why; stderr ends with the same figures. The
    compile is counted as cached once a packed run has built the steps (a marker beside
    inductor's cache): auto keeps float32 before (no reply waits for a build) and packs
    after, with the same text."""
    no_c_step(monkeypatch)  # decode.py's steps: builds, markers and notes
    monkeypatch.setattr(decode, "_STEPS", {})  # this process's steps stay as other tests left them
    monkeypatch.setattr(decode, "_KERNELS", {})
    marker = tmp_path / "steps-marker"
    monkeypatch.setattr(decode, "steps_marker", lambda key: marker)
    monkeypatch.setattr(cmd_infer, "PACKED_EXTRA_S", 0.0)
    args = ["infer", "--model", quant_gguf, "--prompt", "ROMEO. What", "--temperature", "0"]
    args += ["--max-new-tokens", "12"]
    code, plain, err = toy_cli(*args)
    assert code == 0, err
    code, out, err = toy_cli(*args, "--json")
    assert code == 0, err
    r = _report(out)
    assert r["text"] == plain.rstrip("\n") and r["text"].startswith("ROMEO. What")
    assert r["tokens"] == 12
    assert r["first_token_s"] > 0 and r["tokens_per_s"] > 0
    assert r["base_dtype"] == "float32" and "not yet" in r["why"], r
    speed = err.strip().splitlines()[-1]
    assert speed.startswith("[12 tokens: first after ") and speed.endswith("tokens/s after it]")
    assert not marker.exists()
    code, out, err = toy_cli(*args, "--json", "--base-dtype", "quantized")  # builds the steps
    assert code == 0 and marker.is_file(), err
    assert _report(out)["base_dtype"] == "quantized (packed)"
    code, out, err = toy_cli(*args, "--json")  # auto, the compile cached now
    assert code == 0, err
    r2 = _report(out)
    assert r2["base_dtype"] == "quantized (packed)" and r2["why"].startswith("auto: packed")
    assert r2["text"] == r["text"]


def test_auto_answers_at_once_and_builds_the_steps_in_the_background(
    quant_gguf, toy_cli, monkeypatch, tmp_path
):
    """Issue 58 item 4: a reply never waits for a build. Where the steps are not built on
    this machine, auto answers from float32 at once and, the reply out, starts `toy infer
    --build-steps` in a process of its own (one a model at a time: a lock); that build
    writes the marker, and the next run packs. Costs set so that packing pays once built."""
    no_c_step(monkeypatch)  # decode.py's steps: builds, markers and notes
    import subprocess

    monkeypatch.delenv("TOY_BACKGROUND_BUILDS", raising=False)
    monkeypatch.setattr(decode, "steps_marker", lambda key: tmp_path / "steps" / key)
    monkeypatch.setattr(cmd_infer, "PACKED_EXTRA_S", 0.0)
    started, order = [], []
    monkeypatch.setattr(
        subprocess, "Popen", lambda argv, **kw: started.append(argv) or order.append("build")
    )
    real_write = sys.stdout.write
    monkeypatch.setattr(sys.stdout, "write", lambda t: order.append("text") or real_write(t))
    args = ["infer", "--model", quant_gguf, "--prompt", "ROMEO. What", "--temperature", "0"]
    args += ["--max-new-tokens", "12", "--json"]
    code, out, err = toy_cli(*args)
    assert code == 0, err
    r = _report(out)
    assert r["base_dtype"] == "float32" and "background build" in r["why"], r
    assert order[-1] == "build" and "text" in order[:-1]  # started once the reply was out
    [argv] = started
    assert argv[argv.index("--model") + 1] == str(quant_gguf) and "--build-steps" in argv
    lock = Path(argv[argv.index("--build-lock") + 1])
    assert lock.is_file()
    code, out, err = toy_cli(*args)  # while that build is under way: none more
    assert code == 0 and len(started) == 1, err
    # the build itself (here in this process): the steps, the marker, the lock freed
    mine = tmp_path / "mine.txt"  # a --build-lock that is not the model's lock stays
    mine.write_text("a user's file")
    code, _, err = toy_cli("infer", "--model", quant_gguf, "--build-steps", "--build-lock", mine)
    assert code == 0 and mine.read_text() == "a user's file" and lock.exists(), err
    code, _, err = toy_cli("infer", "--model", quant_gguf, "--build-steps", "--build-lock", lock)
    assert code == 0 and "built: " in err and not lock.exists(), err
    code, out, err = toy_cli(*args)  # and the next run packs, with the same text
    assert code == 0 and len(started) == 1, err
    r2 = _report(out)
    assert r2["base_dtype"] == "quantized (packed)" and r2["text"] == r["text"], r2
    code, _, err = toy_cli("infer", "--model", quant_gguf, "--build-steps", "--prompt", "x")
    assert code == 2 and "--build-steps takes --model" in err


def test_auto_choosing_packed_without_a_compiler_generates_in_float32(
    quant_gguf, toy_cli, monkeypatch
):
    no_c_step(monkeypatch)  # decode.py's steps: builds, markers and notes
    monkeypatch.setattr(cmd_infer, "pack_pays", lambda size, tokens, cached: True)
    monkeypatch.setattr(decode, "compile_unavailable", lambda device: "no C++ compiler (test)")
    args = ["infer", "--model", quant_gguf, "--prompt", "ROMEO. What", "--temperature", "0"]
    args += ["--max-new-tokens", "12", "--json"]
    code, out, err = toy_cli(*args)
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "no C++ compiler (test)" in notes[0], err
    r = _report(out)
    assert r["base_dtype"] == "float32"
    code, out, err = toy_cli(*args, "--base-dtype", "float32")
    assert code == 0 and _report(out)["text"] == r["text"], err


def test_json_needs_a_prompt_or_a_chat(quant_gguf, toy_cli):
    code, out, err = toy_cli("infer", "--model", quant_gguf, "--json")
    assert code == 2 and "--json needs --prompt" in err and not out


# ---------------------------------------------------------------- float32 without a second read


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_gguf_dequantized_from_its_probe_is_the_files_float_read(quant_gguf, dtype):
    """held_as dequantizes the probe (read as stored) instead of reading the file again: the
    same tensors, bit for bit and dtype for dtype, as read_base(path, dtype)."""
    from toy.formats.base_readers import held_as, read_base

    probe = read_base(quant_gguf, "quantized")
    got = held_as(probe, Path(quant_gguf), dtype)
    want = read_base(quant_gguf, dtype)
    assert got.base_dtype == dtype and sorted(got.state_dict) == sorted(want.state_dict)
    for name, t in want.state_dict.items():
        assert got.state_dict[name].dtype == t.dtype, name
        assert torch.equal(got.state_dict[name], t), name
    assert got.tokenizer is probe.tokenizer  # built once


def test_float32_infer_parses_the_gguf_header_once(quant_gguf, toy_cli, monkeypatch):
    from toy.formats import gguf

    calls = []
    real = gguf.read_gguf_header
    monkeypatch.setattr(gguf, "read_gguf_header", lambda *a: calls.append(a) or real(*a))
    args = ["infer", "--model", quant_gguf, "--prompt", "ROMEO. What", "--temperature", "0"]
    code, out, err = toy_cli(*args, "--max-new-tokens", "8", "--base-dtype", "float32")
    assert code == 0, err
    assert len(calls) == 1
    assert out.startswith("ROMEO. What") and len(out) > len("ROMEO. What")


def test_the_infer_process_leaves_at_once_with_its_whole_reply_and_code(quant_gguf):
    """`toy infer` ends with os._exit once its streams are flushed (cli/main.entry: the
    interpreter's teardown of torch took up to 0.9 s after the last token): its exit code
    stays, and nothing it wrote is lost, through a pipe: the streamed text is, byte for
    byte, the --json object's text and a newline (a tail that is half a character too)."""
    import subprocess

    from helpers.common import run_toy

    args = [sys.executable, "-m", "toy", "infer", "--model", str(quant_gguf), "--prompt"]
    args += ["ROMEO. What", "--temperature", "0", "--base-dtype", "float32"]
    for n in ("40", "1"):  # this model's first token is half a character: "What\ufffd"
        run = [*args, "--max-new-tokens", n]
        r = subprocess.run([*run, "--json"], capture_output=True)  # a pipe: one object
        assert r.returncode == 0, r.stderr
        text = json.loads(r.stdout)["text"]
        assert text.startswith("ROMEO. What") and len(text) > len("ROMEO. What")
        r = subprocess.run(run, capture_output=True)  # the streamed text, to its last byte
        assert r.returncode == 0, r.stderr
        assert r.stdout == text.encode("utf-8", "surrogateescape") + b"\n", (r.stdout, text)
        assert b": first after " in r.stderr.strip().splitlines()[-1]
    bad = run_toy("infer", "--model", quant_gguf, "--prompt", "x", "--top-p", "7")
    assert bad.returncode == 2 and "--top-p" in bad.stderr and "Traceback" not in bad.stderr
    missing = run_toy("infer", "--model", str(quant_gguf) + ".none", "--prompt", "x")
    assert missing.returncode == 2 and "not found" in missing.stderr, missing.stderr
