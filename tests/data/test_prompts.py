"""GRPO prompt files (data/prompts.py): TRL's two forms, columns for the reward functions,
bad lines counted by reason with their first line, one form a file; and the seeded
arithmetic task `toy new` writes (data/arith.py)."""

from __future__ import annotations

import json
import re

import pytest

from toy.data.arith import make_arith
from toy.data.prompts import columns, no_prompts, read_prompts
from toy.data.rewards import accuracy
from toy.errors import InputError


def write(path, *lines) -> str:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def test_standard_prompts_and_their_columns(tmp_path):
    f = write(
        tmp_path / "p.jsonl",
        {"prompt": "What is 1 + 1?", "answer": "2", "level": 1},
        "# a comment, passed over",
        {"prompt": "What is 2 x 3?", "answer": "6", "completion": "six"},
    )
    pf = read_prompts(f)
    assert [p.text for p in pf.prompts] == ["What is 1 + 1?", "What is 2 x 3?"]
    assert pf.lines == [1, 3] and not pf.skipped and pf.conversational is False
    assert pf.prompts[0].chat == ({"role": "user", "content": "What is 1 + 1?"},)
    # As TRL passes dataset columns: every column, None where a line lacks it; TRL drops
    # a "completion" column from the reward arguments, and so does toy.
    assert columns(pf.prompts) == {"answer": ["2", "6"], "level": [1, None]}


def test_conversational_prompts(tmp_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?", "x": 1}]
    pf = read_prompts(write(tmp_path / "p.jsonl", {"prompt": msgs, "answer": "hello"}))
    (p,) = pf.prompts
    assert p.conversational and pf.conversational
    assert p.value == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
    ]
    p.value[0]["content"] = "edited"  # a reward function editing its argument changes nothing
    assert p.messages[0]["content"] == "Be brief."
    cols = columns(pf.prompts)
    cols["answer"][0] = "edited"
    assert columns(pf.prompts) == {"answer": ["hello"]}


def test_bad_lines_are_counted_by_reason_with_their_first_line(tmp_path):
    user = {"role": "user", "content": "Hi?"}
    f = write(
        tmp_path / "p.jsonl",
        {"prompt": "ok", "answer": "1"},  # 1
        "not json",  # 2
        "[1, 2]",  # 3
        {"question": "x"},  # 4
        {"prompt": ""},  # 5
        {"prompt": "   "},  # 6
        {"prompt": 7},  # 7
        {"prompt": None},  # 8
        {"prompt": []},  # 9
        {"prompt": [{"role": "robot", "content": "x"}]},  # 10
        {"prompt": [user, {"role": "assistant", "content": "Hello"}]},  # 11
        {"prompt": [{"role": "user", "content": 3}]},  # 12
        '{"prompt": "a \\ud800 b"}',  # 13
        {"prompt": "ok", "completions": "clash"},  # 14
        {"prompt": "ok too"},  # 15
    )
    pf = read_prompts(f)
    assert pf.lines == [1, 15]
    assert dict(pf.skipped) == {
        "not valid JSON": 1,
        "not a JSON object": 1,
        "no prompt": 1,
        "empty prompt": 3,
        "prompt not a string or messages": 2,
        "unknown role": 1,
        "bad messages": 1,
        "content not a string": 1,
        "lone surrogate escape": 1,
        "reserved column": 1,
    }
    assert pf.first["empty prompt"] == 5 and pf.first["unknown role"] == 10
    assert pf.first["bad messages"] == 11 and pf.first["content not a string"] == 12
    s = pf.summary()
    assert s.startswith("skipped 13 lines: ")
    assert "3 empty prompt (first line 5)" in s and "1 no prompt (line 4)" in s


def test_strict_stops_at_the_first_bad_line(tmp_path):
    f = write(tmp_path / "p.jsonl", {"prompt": "ok"}, {"prompt": 7})
    with pytest.raises(InputError) as e:
        read_prompts(f, strict=True)
    assert str(e.value).startswith(f"{f}:2: ") and "--strict" in str(e.value)
    assert "\n" not in str(e.value)


def test_one_form_a_file(tmp_path):
    f = write(
        tmp_path / "p.jsonl", {"prompt": "plain"}, {"prompt": [{"role": "user", "content": "x"}]}
    )
    with pytest.raises(InputError) as e:
        read_prompts(f)
    msg = str(e.value)
    assert msg.startswith(f"{f}:2: a list of messages, in a file of prompt strings (from line 1)")
    assert "split" in msg and "\n" not in msg


def test_no_prompts_names_the_file_and_the_form(tmp_path):
    f = write(tmp_path / "p.jsonl", {"question": "x"}, {"question": "y"})
    pf = read_prompts(f)
    assert pf.prompts == []
    msg = str(no_prompts(f, pf))
    assert str(f) in msg and "2 no prompt (first line 1)" in msg and '{"prompt": "..."' in msg
    assert "\n" not in msg
    empty = read_prompts(write(tmp_path / "e.jsonl", "# nothing"))
    assert "only blank lines and comments" in str(no_prompts(tmp_path / "e.jsonl", empty))
    with pytest.raises(InputError, match="no such file"):
        read_prompts(tmp_path / "missing.jsonl")


def test_arith_is_seeded_disjoint_correct_and_readable(tmp_path):
    a, b, c = (make_arith(tmp_path / d, 40, 10, seed=s) for d, s in (("a", 1), ("b", 1), ("c", 2)))
    assert (a / "train.jsonl").read_text() == (b / "train.jsonl").read_text()
    assert (a / "train.jsonl").read_text() != (c / "train.jsonl").read_text()
    train, valid = read_prompts(a / "train.jsonl"), read_prompts(a / "valid.jsonl")
    assert (len(train.prompts), len(valid.prompts)) == (40, 10)
    assert not {p.text for p in train.prompts} & {p.text for p in valid.prompts}
    ops = set()
    for p in train.prompts + valid.prompts:
        x, op, y = re.fullmatch(
            r"What is (\d+) ([-+x]) (\d+)\? Answer with the number only\.", p.text
        ).groups()
        ops.add(op)
        want = {"+": int(x) + int(y), "-": int(x) - int(y), "x": int(x) * int(y)}[op]
        assert p.columns["answer"] == str(want) and want >= 0
    assert ops == {"+", "-", "x"}
    # The answers are what the built-in accuracy reward reads.
    answers = columns(train.prompts)["answer"]
    assert accuracy([f"It is {a}." for a in answers], answer=answers) == [1.0] * 40
