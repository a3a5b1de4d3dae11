"""The data formats users have, for `--data`: {"messages"} (with "tools"), {"prompt",
"completion"}, {"text"}, and a directory of train.jsonl / valid.jsonl. Masks are checked
token by token; each format trains through the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.gguf_fixtures import tiny_model, write_llama_gguf  # noqa: E402
from tokenizers import Tokenizer, processors

from toy.data.chat import Example, encode_example, read_chat_jsonl  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402
from toy.errors import InputError  # noqa: E402
from toy.tokenizer import train_bpe  # noqa: E402

CHATML = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
COMMON = [
    "--seq-len",
    "192",
    "--batch-size",
    "4",
    "--eval-batches",
    "2",
    "--lr",
    "1e-2",
    "--warmup",
    "0",
    "--steps",
    "8",
    "--json",
]


@pytest.fixture(scope="module")
def tok():
    text = bundled_text_paths()[0].read_text()[:40000]
    t = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    t.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return t


@pytest.fixture(scope="module")
def bases(tok, tmp_path_factory):
    """Two tiny GGUF bases: one with a chat template, one without (and no turn markers a
    built-in template could use: a vocabulary without <|im_start|> is a plain LM)."""
    d = tmp_path_factory.mktemp("formats")
    model = tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True), max_seq_len=256)
    with_tpl = write_llama_gguf(d / "chat.gguf", model, tok, chat_template=CHATML)
    plain_tok = train_bpe([bundled_text_paths()[1].read_text()[:20000]], vocab_size=300)
    plain = write_llama_gguf(
        d / "plain.gguf", tiny_model(vocab_size=300, max_seq_len=256), plain_tok, chat_template=""
    )
    return {"chat": with_tpl, "plain": plain, "dir": d}


def write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def supervised(tok, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)


# ------------------------------------------------------------------ masks, token by token


def test_prompt_completion_through_the_template(tok):
    ex = Example("prompt", prompt="Who is there?", completion="Nay, answer me.")
    ids, mask = encode_example(tok, CHATML, ex, 200, "", "", tok.token_to_id("<|im_end|>"))
    text = tok.decode(ids, skip_special_tokens=False)
    assert text == (
        "<|im_start|>user\nWho is there?<|im_end|>\n"
        "<|im_start|>assistant\nNay, answer me.<|im_end|>\n"
    )
    assert (
        supervised(tok, ids, mask) == "Nay, answer me.<|im_end|>"
    )  # the reply and its end, nothing else


def test_prompt_completion_joined_without_a_template(tok):
    eos = tok.token_to_id("<|endoftext|>")
    ex = Example("prompt", prompt="To be, or not", completion=" to be.")
    ids, mask = encode_example(tok, None, ex, 200, "", "", eos)
    p = tok.encode("To be, or not", add_special_tokens=False).ids
    c = tok.encode(" to be.", add_special_tokens=False).ids
    assert ids == p + c + [eos] and mask == [0] * len(p) + [1] * (len(c) + 1)


def test_text_supervises_every_token_and_ends_with_eos(tok):
    eos, bos = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_start|>")
    ex = Example("text", text="Now is the winter of our discontent")
    body = tok.encode(ex.text, add_special_tokens=False).ids
    ids, mask = encode_example(tok, None, ex, 200, "", "", eos)
    assert ids == body + [eos] and mask == [0] + [1] * len(body)  # nothing predicts the first token
    with_bos = Tokenizer.from_str(
        tok.to_str()
    )  # a tokenizer whose rules add BOS (a GGUF's add_bos_token)
    with_bos.post_processor = processors.TemplateProcessing(
        single=["<|im_start|>", "$A"], special_tokens=[("<|im_start|>", bos)]
    )
    ids, mask = encode_example(with_bos, None, ex, 200, "", "", eos)
    assert ids == [bos] + body + [eos] and mask == [0] + [1] * (len(body) + 1)


def test_tools_reach_the_template_and_every_assistant_turn_stays_supervised(tok):
    tools = [{"type": "function", "function": {"name": "ring_bell", "parameters": {}}}]
    ex = Example(
        "messages",
        messages=(
            {"role": "user", "content": "Knock?"},
            {"role": "assistant", "content": "Who's there?"},
            {"role": "user", "content": "Ring."},
            {"role": "assistant", "content": "Ding."},
        ),
        tools=tools,
    )
    ids, mask = encode_example(tok, CHATML, ex, 400, "", "", None)
    assert '"ring_bell"' in tok.decode(ids, skip_special_tokens=False)
    assert supervised(tok, ids, mask) == "Who's there?<|im_end|>Ding.<|im_end|>"


def test_a_file_that_mixes_formats_names_the_first_line_that_differs(tmp_path):
    p = write(
        tmp_path / "mix.jsonl",
        [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d"}, {"text": "e"}],
    )
    with pytest.raises(
        InputError,
        match=rf"{p}:3: a {{\"text\"}} document, in a file of "
        r"{\"prompt\", \"completion\"} pairs \(from line 1\)",
    ):
        read_chat_jsonl(p)


# ------------------------------------------------------------------ each trains, through the CLI


def _rows(kind: str, n: int = 30) -> list:
    lines = [
        line.strip()
        for line in bundled_text_paths()[2].read_text().splitlines()
        if len(line.strip()) > 20
    ]
    if kind == "prompt":
        return [{"prompt": lines[2 * i], "completion": " " + lines[2 * i + 1]} for i in range(n)]
    if kind == "text":
        return [{"text": " ".join(lines[3 * i : 3 * i + 3])} for i in range(n)]
    tools = [{"name": "exit"}]
    return [
        {
            "messages": [
                {"role": "user", "content": lines[2 * i]},
                {"role": "assistant", "content": lines[2 * i + 1]},
            ],
            "tools": tools,
        }
        for i in range(n)
    ]


def _train(toy_cli, base, data, out, *extra):
    code, out_text, err = toy_cli(
        "train", "--recipe", "lora", "--model", base, "--data", data, "--out", out, *COMMON, *extra
    )
    assert code == 0, err
    return json.loads(out_text), err


@pytest.mark.parametrize(
    "kind, base", [("prompt", "chat"), ("prompt", "plain"), ("text", "plain"), ("messages", "chat")]
)
def test_each_format_trains(kind, base, bases, toy_cli, tmp_path):
    data = write(tmp_path / f"{kind}.jsonl", _rows(kind))
    r, _ = _train(toy_cli, bases[base], data, tmp_path / "runs")
    val = [x["loss"] for x in r["val_losses"]]
    assert (
        len(r["losses"]) == 8 and val[-1] < val[0]
    )  # lr 1e-2 on a tiny model: the held-out loss falls
    run = json.loads((Path(r["run_dir"]) / "run.json").read_text())
    assert run["job"].get("data_format", "messages") == kind


def test_a_data_directory_uses_train_and_valid(bases, toy_cli, tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    write(d / "train.jsonl", _rows("prompt", 30))
    write(d / "valid.jsonl", _rows("prompt", 34)[30:])
    r, err = _train(toy_cli, bases["chat"], d, tmp_path / "runs")
    run = json.loads((Path(r["run_dir"]) / "run.json").read_text())
    assert (
        run["job"]["conversations"] == 30
    )  # nothing held out of train.jsonl: valid.jsonl is the held-out set
    assert run["job"]["val_data"] == str(d / "valid.jsonl") and len(r["val_losses"]) == 2
    code, _, err = toy_cli(
        "train",
        "--recipe",
        "lora",
        "--model",
        bases["chat"],
        "--data",
        tmp_path,
        "--out",
        tmp_path / "r2",
        *COMMON,
    )
    assert code == 2 and "holds train.jsonl" in err


def test_a_conversation_file_on_a_base_without_a_template_is_refused(bases, toy_cli, tmp_path):
    data = write(tmp_path / "c.jsonl", _rows("messages"))
    code, _, err = toy_cli(
        "train",
        "--recipe",
        "lora",
        "--model",
        bases["plain"],
        "--data",
        data,
        "--out",
        tmp_path / "r",
        *COMMON,
    )
    assert code == 2 and "has no chat template" in err and not (tmp_path / "r").exists()


# ------------------------------------------------------------------ one huge line (issue 32 item 7)


def _uncut(tok, template, ex, max_len, eos_id):
    """(ids, mask) as before strings were cut: everything tokenized whole."""
    from toy.data.chat import encode_chat
    from toy.tokenizer import encode_prompt

    if ex.kind == "text":
        ids = encode_prompt(tok, ex.text) + [eos_id]
        return ids[:max_len], ([0] + [1] * (len(ids) - 1))[:max_len]
    if ex.kind == "prompt" and template is None:
        p = encode_prompt(tok, ex.prompt)
        c = tok.encode(ex.completion, add_special_tokens=False).ids + [eos_id]
        return (p + c)[:max_len], ([0] * len(p) + [1] * len(c))[:max_len]
    msgs = ex.messages or (
        {"role": "user", "content": ex.prompt},
        {"role": "assistant", "content": ex.completion},
    )
    return encode_chat(tok, template, msgs, max_len, "", "<|im_end|>")


def test_a_huge_string_is_cut_to_what_the_window_uses(tok):
    """Cutting a string longer than the window can use changes no id and no mask bit of
    the window, for every format, and says how many strings it cut."""
    from toy.data.chat import window_chars

    words = bundled_text_paths()[0].read_text()[:20000]
    big = (words * 12)[:200_000]
    assert len(big) > window_chars(tok, 65)
    eos = tok.token_to_id("<|im_end|>")
    cases = [
        (None, Example("text", text=big)),
        (None, Example("prompt", prompt="Say:", completion=big)),
        (None, Example("prompt", prompt=big, completion="ok")),
        (CHATML, Example("prompt", prompt="Say:", completion=big)),
        (
            CHATML,
            Example(
                "messages",
                messages=(
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": big},
                    {"role": "user", "content": big},
                    {"role": "assistant", "content": "bye"},
                ),
            ),
        ),
    ]
    for template, ex in cases:
        for max_len in (65, 193):
            cut = []
            got = encode_example(tok, template, ex, max_len, "", "<|im_end|>", eos, cut)
            assert got == _uncut(tok, template, ex, max_len, eos), (ex.kind, max_len)
            assert [n for n, _ in cut] == [2 if ex.kind == "messages" else 1], cut


def test_one_20mb_text_line_costs_memory_by_the_window(bases, tmp_path):
    """A 20 MB {"text"} line with --max-seq-len 64 peaked at 3.2 GB, tokenized whole; now
    its peak is about that of a small file, and the run's notes say what was cut."""
    rows = _rows("text", 20)
    rows.insert(3, {"text": ("the cat sat on the mat. " * 900_000)[:20_000_000]})
    data = write(tmp_path / "big.jsonl", rows)
    wrapper = (
        "import resource, subprocess, sys; "
        "r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "sys.stderr.write(r.stdout + r.stderr); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024); "
        "sys.exit(r.returncode)"
    )
    argv = [sys.executable, "-m", "toy", "train", "--recipe", "lora", "--model", bases["plain"]]
    argv += ["--data", data, "--max-seq-len", "64", "--steps", "1", "--out", tmp_path / "runs"]
    p = subprocess.run(
        [sys.executable, "-c", wrapper, *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    peak_mb = int(p.stdout.split()[-1])
    assert peak_mb < 1200, f"peak {peak_mb} MB"
    assert "cut 1 string in 1 line to their first" in p.stderr, p.stderr
