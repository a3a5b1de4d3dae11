"""`toy infer` on a llama GGUF without torch (cli/reply_fast.py): the first packed reply
keeps its C loop's model in toy's cache, the next one starts from it without importing torch
and writes the same text; a damaged kept file is not trusted; what the path does not take
goes through torch as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.gguf_fixtures import smollm2_gguf  # noqa: F401
from helpers.quant import quant_gguf  # noqa: F401

from toy.cli import cmd_infer, reply_fast
from toy.formats import reply_image
from toy.models import reply_c

pytestmark = pytest.mark.skipif(
    reply_c.library() is None, reason="decode_step.c does not build here"
)

TELL = (
    "import sys; from toy.cli.main import main; code = main(sys.argv[1:]); "
    "print('torch imported:', 'torch' in sys.modules, file=sys.stderr); sys.exit(code)"
)


def _infer(args: list, cache) -> tuple[dict, str]:
    r = subprocess.run(
        [sys.executable, "-c", TELL, "infer", *map(str, args), "--json"],
        capture_output=True,
        text=True,
        env=dict(os.environ, TOY_CACHE=str(cache)),
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stderr


def test_a_second_reply_starts_without_torch_and_writes_the_first_ones_text(
    quant_gguf,  # noqa: F811
    tmp_path,
):
    args = ["--model", quant_gguf, "--prompt", "ROMEO. What", "--base-dtype", "quantized"]
    args += ["--temperature", "0.9", "--seed", "7", "--max-new-tokens", "30"]
    first, err1 = _infer(args, tmp_path)
    assert "torch imported: True" in err1
    kept = list((tmp_path / "reply").iterdir())  # in TOY_CACHE, under the file's key
    assert [p.name for p in kept] == [reply_image.path_for(quant_gguf).name]
    second, err2 = _infer(args, tmp_path)
    assert "torch imported: False" in err2, err2
    assert second["text"] == first["text"] and first["tokens"] >= 10
    # the same lines on stderr but the speed line's figures (and this test's own line)
    said = [[x for x in e.splitlines() if not x.startswith(("[", "torch"))] for e in (err1, err2)]
    assert said[0] == said[1]
    for key in ("tokens", "base_dtype", "why"):
        assert second[key] == first[key]
    assert second["base_dtype"] == "quantized (packed)"
    # another seed draws another text, from the kept model too
    other, err3 = _infer([*args[:-4], "--seed", "8", "--max-new-tokens", "30"], tmp_path)
    assert "torch imported: False" in err3 and other["text"] != first["text"]


def test_an_interactive_chat_steps_in_c_and_starts_without_torch_the_next_time(
    quant_gguf,  # noqa: F811
    tmp_path,
):
    """A chat session on a llama GGUF held packed: every turn in C on one state carried
    across turns; the first session keeps the model, the next starts from it without torch
    and writes the same transcript; its first reply is the one-shot --chat reply's."""
    lines = "Who is there?\nNay, answer me: stand, and unfold yourself.\n\n"
    args = ["infer", "--model", quant_gguf, "--base-dtype", "quantized", "--temperature", "0.7"]
    args += ["--max-new-tokens", "12"]
    runs = []
    for _ in range(2):
        r = subprocess.run(
            [sys.executable, "-c", TELL, *map(str, args)],
            input=lines,
            capture_output=True,
            text=True,
            env=dict(os.environ, TOY_CACHE=str(tmp_path)),
            timeout=600,
        )
        assert r.returncode == 0, r.stderr
        runs.append(r)
    assert "torch imported: True" in runs[0].stderr
    assert "torch imported: False" in runs[1].stderr, runs[1].stderr
    assert runs[1].stdout == runs[0].stdout
    replies = [line.removeprefix("> ") for line in runs[0].stdout.splitlines()]
    one, _ = _infer([*args[1:], "--chat", "Who is there?"], tmp_path)
    assert replies[0] == one["text"] and one["text"].strip()


def test_a_damaged_kept_model_is_not_trusted_and_is_written_again(
    quant_gguf,  # noqa: F811
    toy_run,
    monkeypatch,
):
    args = ["infer", "--model", quant_gguf, "--prompt", "ROMEO. What", "--temperature", "0"]
    args += ["--base-dtype", "quantized", "--max-new-tokens", "20"]
    first = toy_run(*args)
    assert first.returncode == 0, first.stderr
    path = reply_image.path_for(quant_gguf)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # a code of a block
    path.write_bytes(bytes(data))
    taken = []
    real = cmd_infer.load_kept
    monkeypatch.setattr(cmd_infer, "load_kept", lambda a: taken.append(real(a)) or taken[-1])
    again = toy_run(*args)
    assert again.returncode == 0 and again.stdout == first.stdout
    assert taken == [None]  # not trusted: torch's path, which wrote it again
    assert reply_image.read(path) is not None
    last = toy_run(*args)
    assert last.stdout == first.stdout and taken[-1] is not None


def test_what_the_path_does_not_take_goes_through_torch(quant_gguf, toy_run, monkeypatch):  # noqa: F811
    base = ["infer", "--model", quant_gguf, "--prompt", "ROMEO. What", "--temperature", "0"]
    base += ["--max-new-tokens", "12"]
    assert toy_run(*base, "--base-dtype", "quantized").returncode == 0  # keeps the model
    taken = []
    real = cmd_infer.load_kept
    monkeypatch.setattr(cmd_infer, "load_kept", lambda a: taken.append(real(a)) or taken[-1])
    for extra in (["--base-dtype", "float32"], ["--threads", "1", "--base-dtype", "quantized"]):
        r = toy_run(*base, *extra)
        assert r.returncode == 0, r.stderr
    assert taken[0] is None and taken[1] is not None
    monkeypatch.setattr(reply_fast, "PREFILL_MAX", 2)  # a prompt longer than C prefills
    r = toy_run(*base, "--base-dtype", "quantized")
    assert r.returncode == 0 and taken[-1] is None
    monkeypatch.setenv("TOY_NATIVE", "0")
    r = toy_run(*base, "--base-dtype", "quantized")
    assert r.returncode == 0 and taken[-1] is None


@pytest.mark.slow
def test_smollm2_kept_model_reply_is_the_first_ones_the_float32_text_and_llamacpps(
    smollm2_gguf,  # noqa: F811
    tmp_path,
):
    """SmolLM2-135M Q4_1 through its ChatML template, against the real client: the second
    command maps the kept model, never imports torch, and answers with the first one's text,
    greedy and sampled; the greedy one is the float32 base's text, and each token llama.cpp
    chooses on the same file and prompt is (nearly) toy's own choice there (llama.cpp's Q4_1
    products take 8-bit activations, not toy's float32 arithmetic: its text is held to a
    margin, as tests/formats/test_llamacpp.py holds it)."""
    from pathlib import Path

    from toy.cli.cmd_infer import load_base_lm
    from toy.data.chat import render_template
    from toy.models.generate import generate
    from toy.tokenizer import encode_prompt

    question, n = "What is the capital of France?", 24
    texts = {}
    for temp in ("0", "0.8"):
        args = ["--model", smollm2_gguf, "--chat", question, "--temperature", temp]
        args += ["--max-new-tokens", str(n)]
        first, err1 = _infer(args, tmp_path / temp)
        kept, err2 = _infer(args, tmp_path / temp)
        assert "torch imported: True" in err1
        assert "torch imported: False" in err2, err2
        assert kept["text"] == first["text"] and len(first["text"]) > 20
        assert kept["base_dtype"] == first["base_dtype"] == "quantized (packed)"
        texts[temp] = kept["text"]
    lm = load_base_lm(Path(smollm2_gguf), None, "cpu", "float32")
    text = render_template(
        lm.template,
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        bos_token=lm.bos,
        eos_token=lm.eos,
    )
    prompt = encode_prompt(lm.tok, text)
    want = list(generate(lm.model, prompt, n, 0.0, stop_ids=lm.stop))
    assert texts["0"] == lm.tok.decode(want) and len(want) >= 5
    pytest.importorskip("llama_cpp")
    from helpers.llamacpp import _cpp_greedy, _llama, _teacher_forced_margin

    cpp = _cpp_greedy(_llama(Path(smollm2_gguf)), prompt, n, lm.stop)
    assert cpp and _teacher_forced_margin(lm.model, prompt, cpp) < 0.5
