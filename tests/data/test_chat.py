"""Chat JSONL -> (ids, mask): templates in the sandbox, every assistant turn supervised,
length-grouped batches, padding, and the errors a user sees for a bad file."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.chat import SMOLLM2  # noqa: F401

from toy.data.chat import (
    ConversationError,
    encode_chat,
    pad_batch,
    read_chat_jsonl,
    render_template,
)
from toy.errors import InputError, ToyError
from toy.tokenizer import train_bpe

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy? Answer with café émoji 🙂."},
    {"role": "assistant", "content": " Rome, naturally 🙂"},
]


@pytest.fixture(scope="module")
def tok():
    texts = [
        "What is the capital of France? Paris. And of Italy? Rome, naturally.",
        "You are terse. You are a helpful AI assistant named SmolLM, trained by Hugging Face",
        "system user assistant",
    ] * 4
    t = train_bpe(texts, vocab_size=300)
    t.add_special_tokens(
        ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    )
    return t


def supervised_runs(tok, ids, mask) -> list[str]:
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


@pytest.mark.parametrize("template", [CHATML, SMOLLM2], ids=["chatml", "smollm2"])
def test_every_assistant_turn_supervised(tok, template):
    ids, mask = encode_chat(tok, template, CONV, max_len=1024, bos_token="", eos_token="<|im_end|>")
    assert len(ids) == len(mask)
    text = render_template(template, CONV, False, "", "<|im_end|>")
    assert (
        ids == tok.encode(text, add_special_tokens=False).ids
    )  # one tokenization of the whole text
    # Both turns, not only the last (earlier replies must be supervised too), each with its
    # end-of-turn token.
    assert supervised_runs(tok, ids, mask) == ["Paris.<|im_end|>", " Rome, naturally 🙂<|im_end|>"]
    # The newline after <|im_end|> and the assistant header are not targets.
    im_end, im_start = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|im_start|>")
    ends = [t for t in range(len(ids)) if ids[t] == im_end]
    assert [mask[t] for t in ends] == [0] * (len(ends) - 3) + [
        1,
        0,
        1,
    ]  # ..., assistant, user, assistant
    assert all(mask[t + 1] == 0 for t in ends if t + 1 < len(ids))  # the "\n" after <|im_end|>
    assert all(mask[t] == 0 for t in range(len(ids)) if ids[t] == im_start)
    assert mask[0] == 0


def test_llama3_style_template(tok):
    # No newline after the end-of-turn token, a BOS from the template, a two-newline header.
    tpl = (
        "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
        "'<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    )
    ids, mask = encode_chat(
        tok, tpl, CONV, max_len=1024, bos_token="<|endoftext|>", eos_token="<|eot_id|>"
    )
    assert ids[0] == tok.token_to_id("<|endoftext|>") and mask[0] == 0
    assert supervised_runs(tok, ids, mask) == ["Paris.<|eot_id|>", " Rome, naturally 🙂<|eot_id|>"]


def test_no_system_prompt_default_inserted(tok):
    conv = CONV[1:3]
    ids, mask = encode_chat(tok, SMOLLM2, conv, max_len=1024, bos_token="", eos_token="<|im_end|>")
    assert "You are a helpful AI" in tok.decode(ids, skip_special_tokens=False)
    assert supervised_runs(tok, ids, mask) == ["Paris.<|im_end|>"]


def test_truncation(tok):
    full_ids, full_mask = encode_chat(tok, CHATML, CONV, max_len=10_000, bos_token="", eos_token="")
    for n in (1, 7, len(full_ids) - 3, len(full_ids), len(full_ids) + 5):
        ids, mask = encode_chat(tok, CHATML, CONV, max_len=n, bos_token="", eos_token="")
        assert ids == full_ids[:n] and mask == full_mask[:n]
    ids, mask = encode_chat(tok, CHATML, CONV, max_len=5, bos_token="", eos_token="")
    assert sum(mask) == 0  # prompt only: the caller decides to skip such samples


def test_template_not_prefix_stable(tok):
    # Renders a closing marker only when the conversation ends: earlier prefixes differ.
    bad = CHATML + "{% if not add_generation_prompt %}<END>{% endif %}"
    with pytest.raises(InputError, match="not prefix-stable at message 2"):
        encode_chat(tok, bad, CONV, max_len=100, bos_token="", eos_token="")


def test_bos_and_raise_exception():
    tpl = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}"
        "{% endfor %}"
    )
    assert (
        render_template(tpl, [{"role": "user", "content": "hi"}], False, "<s>", "</s>") == "<s>hi"
    )
    with pytest.raises(InputError, match="rejected the conversation: System role not supported"):
        render_template(tpl, CONV, False, "<s>", "</s>")


def test_trim_blocks_like_hf():
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indent before one.
    tpl = (
        "{% for m in messages %}\n    {% if true %}{{ m['content'] }}\n    {% endif %}\n"
        "{% endfor %}"
    )
    assert (
        render_template(tpl, CONV[:2], False, "", "")
        == "You are terse.\nWhat is the capital of France?\n"
    )


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.popen('echo pwned').read() }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{% set x = messages.append({'role': 'user'}) %}",
        "{{ self._TemplateReference__context }}",
    ],
)
def test_sandbox_escape_fails_safely(template):
    with pytest.raises(InputError) as e:
        render_template(template, CONV, False, "", "")
    assert "\n" not in str(e.value)
    assert "pwned" not in str(e.value)


def test_template_syntax_error_names_line():
    with pytest.raises(InputError, match="chat template line 2: syntax error"):
        render_template("ok\n{% for m in messages %}", CONV, False, "", "")
    with pytest.raises(InputError, match="failed to render"):
        render_template("{{ messages[0]['content'] + 1 }}", CONV, False, "", "")


def test_what_one_conversation_cannot_render_is_told_apart_from_a_broken_template(tok):
    """A ConversationError concerns one conversation (the recipe skips it); any other
    InputError is the template's own fault and would hit every conversation."""
    opens_with_reply = [
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Hi."},
    ]
    rejecting = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        + CHATML
    )
    for template, conv in [
        (SMOLLM2, opens_with_reply),  # the default system prompt breaks prefix-stability
        (rejecting, CONV),
        ("{{ messages[0]['content'] + 1 }}", CONV),
    ]:  # fails at run time on this data
        with pytest.raises(ConversationError):
            encode_chat(tok, template, conv, max_len=1024, bos_token="", eos_token="")
    encode_chat(
        tok, rejecting, CONV[1:], max_len=1024, bos_token="", eos_token=""
    )  # the others still render
    for template in ("{% for m in messages %}", "{{ ''.__class__.__mro__ }}"):
        with pytest.raises(InputError) as e:
            encode_chat(tok, template, CONV, max_len=1024, bos_token="", eos_token="")
        assert not isinstance(e.value, ConversationError)


# --------------------------------------------------------------------------- JSONL


def write_lines(path, lines):
    path.write_bytes(b"".join((l if isinstance(l, bytes) else l.encode()) + b"\n" for l in lines))
    return path


GOOD = json.dumps({"messages": CONV[1:3]})


def test_jsonl_skips_and_counts(tmp_path):
    p = write_lines(
        tmp_path / "chat.jsonl",
        [
            "# a comment",
            "",
            GOOD,
            "   ",
            b"\xff\xfe\x00garbage\x80",  # 5: binary
            "{not json",  # 6
            json.dumps({"txt": "hello"}),  # 7: wrong schema
            json.dumps({"messages": [{"role": "robot", "content": "x"}]}),  # 8: unknown role
            json.dumps({"messages": []}),  # 9: empty
            json.dumps({"messages": [{"role": "user", "content": "hi"}]}),  # 10: no assistant
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": 3},
                        {"role": "assistant", "content": "x"},
                    ]
                }
            ),  # 11
            json.dumps([1, 2]),  # 12
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": " "},
                    ]
                }
            ),  # 13
            json.dumps({"messages": CONV, "id": 7}),
        ],
    )
    warnings: list[str] = []
    chat = read_chat_jsonl(p, strict=False, warn=warnings.append)
    assert chat.n_skipped == 9 and len(chat.conversations) == 2
    assert chat.conversations[0] == CONV[1:3] and chat.conversations[1] == CONV
    assert chat.lines == [3, 14]  # each conversation keeps its line, for later warnings
    # The first five bad lines one by one, then one line for the rest.
    assert len(warnings) == 6 and [w.split(":")[1] for w in warnings[:5]] == [
        "5",
        "6",
        "7",
        "8",
        "9",
    ]
    assert all(w.startswith(str(p) + ":") and "\n" not in w for w in warnings)
    assert "not UTF-8" in warnings[0] and "not valid JSON" in warnings[1]
    assert 'no "messages", "prompt"/"completion" or "text" key (keys: txt)' in warnings[2]
    assert "unknown role 'robot'" in warnings[3]
    assert "is empty" in warnings[4]
    assert warnings[5].startswith(f"{p}: ... and 4 more invalid lines (")
    assert (
        chat.skipped["no assistant reply with content"] == 2
    )  # no assistant turn, or only an empty one


# One check of a {"role", "content"} message list (data/chat.py check_messages), one wording a
# problem, in the chat, pair and prompt readers: (messages, reason counted, detail; KEY is the
# line's key that holds the list).
BAD_MESSAGES = [
    ("hello", '"KEY" not a list', '"KEY" must be a list of {"role", "content"} messages, got str'),
    ([], 'empty "KEY"', '"KEY" is empty; give at least one {"role", "content"} message'),
    ([1], "message not an object", 'KEY[0] must be a {"role", "content"} object, got int'),
    (
        [{"role": "bot", "content": "x"}],
        "unknown role",
        "KEY[0] has unknown role 'bot' (use one of: system, user, assistant)",
    ),
    ([{"role": "user"}], "content not a string", 'KEY[0] "content" must be a string, got NoneType'),
]


@pytest.mark.parametrize(
    "msgs,reason,detail", BAD_MESSAGES, ids=["list", "empty", "object", "role", "content"]
)
def test_one_message_check_one_wording_in_every_reader(tmp_path, msgs, reason, detail):
    from toy.data.preference import parse_pair, read_pairs
    from toy.data.prompts import read_prompts

    user = [{"role": "user", "content": "Who is there?"}]
    # Chat JSONL: counted by the reason, warned as FILE:LINE: detail.
    p = write_lines(tmp_path / "c.jsonl", [GOOD, json.dumps({"messages": msgs})])
    warnings: list[str] = []
    chat = read_chat_jsonl(p, strict=False, warn=warnings.append)
    key = "messages"
    assert dict(chat.skipped) == {reason.replace("KEY", key): 1}
    assert warnings == [f"{p}:2: {detail.replace('KEY', key)}; line skipped"]
    # A preference pair's answers: the same reason and detail, naming "chosen".
    bad = {"prompt": user, "chosen": msgs, "rejected": [{"role": "assistant", "content": "No."}]}
    key = "chosen"
    assert parse_pair(bad) == (None, reason.replace("KEY", key), detail.replace("KEY", key))
    good = {"prompt": "Who?", "chosen": "Me.", "rejected": "None."}
    f = write_lines(tmp_path / "pairs.jsonl", [json.dumps(good), json.dumps(bad)])
    pf = read_pairs(f)
    assert dict(pf.skipped) == {reason.replace("KEY", key): 1}
    assert pf.first == {reason.replace("KEY", key): 2}
    # A GRPO prompt's messages (a string or an empty list is a prompt of another kind).
    if isinstance(msgs, list) and msgs:
        f = write_lines(
            tmp_path / "prompts.jsonl", ['{"prompt": "ok"}', json.dumps({"prompt": msgs})]
        )
        assert dict(read_prompts(f).skipped) == {reason: 1}
        with pytest.raises(InputError) as e:
            read_prompts(f, strict=True)
        assert str(e.value).startswith(f"{f}:2: {detail.replace('KEY', 'prompt')}; each line")


def test_jsonl_default_warns_on_stderr(tmp_path, capsys):
    p = write_lines(tmp_path / "c.jsonl", [GOOD, "{oops"])
    chat = read_chat_jsonl(p, strict=False)
    assert (len(chat.conversations), chat.n_skipped) == (1, 1)
    assert f"{p}:2: not valid JSON" in capsys.readouterr().err


def test_jsonl_strict(tmp_path):
    p = write_lines(
        tmp_path / "c.jsonl",
        [GOOD, GOOD, json.dumps({"messages": [{"role": "bot", "content": ""}]}), "{"],
    )
    with pytest.raises(InputError, match=rf"{p}:3: messages\[0\] has unknown role 'bot'"):
        read_chat_jsonl(p, strict=True)


def test_jsonl_empty_missing_all_invalid(tmp_path):
    with pytest.raises(
        InputError, match="no example to learn from in .* only blank lines and comments"
    ):
        read_chat_jsonl(write_lines(tmp_path / "e.jsonl", ["", "# only comments"]), strict=False)
    (tmp_path / "z.jsonl").write_bytes(b"")
    with pytest.raises(InputError, match="no example to learn from"):
        read_chat_jsonl(tmp_path / "z.jsonl", strict=False)
    with pytest.raises(
        InputError, match=r"\(2 lines skipped: 1 not valid JSON, 1 not a JSON object\); each line"
    ):
        read_chat_jsonl(
            write_lines(tmp_path / "bad.jsonl", ["{", "[]"]), strict=False, warn=lambda m: None
        )
    with pytest.raises(InputError, match="no such file"):
        read_chat_jsonl(tmp_path / "missing.jsonl", strict=False)
    with pytest.raises(InputError, match="is a directory"):
        read_chat_jsonl(tmp_path, strict=False)
    assert issubclass(InputError, ToyError)


def test_jsonl_nothing_to_learn(tmp_path):
    """An empty reply, an unknown role, messages that are not a list: nothing to train on.
    (Before, the empty reply was kept and trained on: it supervised one <|im_end|>.)"""
    p = write_lines(
        tmp_path / "it.jsonl",
        [
            json.dumps({"messages": [{"role": "assistant", "content": ""}]}),
            json.dumps(
                {
                    "messages": [
                        {"role": "wizard", "content": "hi"},
                        {"role": "assistant", "content": "x"},
                    ]
                }
            ),
            json.dumps({"messages": "hello"}),
        ],
    )
    with pytest.raises(InputError) as e:
        read_chat_jsonl(p, warn=lambda m: None)
    assert str(e.value).startswith(
        f"no example to learn from in {p} (3 lines skipped: "
        '1 no assistant reply with content, 1 unknown role, 1 "messages" not a list)'
    )


def test_jsonl_a_wrong_kind_of_file_stops_early(tmp_path):
    # 500 lines of prose: one error at line 50, not 500 warnings (nor 5 warnings before it).
    p = tmp_path / "notes.txt"
    p.write_text("".join(f"note number {i}\n" for i in range(500)))
    warnings: list[str] = []
    with pytest.raises(InputError) as e:
        read_chat_jsonl(p, warn=warnings.append)
    assert warnings == []
    assert str(e.value).startswith(
        f"{p} does not look like training JSONL: none of its first 50 lines is an example "
        "(line 1: not valid JSON (Expecting value at column 1)); each line must be one of "
        '{"messages": '
    )
    # One good conversation among many bad lines is chat JSONL with bad lines: read to the end.
    p.write_text(GOOD + "\n" + "".join(f"note number {i}\n" for i in range(500)))
    warnings.clear()
    chat = read_chat_jsonl(p, warn=warnings.append)
    assert len(chat.conversations) == 1 and chat.n_skipped == 500
    assert len(warnings) == 6 and "... and 495 more invalid lines" in warnings[-1]


def test_jsonl_bom_and_crlf(tmp_path):
    p = tmp_path / "w.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + GOOD.encode() + b"\r\n" + GOOD.encode() + b"\r\n")
    chat = read_chat_jsonl(p, strict=True)
    assert (len(chat.conversations), chat.n_skipped) == (2, 0)


# --------------------------------------------------------------------------- padding


def sample(n: int, start: int) -> tuple[list[int], list[int]]:
    return list(range(start, start + n)), [1] * n


def test_pad_batch():
    b = pad_batch([sample(3, 10), sample(5, 20)], pad_id=9)
    assert b["ids"].tolist() == [[10, 11, 12, 9, 9], [20, 21, 22, 23, 24]]
    assert b["mask"].tolist() == [[1, 1, 1, 0, 0], [1] * 5]
    b = pad_batch([sample(3, 10), sample(5, 20)], pad_id=9, seq_len=4)
    assert b["ids"].shape == (2, 4) and b["mask"][1].tolist() == [1] * 4


# --------------------------------------------------------------------------- length-grouped batches


def test_length_batches_cover_every_sample_within_the_budget_and_keep_their_count():
    from toy.data.chat import length_batches

    rng = np.random.default_rng(3)
    lengths = rng.integers(5, 300, size=237).tolist() + [600]  # one longer than the budget
    counts = set()
    for epoch in range(4):
        batches = length_batches(lengths, budget=512, seed=0, epoch=epoch)
        flat = sorted(i for b in batches for i in b)
        assert flat == list(range(len(lengths)))  # each sample once per epoch
        for b in batches:
            padded = len(b) * max(lengths[i] for i in b)
            assert padded <= 512 or len(b) == 1, (b, padded)
        counts.add(len(batches))
        assert batches == length_batches(lengths, budget=512, seed=0, epoch=epoch)  # pure function
    assert len(counts) == 1  # --epochs can count steps before training
    a, b = length_batches(lengths, 512, 0, 0), length_batches(lengths, 512, 0, 1)
    assert a != b  # a new epoch regroups and reorders
    # Grouping by length keeps padding low: under 15% of the padded tokens here.
    padded = sum(len(b) * max(lengths[i] for i in b) for b in a)
    assert sum(lengths) / padded > 0.85


def test_jsonl_from_a_pipe_is_read(tmp_path):
    """--data <(...): the token-file check peeks at the start, and a pipe cannot seek back."""
    import os

    r, w = os.pipe()
    os.write(w, b'{"prompt": "a", "completion": "b"}\n' * 3)
    os.close(w)
    try:
        assert len(read_chat_jsonl(f"/dev/fd/{r}").examples) == 3
    finally:
        os.close(r)
