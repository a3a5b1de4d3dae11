"""One row of the issue-18 warm-start table: scratch / donor / pca over several seeds.

Runs `toy train --recipe warm-start` through the CLI once per (init, seed), reads the final
validation loss from the --json output, and prints a markdown row:

    | config | scratch | donor | pca | donor-scratch | pca-scratch | seeds |

Each cell is "mean [min, max]" over the seeds that ran. The differences are means of the
per-seed differences (same seed = same blocks, same batches). `scratch` never gets
`--freeze-embed-steps` (the baseline is the plain, unfrozen scratch run), so a freeze row
reuses the baseline's scratch runs.

Every finished run is appended to --cache (JSON lines); a run already there with the same
settings is not run again, so rows can share runs and an interrupted row can be resumed.

Example (issue 18's setup, King James text, SmolLM2 donor; two runs at once, one thread each):

    PYTHONPATH=src python scripts/warm_start_probe.py --jobs 2 --curves \\
        --corpus /tmp/learn/kjv/kjv.bin \\
        --donor ~/.cache/toy/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

INITS = ("scratch", "donor", "pca")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--corpus", required=True, help="token file from `toy prep --tokenizer DONOR`")
    ap.add_argument("--donor", required=True, help="donor GGUF (its token_embd.weight)")
    ap.add_argument("--inits", nargs="+", default=list(INITS), choices=INITS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-kv-head", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument(
        "--eval-every", type=int, default=20, help="validation every N steps: the curves"
    )
    ap.add_argument("--freeze-embed-steps", type=int, default=0, help="donor and pca only")
    ap.add_argument("--embed-lr-scale", type=float, help="all three inits (default: the recipe's)")
    ap.add_argument(
        "--scratch-embed-lr-scale",
        type=float,
        help="scratch only, e.g. 1 for the baseline before the embedding LR became 3 x --lr",
    )
    ap.add_argument("--label", help="config cell (default: built from the settings)")
    ap.add_argument("--cache", default="warm_start_probe.jsonl", help="JSON lines of finished runs")
    ap.add_argument("--out", help="where run directories go (default: a temporary directory)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at once (each with OMP_NUM_THREADS=1 unless it is set); 2 on 2 cores",
    )
    ap.add_argument(
        "--curves",
        action="store_true",
        help="also print the validation curve by step (mean over seeds) for each init",
    )
    ap.add_argument(
        "--cached-only",
        action="store_true",
        help="run nothing: print the row from the runs already in --cache",
    )
    return ap.parse_args()


def settings(a: argparse.Namespace, init: str, seed: int) -> dict:
    return {
        "corpus": str(Path(a.corpus).resolve()),
        "donor": str(Path(a.donor).expanduser().resolve()),
        "init": init,
        "seed": seed,
        "steps": a.steps,
        "lr": a.lr,
        "n_layer": a.n_layer,
        "d_model": a.d_model,
        "n_head": a.n_head,
        "n_kv_head": a.n_kv_head,
        "seq_len": a.seq_len,
        "batch_size": a.batch_size,
        "eval_batches": a.eval_batches,
        "eval_every": a.eval_every,
        "freeze_embed_steps": 0 if init == "scratch" else a.freeze_embed_steps,
        "embed_lr_scale": (
            a.scratch_embed_lr_scale
            if init == "scratch" and a.scratch_embed_lr_scale is not None
            else a.embed_lr_scale
        ),
    }


def run_one(a: argparse.Namespace, s: dict, out: str) -> list[list[float]]:
    """The run's validation curve: [[step, loss], ...]."""
    cmd = [
        a.python,
        "-m",
        "toy",
        "train",
        "--recipe",
        "warm-start",
        "--donor",
        s["donor"],
        "--corpus",
        s["corpus"],
        "--init",
        s["init"],
        "--n-layer",
        str(s["n_layer"]),
        "--d-model",
        str(s["d_model"]),
        "--n-head",
        str(s["n_head"]),
        "--n-kv-head",
        str(s["n_kv_head"]),
        "--seq-len",
        str(s["seq_len"]),
        "--batch-size",
        str(s["batch_size"]),
        "--lr",
        str(s["lr"]),
        "--eval-batches",
        str(s["eval_batches"]),
        "--eval-every",
        str(s["eval_every"]),
        "--steps",
        str(s["steps"]),
        "--seed",
        str(s["seed"]),
        "--json",
        "--out",
        out,
    ]
    if s["freeze_embed_steps"]:
        cmd += ["--freeze-embed-steps", str(s["freeze_embed_steps"])]
    if s["embed_lr_scale"] is not None:
        cmd += ["--embed-lr-scale", str(s["embed_lr_scale"])]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    env = os.environ.copy()
    env.setdefault("OMP_NUM_THREADS", "1")  # several runs at once must not oversubscribe the cores
    res = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    report = json.loads(res.stdout)
    return [[v["step"], float(v["loss"])] for v in report["val_losses"]]


def cell(xs: list[float], signed: bool = False) -> str:
    if not xs:
        return "-"
    m = statistics.fmean(xs)
    return (
        f"{m:+.3f} [{min(xs):+.3f}, {max(xs):+.3f}]"
        if signed and len(xs) > 1
        else (
            f"{m:+.3f}"
            if signed
            else f"{m:.3f} [{min(xs):.3f}, {max(xs):.3f}]"
            if len(xs) > 1
            else f"{m:.3f}"
        )
    )


def main() -> None:
    a = parse()
    cache = Path(a.cache)
    done: list[dict] = []
    if cache.exists():
        done = [json.loads(line) for line in cache.read_text().splitlines() if line.strip()]
    out = a.out or tempfile.mkdtemp(prefix="warm_start_probe_")
    loss: dict[tuple[str, int], float] = {}
    curve: dict[tuple[str, int], list] = {}
    todo = []
    for seed in a.seeds:  # seed-major, so an interrupted row still has whole seeds
        for init in ("scratch", *[i for i in a.inits if i != "scratch"]):
            s = settings(a, init, seed)
            hit = next((d for d in done if d["settings"] == s), None)
            if hit is not None:
                loss[(init, seed)], curve[(init, seed)] = hit["val_loss"], hit["curve"]
            elif not a.cached_only:
                todo.append((init, seed, s))
    lock = threading.Lock()

    def one(job) -> None:
        init, seed, s = job
        c = run_one(a, s, out)
        with lock:
            with cache.open("a") as f:
                f.write(json.dumps({"settings": s, "val_loss": c[-1][1], "curve": c}) + "\n")
            loss[(init, seed)], curve[(init, seed)] = c[-1][1], c
            print(f"{init} seed {seed}: {c[-1][1]:.4f}", file=sys.stderr, flush=True)

    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        list(pool.map(one, todo))  # list(): a failed run raises here

    def col(init: str) -> list[float]:
        return [loss[(init, s)] for s in a.seeds if (init, s) in loss]

    def diff(init: str) -> list[float]:
        return [
            loss[(init, s)] - loss[("scratch", s)]
            for s in a.seeds
            if (init, s) in loss and ("scratch", s) in loss
        ]

    label = a.label or (
        f"{a.steps} steps, lr {a.lr:g}"
        + (f", freeze {a.freeze_embed_steps}" if a.freeze_embed_steps else "")
        + (f", embed LR x{a.embed_lr_scale:g}" if a.embed_lr_scale is not None else "")
        + (
            f", scratch embed LR x{a.scratch_embed_lr_scale:g}"
            if a.scratch_embed_lr_scale is not None
            else ""
        )
    )
    cells = [label, cell(col("scratch"))]
    cells += [cell(col(i)) if i in a.inits else "-" for i in ("donor", "pca")]
    cells += [cell(diff(i), signed=True) if i in a.inits else "-" for i in ("donor", "pca")]
    have = {i: ",".join(str(s) for s in a.seeds if (i, s) in loss) for i in ("scratch", *a.inits)}
    full = ",".join(str(s) for s in a.seeds)
    cells.append(
        full
        if all(v == full for v in have.values())
        else "; ".join(f"{i} {v or 'none'}" for i, v in have.items()) + " (incomplete)"
    )
    print("| " + " | ".join(cells) + " |")
    if a.curves:
        inits = ("scratch", *[i for i in ("donor", "pca") if i in a.inits])
        steps = sorted({st for c in curve.values() for st, _ in c})
        print("\n| step | " + " | ".join(f"`{i}`" for i in inits) + " |")
        print("|---:|" + "---:|" * len(inits))
        for st in steps:
            row = []
            for i in inits:
                xs = [v for sd in a.seeds for s2, v in curve.get((i, sd), []) if s2 == st]
                row.append(f"{statistics.fmean(xs):.3f}" if xs else "-")
            print(f"| {st} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
