"""The bad-input catalogue: one case per broken or hostile input, each through the
command line as a user would meet it. Every case must exit 2 with one line that names
the file (or flag), without a traceback, in bounded time, and leave no run behind."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.chat import SMOLLM2  # noqa: E402
from helpers.gguf_fixtures import tiny_model, write_llama_gguf  # noqa: E402

from toy.data.dialogue import conversations, write_jsonl  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402
from toy.data.tokens import write_tokens  # noqa: E402
from toy.tokenizer import train_bpe  # noqa: E402


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    text = bundled_text_paths()[0].read_text()[:30000]
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=300)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    model = tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True), max_seq_len=128)
    good = write_llama_gguf(d / "good.gguf", model, tok)
    chat = write_jsonl(
        conversations(bundled_text_paths(), 10, seed=0, max_chars=100), d / "chat.jsonl"
    )
    return {"d": d, "tok": tok, "model": model, "good": good, "chat": chat}


def _field_offset(data: bytes, name: bytes) -> int:
    return data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)


# ---- GGUF: each builder returns the broken file's path


def gguf_random(k, p):
    p.write_bytes(np.random.default_rng(1).bytes(8192))


def gguf_wrong_magic(k, p):
    p.write_bytes(b"GGML" + k["good"].read_bytes()[4:])


def _cut(frac_or_where):
    def build(k, p):
        from toy.formats.gguf_header import read_gguf_header

        data = k["good"].read_bytes()
        h = read_gguf_header(k["good"])
        at = {
            "header": 12,
            "kv": 200,
            "tensor_info": h.data_start - 40,
            "data": h.data_start + 500,
        }[frac_or_where]
        p.write_bytes(data[:at])

    return build


def gguf_absurd_counts(k, p):
    data = bytearray(k["good"].read_bytes())
    data[8:24] = struct.pack("<QQ", 1 << 61, 1 << 61)
    p.write_bytes(bytes(data))


def gguf_tensor_out_of_bounds(k, p):
    data = bytearray(k["good"].read_bytes())
    at = _field_offset(data, b"blk.1.ffn_down.weight")
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into(
        "<Q", data, at + 4 + 8 * n_dims + 4, 1 << 40
    )  # its data offset, far past the end
    p.write_bytes(bytes(data))


def gguf_unknown_quant(k, p):
    data = bytearray(k["good"].read_bytes())
    at = _field_offset(data, b"blk.0.attn_q.weight")
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 999)
    p.write_bytes(bytes(data))


def gguf_missing_key(k, p):
    data = bytearray(k["good"].read_bytes())
    key = b"llama.block_count"
    at = data.index(key)
    data[at : at + len(key)] = b"llama.bxock_count"  # same length: the key is simply absent
    p.write_bytes(bytes(data))


def gguf_missing_tensor(k, p):
    write_llama_gguf(p, k["model"], k["tok"], drop={"blk.1.ffn_down.weight"})


def gguf_misshapen_tensor(k, p):
    write_llama_gguf(
        p, k["model"], k["tok"], replace={"blk.0.attn_q.weight": np.zeros((32, 64), np.float32)}
    )


def gguf_unsupported_arch(k, p):
    write_llama_gguf(p, k["model"], k["tok"], arch="bert", permute=False)


GGUF_CASES = {
    "random bytes": (gguf_random, "not a GGUF"),
    "wrong magic": (gguf_wrong_magic, "not a GGUF"),
    "truncated in the header": (_cut("header"), ""),
    "truncated in the key/values": (_cut("kv"), ""),
    "truncated in the tensor infos": (_cut("tensor_info"), ""),
    "truncated in the tensor data": (_cut("data"), ""),
    "absurd counts in the header": (gguf_absurd_counts, ""),
    "a tensor out of bounds": (gguf_tensor_out_of_bounds, ""),
    "an unknown quant type": (gguf_unknown_quant, "999"),
    "a missing key": (gguf_missing_key, "block_count"),
    "a missing tensor": (gguf_missing_tensor, "blk.1.ffn_down.weight"),
    "a misshapen tensor": (gguf_misshapen_tensor, "blk.0.attn_q.weight"),
    "an unsupported architecture": (gguf_unsupported_arch, "llama"),
}


def check_one_line(code, err, *needles):
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf(kit, toy_cli, tmp_path, case):
    build, needle = GGUF_CASES[case]
    p = tmp_path / "broken.gguf"
    build(kit, p)
    commands = [
        [
            "train",
            "--recipe",
            "lora",
            "--model",
            p,
            "--data",
            kit["chat"],
            "--out",
            tmp_path / "runs",
        ],
        ["infer", "--model", p, "--prompt", "x"],
        ["describe", p],
    ]
    for argv in commands:
        t0 = time.perf_counter()
        code, _, err = toy_cli(*argv)
        assert time.perf_counter() - t0 < 10
        check_one_line(code, err, "broken.gguf", needle)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("case", ["a missing tensor", "a misshapen tensor"])
def test_describe_shows_a_gguf_it_cannot_load_then_says_why(kit, toy_cli, tmp_path, case):
    # The header is whole, so describe shows it; the tensors do not fit, so it must not exit 0.
    build, needle = GGUF_CASES[case]
    p = tmp_path / "broken.gguf"
    build(kit, p)
    code, out, err = toy_cli("describe", p)
    check_one_line(code, err, "broken.gguf", needle)
    assert "architecture  llama: 2 layers" in out and "chat template yes" in out
    code, out, err = toy_cli("describe", p, "--json")
    check_one_line(code, err, needle)
    d = json.loads(out)
    assert d["hyperparameters"]["n_layer"] == 2 and needle in d["load_error"]
    code, out, _ = toy_cli("describe", kit["good"], "--json")
    assert code == 0 and json.loads(out)["load_error"] is None


# ---- token files


def tokens_bad_magic(k, p):
    write_tokens(p, np.arange(500) % 300, 300)
    p.write_bytes(b"XXXXXXXX" + p.read_bytes()[8:])


def tokens_truncated(k, p):
    write_tokens(p, np.arange(500) % 300, 300)
    p.write_bytes(p.read_bytes()[:-101])


def tokens_id_too_big(k, p):
    arr = np.arange(500) % 300
    write_tokens(p, arr, 300)
    data = bytearray(p.read_bytes())
    struct.pack_into("<H", data, 64 + 2 * 77, 300)  # == vocab size
    p.write_bytes(bytes(data))


TOKEN_CASES = {
    "bad magic": (tokens_bad_magic, "bad magic"),
    "truncated": (tokens_truncated, "truncated"),
    "token id >= vocab": (tokens_id_too_big, "outside the vocabulary"),
}


@pytest.mark.parametrize("case", list(TOKEN_CASES))
def test_token_file(toy_cli, tmp_path, case):
    build, needle = TOKEN_CASES[case]
    p = tmp_path / "broken.bin"
    build(None, p)
    code, _, err = toy_cli("train", "--corpus", p, "--out", tmp_path / "runs", "--preset", "tiny")
    check_one_line(code, err, "broken.bin", needle)
    assert not (tmp_path / "runs").exists()


def test_token_file_vocab_mismatch_with_the_model(kit, toy_cli, tmp_path):
    p = tmp_path / "other.bin"
    code, _, err = toy_cli("prep", bundled_text_paths()[1], "--out", p, "--vocab-size", "260")
    assert code == 0, err
    code, _, err = toy_cli(
        "train",
        "--recipe",
        "lora",
        "--model",
        kit["good"],
        "--corpus",
        p,
        "--out",
        tmp_path / "runs",
    )
    check_one_line(code, err, "other.bin", "another tokenizer")


# ---- chat JSONL

NOTHING = "no example to learn from in"
CHAT_CASES = {
    "binary garbage": (b"\x00\xff\xfe\x81garbage\x00\n" * 5, "5 lines skipped: 5 not UTF-8"),
    "wrong schema": (b'{"txt": "not a chat"}\n[1, 2, 3]\n', NOTHING),
    "unknown roles": (
        b'{"messages": [{"role": "wizard", "content": "hi"}, '
        b'{"role": "assistant", "content": "x"}]}\n',
        "1 unknown role",
    ),
    "empty file": (b"", NOTHING),
    "all invalid": (
        b'{"messages": []}\n{"messages": [{"role": "user", "content": "only a question"}]}\n',
        NOTHING,
    ),
    # Before, this trained a step on the first line's lone end-of-turn token and exited 0.
    "nothing to learn": (
        b'{"messages": [{"role": "assistant", "content": ""}]}\n'
        b'{"messages": [{"role": "wizard", "content": "hi"}, '
        b'{"role": "assistant", "content": "x"}]}\n'
        b'{"messages": "hello"}\n',
        '(3 lines skipped: 1 no assistant reply with content, 1 unknown role, 1 "messages" not '
        "a list)",
    ),
}


@pytest.mark.parametrize("case", list(CHAT_CASES))
def test_chat_jsonl(kit, toy_cli, tmp_path, case):
    blob, needle = CHAT_CASES[case]
    p = tmp_path / "broken.jsonl"
    p.write_bytes(blob)
    code, _, err = toy_cli(
        "train", "--recipe", "lora", "--model", kit["good"], "--data", p, "--out", tmp_path / "r"
    )
    last = err.strip().splitlines()[-1] if err.strip() else ""
    assert code == 2 and "broken.jsonl" in last and needle in last and "Traceback" not in err
    assert NOTHING in last
    # Warnings name each bad line; the final error is one line.
    assert not (tmp_path / "r").exists()


def test_chat_jsonl_strict_stops_at_the_first_bad_line(kit, toy_cli, tmp_path):
    p = tmp_path / "mixed.jsonl"
    p.write_bytes(kit["chat"].read_bytes() + b"{broken\n")
    code, _, err = toy_cli(
        "train",
        "--recipe",
        "lora",
        "--model",
        kit["good"],
        "--data",
        p,
        "--strict",
        "--out",
        tmp_path / "r",
    )
    check_one_line(code, err, "mixed.jsonl:11")


def test_not_chat_jsonl_at_all_is_refused_in_one_line(kit, toy_cli, tmp_path):
    # Before: 500 "not valid JSON" warnings, then the error; then 5 warnings and the error.
    p = tmp_path / "notes.txt"
    p.write_text("".join(f"a note, line {i}\n" for i in range(500)))
    code, _, err = toy_cli(
        "train", "--recipe", "lora", "--model", kit["good"], "--data", p, "--out", tmp_path / "r"
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert (
        "notes.txt does not look like training JSONL: none of its first 50 lines is an example"
        " (line 1: not valid JSON" in lines[0]
    )
    assert not (tmp_path / "r").exists()


def test_a_token_file_given_as_data_is_named_as_one(kit, toy_cli, tmp_path):
    from toy.data.tokens import write_tokens

    p = tmp_path / "c.bin"
    write_tokens(p, list(range(64)) * 4, 64)
    code, _, err = toy_cli(
        "train", "--recipe", "lora", "--model", kit["good"], "--data", p, "--out", tmp_path / "r"
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "c.bin is a token file from `toy prep`, not JSONL: give the JSONL file" in lines[0]
    assert not (tmp_path / "r").exists()


def test_bad_lines_before_the_first_example_are_still_warned_in_order(tmp_path):
    from toy.data.chat import read_chat_jsonl

    p = tmp_path / "d.jsonl"
    good = '{"prompt": "a", "completion": "b"}\n'
    p.write_text("not json\n{}\n" + good + "also bad\n" + good)
    said: list[str] = []
    chat = read_chat_jsonl(p, warn=said.append)
    assert len(chat.examples) == 2 and chat.lines == [3, 5]
    assert [s.split(": ")[0] for s in said] == [f"{p}:1", f"{p}:2", f"{p}:4"]


# ---- chat templates: one conversation the template cannot render is skipped, as a bad line is

REJECT_SYSTEM = (
    "{% for m in messages %}{% if m.role == 'system' %}"
    "{{ raise_exception('no system role') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
Q, A = (
    {"role": "user", "content": "Who is there?"},
    {"role": "assistant", "content": "Nay, answer me."},
)
SYSTEM, HELLO = (
    {"role": "system", "content": "Be brief."},
    {"role": "assistant", "content": "Well met."},
)


def _model_with_template(kit, tmp_path, template) -> Path:
    return write_llama_gguf(tmp_path / "tpl.gguf", kit["model"], kit["tok"], chat_template=template)


def _chat_file(tmp_path, *convs) -> Path:
    p = tmp_path / "c.jsonl"
    p.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    return p


@pytest.mark.parametrize(
    "template,bad,needle",
    [
        (REJECT_SYSTEM, [SYSTEM, Q, A], "chat template rejected the conversation: no system role"),
        # SmolLM2's default system prompt, before a chat that opens with the assistant: not
        # prefix-stable.
        (SMOLLM2, [HELLO, Q, A], "chat template is not prefix-stable at message 0"),
    ],
    ids=["raise_exception", "smollm2 opening reply"],
)
def test_a_conversation_the_template_cannot_render_is_skipped(
    kit, toy_cli, tmp_path, template, bad, needle
):
    model = _model_with_template(kit, tmp_path, template)
    data = _chat_file(tmp_path, [Q, A], bad, [Q, A])
    args = (
        "train",
        "--recipe",
        "lora",
        "--model",
        model,
        "--data",
        data,
        "--steps",
        "1",
        "--seq-len",
        "128",
    )
    code, out, err = toy_cli(*args, "--out", tmp_path / "r")
    assert code == 0, err
    assert f"warning: {data}:2: {needle}" in err and "conversation skipped" in err
    assert f"{data}: skipped 1 conversation the chat template cannot render" in out
    code, _, err = toy_cli(*args, "--strict", "--out", tmp_path / "strict")
    check_one_line(code, err, f"{data}:2: {needle}", "--strict")
    assert not (tmp_path / "strict").exists()


@pytest.mark.parametrize(
    "template,needle",
    [
        ("{% for m in messages %}{{ m.content }}", "syntax error"),
        ("{{ ''.__class__.__mro__ }}", "refused by the sandbox"),
        ("{{ raise_exception('not today') }}", "renders none of all 3 conversations in"),
    ],
    ids=["syntax", "sandbox", "rejects all"],
)
def test_a_template_that_renders_nothing_is_one_error(kit, toy_cli, tmp_path, template, needle):
    model = _model_with_template(kit, tmp_path, template)
    data = _chat_file(tmp_path, [Q, A], [SYSTEM, Q, A], [Q, A])
    code, _, err = toy_cli(
        "train", "--recipe", "lora", "--model", model, "--data", data, "--out", tmp_path / "r"
    )
    check_one_line(code, err, "tpl.gguf", needle)  # no warning per conversation
    assert not (tmp_path / "r").exists()


# ---- adapter directories


def test_adapter_run_directory_without_final(kit, toy_cli, tmp_path):
    run = tmp_path / "unfinished"
    (run / "checkpoints").mkdir(parents=True)
    (run / "run.json").write_text("{}")
    for argv in (
        ["infer", "--model", kit["good"], "--adapter", run, "--prompt", "x"],
        ["export", run, "--format", "peft"],
    ):
        code, _, err = toy_cli(*argv)
        check_one_line(
            code,
            err,
            "unfinished: has no final/ yet (the run did not finish)",
            "toy train --resume",
        )
    code, _, err = toy_cli(
        "infer", "--model", kit["good"], "--adapter", tmp_path / "nowhere", "--prompt", "x"
    )
    check_one_line(code, err, "--adapter", "nowhere: no such run or adapter directory")


# ---- conflicting flags

CONFLICTS = [
    (
        ["prep", "x.txt", "--out", "x.bin", "--vocab-size", "300", "--tokenizer", "t.json"],
        "conflict",
    ),
    (["train", "--recipe", "lora", "--data", "{chat}", "--corpus", "{chat}"], "conflict"),
    (
        ["train", "--recipe", "lora", "--data", "{chat}", "--steps", "3", "--epochs", "1"],
        "conflict",
    ),
    (["infer", "--model", "{gguf}", "--prompt", "a", "--chat", "b"], "conflict"),
    (["train", "--resume", "somewhere", "--run-id", "x"], "somewhere"),
]


@pytest.mark.parametrize(
    "argv,needle", CONFLICTS, ids=[" ".join(a[:3]) + "..." + a[-2] for a, _ in CONFLICTS]
)
def test_conflicting_flags(kit, toy_cli, tmp_path, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.txt").write_text("hello world " * 50)
    argv = [a.format(chat=kit["chat"], gguf=kit["good"]) for a in argv]
    code, _, err = toy_cli(*argv)
    check_one_line(code, err, needle)
