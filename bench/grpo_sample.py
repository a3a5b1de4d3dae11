"""GRPO's sampling cost: batched group sampling (models/sample.py) against single-stream decode.

    python bench/grpo_sample.py [--model data/smollm2-135m.gguf] [--tokens 128] [--group 8]
                                [--precision float32,bf16] [--profile]

The base is loaded as `toy train --recipe grpo` (the LoRA recipes' load_adapted) holds it:
float32 precision keeps the GGUF's quantized blocks, bf16 autocast (only where the CPU has
bf16 units) a bfloat16 copy; a rank-8 adapter on q_proj, v_proj is applied unmerged. Then:

- single: `generate` at temperature 1 for --tokens new tokens (no stop), the steady rate
  (tokens after the second, over their time);
- grouped: `sample_groups`, --group completions for each of 4 ChatML-rendered questions, up
  to --tokens new tokens, stopping at <|im_end|> / EOS: sampled tokens over wall time (the
  prompts' prefills included), and its ratio to single.

--profile prints, for each precision, where a batched decode step's time goes (torch's
profiler over one group, top operators by self time) to stderr. Prints one JSON line per
run: the figures, the CPU kind and torch's thread count. The machine may be shared: the
figures are indicative, compare them only within one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

QUESTIONS = [
    "What is 17 times 23? Think step by step, then give the answer.",
    "Name three prime numbers larger than 50 and explain why each is prime.",
    "Write a short poem about the sea.",
    "If a train leaves at 3pm and travels 120 km at 80 km/h, when does it arrive?",
]
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(question: str) -> str:
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def load(path: str, precision: str):
    """(model, tokenizer, stop ids) as the LoRA recipes hold the base at this precision."""
    from toy.formats.base_readers import read_base
    from toy.lora import apply_lora

    base = read_base(path, "quantized" if precision == "float32" else "bfloat16")
    torch.manual_seed(0)
    model = base.build_model()
    apply_lora(model, ["q_proj", "v_proj"], rank=8, alpha=16.0, dropout=0.05, seed=0)
    stops = set(base.special.stops) | {base.special.eos} - {None}  # <|im_end|>, EOS
    return model.eval(), base.tokenizer, stops


def single_stream(model, ids: list[int], tokens: int) -> float:
    from toy.models.generate import generate

    times, t = [], time.perf_counter()
    for _ in generate(model, ids, tokens, temperature=1.0, seed=0, stop_ids=set()):
        now = time.perf_counter()
        times.append(now - t)
        t = now
    steady = times[2:]
    return len(steady) / sum(steady)


def grouped(model, prompts, group: int, tokens: int, stops: set[int]) -> dict:
    from toy.models.sample import sample_groups

    gen = torch.Generator().manual_seed(0)
    t = time.perf_counter()
    out = sample_groups(model, prompts, group, tokens, generator=gen, stop_ids=stops)
    wall = time.perf_counter() - t
    lengths = [len(c.ids) for g in out for c in g]
    return {
        "sampled_tokens": sum(lengths),
        "wall_s": round(wall, 2),
        "tokens_per_s": sum(lengths) / wall,
        "stopped": sum(c.stopped for g in out for c in g),
        "mean_len": round(sum(lengths) / len(lengths), 1),
    }


def profile(model, prompt, group: int, tokens: int, stops: set[int]) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    from toy.models.sample import sample_group

    gen = torch.Generator().manual_seed(0)
    with prof(activities=[ProfilerActivity.CPU]) as p:
        sample_group(model, prompt, group, tokens, generator=gen, stop_ids=stops)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), file=sys.stderr)


def main() -> None:
    from toy.train.device import cpu_bf16_units, cpu_kind

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="data/smollm2-135m.gguf")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--precision", default="float32,bf16")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    for precision in a.precision.split(","):
        if precision == "bf16" and not cpu_bf16_units():
            print(json.dumps({"precision": "bf16", "skipped": "no bf16 units"}))
            continue
        model, tok, stops = load(a.model, precision)
        prompts = [tok.encode(chatml(q)).ids for q in QUESTIONS]
        ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
        with ctx:
            grouped(model, prompts[:1], 2, 4, stops)  # warm-up: first-call costs out of the way
            single = single_stream(model, prompts[0], a.tokens)
            g = grouped(model, prompts, a.group, a.tokens, stops)
            if a.profile:
                profile(model, prompts[0], a.group, 32, set())
        row = {"precision": precision, "cpu": cpu_kind(), "threads": torch.get_num_threads()}
        row |= {"single_tokens_per_s": round(single, 2)} | g
        row["tokens_per_s"] = round(g["tokens_per_s"], 2)
        row["ratio"] = round(g["tokens_per_s"] / single, 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
