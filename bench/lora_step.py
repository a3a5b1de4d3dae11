"""One benchmark child: a GGUF base (SmolLM2-135M) + LoRA r=8 on q,v; time training steps.

Each implementation runs in its own process so load time and peak RSS are its alone:
    python bench/lora_step.py --impl toy|hf --model SmolLM2.gguf --corpus tokens.bin
        [--steps 8] [--compile] [--base-dtype auto|quantized|bfloat16|float32] [--checkpointing]
        [--batch 4] [--seq 256] [--precision float32|bf16]
toy runs its real recipe and loop (the figure `toy train --json` reports), its base held
as --base-dtype says (auto, toy's default: a bf16 copy under bf16 on a CPU with the units,
the GGUF's own blocks otherwise: recipes/adapter.base_dtype); the peer is
transformers (GGUF load, dequantized to float32, SDPA) + peft with torch AdamW, fed the
same token windows. Prints one JSON line: load_s, tokens_per_s, peak_rss_mb.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def run_toy(a) -> tuple[float, float]:
    from toy.recipes import lora
    from toy.runs import EventLog, Project
    from toy.train.config import RunConfig
    from toy.train.loop import train

    opts = lora.RECIPE.config(
        model=str(a.model),
        corpus=str(a.corpus),
        seed=0,
        seq_len=a.seq,
        batch_size=a.batch,
        eval_batches=1,
        base_dtype=None if a.base_dtype == "auto" else a.base_dtype,
        device="cpu",
        precision=a.precision,  # resolved, as `toy train` passes it to the recipe
    )
    t0 = time.perf_counter()
    built = lora.build(opts, Project(root=None))
    load_s = time.perf_counter() - t0
    built.job.eval_batches = lambda: []  # time training only
    cfg = RunConfig(
        steps=3 + a.steps,
        batch_size=a.batch,
        lr=1e-4,
        min_lr=1e-5,
        warmup=0,
        weight_decay=0.0,
        compile=a.compile,
        checkpointing=a.checkpointing,
        precision=a.precision,
    )
    res = train(built.job, cfg, None, torch.device("cpu"), EventLog(None))
    return load_s, res.items_per_s  # measured after 3 warm-up steps, as `toy train` reports it


def peer(model_path: Path, corpus: Path, batch: int, seq: int):
    """transformers (GGUF dequantized to float32) + peft, and its training step:
    step(k) -> tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from toy.data.tokens import Windows, read_tokens

    model = AutoModelForCausalLM.from_pretrained(
        str(model_path.parent),
        gguf_file=model_path.name,
        dtype=torch.float32,
        attn_implementation="sdpa",
    )
    model = get_peft_model(
        model,
        LoraConfig(
            r=8,
            lora_alpha=16,
            lora_dropout=0.0,
            target_modules=["q_proj", "v_proj"],
            task_type="CAUSAL_LM",
        ),
    )
    model.train()
    win = Windows(read_tokens(corpus, check_ids=False), seq, batch, seed=0)
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0
    )

    def step(k: int) -> int:
        b = win.batch(k)
        logits = model(input_ids=b["ids"], use_cache=False).logits  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), b["targets"].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        return batch * seq

    return model, step


def run_hf(a) -> tuple[float, float]:
    t0 = time.perf_counter()
    _, step = peer(a.model, a.corpus, a.batch, a.seq)
    if a.precision == "bf16":  # the one line a user adds: CPU bf16 autocast
        plain = step

        def step(k: int) -> int:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return plain(k)

    load_s = time.perf_counter() - t0
    times = []
    for k in range(3 + a.steps):
        t = time.perf_counter()
        step(k)
        if k >= 3:
            times.append(time.perf_counter() - t)
    return load_s, a.batch * a.seq / statistics.mean(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("toy", "hf"), required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument(
        "--compile", action="store_true", help="toy: --compile (torch.compile each block)"
    )
    ap.add_argument(
        "--checkpointing", action="store_true", help="toy: --checkpointing (recompute blocks)"
    )
    ap.add_argument(
        "--tune-malloc",
        action="store_true",
        help="hf: with toy's allocator setting (runs.tune_malloc)",
    )
    ap.add_argument(
        "--base-dtype",
        default="auto",
        choices=("auto", "quantized", "bfloat16", "float32"),
        help="toy: the base's form",
    )
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument(
        "--precision",
        choices=("float32", "bf16"),
        default="float32",
        help="toy: --precision; the peer: its step under torch.autocast('cpu', bfloat16) "
        "(the one line a user adds)",
    )
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.impl == "toy" or a.tune_malloc:
        from toy.runs import tune_malloc

        tune_malloc()  # what `toy train` does at start
    load_s, tps = (run_toy if a.impl == "toy" else run_hf)(a)
    print(
        json.dumps(
            {
                "impl": a.impl,
                "precision": a.precision,
                "load_s": round(load_s, 3),
                "tokens_per_s": round(tps, 1),
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
