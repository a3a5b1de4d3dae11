"""One benchmark child: one epoch of chat SFT, SmolLM2-135M (GGUF) + LoRA r=8 on q,v.

    python bench/chat_epoch.py --make-data chat.jsonl [--n 240]
    python bench/chat_epoch.py --impl toy|hf --model SmolLM2.gguf --data chat.jsonl
                               [--batch 4] [--seq 512] [--limit-steps N] [--compile]
--make-data writes the fixed dataset: real dialogue from the bundled plays (seed 0, 1-3
exchanges each, so lengths vary a lot). toy runs its real recipe and loop (packed rows,
block-causal mask, loss on assistant turns) for the step count `--epochs 1` gives; the
peer is transformers (GGUF load, SDPA) + peft fed the usual way: chat template, one
conversation per row, right-padded batches, labels -100 outside assistant turns.
Both train on every conversation of --data at a constant lr 1e-4 (no warm-up, no decay).
Prints one JSON line: epoch_s (steps only, no load), steps, conversations,
supervised_tokens and tokens_fed (padding included) over the steps run, peak_rss_mb,
final_loss. --limit-steps N stops early and scales nothing: "limited" says so.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

LR = 1e-4


def make_data(out: Path, n: int) -> None:
    from toy.data.dialogue import conversations, write_jsonl
    from toy.data.prep import bundled_text_paths

    convs = conversations(bundled_text_paths(), n, seed=0, turns=(1, 3))
    write_jsonl(convs, out)
    print(json.dumps({"data": str(out), "conversations": len(convs)}))


def run_toy(a) -> dict:
    from toy.data.chat import read_chat_jsonl
    from toy.recipes import lora
    from toy.runs import EventLog, Project
    from toy.train.config import RunConfig
    from toy.train.loop import train

    with tempfile.TemporaryDirectory() as d:
        # A separate --val-data, so toy trains on all of --data as the peer does (without
        # it the recipe holds 5% out). Eval is off below: its content never matters.
        n_conv = len(read_chat_jsonl(a.data).conversations)
        val = Path(d) / "val.jsonl"
        val.write_text("".join(a.data.read_text().splitlines(keepends=True)[:2]))
        opts = lora.RECIPE.config(
            model=str(a.model),
            data=str(a.data),
            val_data=str(val),
            seed=0,
            seq_len=a.seq,
            batch_size=a.batch,
            eval_batches=1,
            epochs=1,
            steps=None,
        )
        built = lora.build(opts, Project(root=None))  # epochs=1: the recipe derives the step count
    for note in built.notes:
        print(f"toy: {note}", file=sys.stderr)
    job = built.job
    job.eval_batches = list  # no eval batches: time training only
    epoch_steps = built.derived["steps"]
    steps = min(epoch_steps, a.limit_steps or epoch_steps)
    cfg = RunConfig(
        steps=steps,
        batch_size=a.batch,
        lr=LR,
        min_lr=LR,
        warmup=0,
        weight_decay=0.0,
        compile=a.compile,
    )
    t0 = time.perf_counter()
    res = train(job, cfg, None, torch.device("cpu"), EventLog(None))
    epoch_s = time.perf_counter() - t0
    # Batch k is a pure function of k: count what was fed after the clock stopped.
    batches = [job.micro_batch(k) for k in range(steps)]
    return {
        "epoch_s": epoch_s,
        "steps": steps,
        "epoch_steps": epoch_steps,
        "conversations": job.config["conversations"],
        "dropped": n_conv - job.config["conversations"],
        "supervised_tokens": sum(int(job.count(b)) for b in batches),
        "tokens_fed": sum(b["ids"].numel() for b in batches),
        "final_loss": res.losses[-1]["loss"],
    }


def encode_hf(tok, messages: list[dict], seq: int) -> tuple[list[int], list[int]]:
    """(input_ids, labels): the template's rendering, labels -100 outside assistant turns.

    Assistant spans by the prefix method: render the conversation up to the turn with
    add_generation_prompt=True (start) and including it (end), compare token counts."""

    def ids(msgs, gen=False):
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        return tok(text, add_special_tokens=False)["input_ids"]

    full = ids(messages)
    labels = [-100] * len(full)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start, end = len(ids(messages[:i], gen=True)), len(ids(messages[: i + 1]))
            labels[start:end] = full[start:end]
    return full[:seq], labels[:seq]


def run_hf(a) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(a.model.parent), gguf_file=a.model.name, dtype=torch.float32, attn_implementation="sdpa"
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
    tok = AutoTokenizer.from_pretrained(str(a.model.parent), gguf_file=a.model.name)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    convs = [
        json.loads(line)["messages"] for line in a.data.read_text().splitlines() if line.strip()
    ]
    samples = [encode_hf(tok, c, a.seq) for c in convs]
    kept = [
        s for s in samples if any(t != -100 for t in s[1][1:])
    ]  # a label at position 0 is never a target
    order = np.random.default_rng(0).permutation(len(kept))
    batches = []
    for i in range(0, len(kept), a.batch):
        group = [kept[int(j)] for j in order[i : i + a.batch]]
        T = max(len(ids) for ids, _ in group)
        input_ids = torch.full((len(group), T), pad, dtype=torch.long)
        attn = torch.zeros((len(group), T), dtype=torch.long)
        labels = torch.full((len(group), T), -100, dtype=torch.long)
        for r, (ids, lab) in enumerate(group):
            input_ids[r, : len(ids)] = torch.tensor(ids)
            attn[r, : len(ids)] = 1
            labels[r, : len(lab)] = torch.tensor(lab)
        batches.append({"input_ids": input_ids, "attention_mask": attn, "labels": labels})
    epoch_steps = len(batches)
    batches = batches[: a.limit_steps or epoch_steps]
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    t0 = time.perf_counter()
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    for b in batches:
        loss = model(
            **b, use_cache=False
        ).loss  # mean over the batch's supervised (shifted) targets
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        final_loss = loss.item()
    epoch_s = time.perf_counter() - t0
    return {
        "epoch_s": epoch_s,
        "steps": len(batches),
        "epoch_steps": epoch_steps,
        "conversations": len(kept),
        "dropped": len(samples) - len(kept),
        "supervised_tokens": sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches),
        "tokens_fed": sum(b["input_ids"].numel() for b in batches),
        "final_loss": final_loss,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--make-data", type=Path, metavar="OUT.jsonl", help="write the fixed dataset and exit"
    )
    ap.add_argument("--n", type=int, default=240, help="--make-data: conversations (default 240)")
    ap.add_argument("--impl", choices=("toy", "hf"))
    ap.add_argument("--model", type=Path)
    ap.add_argument("--data", type=Path)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument(
        "--compile", action="store_true", help="toy: --compile (torch.compile each block)"
    )
    ap.add_argument(
        "--limit-steps", type=int, default=None, help="stop after N steps (smoke tests)"
    )
    a = ap.parse_args()
    if a.make_data:
        return make_data(a.make_data, a.n)
    if not (a.impl and a.model and a.data):
        ap.error("give --impl, --model and --data (or --make-data OUT.jsonl)")
    torch.manual_seed(0)
    out = (run_toy if a.impl == "toy" else run_hf)(a)
    print(
        json.dumps(
            {
                "impl": a.impl,
                **{k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()},
                "limited": a.limit_steps is not None and out["steps"] < out["epoch_steps"],
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
