"""Third review, the inputs (items 3, 5, 11, 12): a huge preference prompt is cut by
characters before it is tokenized (the same tokens kept, memory bounded by --max-seq-len);
a lone surrogate escape in a data line is a counted skip and in `toy infer`'s text one
line and exit 2; a pair whose answers a `| trim` template renders alike says so; a pair
with an empty prompt and no BOS, whose answers' first tokens nothing predicts, is skipped
with that reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.gguf_fixtures import tiny_model, write_llama_gguf  # noqa: E402

from toy.data.chat import BUILTIN_TEMPLATES, window_chars  # noqa: E402
from toy.data.preference import (  # noqa: E402
    TOO_LONG,
    encode_answer,
    encode_pair,
    fit,
    parse_pair,
)
from toy.data.prep import bundled_text_paths  # noqa: E402
from toy.formats.base_readers import read_base  # noqa: E402
from toy.tokenizer import train_bpe  # noqa: E402

TEXT = bundled_text_paths()[0].read_text()[:30000]
CHATML = BUILTIN_TEMPLATES["chatml"]
TRIM = CHATML.replace("message['content']", "(message['content'] | trim)")
GOOD = [
    {"prompt": f"What news from {w}?", "chosen": f"Verily, none from {w}.", "rejected": "None."}
    for w in ("Rome", "Athens", "Sparta", "Troy")
]


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """Tiny llamas: one with ChatML markers and template, one whose template trims the
    contents, and one with neither template nor BOS (texts joined as they are)."""
    d = tmp_path_factory.mktemp("review3")
    tok = train_bpe([TEXT[i : i + 400] for i in range(0, len(TEXT), 400)], vocab_size=300)
    plain = tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True), max_seq_len=128)
    out = {"d": d, "plain": write_llama_gguf(d / "plain.gguf", plain, tok, chat_template="")}
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    model = tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True), max_seq_len=128)
    out["chatml"] = write_llama_gguf(d / "chatml.gguf", model, tok, chat_template=CHATML)
    out["trim"] = write_llama_gguf(d / "trim.gguf", model, tok, chat_template=TRIM)
    return out


def pairs_file(path: Path, *extra: str) -> Path:
    """Four good pairs (lines 1-4), then the `extra` lines as they are (line 5 on)."""
    path.write_text("".join(json.dumps(g) + "\n" for g in GOOD) + "".join(e + "\n" for e in extra))
    return path


def train(toy_cli, model, data, out, recipe="dpo"):
    return toy_cli(
        "train", "--recipe", recipe, "--model", model, "--data", data, "--out", out,
        "--steps", "1", "--max-seq-len", "64",
    )  # fmt: skip


def skipped_line(text: str) -> str:
    """The note that counts the skipped lines (stdout in text mode)."""
    return next(ln for ln in text.splitlines() if "skipped" in ln)


# ---- item 3: a huge prompt is cut by characters, keeping the tokens the token cut keeps


def words(n_chars: int) -> str:
    """Varied text (the bundled book's words) of at least n_chars characters."""
    return " ".join([TEXT] * (n_chars // len(TEXT) + 1))


def old_encode_pair(tok, template, pair, budget, bos, eos, eos_id):
    """What encode_pair gave before the character cut: both sequences tokenized whole, then
    cut to `budget` tokens by `fit` (the reference the cut must keep)."""
    seqs = [
        encode_answer(tok, template, pair, a, bos, eos, eos_id)
        for a in (pair.chosen, pair.rejected)
    ]
    (c, r), p_cut, a_cut = fit(seqs, budget)
    return None if c == r else (c, r, p_cut, a_cut)


@pytest.mark.parametrize("where", ["chatml", "plain"])
def test_a_long_prompt_keeps_the_tokens_it_kept_when_tokenized_whole(kit, where):
    b = read_base(kit[where], "float32")
    tok, s = b.tokenizer, b.special
    template = CHATML if where == "chatml" else None
    budget = 65
    chars = window_chars(tok, budget)
    long = words(3 * chars)  # cut by characters, yet far cheaper whole than the 8 MB
    user = {"role": "user", "content": long}
    cases = [
        {"prompt": "What news?", "chosen": "Verily, none.", "rejected": "None."},  # fits
        {"prompt": long, "chosen": "Verily, none.", "rejected": "None."},
        {"prompt": long, "chosen": long + " yes", "rejected": long[:-9] + " no"},  # both cut
        {"prompt": "Hm?", "chosen": "Verily, " + long, "rejected": long},
    ]
    if template is not None:  # a long system message before a long question
        system = {"role": "system", "content": long[: chars * 2]}
        a, r = {"role": "assistant", "content": "Aye."}, {"role": "assistant", "content": "Nay."}
        cases.append({"prompt": [system, user], "chosen": [a], "rejected": [r]})
    for obj in cases:
        pair, why, _ = parse_pair(obj)
        assert pair is not None, why
        args = (tok, template, pair, budget, b.token(s.bos), b.token(s.eos), s.eos)
        want = old_encode_pair(*args)
        if want is None:  # the pair the whole tokenization could not fit is still refused
            with pytest.raises(Exception, match=TOO_LONG):
                encode_pair(*args)
            continue
        e = encode_pair(*args)
        assert (e.chosen, e.rejected, e.prompt_cut, e.answer_cut) == want


def test_an_8_mb_prompt_costs_memory_by_max_seq_len_not_by_its_size(kit, tmp_path):
    """Issue: one 8 MB prompt line at --max-seq-len 64 held 2.16 GB (it was tokenized whole
    before the cut); now it is cut by characters first and costs what a small file does."""
    big = {"prompt": words(8 << 20), "chosen": "Verily, none.", "rejected": "None."}
    data = pairs_file(tmp_path / "big.jsonl", json.dumps(big))
    assert data.stat().st_size > 8 << 20
    argv = [
        "train", "--recipe", "dpo", "--model", kit["chatml"], "--data", data,
        "--out", tmp_path / "runs", "--steps", "1", "--max-seq-len", "64",
    ]  # fmt: skip
    # The child reports its own peak resident memory (KiB) on its last line: VmHWM, its
    # address space's high-water mark. Not ru_maxrss: Linux carries the forking parent's
    # peak across exec into it (a pytest worker at 5 GB made a small child read 5.7 GB).
    code = (
        "import sys\nfrom toy.cli.main import main\n"
        "code = main(sys.argv[1:])\n"
        "hwm = [x for x in open('/proc/self/status') if x.startswith('VmHWM')][0]\n"
        "print(hwm.split()[1], file=sys.stderr)\n"
        "sys.exit(code)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, *map(str, argv)], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr
    assert "to fit --max-seq-len 64: 1 prompt cut from the left" in r.stdout + r.stderr
    peak_mb = int(r.stderr.strip().splitlines()[-1]) / 1024
    assert peak_mb < 1024, peak_mb  # whole: 2.9 GB; cut: what the tiny run needs (~0.45 GB)


# ---- item 5: a lone surrogate escape


SURROGATE_PAIR = '{"prompt": "hi \\ud800 there", "chosen": "Aye, sir.", "rejected": "No."}'


@pytest.mark.parametrize("recipe", ["dpo", "orpo"])
def test_a_lone_surrogate_in_a_pair_is_a_counted_skip(kit, toy_cli, tmp_path, recipe):
    # A well-formed pair (an emoji's two halves) passes; the lone half is skipped.
    emoji = '{"prompt": "hi \\ud83d\\ude00", "chosen": "Aye, sir.", "rejected": "No."}'
    data = pairs_file(tmp_path / "s.jsonl", emoji, SURROGATE_PAIR)
    code, out, err = train(toy_cli, kit["chatml"], data, tmp_path / "r", recipe)
    assert code == 0, err
    assert "skipped 1 line: 1 lone surrogate escape (line 6)" in skipped_line(out)


def test_a_lone_surrogate_in_a_conversation_is_a_counted_skip(kit, toy_cli, tmp_path):
    conv = [{"role": "user", "content": "Who is there?"}, {"role": "assistant", "content": "Me."}]
    bad = '{"messages": [{"role": "user", "content": "hi \\udce9"}, ' + json.dumps(conv[1]) + "]}"
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"messages": conv}) + "\n" + bad + "\n")
    code, out, err = toy_cli(
        "train", "--recipe", "lora", "--model", kit["chatml"], "--data", data,
        "--out", tmp_path / "r", "--steps", "1", "--max-seq-len", "64",
    )  # fmt: skip
    assert code == 0, err
    assert f"{data}:2: \\udce9 is half of a UTF-16 surrogate pair" in err
    assert "skipped 1 invalid line (1 lone surrogate escape)" in out + err


def toy_bytes(*argv, stdin: bytes | None = None, **env) -> subprocess.CompletedProcess:
    """`python -m toy` with byte arguments: what a shell passes for $'caf\\xe9'."""
    args = [a if isinstance(a, bytes) else os.fsencode(str(a)) for a in argv]
    return subprocess.run(
        [sys.executable, "-m", "toy", *args],
        input=stdin,
        capture_output=True,
        timeout=300,
        env={**os.environ, **env},
    )


@pytest.mark.parametrize(
    "flags,stdin,env",
    [
        (["--prompt", b"caf\xe9"], None, {"PYTHONUTF8": "1"}),
        (["--chat", b"caf\xe9"], None, {"PYTHONUTF8": "1"}),
        (["--chat", "hi", "--system", b"caf\xe9"], None, {"PYTHONUTF8": "1"}),
        # stdin: UTF-8 mode reads it with surrogateescape, a UTF-8 locale strictly
        (["--chat", "-"], b"caf\xe9\n", {"PYTHONUTF8": "1"}),
        (["--chat", "-"], b"caf\xe9\n", {"PYTHONUTF8": "0", "LC_ALL": "C.UTF-8"}),
    ],
    ids=["prompt", "chat", "system", "chat-stdin-surrogateescape", "chat-stdin-strict"],
)
def test_infer_text_that_is_not_utf8_is_one_line_exit_2(kit, flags, stdin, env):
    r = toy_bytes("infer", "--model", kit["chatml"], *flags, stdin=stdin, **env)
    err = r.stderr.decode("utf-8", "replace")
    flag = next(f for f in flags if isinstance(f, bytes) or f == "-")
    name = "--chat -" if stdin else flags[flags.index(flag) - 1]
    assert r.returncode == 2 and err.count("\n") == 1, err
    assert f"{name}: not UTF-8 text (byte 0xe9)" in err and "UTF-8" in err.split(";")[1]


@pytest.mark.parametrize(
    "env",
    [{"PYTHONUTF8": "1"}, {"PYTHONUTF8": "0", "LC_ALL": "C.UTF-8"}],
    ids=["surrogateescape", "strict"],
)
def test_an_interactive_line_that_is_not_utf8_is_asked_again(kit, env):
    """A chat session on the terminal: a line that is not UTF-8 is refused in one line and
    the session goes on with the next one (it used to end in an internal error)."""
    r = toy_bytes(
        "infer", "--model", kit["chatml"], "--max-new-tokens", "2", "--temperature", "0",
        stdin=b"caf\xe9\nhello\n", **env,
    )  # fmt: skip
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0 and "Traceback" not in err, err
    assert "your line: not UTF-8 text" in err and "type it again" in err, err
    assert "[2 tokens: first after" in err, err  # the next line was answered


# ---- item 11: answers the template renders alike


def test_answers_a_trim_template_renders_alike_say_so(kit, toy_cli, tmp_path):
    same = json.dumps({"prompt": "Well?", "chosen": "Yes", "rejected": "Yes "})
    data = pairs_file(tmp_path / "t.jsonl", same)
    code, out, err = train(toy_cli, kit["trim"], data, tmp_path / "r")
    assert code == 0, err
    line = skipped_line(out)
    assert "1 chosen and rejected render the same (line 5)" in line
    assert "max-seq-len" not in line


# ---- item 12: an empty prompt with no BOS


def test_an_empty_prompt_with_no_bos_is_skipped_saying_why(kit, toy_cli, tmp_path):
    empty = json.dumps({"prompt": "", "chosen": "Yes", "rejected": "No"})
    data = pairs_file(tmp_path / "e.jsonl", empty)
    code, out, err = train(toy_cli, kit["plain"], data, tmp_path / "r", "orpo")
    assert code == 0, err
    assert "1 empty prompt and no BOS" in skipped_line(out) and "(line 5)" in skipped_line(out)
    # With a template the prompt's turn markers come before the answer: the pair is kept.
    code, out, err = train(toy_cli, kit["chatml"], data, tmp_path / "t", "orpo")
    assert code == 0 and "skipped" not in out, out
