"""GRPO reward functions (data/rewards.py): the built-ins, a user's reward file written for
TRL loaded by path, weights and None combined as TRL 1.16 combines them (checked against
TRL's own _calculate_rewards), and one-line errors naming the function and the sample."""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from toy.data.rewards import (
    DEFAULT_FORMAT,
    Logs,
    RewardError,
    State,
    accuracy,
    check_columns,
    final_answer,
    format_reward,
    length_reward,
    normalize,
    parse_reward,
    score,
)
from toy.errors import UsageError

# A reward file as TRL's GRPOTrainer docs write them: plain Python, TRL's signature.
TRL_FILE = textwrap.dedent(
    """
    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    def reward_len_chat(completions, **kwargs):
        return [-abs(20 - len(completion[0]["content"])) for completion in completions]

    def only_level_two(completions, level, **kwargs):
        return [1.0 if lv == 2 else None for lv in level]

    def sees(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **kw):
        log_extra("seen", [str(c) for c in completions])
        log_metric("step", trainer_state.global_step)
        return [float(len(ids)) for ids in completion_ids]

    async def slow_one(completions, **kwargs):
        return [1.0 for _ in completions]
    """
)


@pytest.fixture
def rfile(tmp_path):
    f = tmp_path / "my_rewards.py"
    f.write_text(TRL_FILE)
    return f


def test_accuracy_reads_the_answer_tag_else_the_last_number():
    comps = [
        "<think>6 x 7</think><answer> 42 </answer>",  # inside the tag, whitespace folded
        "17 + 25 = 42",  # no tag: the last number
        "It is 42.0.",  # number form: 42.0 == 42
        "That makes 1,000 in all",  # thousands grouped
        "The result is \u22123",  # U+2212 minus
        "<answer>41</answer> ... 42",  # the tag wins over a later number
        "25-8",  # "-8" would be a subtraction, not a negative: the last number is 8
        "  PARIS ",  # no number: the whole text, case and whitespace folded
        "no idea",
    ]
    answers = ["42", "42", "42", "1000", "-3", "41", "8", "paris", "7"]
    assert accuracy(comps, answer=answers) == [1.0] * 8 + [0.0]
    assert final_answer("first 3 then 4") == "4"
    # None where the sample has no answer: the function does not apply there.
    assert accuracy(["42", "42"], answer=["42", None]) == [1.0, None]
    # Conversational completions: one assistant message.
    chat = [[{"role": "assistant", "content": "= 12"}]]
    assert accuracy(chat, answer=[12]) == [1.0]


def test_format_default_and_custom():
    comps = [
        "<think>a\nb</think>\n<answer>4</answer>\n",  # surrounding whitespace allowed
        "<answer>4</answer>",  # no think part
        "<think>a</think><answer>4</answer> and more",  # not a full match
        "ANSWER: 4",
    ]
    assert format_reward(comps) == [1.0, 0.0, 0.0, 0.0]
    assert format_reward(comps, format_regex=r"ANSWER: \d+") == [0.0, 0.0, 0.0, 1.0]
    r = parse_reward("format:0.5", format_regex=r"<answer>.*</answer>")
    assert r.weight == 0.5 and r.fn(completions=comps) == [0.0, 1.0, 0.0, 0.0]
    with pytest.raises(RewardError, match="fix --format-regex"):
        parse_reward("format", format_regex="(")


def test_length_penalty():
    ids = [[1] * 10, [1] * 5, [], [1] * 20, [1] * 30]
    assert length_reward(ids, target_length=10) == [0.0, -0.5, -1.0, -1.0, -2.0]
    r = parse_reward("length", target_length=10)
    assert r.fn(completion_ids=ids[:2]) == [0.0, -0.5]


# ------------------------------------------------------------------ hostile completions

# One completion each, of what a policy can write in 64k characters: the built-ins must
# score each in milliseconds. Before the fix, "1e999999999" made Fraction compute
# 10**999999999 (minutes, in C, deaf to SIGTERM) and "<answer>" * 8000 took final_answer's
# regex 2 s, "</think><answer></answer>x" * 2500 the default format regex 0.5 s.
HOSTILE = """
N = 64_000
HOSTILE = {
    "huge exponent": "<answer>1e999999999</answer>",
    "huge negative exponent": "<answer>1e-999999999</answer>",
    "bare huge exponent": "= 1e999999999",
    "<answer> unclosed": "<answer>" * (N // 8),
    "</think><answer> unclosed": "</think><answer>" * (N // 16),
    "format almost": "<think>" + "</think><answer></answer>x" * (N // 26),
    "format no answer tag": "<think>" + "</think> " * (N // 9) + "</answer>",
    "60k digits": "<answer>" + "9" * 60_000 + "</answer>",
    "60k decimals": "<answer>0." + "1" * 60_000 + "</answer>",
    "60k digits untagged": "9" * 60_000,
    "grouped": "1" + ",000" * 15_000,
    "minus run": "-" * N + "1",
    "U+2212 run": "\u2212" * N,
    "comma run": "1," * (N // 2),
    "many numbers": " ".join(map(str, range(12_000)))[:N],
}
"""


def run_isolated(code: str, timeout: float = 60) -> dict:
    """`code`'s JSON printout, run in a fresh interpreter: a built-in that hangs (in C, where
    no signal reaches it) fails the test at `timeout` instead of hanging the suite."""
    try:
        r = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        r = None
    if r is None:
        pytest.fail(f"still running after {timeout} s: a built-in reward hangs")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_hostile_completions_score_in_milliseconds():
    code = HOSTILE + textwrap.dedent(
        """
        import json, time
        from toy.data.rewards import accuracy, format_reward, length_reward
        took = {}
        for name, text in HOSTILE.items():
            t = time.perf_counter()
            accuracy([text], answer=["42"])
            accuracy(["42"], answer=[text])  # an answer column as hostile
            accuracy([[{"role": "assistant", "content": text}]], answer=["1e999999998"])
            format_reward([text])
            length_reward([list(range(len(text)))])
            took[name] = time.perf_counter() - t
        print(json.dumps(took))
        """
    )
    took = run_isolated(code)
    # Each takes under 10 ms here; 2 s in all leaves room for a loaded 2-core CI machine.
    slow = {k: f"{v:.3f} s" for k, v in sorted(took.items(), key=lambda kv: -kv[1])[:3]}
    assert sum(took.values()) < 2.0, f"slowest: {slow}"


def test_a_huge_exponent_compares_as_text():
    code = textwrap.dedent(
        """
        import json
        from toy.data.rewards import accuracy
        tag = "<answer>1e999999999</answer>"
        print(json.dumps([
            accuracy([tag, tag, tag], answer=["1e999999999", "1E999999999", "1e999999998"]),
            accuracy(["<answer>1e-999999999</answer>"], answer=["0"]),
            accuracy(["<answer>1e5</answer>"], answer=["1e999999999"]),
        ]))
        """
    )
    assert run_isolated(code) == [[1.0, 1.0, 0.0], [0.0], [0.0]]


def test_numbers_compare_by_value_within_bounds():
    same = [
        ("42.0", "42"),
        ("4.2e1", "42"),
        ("4.2E+1", " 42 "),
        ("1,000", "1000"),
        ("\u22123", "-3"),
        ("2/6", "1/3"),
        ("5e-1", "0.5"),
        ("1e300", "1" + "0" * 300),  # 300-digit answers still compare by value
        ("1e-300", "0." + "0" * 299 + "1"),
        ("9" * 900 + ".0", "9" * 900),
        ("PARIS", "paris"),
    ]
    for a, b in same:
        assert normalize(a) == normalize(b), (a[:20], b[:20])
    assert normalize("41.99") != normalize("42") and normalize("1e300") != normalize("1e301")
    # Past the bounds a number is text (test_a_huge_exponent_compares_as_text has the
    # exponents that hang Fraction; these would not, so a regression fails here, not hangs).
    assert normalize("1e1001") == "1e1001" == normalize(" 1E1001 ")
    assert normalize("1e1001") != normalize("10e1000")
    assert normalize("1" * 1001) == "1" * 1001
    assert normalize("0/0") == "0/0"


def test_answer_tag_and_default_format_keep_their_regex_semantics():
    """final_answer and the default format check, rewritten to run in linear time, agree
    with the regexes they replace on every short arrangement of the tags."""
    parts = ["<answer>", "</answer>", "<think>", "</think>", " ", "7", "<", "x"]
    texts = ["".join(p) for n in range(5) for p in itertools.product(parts, repeat=n)]
    tag = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
    for t in texts:
        tags = tag.findall(t)
        if tags:
            assert final_answer(t) == tags[-1], t
    assert final_answer("<answer>a<answer>b</answer>") == "a<answer>b"
    assert final_answer("<answer>1</answer> 2</answer>") == "1"
    assert final_answer("<answer>1</answer><answer>2") == "1"
    same_regex = f"(?:{DEFAULT_FORMAT})"  # not the default's string: the regex path
    assert format_reward(texts) == format_reward(texts, format_regex=same_regex)
    assert sum(format_reward(texts)) > 0


def test_a_trl_reward_file_loads_by_path_and_scores(rfile):
    r = parse_reward(f"{rfile}:reward_len:2")
    assert (r.name, r.weight) == ("reward_len", 2.0)
    comps = ["x" * 20, "x" * 25]
    per, total = score([r], ["p1", "p2"], comps, [[1], [2]], {})
    assert per == [[0.0, -5.0]] and total == [0.0, -10.0]
    # Conversational prompts: completions reach the function as one assistant message.
    chat = parse_reward(f"{rfile}:reward_len_chat")
    prompts = [[{"role": "user", "content": "hi"}]] * 2
    per, _ = score([chat], prompts, comps, [[1], [2]], {})
    assert per == [[0.0, -5.0]]
    # The same file named twice is imported once.
    assert parse_reward(f"{rfile}:reward_len").fn is r.fn


def test_every_argument_trl_passes_reaches_the_function(rfile):
    r = parse_reward(f"{rfile}:sees")
    logs = Logs()
    per, _ = score([r], ["a", "b"], ["x", "y"], [[1, 2], [3]], {}, State(global_step=7), logs)
    assert per == [[2.0, 1.0]]
    assert logs.extra == {"seen": ["x", "y"]} and logs.metrics == {"step": [7]}
    assert score([parse_reward(f"{rfile}:slow_one")], ["a"], ["x"], [[1]], {})[0] == [[1.0]]


def _trl_total(per_func, weights):
    """TRL 1.16 _generate_and_score_completions, sum_then_normalize: the weighted nansum,
    and NaN for an unscorable row (every function returned None)."""
    rewards_per_func = torch.tensor(per_func, dtype=torch.float32).T
    w = torch.tensor(weights, dtype=torch.float32)
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * w.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    return rewards.tolist()


def test_weights_and_none_combine_as_trl(rfile):
    rs = [parse_reward("accuracy:2"), parse_reward(f"{rfile}:only_level_two:-0.5")]
    cols = {"answer": ["4", None, "4", None], "level": [1, 2, 2, 1]}
    per, total = score(rs, ["q"] * 4, ["4", "4", "5", "5"], [[1]] * 4, cols)
    assert [[v if v == v else None for v in row] for row in per] == [
        [1.0, None, 0.0, None],
        [None, 1.0, 1.0, None],
    ]
    want = _trl_total(per, [2.0, -0.5])
    assert total[:3] == pytest.approx(want[:3]) and total[:3] == [2.0, -0.5, -0.5]
    assert math.isnan(total[3]) and math.isnan(want[3])  # unscorable: NaN, not 0


def test_trl_calculate_rewards_gives_the_same_per_function_rewards(rfile):
    """TRL's own reward-calling code on a stand-in trainer (it needs no model for custom
    functions): the same functions, prompts and columns give the same rewards."""
    grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    from transformers import TrainerState

    rs = [
        parse_reward("accuracy:2"),
        parse_reward(f"{rfile}:reward_len_chat"),
        parse_reward(f"{rfile}:only_level_two"),
        parse_reward("length", target_length=4),
    ]
    prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    texts = ["it is 4", "<answer>5</answer>", "x" * 20]
    ids = [[1, 2, 3, 4], [5], [6] * 9]
    rows = [{"prompt": p, "answer": a, "level": lv} for p, a, lv in zip(prompts, "45 ", [1, 2, 2])]
    rows[2]["answer"] = None
    fake = SimpleNamespace(
        accelerator=SimpleNamespace(device="cpu", is_main_process=True),
        args=SimpleNamespace(report_to=[]),
        state=TrainerState(),
        reward_funcs=[r.fn for r in rs],
        reward_processing_classes=[None] * len(rs),
        reward_func_names=[r.name for r in rs],
        _log_completion_extra=lambda *a: None,
        _log_metric=lambda *a: None,
        environments=None,
    )
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    theirs = grpo.GRPOTrainer._calculate_rewards(fake, rows, prompts, completions, ids)
    cols = {"answer": [r["answer"] for r in rows], "level": [r["level"] for r in rows]}
    per, total = score(rs, prompts, texts, ids, cols)
    torch.testing.assert_close(torch.tensor(per, dtype=torch.float32).T, theirs, equal_nan=True)
    assert total == pytest.approx(_trl_total(per, [r.weight for r in rs]))


# ------------------------------------------------------------------ errors


def one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, UsageError) and e.value.exit_code == 2
    return msg


@pytest.mark.parametrize(
    "body, want",
    [
        (
            "def f(completions, **kw):\n    return [1 / (len(c) - 3) for c in completions]\n",
            r"raised ZeroDivisionError: division by zero \(bad\.py line 2\) on sample 1 "
            r"\(prompt 'second prompt'\)",
        ),
        ("def f(completions, **kw):\n    return [1.0]\n", "returned 1 rewards for 2 completions"),
        ("def f(completions, **kw):\n    return 1.0\n", "returned a float, not a list"),
        (
            "def f(completions, **kw):\n    return [0.0, float('nan')]\n",
            r"sample 1 \(prompt 'second prompt'\): returned nan, not a finite number",
        ),
        (
            "def f(completions, **kw):\n    return [0.0, 'high']\n",
            r"sample 1 \(prompt 'second prompt'\): returned 'high', not a finite number",
        ),
        ("def f(completions):\n    return [0.0, 0.0]\n", "unexpected keyword argument"),
    ],
)
def test_a_bad_function_is_one_line_naming_it_and_the_sample(tmp_path, body, want):
    f = tmp_path / "bad.py"
    f.write_text(body)
    r = parse_reward(f"{f}:f")
    with pytest.raises(RewardError) as e:
        score([r], ["first prompt", "second prompt"], ["abcd", "abc"], [[1], [2]], {})
    msg = one_line(e)
    assert msg.startswith(f"--reward {f}:f: ") and re.search(want, msg), msg


def test_bad_specs_are_one_line_naming_the_spec_and_the_fix(tmp_path, rfile):
    (tmp_path / "raises.py").write_text("import json\nraise RuntimeError('no GPU here\\nmore')\n")
    (tmp_path / "syntax.py").write_text("def f(:\n")
    (tmp_path / "notes.txt").write_text("")
    cases = {
        "nope": "no reward 'nope'; use a built-in (accuracy, format, length)",
        "accuracy:heavy": "weight 'heavy' is not a finite number",
        "accuracy:inf": "weight 'inf' is not a finite number",
        f"{tmp_path}/missing.py:f": "missing.py: no such file",
        f"{tmp_path}/notes.txt:f": "notes.txt is not a Python file",
        f"{rfile}": "names no function; name it: ",
        f"{rfile}:nothing": "no 'nothing' in",
        f"{rfile}:TRL_FILE": "no 'TRL_FILE'",
        f"{tmp_path}/raises.py:f": "importing raises.py raised RuntimeError: no GPU here "
        "(raises.py line 2)",
        f"{tmp_path}/syntax.py:f": "syntax.py:1: invalid syntax",
    }
    for spec, want in cases.items():
        with pytest.raises(RewardError) as e:
            parse_reward(spec)
        msg = one_line(e)
        assert msg.startswith(f"--reward {spec}: ") and want in msg, msg
    (tmp_path / "consts.py").write_text("LIMIT = 3\n")
    with pytest.raises(RewardError) as e:
        parse_reward(f"{tmp_path}/consts.py:LIMIT")
    assert "LIMIT in" in one_line(e) and "is not a function but a int" in str(e.value)


def test_accuracy_without_an_answer_column(rfile):
    r = parse_reward("accuracy")
    with pytest.raises(UsageError) as e:
        check_columns([r, parse_reward(f"{rfile}:reward_len")], ["level"], "data/train.jsonl")
    assert "'answer' column" in one_line(e) and "data/train.jsonl" in str(e.value)
    check_columns([r], ["answer"], "data/train.jsonl")  # no error where it has one
    with pytest.raises(UsageError, match='add "answer" to each line'):
        score([r], ["q"], ["4"], [[1]], {})
