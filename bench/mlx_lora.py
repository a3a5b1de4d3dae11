"""One benchmark child: LoRA r8 on q_proj, v_proj of SmolLM2-135M, batch 4 x 256 tokens of
plain text (every token supervised), on a base of any kind, toy or mlx-lm's own trainer.

    python bench/mlx_lora.py --impl toy --model MLX_DIR|FILE.gguf --data DIR [--steps 6]
    python bench/mlx_lora.py --impl mlx --model MLX_DIR --data DIR [--steps 2] [--timeout 1200]

DIR holds train.jsonl ({"text"} lines of ~300 tokens: each fills a 256-token row). toy runs
its real recipe and loop (the tokens/s `toy train --json` reports, after 3 warm-up steps);
mlx-lm runs `python -m mlx_lm lora` with the same rank, scale (alpha / r = 2), keys, batch
and sequence length, and its own tok/s (loss tokens over training time, validation
excluded) is read from its report. Prints one JSON line: tokens_per_s, peak_rss_mb (the
process's own, or the mlx-lm child's), and for mlx `iterations` done within --timeout.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_toy(a) -> dict:
    import torch

    from toy.recipes import lora
    from toy.runs import EventLog, Project
    from toy.train.config import RunConfig
    from toy.train.loop import train

    opts = lora.RECIPE.config(
        model=str(a.model),
        data=str(a.data),
        seed=0,
        seq_len=256,
        batch_size=4,
        eval_batches=1,
        targets="q_proj,v_proj",
        rank=8,
        alpha=16.0,
    )
    t0 = time.perf_counter()
    built = lora.build(opts, Project(root=None))
    load_s = time.perf_counter() - t0
    built.job.eval_batches = lambda: []  # time training only
    cfg = RunConfig(
        steps=3 + a.steps, batch_size=4, lr=1e-4, min_lr=1e-5, warmup=0, weight_decay=0.0
    )
    res = train(built.job, cfg, None, torch.device("cpu"), EventLog(None))
    return {"load_s": load_s, "tokens_per_s": res.items_per_s}


def run_mlx(a) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "lora.yaml"
        cfg.write_text(
            "lora_parameters:\n  rank: 8\n  scale: 2.0\n  dropout: 0.0\n"
            '  keys: ["self_attn.q_proj", "self_attn.v_proj"]\n'
        )
        cmd = [
            sys.executable,
            "-m",
            "mlx_lm",
            "lora",
            "--model",
            str(a.model),
            "--train",
            "--data",
            str(a.data),
            "-c",
            str(cfg),
            "--num-layers",
            "-1",
            "--batch-size",
            "4",
            "--max-seq-length",
            "256",
            "--iters",
            str(a.steps),
            "--learning-rate",
            "1e-4",
            "--steps-per-report",
            "1",
            "--adapter-path",
            str(Path(d) / "adapters"),
            "--seed",
            "0",
        ]
        t0 = time.perf_counter()
        try:
            r = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=a.timeout,
                env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
            )
            out, timed_out = r.stdout, False
        except subprocess.TimeoutExpired as e:
            out, timed_out = (
                (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""),
                True,
            )
    wall = time.perf_counter() - t0
    rates = [
        float(m)
        for m in re.findall(
            r"^\s*\d+\s+[\d.]+\s+([\d.]+)\s+", re.sub(r"\x1b\[[0-9;]*m", "", out), flags=re.M
        )
    ]
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {
        "tokens_per_s": rates[-1] if rates else None,
        "iterations": len(rates),
        "timed_out": timed_out,
        "wall_s": wall,
        "peak_rss_mb": peak,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("toy", "mlx"), required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument(
        "--timeout", type=float, default=1200, help="mlx: seconds before its run is stopped"
    )
    a = ap.parse_args()
    out = run_toy(a) if a.impl == "toy" else run_mlx(a)
    if a.impl == "toy":
        out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))


if __name__ == "__main__":
    main()
