"""Same losses before and after a change: every recipe, byte for byte.

    python scripts/same_losses.py REV          # e.g. REV = the commit before a refactor

Checks REV out into a temporary git worktree, makes one set of tiny inputs (a corpus, a
tiny quantized GGUF base with a ChatML tokenizer, chat JSONL, a donor, an image folder),
then runs the same `toy train --json` command lines with REV's code and with this
checkout's, on this machine, one after the other, and compares the loss numbers as JSON
text: every training and validation loss of every case must be the same bytes. Prints a
line per case and exits 1 on any difference. Floats differ between CPU kinds, so the
comparison is always between two revisions run here, never against stored figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "--preset",
    "tiny",
    "--batch-size",
    "4",
    "--seq-len",
    "32",
    "--eval-batches",
    "2",
    "--steps",
    "6",
]
LORA = [
    "--seq-len",
    "96",
    "--batch-size",
    "2",
    "--eval-batches",
    "2",
    "--lr",
    "1e-2",
    "--warmup",
    "0",
    "--steps",
    "5",
]

# GRPO: its figures (each reward's mean, the completions' lengths) ride in the losses, so
# the same bytes mean the same completions and rewards too.
GRPO = [
    "--reward",
    "length",
    "--reward",
    "accuracy",
    "--target-length",
    "4",
    "--num-generations",
    "4",
    "--max-completion-length",
    "12",
    "--seq-len",
    "96",
    "--lr",
    "5e-2",
    "--steps",
    "4",
    "--eval-every",
    "2",
]


def cases(d: Path) -> dict[str, list[str]]:
    """Name -> `toy train` arguments (each also gets --json --out --run-id)."""
    return {
        "from-scratch llama": ["--corpus", d / "c.bin", *TINY],
        "from-scratch gpt2": ["--arch", "gpt2", "--corpus", d / "c.bin", *TINY],
        "from-scratch accum 2": ["--corpus", d / "c.bin", *TINY, "--grad-accum", "2"],
        "from-scratch checkpointing": ["--corpus", d / "c.bin", *TINY, "--checkpointing"],
        "warm-start scratch": [
            "--recipe",
            "warm-start",
            "--donor",
            d / "donor.gguf",
            "--corpus",
            d / "w.bin",
            "--init",
            "scratch",
            *TINY,
        ],
        "warm-start donor": [
            "--recipe",
            "warm-start",
            "--donor",
            d / "donor.gguf",
            "--corpus",
            d / "w.bin",
            "--init",
            "donor",
            "--d-model",
            "32",
            *TINY,
        ],
        "warm-start pca": [
            "--recipe",
            "warm-start",
            "--donor",
            d / "donor.gguf",
            "--corpus",
            d / "w.bin",
            "--init",
            "pca",
            "--d-model",
            "32",
            *TINY,
        ],
        "lora chat quantized": [
            "--recipe",
            "lora",
            "--model",
            d / "base.gguf",
            "--data",
            d / "chat.jsonl",
            *LORA,
        ],
        "lora chat float32": [
            "--recipe",
            "lora",
            "--model",
            d / "base.gguf",
            "--data",
            d / "chat.jsonl",
            *LORA,
            "--base-dtype",
            "float32",
            "--targets",
            "q_proj,v_proj,down_proj",
        ],
        "lora tokens": [
            "--recipe",
            "lora",
            "--model",
            d / "base.gguf",
            "--corpus",
            d / "b.bin",
            *LORA,
        ],
        "dpo": ["--recipe", "dpo", "--model", d / "base.gguf", "--data", d / "pairs", *LORA],
        "orpo": ["--recipe", "orpo", "--model", d / "base.gguf", "--data", d / "pairs", *LORA],
        "dpo float32 base": [
            "--recipe",
            "dpo",
            "--model",
            d / "base.gguf",
            "--data",
            d / "pairs",
            *LORA,
            "--base-dtype",
            "float32",
            "--beta",
            "0.3",
        ],
        "simpo": ["--recipe", "simpo", "--model", d / "base.gguf", "--data", d / "pairs", *LORA],
        "grpo": ["--recipe", "grpo", "--model", d / "base.gguf", "--data", d / "arith", *GRPO],
        "grpo reused KL batch-scale": [
            "--recipe",
            "grpo",
            "--model",
            d / "base.gguf",
            "--data",
            d / "arith",
            *GRPO,
            "--num-iterations",
            "2",
            "--beta",
            "0.05",
            "--scale-rewards",
            "batch",
            "--loss-type",
            "grpo",
        ],
        "vit-tiny": [
            "--recipe",
            "vit-tiny",
            "--images",
            d / "img",
            "--preset",
            "tiny",
            "--batch-size",
            "8",
            "--steps",
            "5",
            "--eval-batches",
            "2",
        ],
        "from-scratch 2 processes": ["--nproc", "2", "--corpus", d / "c.bin", *TINY],
    }


def make_inputs(d: Path) -> None:
    """Tiny inputs made with this checkout's code and test fixtures (both revisions read the
    same files)."""
    sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]
    from helpers.gguf_fixtures import tiny_model, write_llama_gguf
    from PIL import Image

    from toy.cli.main import main
    from toy.data.arith import make_arith
    from toy.data.dialogue import conversations, preference_pairs, write_jsonl, write_pairs
    from toy.data.prep import bundled_text_paths
    from toy.tokenizer import train_bpe

    plays = bundled_text_paths()
    text = plays[0].read_text()[:40000]
    (d / "t.txt").write_text(text)
    assert main(["prep", str(d / "t.txt"), "--out", str(d / "c.bin"), "--vocab-size", "300"]) == 0
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    vocab = tok.get_vocab_size(with_added_tokens=True)
    write_llama_gguf(d / "donor.gguf", tiny_model(seed=3, vocab_size=vocab), tok)
    assert (
        main(
            [
                "prep",
                str(d / "t.txt"),
                "--out",
                str(d / "w.bin"),
                "--tokenizer",
                str(d / "donor.gguf"),
            ]
        )
        == 0
    )
    base = tiny_model(vocab_size=vocab, max_seq_len=256)
    q8 = {
        f"blk.{i}.{t}.weight": "Q8_0"
        for i in range(2)
        for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    }
    write_llama_gguf(d / "base.gguf", base, tok, qtypes=q8)
    write_jsonl(conversations(plays, 60, seed=1, turns=(1, 2), max_chars=150), d / "chat.jsonl")
    write_pairs(preference_pairs(plays, 40, seed=1, max_chars=120), d / "pairs")
    make_arith(d / "arith", 24, 4, seed=0)
    assert (
        main(
            [
                "prep",
                str(d / "t.txt"),
                "--out",
                str(d / "b.bin"),
                "--tokenizer",
                str(d / "base.gguf"),
            ]
        )
        == 0
    )
    import numpy as np

    rng = np.random.default_rng(0)
    for c in ("a", "b", "c"):
        (d / "img" / c).mkdir(parents=True)
        for i in range(12):
            Image.fromarray(rng.integers(0, 255, (28, 28), dtype=np.uint8)).save(
                d / "img" / c / f"{i}.png"
            )


def run_all(
    src: Path, d: Path, out: Path, only: list[str] | None, extra: list[str]
) -> dict[str, dict]:
    env = {
        **os.environ,
        "PYTHONPATH": str(src),
        "TOY_CACHE": str(d / "cache"),
        "OMP_NUM_THREADS": "1",
    }
    results = {}
    for name, argv in cases(d).items():
        if only and name not in only:
            continue
        rid = name.replace(" ", "-")
        cmd = [
            sys.executable,
            "-m",
            "toy",
            "train",
            *map(str, argv),
            *extra,
            "--json",
            "--out",
            str(out),
            "--run-id",
            rid,
        ]
        r = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            results[name] = {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
            continue
        j = json.loads(r.stdout.strip().splitlines()[-1])
        # The numbers as JSON text: the same bytes or not.
        results[name] = {
            "losses": json.dumps(j["losses"]),
            "val_losses": json.dumps(j["val_losses"]),
            "metrics": json.dumps(j.get("metrics")),  # held-out figures (GRPO's rewards)
        }
    return results


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "rev", help="the revision to compare this checkout with (a commit, tag or branch)"
    )
    ap.add_argument("--case", action="append", help="run only this case (repeatable)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument(
        "--precision",
        choices=("float32", "bf16"),
        help="give every case --precision P (default: none, auto: bf16 on a cpu with bf16 units)",
    )
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="same-losses-"))
    wt = tmp / "rev"
    try:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(wt), a.rev],
            check=True,
        )
        d = tmp / "inputs"
        d.mkdir()
        make_inputs(d)
        extra = ["--precision", a.precision] if a.precision else []
        before = run_all(wt / "src", d, tmp / "runs-before", a.case, extra)
        after = run_all(ROOT / "src", d, tmp / "runs-after", a.case, extra)
        bad = 0
        for name in before:
            b, n = before[name], after[name]
            same = "error" not in b and b == n
            bad += not same
            what = "same losses" if same else f"DIFFER: {a.rev}: {b} / here: {n}"
            print(f"{name:28s} {what}")
        print(
            f"{len(before) - bad} of {len(before)} cases give the same losses byte for byte "
            f"as {a.rev}"
        )
        return 1 if bad else 0
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(wt)], capture_output=True
        )
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")


if __name__ == "__main__":
    sys.exit(main())
