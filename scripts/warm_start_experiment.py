#!/usr/bin/env python
"""Warm start vs scratch: three small llamas on a few Shakespeare plays tokenized with
SmolLM2-135M's tokenizer, identical but for the embedding init (--init scratch | donor |
pca), then the figures into docs/results.md ("Warm start" section) and a loss plot.

    nice -n 10 .venv/bin/python scripts/warm_start_experiment.py  # ~20 min a run on 2 busy cores
    .venv/bin/python scripts/warm_start_experiment.py --steps 20 --no-write  # a quick look

Everything goes through the `toy` command line (prep, train --json, plot), so the
experiment exercises what a user runs. The donor comes from scripts/get-smollm2.sh
(cached in ~/.cache/toy/models). Only the block between the `warm-start:begin/end`
markers of docs/results.md is rewritten; the discussion around it is kept.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PLAYS = ROOT / "src" / "toy" / "data" / "assets" / "shakespeare"
BEGIN, END = "<!-- warm-start:begin -->", "<!-- warm-start:end -->"
SECTION = "## Warm start"


def toy(*args: object) -> str:
    """Run `python -m toy ARGS`; its stdout, or exit with its stderr."""
    cmd = [sys.executable, "-m", "toy", *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr.strip()}")
    return r.stdout


def get_donor(work: Path) -> Path:
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "get-smollm2.sh"), str(work)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    if r.returncode != 0:
        sys.exit(f"scripts/get-smollm2.sh failed: {r.stderr.strip()}")
    return Path(r.stdout.strip().splitlines()[-1])


def unigram_val_loss(train: Path, val: Path) -> float:
    """Cross-entropy of the validation tokens under the training tokens' add-one unigram:
    the loss of a model that ignores context, a floor any LM should get under quickly."""
    from toy.data.tokens import read_tokens

    tr, va = read_tokens(train), read_tokens(val)
    counts = np.bincount(np.asarray(tr.tokens), minlength=tr.vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(va.tokens)].mean())


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--work",
        default="/tmp/ws",
        help="scratch directory: donor link, corpus, runs (default /tmp/ws)",
    )
    ap.add_argument(
        "--plays", default="hamlet,macbeth,othello,tempest", help="bundled plays to train on"
    )
    ap.add_argument("--inits", default="scratch,donor,pca")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--n-kv-head", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--probe",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure the step-0 loss of the exact equal-width copy (d_model = donor width)",
    )
    ap.add_argument("--results", default=str(ROOT / "docs" / "results.md"))
    ap.add_argument("--plot", default=str(ROOT / "docs" / "warm_start_loss.png"))
    ap.add_argument("--no-write", action="store_true", help="print the figures, leave docs/ alone")
    a = ap.parse_args()

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    donor = get_donor(work)
    desc = json.loads(toy("describe", donor, "--json"))
    plays = [PLAYS / f"{p.strip()}.txt" for p in a.plays.split(",")]
    corpus = work / "corpus.bin"
    prep = json.loads(
        toy(
            "prep",
            *plays,
            "--tokenizer",
            donor,
            "--out",
            corpus,
            "--val-fraction",
            "0.1",
            "--force",
            "--json",
        )
    )
    print(
        f"corpus: {prep['train_tokens']:,} train / {prep['val_tokens']:,} val tokens, "
        f"vocab {prep['vocab_size']:,}",
        flush=True,
    )
    runs = work / "runs"
    shape = [
        "--n-layer",
        a.n_layer,
        "--d-model",
        a.d_model,
        "--n-head",
        a.n_head,
        "--n-kv-head",
        a.n_kv_head,
        "--seq-len",
        a.seq_len,
        "--batch-size",
        a.batch_size,
        "--lr",
        a.lr,
        "--seed",
        a.seed,
    ]
    results: dict[str, dict] = {}
    for init in a.inits.split(","):
        rid = f"ws-{init}"
        shutil.rmtree(runs / rid, ignore_errors=True)
        t0 = time.perf_counter()
        out = toy(
            "train",
            "--recipe",
            "warm-start",
            "--donor",
            donor,
            "--corpus",
            corpus,
            "--init",
            init,
            *shape,
            "--steps",
            a.steps,
            "--eval-every",
            a.eval_every,
            "--eval-batches",
            a.eval_batches,
            "--out",
            runs,
            "--run-id",
            rid,
            "--json",
        )
        r = json.loads(out)
        r["process_s"] = time.perf_counter() - t0
        info = json.loads((runs / rid / "run.json").read_text())
        r["trainable"] = info["params"]
        results[init] = r
        vals = " ".join(f"{v['step']}:{v['loss']:.3f}" for v in r["val_losses"])
        print(
            f"{init:8s} val {vals} | {r['tokens_per_s']:.0f} tok/s, {r['wall_s']:.0f}s", flush=True
        )

    probe = None
    if a.probe:
        # The exact copy at the donor's width (576 for SmolLM2): its step-0 loss shows what
        # the donor's own scale does to a fresh tied model. One step is enough to see it.
        width = desc["hyperparameters"]
        rid = "ws-probe-equal-width"
        shutil.rmtree(runs / rid, ignore_errors=True)
        out = toy(
            "train",
            "--recipe",
            "warm-start",
            "--donor",
            donor,
            "--corpus",
            corpus,
            "--init",
            "donor",
            "--n-layer",
            a.n_layer,
            "--d-model",
            width["d_model"],
            "--n-head",
            width["n_head"],
            "--n-kv-head",
            width["n_kv_head"],
            "--seq-len",
            a.seq_len,
            "--batch-size",
            a.batch_size,
            "--seed",
            a.seed,
            "--steps",
            1,
            "--eval-batches",
            a.eval_batches,
            "--out",
            runs,
            "--run-id",
            rid,
            "--json",
        )
        r = json.loads(out)
        probe = {"d_model": width["d_model"], "val0": r["val_losses"][0]["loss"]}
        print(
            f"probe: equal-width copy (d_model {width['d_model']}) val loss at step 0 "
            f"{probe['val0']:.3f}",
            flush=True,
        )

    unigram = unigram_val_loss(corpus, work / "corpus.val.bin")
    vocab = prep["vocab_size"]
    text = report(a, prep, plays, results, probe, unigram, vocab, desc)
    print(text)
    if a.no_write:
        return
    toy(
        "plot",
        *(runs / f"ws-{i}" for i in results),
        "--out",
        a.plot,
        "--title",
        f"warm start from SmolLM2-135M's embedding: {a.n_layer} layers, d_model {a.d_model}",
    )
    write_section(Path(a.results), text)
    print(f"wrote {a.results} and {a.plot}")


def report(
    a,
    prep: dict,
    plays: list[Path],
    results: dict[str, dict],
    probe: dict | None,
    unigram: float,
    vocab: int,
    desc: dict,
) -> str:
    inits = list(results)
    steps = sorted({v["step"] for r in results.values() for v in r["val_losses"]})
    val = {i: {v["step"]: v["loss"] for v in r["val_losses"]} for i, r in results.items()}
    any_r = next(iter(results.values()))
    d = a.d_model
    emb = vocab * d
    full = results.get("scratch", any_r)["params"]
    lines = [
        BEGIN,
        f"Measured {time.strftime('%Y-%m-%d')} with `scripts/warm_start_experiment.py` "
        f"on {platform.machine()} CPU, "
        f"{os.cpu_count()} cores shared with other jobs "
        "(`nice -n 10`; speed figures are indicative only).",
        "",
        f"- Donor: {Path(os.path.realpath(desc['path'])).name} "
        f"(`general.name` {desc.get('name')!r}), width "
        f"{desc['hyperparameters']['d_model']}, "
        f"vocabulary {desc['hyperparameters']['vocab_size']:,} "
        f"(tensor types: {', '.join(desc['tensor_types'])}).",
        f"- Corpus: {', '.join(p.stem for p in plays)}, tokenized with the donor's tokenizer: "
        f"{prep['train_tokens']:,} train / {prep['val_tokens']:,} validation tokens "
        f"(validation = the last 10% of the token stream).",
        f"- Model: llama, {a.n_layer} layers, d_model {d}, "
        f"{a.n_head} heads / {a.n_kv_head} kv heads, tied "
        f"embedding; {full:,} parameters, of which the {vocab:,} x {d} embedding is {emb:,} "
        f"({emb / full:.0%}).",
        f"- Training: {a.steps} steps of {a.batch_size} x {a.seq_len} tokens, "
        f"AdamW lr {a.lr:g} (warmup 10, cosine "
        f"to 1e-4, weight decay 0.1), seed {a.seed} for all three: same blocks, same batches; "
        "only the embedding "
        "differs.",
        f"- Validation: {a.eval_batches} batch(es) "
        f"({a.eval_batches * a.batch_size * a.seq_len:,} tokens), the same "
        f"every time. A context-free unigram model scores {unigram:.3f}; "
        f"a uniform guess ln({vocab}) = "
        f"{math.log(vocab):.3f}.",
        "",
        "Validation loss (nats/token) by step:",
        "",
        "| step | " + " | ".join(f"`--init {i}`" for i in inits) + " |",
        "|---:|" + "---:|" * len(inits),
    ]
    for s in steps:
        row = [f"{val[i][s]:.3f}" if s in val[i] else "-" for i in inits]
        best = min((val[i][s] for i in inits if s in val[i]), default=None)
        row = [f"**{c}**" if best is not None and c == f"{best:.3f}" else c for c in row]
        lines.append(f"| {s} | " + " | ".join(row) + " |")
    lines += [
        "",
        "| init | trainable params | final train loss | final val loss | tokens/s "
        "| train wall time |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for i, r in results.items():
        lines.append(
            f"| {i} | {r['trainable']:,} | {r['losses'][-1]['loss']:.3f} | "
            f"{r['val_losses'][-1]['loss']:.3f} | {r['tokens_per_s']:,.0f} | {r['wall_s']:.0f} s |"
        )
    if probe is not None:
        lines += [
            "",
            "Probe: the exact copy at the donor's width "
            f"(`--init donor --d-model {probe['d_model']}`, "
            f"no rescale) starts at validation loss {probe['val0']:.3f}.",
        ]
    lines += ["", f"![validation and train loss]({Path(a.plot).name})", END]
    return "\n".join(lines)


def write_section(path: Path, block: str) -> None:
    """Replace the block between the markers; else add a Warm start section at the end.
    Other sections (another engineer's) are left as they are."""
    text = path.read_text() if path.is_file() else "# Results\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + f"\n\n{SECTION}\n\n{block}\n"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
