"""Prompts for GRPO and on-policy distillation: one JSON object a line, in TRL's two forms,

    standard:        {"prompt": "What is 17 + 25?", "answer": "42"}
    conversational:  {"prompt": [{"role": "system", "content": "..."},
                                 {"role": "user", "content": "What is 17 + 25?"}], "answer": "42"}

A standard prompt is a user turn through the model's chat template where it has one (as a
preference pair's prompt string is; TRL itself feeds such a string to the model as raw
text), else the text itself. A conversation's roles are system, user and assistant; it
must not end with an assistant turn (there would be no question to answer). One form a
file: reward functions see every prompt of a batch in one form, as TRL's do.

Every other key of a line is a column, passed by name to the reward functions (data/
rewards.py), as TRL passes a dataset's columns: `columns(prompts)` gives each column's
values, None where a line lacks it. TRL drops the columns "completion" and
"completion_ids" (it passes its own completion ids); so does toy. A column named like one
of the reward functions' own arguments (RESERVED) would collide with it, and its line is
skipped.

A line that is no prompt (not JSON, no "prompt" key, an empty prompt, a prompt that is
neither a string nor a list of messages, messages that are not a conversation, a lone
surrogate escape, a reserved column) is skipped and counted by reason with its first line
number, as data/preference.py counts pairs; with strict=True (--strict) the first such
line is an InputError instead.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from toy.data.chat import (
    ENDS_WITH_REPLY,
    IGNORE_INDEX,
    SkipCounts,
    check_messages,
    json_lines,
    render_template,
)
from toy.errors import InputError
from toy.tokenizer import encode_prompt

SCHEMA = (
    'each line must be a prompt: {"prompt": "...", ...} or {"prompt": [{"role": '
    '"system"|"user"|"assistant", "content": "..."}, ...], ...}, not ending with an '
    'assistant turn; its other keys (e.g. "answer") are columns for the reward functions'
)
DROPPED = ("completion", "completion_ids")  # TRL leaves these out of the reward arguments
# The reward functions' own keyword arguments (data/rewards.py): a column of one of these
# names would be passed twice.
RESERVED = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


@dataclass(frozen=True)
class Prompt:
    """One prompt: `text` for a standard line, `messages` ({"role", "content"} dicts) for a
    conversational one; its columns and the line it came from."""

    text: str | None = None
    messages: tuple = ()
    columns: dict = field(default_factory=dict)
    line: int = 0

    @property
    def conversational(self) -> bool:
        return self.text is None

    @property
    def value(self) -> str | list[dict]:
        """What a reward function gets in `prompts`: the string, or a fresh list of
        message dicts (a function that edits it changes nothing here)."""
        return self.text if self.text is not None else [dict(m) for m in self.messages]

    @property
    def chat(self) -> tuple:
        """The messages to render: a standard prompt is one user turn."""
        if self.text is not None:
            return ({"role": "user", "content": self.text},)
        return self.messages


def parse_prompt(obj: Any, line: int = 0) -> tuple[Prompt | None, str, str]:
    """(prompt, "", "") or (None, reason, detail) for one JSON object."""
    if not isinstance(obj, dict):
        return None, "not a JSON object", f"expected a JSON object, got {type(obj).__name__}"
    if "prompt" not in obj:
        keys = ", ".join(sorted(map(str, obj))[:5]) or "none"
        return None, "no prompt", f'no "prompt" key (keys: {keys})'
    p = obj["prompt"]
    if not isinstance(p, (str, list)):
        what = type(p).__name__ if p is not None else "null"
        return None, "prompt not a string or messages", f'"prompt" is a {what}'
    if not p or (isinstance(p, str) and not p.strip()):
        return None, "empty prompt", '"prompt" is empty (nothing to answer)'
    if isinstance(p, list):
        msgs, reason, detail = check_messages(p, "prompt")
        if msgs is None:
            return None, reason, detail
        if msgs[-1]["role"] == "assistant":
            return None, "bad messages", ENDS_WITH_REPLY
        if not any(m["content"].strip() for m in msgs):
            return None, "empty prompt", "every message of the prompt is empty"
    clash = [k for k in obj if k in RESERVED]
    if clash:
        return (
            None,
            "reserved column",
            f'column "{clash[0]}" is a reward function argument of that name; rename it',
        )
    cols = {k: v for k, v in obj.items() if k != "prompt" and k not in DROPPED}
    if isinstance(p, str):
        return Prompt(text=p, columns=cols, line=line), "", ""
    return Prompt(messages=tuple(msgs), columns=cols, line=line), "", ""


@dataclass
class PromptFile(SkipCounts):
    path: Path
    prompts: list[Prompt] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)  # reason -> lines skipped for it
    first: dict = field(default_factory=dict)  # reason -> the first line skipped for it

    @property
    def lines(self) -> list[int]:
        return [p.line for p in self.prompts]

    @property
    def conversational(self) -> bool | None:
        return self.prompts[0].conversational if self.prompts else None


def read_prompts(path: str | Path, strict: bool = False) -> PromptFile:
    """Every prompt of a JSONL file, with its line; the others counted by reason (with
    strict=True the first is an InputError). A prompt of the other form than the file's
    first is an InputError: reward functions see one form."""
    out = PromptFile(Path(path))
    for lineno, obj, reason, detail in json_lines(out.path, SCHEMA):
        prompt = None
        if obj is not None:
            prompt, reason, detail = parse_prompt(obj, lineno)
        if prompt is None:
            if strict:
                raise InputError(
                    f"{out.path}:{lineno}: {detail}; {SCHEMA} (--strict stops at the first "
                    "bad line)"
                )
            out.skip(reason, lineno)
            continue
        if out.prompts and prompt.conversational != out.conversational:
            a = ("a prompt string", "a list of messages")[prompt.conversational]
            b = ("prompt strings", "conversations")[out.conversational]
            raise InputError(
                f"{out.path}:{lineno}: {a}, in a file of {b} (from line "
                f"{out.prompts[0].line}); one form a file: split it or convert the prompts"
            )
        out.prompts.append(prompt)
    return out


def no_prompts(path: str | Path, pf: PromptFile) -> InputError:
    what = pf.summary() if pf.skipped else "it holds only blank lines and comments"
    return InputError(f"no prompt to learn from in {path} ({what}); {SCHEMA}")


def columns(prompts: list[Prompt]) -> dict[str, list]:
    """Each column's values over `prompts` (None where a prompt lacks it), in the order
    the columns first appear: the keyword arguments TRL passes a reward function. Values
    are copies, so a reward function that edits one changes no later batch."""
    names = dict.fromkeys(k for p in prompts for k in p.columns)
    return {k: [copy.deepcopy(p.columns.get(k)) for p in prompts] for k in names}


# --------------------------------------------------------------------------- prompts to rows


class PromptEncoder:
    """A prompt's token ids as the policy sees it: through the chat template where the
    base has one (a user turn, or the prompt's messages), cut from the left to `room`
    tokens (its end is what the completion follows); `cut` counts the prompts cut."""

    def __init__(self, side, room: int):
        self.side, self.room, self.cut = side, room, 0

    def __call__(self, p: Prompt) -> list[int]:
        side = self.side
        if side.template is not None:
            text = render_template(
                side.template, list(p.chat), True, side.bos or "", side.eos or ""
            )
        else:
            text = p.text if p.text is not None else "\n".join(m["content"] for m in p.chat)
        ids = encode_prompt(side.tok, text)
        if len(ids) > self.room:
            self.cut += 1
            ids = ids[-self.room :]
        side.check_vocab(ids)
        return ids


class PromptBatches:
    """Global prompt batch j's share of process `rank` among `world`: `per` prompts, each
    pass over them (epoch) in a fresh order seeded by (seed, epoch), so batch j is the same
    whatever the process count. `n_batches` global batches make an epoch."""

    def __init__(self, items: list, per: int, seed: int, world: int = 1, rank: int = 0):
        self.items, self.per, self.seed, self.world, self.rank = items, per, seed, world, rank
        self.n_batches = max(1, math.ceil(len(items) / (per * world)))
        self.orders: dict[int, np.ndarray] = {}

    def __call__(self, j: int) -> list:
        per = self.per
        epoch, i = divmod(j * self.world + self.rank, self.n_batches * self.world)
        if epoch not in self.orders:
            self.orders.clear()
            rng = np.random.default_rng([self.seed, epoch, 17])
            self.orders[epoch] = rng.permutation(len(self.items))
        idx = self.orders[epoch][i * per : (i + 1) * per].tolist()
        if not idx:  # a last partial batch that this process has no share of
            idx = self.orders[epoch][:per].tolist()
        return [self.items[t] for t in idx]


def completion_rows(prompts: list[list[int]], comps: list, pad: int) -> dict[str, torch.Tensor]:
    """Each prompt + its completion as a right-padded row ("ids" (N, L)); a completion's
    tokens ("tgt" (N, T), IGNORE_INDEX past its end), the position whose hidden state predicts
    each ("pos": token j + 1 is predicted at j, so from len(prompt) - 1 on) and "mask"."""
    L = max(len(s) + len(c.ids) for s, c in zip(prompts, comps))
    T = max(len(c.ids) for c in comps)
    N = len(comps)
    ids = torch.full((N, L), pad, dtype=torch.long)
    pos = torch.zeros((N, T), dtype=torch.long)
    tgt = torch.full((N, T), IGNORE_INDEX, dtype=torch.long)
    for r, (s, c) in enumerate(zip(prompts, comps)):
        row = s + c.ids
        ids[r, : len(row)] = torch.tensor(row)
        n = len(c.ids)
        pos[r, :n] = torch.arange(len(s) - 1, len(s) - 1 + n)
        tgt[r, :n] = torch.tensor(c.ids)
    return {"ids": ids, "pos": pos, "tgt": tgt, "mask": (tgt != IGNORE_INDEX).float()}


def completion_targets(prompts: list[list[int]], comps: list, pad: int) -> dict[str, torch.Tensor]:
    """Each prompt + its completion as a next-token batch, as chat data's (ids (N, L - 1),
    targets: the completion's tokens where they are predicted, IGNORE_INDEX elsewhere): the
    loss of a language model on sampled completions."""
    L = max(len(s) + len(c.ids) for s, c in zip(prompts, comps))
    ids = torch.full((len(comps), L), pad, dtype=torch.long)
    targets = torch.full((len(comps), L - 1), IGNORE_INDEX, dtype=torch.long)
    for r, (s, c) in enumerate(zip(prompts, comps)):
        row = list(s) + list(c.ids)
        ids[r, : len(row)] = torch.tensor(row)
        targets[r, len(s) - 1 : len(row) - 1] = torch.tensor(list(c.ids))
    return {"ids": ids[:, :-1], "targets": targets}
