"""Chat conversations and preference pairs made from the dialogue of the bundled plays:
real text, varied lengths, several turns each. `toy new` writes both into a project, and
the LoRA and preference tests, the effect check and the chat benchmark use them, so none
needs a download.

Each conversation is a run of consecutive speeches between two speakers of one scene:
the first speaker's lines are the user turns, the second's the assistant turns.

Each preference pair is one exchange of a scene: the first speaker's speech is the prompt
(a user turn), the second speaker's the answer. The chosen answer opens with a fixed word
("Verily,") that the rejected one, otherwise the same words, does not have: a style a
user sees in the first word of a reply.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

SYSTEM = (
    "You are a player in a Shakespeare company. "
    "Answer in character, in verse or prose as the play does."
)
STAGE = re.compile(r"\[[^\]]*\]\s*")  # an inline stage direction: "[Aside.]"
OPENING = "Verily,"
_SPEAKER = re.compile(r"^([A-Z][A-Za-z]*\.?( [A-Z][A-Za-z]*\.?)?)\.$")


def speeches(text: str) -> list[tuple[str, str]]:
    """(speaker, speech) pairs in order. A speech is a speaker cue line ("Ham.") followed
    by its lines up to a blank line; stage directions in brackets are dropped."""
    out: list[tuple[str, str]] = []
    for block in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in block.strip().splitlines()]
        if len(lines) < 2 or not _SPEAKER.match(lines[0]):
            if lines and (lines[0].startswith("ACT") or lines[0].startswith("Scene")):
                out.append(("", ""))  # a scene boundary: conversations never cross it
            continue
        body = [ln for ln in lines[1:] if not (ln.startswith("[") and ln.endswith("]"))]
        speech = " ".join(body).strip()
        if speech:
            out.append((lines[0].rstrip("."), speech))
    return out


def conversations(
    paths: list[Path], n: int, seed: int = 0, turns: tuple[int, int] = (1, 3), max_chars: int = 600
) -> list[dict]:
    """Up to n conversations of 1-3 user/assistant exchanges, picked deterministically."""
    pool: list[list[dict]] = []
    for p in paths:
        sp = speeches(Path(p).read_text())
        i = 0
        while i + 1 < len(sp):
            a, b = sp[i][0], sp[i + 1][0]
            if not a or not b or a == b:
                i += 1
                continue
            msgs = []
            j = i
            # Alternate a, b, a, b... as long as the same two speakers keep talking.
            while (
                j + 1 < len(sp) and sp[j][0] == a and sp[j + 1][0] == b and len(msgs) < 2 * turns[1]
            ):
                if len(sp[j][1]) > max_chars or len(sp[j + 1][1]) > max_chars:
                    break
                msgs += [
                    {"role": "user", "content": sp[j][1]},
                    {"role": "assistant", "content": sp[j + 1][1]},
                ]
                j += 2
            if len(msgs) >= 2 * turns[0]:
                pool.append([{"role": "system", "content": SYSTEM}] + msgs)
                i = j
            else:
                i += 1
    order = np.random.default_rng(seed).permutation(len(pool))[:n]
    return [{"messages": pool[int(k)]} for k in sorted(order)]


def write_jsonl(convs: list[dict], path: Path) -> Path:
    with open(path, "w") as fh:
        for c in convs:
            fh.write(json.dumps(c) + "\n")
    return path


def exchanges(paths: list[Path], max_chars: int) -> list[tuple[str, str]]:
    """(speech, reply) of consecutive speakers of one scene, both at most max_chars."""
    out = []
    for path in paths:
        sp = [(who, STAGE.sub("", s).strip()) for who, s in speeches(Path(path).read_text())]
        for (a, sa), (b, sb) in zip(sp, sp[1:]):
            if a and b and a != b and len(sa) <= max_chars and 8 <= len(sb) <= max_chars:
                out.append((sa, sb))
    return out


def with_opening(word: str, answer: str) -> str:
    """`answer` opened by `word`: "Verily, my lord." from "My lord." ("I" stays capital)."""
    first = answer.split(" ", 1)[0]
    keep = first == "I" or first.startswith("I'") or first.isupper()
    return f"{word} {answer if keep else answer[0].lower() + answer[1:]}"


def preference_pairs(
    paths: list[Path], n: int, seed: int = 0, opening: str = OPENING, max_chars: int = 160
) -> list[dict]:
    """n {"prompt", "chosen", "rejected"} pairs (TRL's standard form), picked
    deterministically by seed; ValueError when the plays hold fewer exchanges."""
    pool = exchanges(paths, max_chars)
    if len(pool) < n:
        raise ValueError(f"only {len(pool)} exchanges of <= {max_chars} chars; ask for fewer")
    pick = np.random.default_rng(seed).permutation(len(pool))[:n]
    return [
        {"prompt": p, "chosen": with_opening(opening, a), "rejected": a}
        for p, a in (pool[int(k)] for k in pick)
    ]


def write_pairs(pairs: list[dict], out: Path, valid_share: float = 0.15) -> Path:
    """out/train.jsonl and out/valid.jsonl (the first ceil(valid_share * n) pairs), the
    layout `--data DIR` reads."""
    n_val = max(1, math.ceil(len(pairs) * valid_share))
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.jsonl", pairs[n_val:]), ("valid.jsonl", pairs[:n_val])):
        (out / name).write_text("".join(json.dumps(p) + "\n" for p in part))
    return out
