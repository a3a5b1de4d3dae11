"""Where a GRPO step's time goes: toy's real job (bench/grpo_step.py's setting), its parts
timed from inside.

    python bench/grpo_phases.py --gguf data/smollm2-135m.gguf [--task open|arith]
                                [--steps 3] [--tokens 128]

Runs `--recipe grpo` in this process as grpo_step.py's toy child does (4 prompts x 8
completions, LoRA r8 q,v, dapo, beta 0, bf16 where the CPU has bf16 units) and wraps, for
the steps after the first: each prompt's prefill, each decode step (by the rows still in
the batch), the finished rows' cache compaction, the draws, the rewards and the batch's
layout (the rest of sampling), the log-prob forward (the loss), its backward, and the
optimizer. Prints one JSON line: seconds a step of each part (mean over the timed steps),
the decode steps' time by rows alive, the step's FLOPs floor (see --ceiling) and the CPU
kind. A figure for docs/performance.md, not a timed test.

--ceiling GFLOPS: the machine's bf16 matmul rate (2048^3, what bench/profile_step.py
measures) to turn the step's matmul FLOPs (2 x weights a sampled token; 4 x weights a
trained token: the forward and the backward to the activations) into a floor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, default=Path("data/smollm2-135m.gguf"))
    ap.add_argument("--task", choices=("arith", "open"), default="open")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--ceiling", type=float, default=0.0, help="bf16 matmul GFLOP/s")
    ap.add_argument(
        "--unshared",
        action="store_true",
        help="score every row whole, its prompt included (the float32 path), for comparison",
    )
    a = ap.parse_args()

    import grpo_step

    from toy.cli.main import main as toy_main
    from toy.models import sample
    from toy.train.device import cpu_kind

    parts: dict[str, float] = defaultdict(float)
    by_rows: dict[int, list[float]] = defaultdict(list)
    counting = [False]  # after the warm-up step
    tokens = {"prefill": 0, "decode": 0}

    def timed(name, fn):
        def run(*args, **kw):
            t = time.perf_counter()
            out = fn(*args, **kw)
            if counting[0]:
                parts[name] += time.perf_counter() - t
            return out

        return run

    real_last = sample.last_logits

    def last_logits(model, ids, cache, *rest):
        t = time.perf_counter()
        out = real_last(model, ids, cache, *rest)
        if counting[0]:
            dt = time.perf_counter() - t
            if ids.shape[1] > 1 or ids.shape[0] == 1 and cache.pos == 0:
                parts["prefill"] += dt
                tokens["prefill"] += ids.numel()
            else:
                parts["decode"] += dt
                by_rows[ids.shape[0]].append(dt)
                tokens["decode"] += ids.shape[0]
        return out

    sample.last_logits = last_logits
    sample._keep_rows = timed("compaction", sample._keep_rows)
    sample.pick = timed("draws", sample.pick)
    real_sample_groups = sample.sample_groups
    from toy.recipes import grpo

    grpo.sample_groups = timed("sampling", real_sample_groups)
    if a.unshared:
        real_logps = grpo.completion_logps
        grpo.completion_logps = lambda m, b, temp: real_logps(m, b, temp, share=False)
    real_sample = grpo.GRPOJob.sample
    grpo.GRPOJob.sample = timed("batch", real_sample)  # sampling + rewards + layout
    real_loss = grpo.GRPOJob.loss
    grpo.GRPOJob.loss = timed("forward", real_loss)
    real_backward = torch.Tensor.backward
    torch.Tensor.backward = timed("backward", real_backward)

    steps_seen = [0]

    def pre(opt, args, kw):
        opt._t = time.perf_counter()

    def post(opt, args, kw):
        if counting[0]:
            parts["optimizer"] += time.perf_counter() - opt._t
        steps_seen[0] += 1
        counting[0] = steps_seen[0] >= 1  # the first step is the warm-up

    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        (d / "rw.py").write_text(grpo_step.reward_source(a.task))
        data = d / "q.jsonl"
        n = grpo_step.PROMPTS * (a.steps + 1)
        grpo_step.questions(data, n, a.task)
        argv = ["train", "--recipe", "grpo", "--model", str(a.gguf), "--data", str(data)]
        argv += ["--reward", f"{d / 'rw.py'}:reward_len", "--num-generations", str(grpo_step.G)]
        argv += ["--max-completion-length", str(a.tokens), "--batch-size", str(grpo_step.PROMPTS)]
        argv += ["--steps", str(a.steps + 1), "--rank", str(grpo_step.RANK)]
        argv += ["--alpha", str(grpo_step.ALPHA), "--out", str(d / "runs"), "--run-id", "b"]
        argv += ["--lr", "1e-5", "--eval-every", "0", "--json"]
        t0 = time.perf_counter()
        code = toy_main(argv)
        wall = time.perf_counter() - t0
        if code:
            raise SystemExit(code)
        events = [json.loads(x) for x in (d / "runs/b/events.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    times = [b["time"] - a_["time"] for a_, b in zip(steps, steps[1:])]
    k = len(times)
    per = {name: round(v / k, 3) for name, v in sorted(parts.items())}
    rest = per.get("batch", 0) - per.get("sampling", 0)
    sampling = per.get("sampling", 0)
    inside = per.get("prefill", 0) + per.get("decode", 0) + per.get("compaction", 0)
    out = {
        "cpu_kind": cpu_kind(),
        "task": a.task,
        "threads": torch.get_num_threads(),
        "s_per_step": round(statistics.mean(times), 3),
        "parts_s": per,
        "sampling_other_s": round(sampling - inside - per.get("draws", 0), 3),
        "rewards_and_layout_s": round(rest, 3),
        "completion_tokens_per_step": round(tokens["decode"] / k, 1),
        "prefill_tokens_per_step": round(tokens["prefill"] / k, 1),
        "decode_ms_by_rows": {
            r: [len(v) // k, round(1e3 * statistics.mean(v), 2)]
            for r, v in sorted(by_rows.items(), reverse=True)
        },
        "wall_s": round(wall, 1),
    }
    if a.ceiling:
        # SmolLM2-135M's matmul weights, the head included: 2 FLOPs a weight a token for a
        # forward; the trained pass is a forward and a backward to the activations (the
        # frozen base's weight gradients are never made: ~2x the forward)
        params = 134.5e6
        sampled = tokens["prefill"] + tokens["decode"]  # sampling's forward tokens
        trained = grpo_step.G * tokens["prefill"] + tokens["decode"]  # every row's tokens
        flops = 2 * params * sampled / k + 2 * 2 * params * trained / k
        out["floor_s"] = round(flops / (a.ceiling * 1e9), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
