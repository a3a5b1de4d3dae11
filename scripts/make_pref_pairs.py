"""Make a preference pair set from the bundled plays, for `toy train --recipe dpo|orpo`.

`toy new` writes one into every project (data/pairs/: 80 pairs of speeches up to 80
characters); this script makes others. Each pair is one exchange of a scene: the first
speaker's speech is the prompt (a user turn), the second speaker's the answer; the chosen
answer opens with a fixed word ("Verily," by default) that the rejected one, otherwise the
same words, does not have (toy.data.dialogue.preference_pairs). Deterministic by --seed;
--valid-share (15%) held out.

    python scripts/make_pref_pairs.py --out data/verily [--pairs 120] [--seed 0]

Writes DIR/train.jsonl and DIR/valid.jsonl in TRL's standard form, one
{"prompt", "chosen", "rejected"} object a line, and prints the directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from toy.data.dialogue import OPENING, preference_pairs, write_pairs  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="directory to write")
    ap.add_argument("--pairs", type=int, default=120, help="pairs in all (default 120)")
    ap.add_argument("--seed", type=int, default=0, help="which exchanges, in which order")
    ap.add_argument("--opening", default=OPENING, help=f'the chosen opening (default "{OPENING}")')
    ap.add_argument("--max-chars", type=int, default=160, help="longest speech (default 160)")
    ap.add_argument("--valid-share", type=float, default=0.15, help="held out (default 0.15)")
    a = ap.parse_args(argv)
    if a.pairs < 2 or not 0 < a.valid_share < 1:
        ap.error("--pairs must be >= 2 and --valid-share in (0, 1)")
    try:
        pairs = preference_pairs(
            bundled_text_paths(), a.pairs, a.seed, a.opening.strip(), a.max_chars
        )
    except ValueError as e:
        ap.error(str(e))
    print(write_pairs(pairs, a.out, a.valid_share))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
