"""One benchmark child: preference tuning on SmolLM2-135M, LoRA r8 on q_proj, v_proj, batch
4 pairs, in a process of its own so its load time and peak RSS are its alone.

    python bench/dpo_step.py --make-data DIR [--pairs 64]
    python bench/dpo_step.py --impl toy|toy-sft|trl --model GGUF|DIR --data DIR [--steps 4]

DIR (made by scripts/make_pref_pairs.py) holds train.jsonl: {"prompt", "chosen",
"rejected"} pairs. The impls:
- toy: `--recipe dpo`'s recipe and loop (the pairs/s `toy train --json` reports, after 3
  warm-up steps, or none with --warm 0 for a smoke run: each step runs the reference pass
  for its new pairs, the base with the adapter off, and the policy forward and backward);
- toy-sft: `--recipe lora` (SFT) over the same tokens: each pair's chosen and rejected
  conversations as two prompt/completion lines, 8 sequences a batch (4 pairs' worth);
- trl: TRL's DPOTrainer with a PEFT LoraConfig on the transformers directory (its
  reference model is the PEFT model with the adapter disabled, as toy's), the same pairs in
  TRL's conversational form (so the chat template is applied as toy applies it), its
  defaults but for those sizes, bf16 where toy computes bf16 (the CPU's bf16 units) and no
  gradient checkpointing (toy recomputes nothing by default either).
Prints one JSON line: load_s, pairs_per_s (toy-sft: tokens_per_s), peak_rss_mb.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SEQ, RANK, ALPHA, TARGETS = 128, 8, 16.0, "q_proj,v_proj"


def make_data(out: Path, pairs: int) -> None:
    """scripts/make_pref_pairs.py's set: `--pairs N --seed 0`, speeches up to 160 characters."""
    from toy.data.dialogue import OPENING, preference_pairs, write_pairs
    from toy.data.prep import bundled_text_paths

    write_pairs(preference_pairs(bundled_text_paths(), pairs, 0, OPENING, 160), out, 0.15)


def sft_lines(data: Path, out: Path) -> Path:
    """The pairs' chosen and rejected answers as prompt/completion lines: SFT's tokens."""
    with open(out, "w") as f:
        for line in (data / "train.jsonl").read_text().splitlines():
            p = json.loads(line)
            for ans in (p["chosen"], p["rejected"]):
                f.write(json.dumps({"prompt": p["prompt"], "completion": ans}) + "\n")
    return out


def run_toy(a, sft: bool) -> dict:
    from toy.recipes import dpo, lora
    from toy.runs import EventLog, Project
    from toy.train.config import RunConfig
    from toy.train.device import resolve_precision
    from toy.train.loop import train

    recipe, mod = ("lora", lora) if sft else ("dpo", dpo)
    # resolved as `toy train` resolves its default (bf16 on a cpu with bf16 units), and given
    # to the recipe as `toy train` gives it: the recipe holds a small base in bf16 under it
    precision = resolve_precision("auto", torch.device("cpu")).name
    with tempfile.TemporaryDirectory() as d:
        data = sft_lines(a.data, Path(d) / "sft.jsonl") if sft else a.data / "train.jsonl"
        batch = 2 * a.batch if sft else a.batch  # rows: 2 sequences a pair
        opts = mod.RECIPE.config(
            model=str(a.model),
            data=str(data),
            seed=0,
            seq_len=SEQ,
            batch_size=batch,
            eval_batches=1,
            targets=TARGETS,
            rank=RANK,
            alpha=ALPHA,
            device="cpu",
            precision=precision,
        )
        t0 = time.perf_counter()
        built = mod.build(opts, Project(root=None))
        load_s = time.perf_counter() - t0
        built.job.eval_batches = lambda: []  # time training only
        if not sft:  # the loop counts the tokens fed (padding included); here: pairs
            built.job.n_items = lambda b: int(b["pair"].numel())
        cfg = RunConfig(
            steps=a.warm + a.steps,
            batch_size=batch,
            lr=1e-4,
            min_lr=1e-5,
            warmup=0,
            weight_decay=0.0,
            precision=precision,
        )
        res = train(built.job, cfg, None, torch.device("cpu"), EventLog(None))
    # DPO counts pairs, SFT tokens (only its peak RSS is compared).
    return {
        "load_s": load_s,
        ("tokens_per_s" if sft else "pairs_per_s"): res.items_per_s,
        "precision": precision,
        "base_dtype": built.job.adapted.dtype,
    }


def run_trl(a) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from toy.train.device import cpu_bf16_units

    rows = []
    for line in (a.data / "train.jsonl").read_text().splitlines():
        p = json.loads(line)
        rows.append(
            {
                "prompt": [{"role": "user", "content": p["prompt"]}],
                "chosen": [{"role": "assistant", "content": p["chosen"]}],
                "rejected": [{"role": "assistant", "content": p["rejected"]}],
            }
        )
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as d:
        args = DPOConfig(
            output_dir=d,
            report_to=[],
            use_cpu=True,
            per_device_train_batch_size=a.batch,
            max_steps=a.warm + a.steps,
            max_length=SEQ,
            learning_rate=1e-4,
            beta=0.1,
            bf16=cpu_bf16_units() is not None,
            gradient_checkpointing=False,
            save_strategy="no",
            logging_strategy="no",
            dataloader_num_workers=0,
            seed=0,
        )
        peft = LoraConfig(
            r=RANK,
            lora_alpha=int(ALPHA),
            lora_dropout=0.0,
            target_modules=TARGETS.split(","),
            task_type="CAUSAL_LM",
        )
        trainer = DPOTrainer(
            model=model,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
            peft_config=peft,
            callbacks=[Clock()],
        )
        load_s = time.perf_counter() - t0
        trainer.train()
    return {"load_s": load_s, "pairs_per_s": a.batch / statistics.mean(times[a.warm :])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--make-data", type=Path, help="write the pair set to this directory")
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--impl", choices=("toy", "toy-sft", "trl"))
    ap.add_argument("--model", type=Path, help="GGUF or model directory (trl: a directory)")
    ap.add_argument("--data", type=Path)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4, help="pairs a step")
    ap.add_argument(
        "--warm",
        type=int,
        default=3,
        choices=(0, 3),
        help="untimed first steps: 3, or 0 for a smoke run of <= 3 steps (toy's loop times "
        "all steps of a run that short)",
    )
    a = ap.parse_args()
    if a.make_data:
        make_data(a.make_data, a.pairs)
        print(json.dumps({"wrote": str(a.make_data)}))
        return
    if not (a.impl and a.model and a.data):
        ap.error("give --impl, --model and --data (or --make-data DIR)")
    if a.warm == 0 and a.steps > 3:
        ap.error("--warm 0 is for runs of at most 3 steps")
    torch.manual_seed(0)
    if a.impl.startswith("toy"):
        from toy.runs import tune_malloc

        tune_malloc()  # what `toy train` does at start
    r = run_trl(a) if a.impl == "trl" else run_toy(a, a.impl == "toy-sft")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
    print(json.dumps({"impl": a.impl, **out, "peak_rss_mb": round(rss, 1)}))


if __name__ == "__main__":
    main()
