"""Reward functions for GRPO, with TRL's signature, so a reward file written for TRL's
GRPOTrainer works in toy unchanged and the reverse:

    def reward(prompts, completions, completion_ids, **kwargs) -> list[float | None]

called with keyword arguments only (as TRL 1.16's _calculate_rewards calls them):
  prompts         the prompt strings, or for conversational prompts (data/prompts.py) their
                  lists of {"role", "content"} messages;
  completions     the completion texts, or for conversational prompts one-message lists
                  [{"role": "assistant", "content": text}];
  completion_ids  the completions' token ids, a list of int lists;
  every column of the prompt file by its name (a list, None where a line lacks it);
  trainer_state   a State: TRL passes transformers' TrainerState; this stand-in has the
                  fields reward functions read for schedules (global_step, max_steps, epoch);
  log_extra       log_extra(column, values): values shown beside the completions;
  log_metric      log_metric(name, value): a scalar averaged over a logging step.
TRL's `environments` (its environment_factory) has no counterpart and is not passed.

A function returns one reward per completion, or None where it does not apply (TRL's
multi-task rule: that function then counts for nothing in that sample). An async function
is awaited (one after another; TRL runs them together).

`--reward SPEC` names one: a built-in (`accuracy`, `format`, `length`) or a function in the
user's file (`rewards.py:reward_len`), each with an optional weight (`accuracy:2`). `score`
calls them on a batch and combines them as TRL does (score's docstring).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import importlib.util
import inspect
import math
import re
import sys
import traceback
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from toy.errors import RunFailed, SecondInterrupt, UsageError

DEFAULT_FORMAT = r"<think>.*?</think>\s*<answer>.*?</answer>"
DEFAULT_TARGET_LENGTH = 64  # tokens (the `length` reward's default target)
SIGNATURE = "fn(prompts, completions, completion_ids, **columns) -> list[float | None]"


class RewardError(UsageError):
    """A reward function that cannot be loaded or called, or whose result is no list of
    one finite number (or None) per completion: the user's code to fix, exit code 2."""


@dataclass
class Reward:
    """One --reward: its name (the function's, as TRL names it in logs), the function, its
    weight, the spec it came from (errors name it), the columns it reads (a built-in's) and
    the user's file it is defined in (errors name its line)."""

    name: str
    fn: Callable
    weight: float = 1.0
    spec: str = ""
    reads: tuple[str, ...] = ()
    file: Path | None = None


@dataclass
class State:
    """The fields of transformers' TrainerState that reward functions read to shape a
    reward by progress (TRL passes the trainer's state as `trainer_state`)."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0


@dataclass
class Logs:
    """What reward functions log through log_extra and log_metric, for the caller to show."""

    extra: dict = field(default_factory=lambda: defaultdict(list))
    metrics: dict = field(default_factory=lambda: defaultdict(list))

    def log_extra(self, column: str, values: list) -> None:
        self.extra[column].extend(values)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[name].append(value)


# ------------------------------------------------------------------ built-ins


def text_of(completion: str | list) -> str:
    """A completion's text: the string, or the content of a conversational one's (last)
    message."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


_ANSWER_OPEN, _ANSWER_CLOSE = "<answer>", "</answer>"
# A number: thousands grouped by commas or not, decimals; a minus sign (ASCII or U+2212)
# only where no digit or letter precedes it ("25-8" ends in 8, "= -8" in -8).
_NUMBER = re.compile(r"(?:(?<![\w.])[-\u2212])?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_GROUPED = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
# A number is compared by value only within these bounds, else as text: Fraction("1e999999999")
# computes 10**999999999 (minutes of CPU, in C, deaf to SIGTERM), and a policy can write it.
# 2**1000 has 302 digits; a Fraction this size takes microseconds.
_MAX_NUMBER_CHARS = 1000
_MAX_EXPONENT = 1000


def normalize(s: Any) -> str | Fraction:
    """An answer compared by value: a number as an exact fraction ("42.0", "42", "4.2e1"
    and "1,000" / "1000" alike, "\u22123" as "-3"), anything else case- and
    whitespace-folded text, as is a number too big to compare quickly (over
    _MAX_NUMBER_CHARS characters, or an exponent past +-_MAX_EXPONENT): "1e999999999"
    equals "1E999999999" but not "10e999999998"."""
    t = " ".join(str(s).split()).replace("\u2212", "-")
    if _GROUPED.fullmatch(t):
        t = t.replace(",", "")
    if len(t) > _MAX_NUMBER_CHARS or abs(_exponent(t)) > _MAX_EXPONENT:
        return t.casefold()
    try:
        return Fraction(t)
    except (ValueError, ArithmeticError):  # ArithmeticError: 0/0, or an int-size limit
        return t.casefold()


def _exponent(t: str) -> int:
    """The exponent Fraction(t) would scale by (10**exponent), 0 where t has none. Fraction's
    exponent is digits after the last e or E, at the end; int() reads a superset of them."""
    e = max(t.rfind("e"), t.rfind("E"))
    try:
        return int(t[e + 1 :]) if e >= 0 else 0
    except ValueError:
        return 0


def final_answer(text: str) -> str:
    """What a completion answers: inside its last <answer>...</answer> when it has one,
    else its last number, else its whole text."""
    # The last match of re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL), found by
    # str.find in one pass: that regex is quadratic where no </answer> follows ("<answer>"
    # written 8000 times took 2 s), as it rescans the rest of the text from every <answer>.
    last, pos = None, 0
    while (start := text.find(_ANSWER_OPEN, pos)) >= 0:
        end = text.find(_ANSWER_CLOSE, start + len(_ANSWER_OPEN))
        if end < 0:
            break  # no later <answer> has a closing tag either
        last, pos = text[start + len(_ANSWER_OPEN) : end], end + len(_ANSWER_CLOSE)
    if last is not None:
        return last
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else text


def accuracy(completions: list, answer: list | None = None, **kwargs) -> list[float | None]:
    """1.0 where the completion's final answer (final_answer) equals the "answer" column
    after normalize, else 0.0; None where the sample has no answer."""
    if answer is None:
        raise UsageError(
            'the accuracy reward reads the "answer" column, and the prompt file has none; '
            'add "answer" to each line or drop --reward accuracy'
        )
    return [
        None if a is None else float(normalize(final_answer(text_of(c))) == normalize(a))
        for c, a in zip(completions, answer, strict=True)
    ]


_THINK_THEN_ANSWER = re.compile(r"</think>\s*<answer>")


def _default_format(text: str) -> bool:
    """re.fullmatch(DEFAULT_FORMAT, text, re.DOTALL), in linear time: the regex is quadratic
    on "</think><answer></answer>" repeated with text after (0.5 s on 64k characters), as it
    tries every </answer> after every </think>. Both bodies match anything, so the text
    matches when it starts with <think>, ends with </answer> and between them has a
    </think>\\s*<answer>; the first one ends soonest, leaving the answer body the most room."""
    head, tail = "<think>", _ANSWER_CLOSE
    if not (text.startswith(head) and text.endswith(tail)):
        return False
    m = _THINK_THEN_ANSWER.search(text, len(head))
    return m is not None and m.end() <= len(text) - len(tail)


def format_reward(
    completions: list, format_regex: str = DEFAULT_FORMAT, **kwargs
) -> list[float | None]:
    """1.0 where the whole completion, less surrounding whitespace, matches format_regex
    (re.DOTALL: `.` crosses lines), else 0.0. The default: a <think>...</think> part, then
    an <answer>...</answer> part."""
    if format_regex == DEFAULT_FORMAT:
        return [float(_default_format(text_of(c).strip())) for c in completions]
    pat = re.compile(format_regex, re.DOTALL)
    return [float(pat.fullmatch(text_of(c).strip()) is not None) for c in completions]


def length_reward(
    completion_ids: list, target_length: int = DEFAULT_TARGET_LENGTH, **kwargs
) -> list[float | None]:
    """-|tokens - target| / target: 0 at target_length tokens, -1 at none or at twice it,
    falling on linearly past that."""
    return [-abs(len(ids) - target_length) / target_length for ids in completion_ids]


BUILTINS = {"accuracy": accuracy, "format": format_reward, "length": length_reward}
READS = {"accuracy": ("answer",)}


# ------------------------------------------------------------------ --reward SPEC


def _fail(spec: str, what: str, fix: str) -> RewardError:
    return RewardError(f"--reward {spec}: {what}; {fix}")


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _weight(spec: str, w: str) -> float:
    try:
        x = float(w)
    except ValueError:
        x = math.nan
    if not math.isfinite(x):
        raise _fail(
            spec,
            f"weight {w!r} is not a finite number",
            "write it as a number: accuracy:2, rewards.py:f:0.5",
        )
    return x


_MODULES: dict[Path, Any] = {}  # a file imported once, however many --reward name it


def _import(spec: str, path: Path) -> Any:
    path = path.resolve()
    if path in _MODULES:
        return _MODULES[path]
    stem = re.sub(r"\W", "_", path.stem)
    name = f"toy_reward_{len(_MODULES)}_{stem}"
    loader = importlib.util.spec_from_file_location(name, path)
    if loader is None or loader.loader is None:
        raise _fail(spec, f"{path} cannot be imported", "pass a Python file (.py)")
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module  # dataclasses and pickling look a module up by name
    # Its own helper modules beside it import as when run with `python`; appended, so a
    # file there named like a library module cannot shadow the library.
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    try:
        loader.loader.exec_module(module)
    except SyntaxError as e:
        del sys.modules[name]
        raise _fail(spec, f"{path.name}:{e.lineno}: {e.msg}", "fix the Python syntax")
    except (Exception, SystemExit) as e:
        del sys.modules[name]
        raise _fail(
            spec,
            f"importing {path.name} raised {_first_line(e)}{_where(e, path)}",
            "fix the file, or install what it imports",
        )
    _MODULES[path] = module
    return module


def parse_reward(
    spec: str,
    format_regex: str = DEFAULT_FORMAT,
    target_length: int = DEFAULT_TARGET_LENGTH,
) -> Reward:
    """A Reward from `--reward SPEC`: NAME[:WEIGHT] for a built-in (format_regex and
    target_length set the `format` and `length` ones), path/to/file.py:FUNCTION[:WEIGHT]
    for the user's own. Every problem is a one-line RewardError naming the spec."""
    builtins = ", ".join(BUILTINS)
    form = f"use a built-in ({builtins}) or path/to/file.py:FUNCTION, each with an optional :WEIGHT"
    at = spec.rfind(".py:")
    if at < 0:
        name, _, w = spec.partition(":")
        if name.endswith(".py"):
            raise _fail(spec, "names no function", f"name it: {name}:FUNCTION")
        if name not in BUILTINS:
            looks_like_file = "/" in name or "." in name
            what = f"{name} is not a Python file" if looks_like_file else f"no reward {name!r}"
            raise _fail(spec, what, form)
        weight = _weight(spec, w) if w else 1.0
        fn = BUILTINS[name]
        if name == "format":
            try:
                re.compile(format_regex, re.DOTALL)
            except re.error as e:
                raise _fail(spec, f"format regex {format_regex!r}: {e}", "fix --format-regex")
            fn = functools.partial(fn, format_regex=format_regex)
        elif name == "length":
            if not (isinstance(target_length, int) and target_length > 0):
                raise _fail(spec, f"target length {target_length!r}", "give a positive number")
            fn = functools.partial(fn, target_length=target_length)
        return Reward(name, fn, weight, spec, READS.get(name, ()))
    path = Path(spec[: at + 3])
    func, _, w = spec[at + 4 :].partition(":")
    if not func.isidentifier():
        raise _fail(spec, f"{func!r} is no function name", f"write {path}:FUNCTION[:WEIGHT]")
    weight = _weight(spec, w) if w else 1.0
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "no such file"
        raise _fail(spec, f"{path}: {what}", f"pass the Python file that defines {func}")
    module = _import(spec, path)
    fn = getattr(module, func, None)
    if fn is None:
        defined = [
            k
            for k, v in vars(module).items()
            if callable(v)
            and not k.startswith("_")
            and getattr(v, "__module__", "") == module.__name__
        ]
        has = f" (it defines: {', '.join(defined[:8])})" if defined else ""
        raise _fail(spec, f"no {func!r} in {path}{has}", "name a function the file defines")
    if not callable(fn):
        raise _fail(
            spec,
            f"{func} in {path} is not a function but a {type(fn).__name__}",
            f"make it {SIGNATURE}",
        )
    return Reward(func, fn, weight, spec, file=path.resolve())


# ------------------------------------------------------------------ scoring


def _where(e: BaseException, path: Path | None) -> str:
    """' (rewards.py line 12)': the innermost line of `path` in e's traceback."""
    if path is None:
        return ""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == path]
    return f" ({path.name} line {frames[-1].lineno})" if frames else ""


def _preview(prompt: str | list | None) -> str:
    """A prompt's first 60 characters on one line (a conversation's last message)."""
    if not prompt:
        return "''"
    text = prompt if isinstance(prompt, str) else (prompt[-1].get("content") or "")
    text = " ".join(str(text).split())
    return repr(text if len(text) <= 60 else text[:59] + "\u2026")


class _Ended(Exception):
    """A reward function that raised SystemExit or KeyboardInterrupt: it tried to end the
    process, which a reward never does."""

    def __init__(self, e: BaseException):
        super().__init__(e)
        self.cause = e
        code = getattr(e, "code", None)
        self.what = f"sys.exit({code!r})" if isinstance(e, SystemExit) else type(e).__name__


def _call(fn: Callable, kwargs: dict) -> Any:
    try:
        out = fn(**kwargs)
        return asyncio.run(out) if inspect.isawaitable(out) else out
    except SecondInterrupt:
        raise  # the user's second Ctrl-C: stop at once
    except (SystemExit, KeyboardInterrupt) as e:
        raise _Ended(e) from None


def _fresh(kwargs: dict) -> dict:
    """What one function is called with: a copy of every list (prompts, completions, their
    ids, each column), so a function that edits one in place changes neither the batch the
    trainer lays out from them nor what the next function sees (TRL passes copies too)."""
    out = {}
    for k, v in kwargs.items():
        if k == "completion_ids":
            out[k] = [list(ids) for ids in v]
        else:
            out[k] = copy.deepcopy(v) if isinstance(v, list) else v
    return out


def _run(r: Reward, kwargs: dict, prompts: list, n: int) -> list[float]:
    """One function's rewards over a batch, NaN for None, or a RewardError that names the
    function, the sample (and its prompt) and the fix."""
    fix = f"fix the function: it is called as {SIGNATURE}, one value per completion"
    try:
        out = _call(r.fn, _fresh(kwargs))
    except UsageError:
        raise  # a built-in's own message (accuracy with no "answer" column)
    except _Ended as e:
        raise RunFailed(
            f"--reward {r.spec}: ended the run with {e.what}{_where(e.cause, r.file)} "
            f"(first prompt {_preview(prompts[0] if prompts else None)}); a reward function "
            "returns its rewards and never ends the process: fix the function"
        ) from None
    except Exception as e:
        # Find the sample that raises on its own: the message can point at its prompt.
        where, msg = (
            f"a batch of {n} (first prompt {_preview(prompts[0] if prompts else None)})",
            _first_line(e),
        )
        for i in range(n):
            one = {k: (v[i : i + 1] if isinstance(v, list) else v) for k, v in kwargs.items()}
            one["log_extra"], one["log_metric"] = Logs().log_extra, Logs().log_metric
            try:
                _call(r.fn, _fresh(one))
            except Exception as e1:
                where, msg, e = f"sample {i} (prompt {_preview(prompts[i])})", _first_line(e1), e1
                break
        raise RewardError(
            f"--reward {r.spec}: raised {msg}{_where(e, r.file)} on {where}; {fix}"
        ) from None
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__iter__"):
        raise RewardError(
            f"--reward {r.spec}: returned a {type(out).__name__}, not a list of rewards "
            f"(first prompt {_preview(prompts[0] if prompts else None)}); {fix}"
        )
    out = list(out)
    if len(out) != n:
        raise RewardError(
            f"--reward {r.spec}: returned {len(out)} rewards for {n} completions "
            f"(first prompt {_preview(prompts[0] if prompts else None)}); {fix}"
        )
    values = []
    for i, v in enumerate(out):
        x = math.nan
        if v is not None and not isinstance(v, (str, bytes)):
            try:
                x = float(v)
            except (TypeError, ValueError):
                pass
        if v is not None and not math.isfinite(x):
            raise RewardError(
                f"--reward {r.spec}: sample {i} (prompt {_preview(prompts[i])}): returned "
                f"{v!r:.40}, not a finite number; return a float, or None where the reward "
                "does not apply"
            )
        values.append(x)
    return values


def score(
    rewards: Sequence[Reward],
    prompts: list,
    completions: list[str],
    completion_ids: list[list[int]],
    columns: dict[str, list],
    state: State | None = None,
    logs: Logs | None = None,
) -> tuple[list[list[float]], list[float]]:
    """Each reward function called on a batch, and the weighted total, as TRL 1.16's
    GRPOTrainer combines them.

    `prompts`: what reward functions see (Prompt.value: strings or message lists);
    `completions`: the completion texts, passed as one-message assistant lists when the
    prompts are conversational (TRL decides by the first prompt, and so does this);
    `columns`: data/prompts.py's columns() of the batch's prompts.

    Returns (per_func, total): per_func[k][i] is function k's reward for sample i, NaN
    where it returned None; total[i] = sum over k of weight_k * per_func[k][i], NaN terms
    left out (torch.nansum). A sample that every function returned None for is NaN in
    total: TRL 1.16 marks it unscorable, leaves it out of its group's mean and std, and
    gives it advantage 0 (nansum alone would make its reward 0 and bias the baseline)."""
    n = len(prompts)
    if n and not isinstance(prompts[0], str):
        completions = [[{"role": "assistant", "content": c}] for c in completions]
    logs = logs if logs is not None else Logs()
    kwargs = {
        **columns,
        "prompts": prompts,
        "completions": completions,
        "completion_ids": completion_ids,
        "trainer_state": state if state is not None else State(),
        "log_extra": logs.log_extra,
        "log_metric": logs.log_metric,
    }
    per_func = [_run(r, kwargs, prompts, n) for r in rewards]
    total = []
    for i in range(n):
        terms = [r.weight * v[i] for r, v in zip(rewards, per_func) if not math.isnan(v[i])]
        total.append(math.fsum(terms) if terms else math.nan)
    return per_func, total


def check_columns(rewards: Sequence[Reward], names: Sequence[str], path: str | Path) -> None:
    """A UsageError, before any step, for a built-in whose column the prompt file lacks."""
    for r in rewards:
        for col in r.reads:
            if col not in names:
                raise UsageError(
                    f"--reward {r.spec} reads the {col!r} column, and no line of {path} has "
                    f'one; add "{col}" to each line or drop --reward {r.spec}'
                )
