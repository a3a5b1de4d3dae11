"""Preference pairs -> (ids, answer mask) for a chosen and a rejected answer: the data of
the preference recipes, one JSON object a line, in TRL's three forms:

    standard:        {"prompt": "...", "chosen": "...", "rejected": "..."}
    conversational:  {"prompt": [messages], "chosen": [{"role": "assistant", ...}],
                      "rejected": [{"role": "assistant", ...}]}
    implicit prompt: {"chosen": [messages], "rejected": [messages]}: the messages both
                     begin with are the prompt, and each ends with its one answer.

A standard prompt is a user turn through the model's chat template where it has one (as
a prompt/completion line is for SFT), else the texts are joined and the answer ends with
EOS. The three forms of one pair give the same ids and mask (tests/data/test_preference.py).

The mask marks the answer's tokens (its content and the end-of-turn marker after it, as
data/chat.py marks an assistant turn), nothing of the prompt: a sequence's log-probability
is the sum over those. A line that is no pair (not JSON, a key missing, chosen ==
rejected, an empty answer, messages that are not a conversation, a lone surrogate escape)
is skipped and counted by reason with its first line number; so is a pair that cannot fit
--max-seq-len: a long prompt is cut from the left and long answers from the right, but a
pair whose two answers differ only beyond the cut has nothing left to prefer. So are a pair
whose answers the template renders alike (`| trim`: "Yes" and "Yes ") and one with an
empty prompt and no BOS (nothing predicts the answer's first token, so it is never scored,
and "Yes" against "No" would compare only what follows them).

A string longer than a window can use is cut by characters before it is tokenized, so a
huge line costs time and memory by --max-seq-len, not by its size: a prompt keeps its tail
(_tail), an answer its head, as the token cut then keeps them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from toy.data.chat import (
    ENDS_WITH_REPLY,
    IGNORE_INDEX,
    ConversationError,
    Example,
    SkipCounts,
    check_messages,
    encode_example,
    json_lines,
    window_chars,
)
from toy.errors import InputError
from toy.runs import plural

SCHEMA = (
    'each line must be a preference pair: {"prompt": "...", "chosen": "...", "rejected": "..."}, '
    'the same with lists of {"role", "content"} messages, or {"chosen": [messages], '
    '"rejected": [messages]} sharing their leading messages'
)
TOO_LONG = "cannot fit --max-seq-len"
SAME = "chosen and rejected render the same"
NO_CONTEXT = "empty prompt and no BOS to predict the answer's first token from"
REASONS = (TOO_LONG, SAME, NO_CONTEXT)  # a pair's encoding skips it for these


@dataclass(frozen=True)
class Pair:
    """One preference pair: the prompt as messages, the two answers' texts. `text` holds a
    standard line's prompt string (joined as text where the model has no template)."""

    prompt: tuple
    chosen: str
    rejected: str
    text: str | None = None
    label: bool | None = None  # an unpaired example's (KTO): chosen is its completion


def parse_pair(obj: Any) -> tuple[Pair | None, str, str]:
    """(pair, "", "") or (None, reason, detail) for one JSON object."""
    if not isinstance(obj, dict):
        return None, "not a JSON object", f"expected a JSON object, got {type(obj).__name__}"
    missing = [k for k in ("chosen", "rejected") if k not in obj]
    if missing:
        keys = ", ".join(sorted(map(str, obj))[:5]) or "none"
        return None, "missing key", f'no "{missing[0]}" key (keys: {keys})'
    p, c, r = obj.get("prompt"), obj["chosen"], obj["rejected"]
    if isinstance(c, str) and isinstance(r, str):
        if not isinstance(p, str):
            what = "no" if p is None else f"a {type(p).__name__} as"
            return None, "missing key", f'{what} "prompt": a standard pair needs a prompt string'
        pair = Pair(({"role": "user", "content": p},), c, r, text=p)
    else:
        cm, reason, detail = check_messages(c, "chosen")
        rm = None
        if cm is not None:
            rm, reason, detail = check_messages(r, "rejected")
        if rm is None:
            return None, reason, detail
        if p is None:  # implicit prompt: the leading messages both answers share
            n = 0
            while n < min(len(cm), len(rm)) - 1 and cm[n] == rm[n]:
                n += 1
            prompt, cm, rm = cm[:n], cm[n:], rm[n:]
            if not prompt:
                return None, "bad messages", "chosen and rejected share no leading message"
        else:
            prompt, reason, detail = check_messages(p, "prompt")
            if prompt is None:
                return None, reason, detail
        if len(cm) != 1 or len(rm) != 1 or {cm[0]["role"], rm[0]["role"]} != {"assistant"}:
            return (
                None,
                "bad messages",
                "each answer must be one assistant message after the prompt",
            )
        if prompt[-1]["role"] == "assistant":
            return None, "bad messages", ENDS_WITH_REPLY
        pair = Pair(tuple(prompt), cm[0]["content"], rm[0]["content"])
    if not pair.chosen.strip() or not pair.rejected.strip():
        return None, "empty answer", "an answer is empty (nothing to prefer)"
    if pair.chosen == pair.rejected:
        return None, "chosen == rejected", "chosen and rejected are the same (nothing to prefer)"
    return pair, "", ""


@dataclass
class PairFile(SkipCounts):
    path: Path
    pairs: list[Pair] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)  # reason -> lines skipped for it
    first: dict = field(default_factory=dict)  # reason -> the first line skipped for it


def read_pairs(path: str | Path) -> PairFile:
    """Every pair of a JSONL file, with its line; the others counted by reason."""
    out = PairFile(Path(path))
    for lineno, obj, reason, _ in json_lines(out.path, SCHEMA):
        pair = None
        if obj is not None:
            pair, reason, _ = parse_pair(obj)
        if pair is None:
            out.skip(reason, lineno)
            continue
        out.pairs.append(pair)
        out.lines.append(lineno)
    return out


# ------------------------------------------------------------------ unpaired (KTO)

UNPAIRED_SCHEMA = (
    'each line must be a labelled completion: {"prompt": "...", "completion": "...", "label": '
    'true|false}, the same with lists of {"role", "content"} messages (TRL\'s unpaired '
    "preference form), or a preference pair (its chosen answer taken as desirable, its "
    "rejected one as undesirable)"
)


def parse_unpaired(obj: Any) -> tuple[list[Pair], str, str]:
    """([example], "", "") for a labelled completion (TRL's unpaired form), two examples
    for a preference pair (as TRL's unpair_preference_dataset: chosen true, rejected
    false), or ([], reason, detail). An example is a Pair whose `chosen` is its completion
    and `label` its label; `rejected` (its KL completion) is filled by read_unpaired."""
    if isinstance(obj, dict) and "chosen" in obj and "rejected" in obj and "label" not in obj:
        pair, reason, detail = parse_pair(obj)
        if pair is None:
            return [], reason, detail
        return (
            [
                Pair(pair.prompt, pair.chosen, "", pair.text, True),
                Pair(pair.prompt, pair.rejected, "", pair.text, False),
            ],
            "",
            "",
        )
    if not isinstance(obj, dict):
        return [], "not a JSON object", f"expected a JSON object, got {type(obj).__name__}"
    missing = [k for k in ("prompt", "completion", "label") if k not in obj]
    if missing:
        keys = ", ".join(sorted(map(str, obj))[:5]) or "none"
        return [], "missing key", f'no "{missing[0]}" key (keys: {keys})'
    label = obj["label"]
    if not isinstance(label, bool):
        return [], "bad label", f'"label" must be true or false, got {json.dumps(label)[:40]}'
    p, c = obj["prompt"], obj["completion"]
    if isinstance(c, str):
        if not isinstance(p, str):
            what = "no" if p is None else f"a {type(p).__name__} as"
            return [], "missing key", f'{what} "prompt": a standard example needs a prompt string'
        ex = Pair(({"role": "user", "content": p},), c, "", text=p, label=label)
    else:
        cm, reason, detail = check_messages(c, "completion")
        if cm is None:
            return [], reason, detail
        prompt, reason, detail = check_messages(p, "prompt")
        if prompt is None:
            return [], reason, detail
        if len(cm) != 1 or cm[0]["role"] != "assistant":
            return [], "bad messages", "the completion must be one assistant message"
        if prompt[-1]["role"] == "assistant":
            return [], "bad messages", ENDS_WITH_REPLY
        ex = Pair(tuple(prompt), cm[0]["content"], "", label=label)
    if not ex.chosen.strip():
        return [], "empty answer", "the completion is empty (nothing to judge)"
    return [ex], "", ""


def read_unpaired(path: str | Path, per: int) -> PairFile:
    """Every labelled completion of a JSONL file, with its line, each given the KL
    completion TRL's KTOTrainer gives it: the examples in file order, in runs of `per`
    (TRL's per_device_train_batch_size), each run's completions turned by one (the
    first example takes the run's last completion, every other the one before it). The
    KL term is estimated from these mismatched (prompt, completion) sequences."""
    out = PairFile(Path(path))
    for lineno, obj, reason, _ in json_lines(out.path, UNPAIRED_SCHEMA):
        examples: list[Pair] = []
        if obj is not None:
            examples, reason, _ = parse_unpaired(obj)
        if not examples:
            out.skip(reason, lineno)
            continue
        out.pairs.extend(examples)
        out.lines.extend([lineno] * len(examples))
    for i in range(0, len(out.pairs), per):
        run = out.pairs[i : i + per]
        turned = [run[-1].chosen] + [e.chosen for e in run[:-1]]
        out.pairs[i : i + per] = [dataclasses.replace(e, rejected=k) for e, k in zip(run, turned)]
    return out


# ------------------------------------------------------------------ encoding


def _last_run(mask: list[int]) -> list[int]:
    """Only the last run of 1s: the answer, not an earlier assistant turn of the prompt."""
    out = [0] * len(mask)
    i = len(mask)
    while i and not mask[i - 1]:
        i -= 1
    while i and mask[i - 1]:
        out[i - 1] = 1
        i -= 1
    return out


_WORD_START = re.compile(r"(?<=\S) ")  # a space after a non-space: a word starts there


def _tail(text: str, chars: int) -> str:
    """The end of a prompt string too long for a window: its last `chars` characters (which
    hold more tokens than the window, window_chars) and back to the start of their first
    word, searched up to `chars` characters further back. The pre-tokenizers split before
    such a space (GPT-2's, llama 3's and qwen2's regexes), so the kept text's tokens are
    those the whole string ends with; a string with no word there (one huge run) keeps
    `chars` characters, a tokenization of its tail that may differ from the whole's."""
    if len(text) <= chars:
        return text
    start = len(text) - chars
    cut = start
    for word in _WORD_START.finditer(text, max(0, start - chars), start + 1):
        cut = word.start()
    return text[cut:]


def _cut(pair: Pair, chars: int) -> tuple[Pair, bool]:
    """The pair with each prompt string cut to its tail and each answer to its first
    `chars` characters, and whether an answer was cut."""
    longest = max(len(pair.chosen), len(pair.rejected), *(len(m["content"]) for m in pair.prompt))
    if longest <= chars:
        return pair, False
    prompt = tuple({**m, "content": _tail(m["content"], chars)} for m in pair.prompt)
    text = _tail(pair.text, chars) if pair.text is not None else None
    c, r = pair.chosen[:chars], pair.rejected[:chars]
    return Pair(prompt, c, r, text), (c, r) != (pair.chosen, pair.rejected)


def encode_answer(tok, template, pair: Pair, answer: str, bos, eos, eos_id):
    """(ids, mask) of the prompt and one answer, not cut to a token budget; the mask on the
    answer alone."""
    if template is None and pair.text is not None:
        ex = Example("prompt", prompt=pair.text, completion=answer)
    else:
        msgs = (*pair.prompt, {"role": "assistant", "content": answer})
        ex = Example("messages", messages=msgs)
    ids, mask = encode_example(tok, template, ex, 1 << 30, bos, eos, eos_id)
    return ids, _last_run(mask)


@dataclass
class Encoded:
    """A pair's two sequences: ids and answer mask each, cut to fit."""

    chosen: tuple[list[int], list[int]]
    rejected: tuple[list[int], list[int]]
    prompt_cut: bool = False
    answer_cut: bool = False
    label: bool | None = None  # an unpaired example's (encode_unpaired)


def fit(seqs, budget: int) -> tuple[list, bool, bool]:
    """Cut the (ids, mask) of a pair's answers to `budget` tokens: the prompt from the left
    first (keeping at least one token, which the answer's first token is predicted from),
    then each answer from the right."""
    lens = []
    for ids, mask in seqs:
        start = mask.index(1) if 1 in mask else len(mask)
        lens.append((start, len(ids) - start))
    longest = max(a for _, a in lens)
    out, p_cut, a_cut = [], False, False
    for (ids, mask), (p, _) in zip(seqs, lens):
        keep = min(p, max(1, budget - longest))
        p_cut |= keep < p
        ids, mask = ids[p - keep :], mask[p - keep :]
        a_cut |= len(ids) > budget
        out.append((ids[:budget], mask[:budget]))
    return out, p_cut, a_cut


def encode_unpaired(tok, template, pair: Pair, budget: int, bos, eos, eos_id) -> Encoded:
    """An unpaired example: its completion (`chosen`) and its KL completion (`rejected`)
    under its prompt, encoded and cut as a pair's answers (the two may be alike: the KL
    sequence is only a sample for the KL estimate); ConversationError NO_CONTEXT as
    encode_pair's, TOO_LONG where the prompt leaves no room for an answer token."""
    pair, _ = _cut(pair, window_chars(tok, budget))
    seqs = [
        encode_answer(tok, template, pair, a, bos, eos, eos_id)
        for a in (pair.chosen, pair.rejected)
    ]
    if any(mask[0] for _, mask in seqs):
        raise ConversationError(NO_CONTEXT)
    (c, r), p_cut, a_cut = fit(seqs, budget)
    if not any(c[1][1:]) or not any(r[1][1:]):
        raise ConversationError(TOO_LONG)
    return Encoded(c, r, p_cut, a_cut, pair.label)


def encode_pair(tok, template, pair: Pair, budget: int, bos, eos, eos_id) -> Encoded:
    """Both answers encoded and cut to `budget` tokens (their strings cut by characters
    first, _cut: the same tokens kept); ConversationError, with one of REASONS, when the
    pair cannot fit (its answers differ only beyond the cut), its answers render the same,
    or nothing predicts an answer's first token."""
    pair, answer_cut = _cut(pair, window_chars(tok, budget))
    seqs = [
        encode_answer(tok, template, pair, a, bos, eos, eos_id)
        for a in (pair.chosen, pair.rejected)
    ]
    if any(mask[0] for _, mask in seqs):  # the answer opens the sequence: pair_batch's
        raise ConversationError(NO_CONTEXT)  # targets start at the second token
    if seqs[0] == seqs[1]:
        raise ConversationError(TOO_LONG if answer_cut else SAME)
    (c, r), p_cut, a_cut = fit(seqs, budget)
    if c == r:
        raise ConversationError(TOO_LONG)
    return Encoded(c, r, p_cut, a_cut)


def encode_pairs(
    pf: PairFile, encode: Callable[[Pair], Encoded], warn: Callable[[str], None]
) -> tuple[list[Encoded], Counter]:
    """Every pair of a file encoded; those that cannot fit, render alike, have no token
    before their answers (REASONS) or that the template cannot render are skipped into
    pf's counts. Returns (encoded, cut counts)."""
    out, cuts = [], Counter()
    for line, pair in zip(pf.lines, pf.pairs):
        try:
            e = encode(pair)
        except ConversationError as err:
            why = err.message if err.message in REASONS else "template cannot render"
            pf.skip(why, line)
            continue
        cuts["prompt"] += e.prompt_cut
        cuts["answer"] += e.answer_cut
        out.append(e)
    return out, cuts


def cut_note(cuts: Counter, budget: int) -> str | None:
    parts = []
    if cuts["prompt"]:
        parts.append(f"{plural(cuts['prompt'], 'prompt')} cut from the left")
    if cuts["answer"]:
        parts.append(f"the answers of {plural(cuts['answer'], 'pair')} cut from the right")
    return f"to fit --max-seq-len {budget - 1}: {', '.join(parts)}" if parts else None


# ------------------------------------------------------------------ batches


def pair_batch(
    items: Sequence[tuple[int, Encoded]], pad: int, bucket: int = 1, budget: int | None = None
) -> dict[str, torch.Tensor]:
    """One batch of B pairs: rows 0..B-1 the chosen sequences, B..2B-1 the rejected, right
    padded (causal attention needs no mask then); position t predicts token t+1.

    ids (2B, T); ans_pos / ans_tgt (2B, A): where each answer's targets are and what they
    are, n_ans their count; `full` (2B, T): every real next token (ORPO's NLL reads the
    chosen rows'), n_full their count; `pair` (B,): the pairs' indices, which the
    reference log-probs are kept by.

    `bucket` > 1 (under --compile) pads T up to a multiple of it (at most `budget` - 1,
    the sequences' longest), as data/chat.py's to_batch: the compiled blocks meet a
    handful of shapes, not one a batch (each a recompile; past dynamo's limit, eager)."""
    seqs = [e.chosen for _, e in items] + [e.rejected for _, e in items]
    T = max(len(ids) for ids, _ in seqs)
    if bucket > 1:
        width = -(-(T - 1) // bucket) * bucket + 1  # inputs are width - 1 long
        T = min(width, max(T, budget)) if budget is not None else width
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    real = torch.zeros((len(seqs), T), dtype=torch.bool)
    for b, (i, m) in enumerate(seqs):
        ids[b, : len(i)] = torch.tensor(i)
        mask[b, : len(m)] = torch.tensor(m)
        real[b, : len(i)] = True
    nxt = ids[:, 1:]
    ignore = torch.full_like(nxt, IGNORE_INDEX)
    # The answer's target positions of each row, gathered into (2B, A), A the longest
    # answer (shorter rows padded with IGNORE at position 0): the head runs on them alone.
    ans = mask[:, 1:] > 0
    n_ans = ans.sum(1)
    A = int(n_ans.max())
    pos = torch.zeros((len(seqs), A), dtype=torch.long)
    tgt = torch.full((len(seqs), A), IGNORE_INDEX, dtype=torch.long)
    for b in range(len(seqs)):
        where = ans[b].nonzero().flatten()
        pos[b, : len(where)] = where
        tgt[b, : len(where)] = nxt[b, where]
    full = torch.where(real[:, 1:], nxt, ignore)
    return {
        "ids": ids[:, :-1],
        "ans_pos": pos,
        "ans_tgt": tgt,
        "n_ans": n_ans.float(),
        "full": full,
        "n_full": (full != IGNORE_INDEX).sum(1).float(),
        "pair": torch.tensor([k for k, _ in items], dtype=torch.long),
        **(
            {"label": torch.tensor([bool(e.label) for _, e in items])}
            if items and items[0][1].label is not None
            else {}
        ),
    }


def no_pairs(
    path: Path, pf: PairFile, what_one: str = "preference pair", schema: str = SCHEMA
) -> InputError:
    what = pf.summary() if pf.skipped else "it holds only blank lines and comments"
    return InputError(f"no {what_one} to learn from in {path} ({what}); {schema}")
