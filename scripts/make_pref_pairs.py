"""Make a preference pair set from the bundled plays, for `toy train --recipe dpo|orpo`.

Each pair is one exchange of a scene: the first speaker's speech is the prompt (a user
turn), the second speaker's the answer. The chosen answer opens with a fixed word ("Verily,"
by default) that the rejected one, otherwise the same words, does not have: a style a user
sees in the first word of a reply. Deterministic by --seed; --valid-share (15%) held out.

    python scripts/make_pref_pairs.py --out data/verily [--pairs 120] [--seed 0]

Writes DIR/train.jsonl and DIR/valid.jsonl in TRL's standard form, one
{"prompt", "chosen", "rejected"} object a line, and prints the directory.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from toy.data.dialogue import speeches  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402

STAGE = re.compile(r"\[[^\]]*\]\s*")  # an inline stage direction: "[Aside.]"


def exchanges(max_chars: int) -> list[tuple[str, str]]:
    """(speech, reply) of consecutive speakers of one scene, both at most max_chars."""
    out = []
    for path in bundled_text_paths():
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


def make_pairs(n: int, seed: int, opening: str, max_chars: int) -> list[dict]:
    pool = exchanges(max_chars)
    if len(pool) < n:
        raise SystemExit(f"only {len(pool)} exchanges of <= {max_chars} chars; ask for fewer")
    pick = np.random.default_rng(seed).permutation(len(pool))[:n]
    return [
        {"prompt": p, "chosen": with_opening(opening, a), "rejected": a}
        for p, a in (pool[int(k)] for k in pick)
    ]


def write(pairs: list[dict], out: Path, valid_share: float) -> Path:
    n_val = max(1, math.ceil(len(pairs) * valid_share))
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.jsonl", pairs[n_val:]), ("valid.jsonl", pairs[:n_val])):
        (out / name).write_text("".join(json.dumps(p) + "\n" for p in part))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="directory to write")
    ap.add_argument("--pairs", type=int, default=120, help="pairs in all (default 120)")
    ap.add_argument("--seed", type=int, default=0, help="which exchanges, in which order")
    ap.add_argument("--opening", default="Verily,", help='the chosen opening (default "Verily,")')
    ap.add_argument("--max-chars", type=int, default=160, help="longest speech (default 160)")
    ap.add_argument("--valid-share", type=float, default=0.15, help="held out (default 0.15)")
    a = ap.parse_args(argv)
    if a.pairs < 2 or not 0 < a.valid_share < 1:
        ap.error("--pairs must be >= 2 and --valid-share in (0, 1)")
    pairs = make_pairs(a.pairs, a.seed, a.opening.strip(), a.max_chars)
    print(write(pairs, a.out, a.valid_share))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
