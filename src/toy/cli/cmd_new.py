"""`toy new DIR`: a project with toy.toml, runs/, and under data/ the bundled plays
tokenized: corpus.bin, corpus.val.bin and corpus.tokenizer.json (the tokenizer that made
them), plus chat.jsonl: conversations made from the plays' dialogue, for a first LoRA
run (`toy train --recipe lora --data data/chat.jsonl`), and pairs/ (train.jsonl,
valid.jsonl): preference pairs whose chosen answer opens with "Verily,", for a first DPO or
ORPO run (`toy train --recipe dpo --data data/pairs`), and arith/ (train.jsonl,
valid.jsonl): arithmetic questions with an "answer" column, a task whose rewards can be
checked, for a first GRPO run (`toy train --recipe grpo --data data/arith --reward
accuracy`). `toy train` uses data/corpus.bin when no --corpus is given."""

from __future__ import annotations

import shutil
from pathlib import Path

from toy.data import dialogue
from toy.data.arith import make_arith
from toy.data.prep import DEFAULT_VOCAB, bundled_corpus, bundled_text_paths
from toy.data.tokens import tokenizer_beside, tokenizer_path_for, val_path_for
from toy.errors import UsageError
from toy.runs import DEFAULT_RUN_ID_TEMPLATE

TOML = """\
# toy project settings. Flags given on the command line win over these.

# Run directory names under runs/. Fields: {{date}} {{recipe}} {{arch}} {{n}} (n: next free number).
run_id = "{template}"

[train]
# Defaults for `toy train` in this project: the same names as its flags, with _ for -.
# A [train.<recipe>] table (e.g. [train.lora]) applies to one recipe only.
seed = 0
device = "cpu"
eval_batches = 8
# steps = 300
# batch_size = 16
# eval_every = 50

# [train.from-scratch]
# lr = 1e-3
"""


# Conversations in data/chat.jsonl: one epoch of LoRA on SmolLM2 over them is a couple of
# minutes on 2 cores, long enough for the held-out loss to fall visibly.
CHATS = 240
# Preference pairs in data/pairs/: the set the DPO walk measures
# (tests/walks/test_preference_walk.py, README): 68 to train on, 12 held out, speeches of at
# most 80 characters.
PAIRS, PAIR_CHARS = 80, 80
FIRST_STEPS = 300  # the first run `toy new` suggests (README's too)
# Arithmetic questions in data/arith/: the GRPO walk's task (README, docs/results.md).
ARITH_TRAIN, ARITH_VALID = 200, 16


def add_parser(sub) -> None:
    p = sub.add_parser("new", help="create a project directory", description=__doc__)
    p.add_argument("dir", help="project directory to create (must not exist, or be empty)")
    p.set_defaults(func=run)


def run(args) -> int:
    d = Path(args.dir)
    if d.exists() and (not d.is_dir() or any(d.iterdir())):
        raise UsageError(f"{d} exists and is not an empty directory; pick a new DIR")
    try:
        (d / "data").mkdir(parents=True, exist_ok=True)
        (d / "runs").mkdir(exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create {d}: {e.strerror}")
    src = bundled_corpus(DEFAULT_VOCAB)
    dst = d / "data" / "corpus.bin"
    # The same names `toy prep --out data/corpus.bin` gives, so a second corpus prepared
    # into data/ never touches this one's tokenizer.
    for a, b in (
        (src, dst),
        (val_path_for(src), val_path_for(dst)),
        (tokenizer_beside(src), tokenizer_path_for(dst)),
    ):
        shutil.copyfile(a, b)
    chats = dialogue.conversations(bundled_text_paths(), CHATS, seed=0, turns=(1, 2), max_chars=400)
    dialogue.write_jsonl(chats, d / "data" / "chat.jsonl")
    pairs = dialogue.preference_pairs(bundled_text_paths(), PAIRS, seed=0, max_chars=PAIR_CHARS)
    dialogue.write_pairs(pairs, d / "data" / "pairs")
    make_arith(d / "data" / "arith", ARITH_TRAIN, ARITH_VALID, seed=0)
    (d / "toy.toml").write_text(TOML.format(template=DEFAULT_RUN_ID_TEMPLATE))
    print(
        f"created project {d}: toy.toml, data/corpus.bin (bundled Shakespeare, BPE "
        f"{DEFAULT_VOCAB}), data/chat.jsonl ({len(chats)} conversations from the plays), "
        f"data/pairs/ ({len(pairs)} preference pairs), data/arith/ ({ARITH_TRAIN} arithmetic "
        "questions with answers), runs/"
    )
    # Long enough for the loss to fall (5 steps, the default, is not).
    print(f"next: cd {d} && toy train --recipe from-scratch --steps {FIRST_STEPS}")
    return 0
