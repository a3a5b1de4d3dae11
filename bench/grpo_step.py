"""GRPO on SmolLM2-135M-Instruct: toy against TRL's GRPOTrainer, each in a process of its own
so its load time and peak RSS are its alone, then the two in one table.

    python bench/grpo_step.py --gguf data/smollm2-135m.gguf --hf data/smollm2-135m-transformers
                              [--steps 3] [--tokens 128] [--only toy|trl] [--task arith|open]
                              [--cold]

The same work on each side: 4 prompts a step as a user turn through the chat template,
G = 8 completions each at temperature 1, up to --tokens new tokens ending at <|im_end|>,
one reward from the same TRL-style function in both:
- --task arith (the default): arithmetic questions, short answers; the reward the
  completion's shortness (what the issue's reference measurement rewarded);
- --task open: open questions, a short-answer one and a long-answer one in turn ("What
  is the capital of Italy?", "Write a short story about a lighthouse keeper."), so a
  step's answers run from a few tokens to the limit (a long tail: the batch decodes for
  its longest answer); the reward the number of distinct tokens (capped at 48), which
  does not favour short answers.
LoRA r8 on q_proj, v_proj, loss dapo, beta 0, one iteration, bf16 where
the CPU has bf16 units (toy's default; TRL's bf16=True) else float32. toy reads the Q4_1
GGUF; TRL the transformers directory `toy fetch smollm2 --as transformers` makes of it (the
same weights in float32). The first step of each is a warm-up and is not timed, and toy's
run is made once untimed before (its compiled decode steps built, as on a machine that ran
GRPO before; --cold: not). Reported:
seconds a step (median), sampled completion tokens a second, peak RSS; the ratios toy /
TRL; the CPU kind. No timed test: figures for docs/performance.md.

    python bench/grpo_step.py --child toy|trl ...   (what the parent runs)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REWARD = '''
def reward_len(completions, completion_ids=None, **kwargs):
    """Shorter is better: what the issue's reference measurement rewarded."""
    return [-len(ids) / 64.0 for ids in completion_ids]
'''
OPEN_REWARD = '''
def reward_len(completions, completion_ids=None, **kwargs):
    """Distinct tokens, up to 48: neither short nor long answers favoured by length alone."""
    return [min(len(set(ids)), 48) / 48.0 for ids in completion_ids]
'''
PROMPTS, G, RANK, ALPHA = 4, 8, 8, 16
SHORT = [
    "What is the capital of Italy?",
    "Name a primary colour.",
    "How many legs does a spider have?",
    "What is the opposite of up?",
    "Is ice cold? Answer yes or no.",
    "What colour is the sky on a clear day?",
    "Which is larger, a cat or an elephant?",
    "Give one word that rhymes with cat.",
    "What day comes after Monday?",
    "How many wheels does a bicycle have?",
    "What do bees make?",
    "What is frozen water called?",
]
LONG = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe the water cycle step by step.",
    "Write a poem about the autumn wind.",
    "Give me a recipe for vegetable soup.",
    "Explain why the sky is blue.",
    "Describe a busy market in the morning.",
    "Write a letter to a friend about your holiday.",
    "Explain how plants make their food.",
    "Tell me about the history of bread.",
    "Describe how to plant a tree.",
    "Write a story about a lost dog finding its way home.",
]


def prompt_texts(task: str, n: int) -> list[str]:
    """n prompts of the task, the same on both sides."""
    if task == "arith":
        from toy.data.arith import questions as make

        return [q["prompt"] for q in make(n, seed=0)]
    both = [q for pair in zip(SHORT, LONG) for q in pair]  # short and long in turn
    return [both[i % len(both)] for i in range(n)]


def questions(path: Path, n: int, task: str) -> None:
    with open(path, "w") as f:
        for q in prompt_texts(task, n):
            f.write(json.dumps({"prompt": q}) + "\n")


def reward_source(task: str) -> str:
    return OPEN_REWARD if task == "open" else REWARD


def child_toy(a, d: Path) -> dict:
    reward = d / "rw.py"
    reward.write_text(reward_source(a.task))
    data = d / "q.jsonl"
    questions(data, PROMPTS * (a.steps + 1), a.task)
    cmd = [sys.executable, "-m", "toy", "train", "--recipe", "grpo", "--model", str(a.gguf)]
    cmd += ["--data", str(data), "--val-data", str(data), "--eval-batches", "1"]
    cmd += ["--reward", f"{reward}:reward_len", "--num-generations", str(G)]
    cmd += ["--max-completion-length", str(a.tokens), "--batch-size", str(PROMPTS)]
    cmd += ["--steps", str(a.steps + 1), "--rank", str(RANK), "--alpha", str(ALPHA)]
    cmd += ["--out", str(d / "runs"), "--json", "--lr", "1e-5"]
    if not a.cold:
        # The same run once, untimed: it builds every compiled decode step the timed run
        # takes (one for each number of rows alive, as answers end), which a user's first
        # GRPO run on a machine builds once and every later run loads. The timed run's first
        # step alone warmed only the row counts that step reached: the arithmetic task's
        # smaller batches came later and were built inside timed steps (2.3x TRL read
        # where the run after it gave 4.1x).
        warm = subprocess.run([*cmd, "--run-id", "warm"], capture_output=True, text=True)
        if warm.returncode:
            raise SystemExit(warm.stderr[-3000:])
    cmd += ["--run-id", "b"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    res = json.loads(r.stdout)
    events = [json.loads(x) for x in (d / "runs" / "b" / "events.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    times = [b["time"] - a_["time"] for a_, b in zip(steps, steps[1:])]  # steps 2.. (+ evals)
    tokens = [e["items"] for e in steps[1:]]
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {
        "s_per_step": statistics.median(times),
        "completion_tokens_per_s": sum(tokens) / sum(times),
        "mean_completion_tokens": statistics.mean(tokens) / (PROMPTS * G),
        "wall_s": wall,
        "peak_rss_mb": peak,
        "precision": res["precision"],
    }


def child_trl(a, d: Path) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from toy.train.device import cpu_bf16_units

    sys.path.insert(0, str(d))
    (d / "rw.py").write_text(reward_source(a.task))
    from rw import reward_len

    rows = [
        {"prompt": [{"role": "user", "content": q}]}
        for q in prompt_texts(a.task, PROMPTS * (a.steps + 1))
    ]
    times: list[float] = []
    tokens: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                tokens.append(logs["completions/mean_length"])

    tok = AutoTokenizer.from_pretrained(a.hf)
    model = AutoModelForCausalLM.from_pretrained(a.hf, dtype=torch.float32)
    bf16 = cpu_bf16_units() is not None
    args = GRPOConfig(
        output_dir=str(d / "trl"),
        report_to=[],
        use_cpu=True,
        bf16=bf16,
        per_device_train_batch_size=PROMPTS * G,
        num_generations=G,
        max_completion_length=a.tokens,
        temperature=1.0,
        max_steps=a.steps + 1,
        learning_rate=1e-5,
        beta=0.0,
        loss_type="dapo",
        logging_steps=1,
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        gradient_checkpointing=False,
    )
    peft = LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_len,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        peft_config=peft,
        callbacks=[Clock()],
    )
    trainer.train()
    timed, toks = times[1:], tokens[1:]
    return {
        "s_per_step": statistics.median(timed),
        "completion_tokens_per_s": sum(t * PROMPTS * G for t in toks) / sum(timed),
        "mean_completion_tokens": statistics.mean(toks) if toks else None,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "precision": "bf16" if bf16 else "float32",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, default=Path("data/smollm2-135m.gguf"))
    ap.add_argument("--hf", type=Path, default=Path("data/smollm2-135m-transformers"))
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--only", choices=("toy", "trl"))
    ap.add_argument("--task", choices=("arith", "open"), default="arith")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="toy: no untimed run first, so steps not yet built on this machine are built "
        "inside the timed ones (a first run on a machine)",
    )
    ap.add_argument("--child", choices=("toy", "trl"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        with tempfile.TemporaryDirectory() as d:
            fn = child_toy if a.child == "toy" else child_trl
            print(json.dumps(fn(a, Path(d))))
        return
    from toy.train.device import cpu_kind

    out = {"cpu_kind": cpu_kind(), "threads": os.cpu_count(), "tokens": a.tokens, "task": a.task}
    for impl in ("toy", "trl"):
        if a.only and impl != a.only:
            continue
        argv = [sys.executable, __file__, "--child", impl, "--gguf", str(a.gguf)]
        argv += ["--hf", str(a.hf), "--steps", str(a.steps), "--tokens", str(a.tokens)]
        argv += ["--task", a.task] + (["--cold"] if a.cold else [])
        r = subprocess.run(argv, capture_output=True, text=True)
        if r.returncode:
            out[impl] = {"error": r.stderr.strip().splitlines()[-3:]}
            continue
        out[impl] = json.loads(r.stdout.strip().splitlines()[-1])
    if "s_per_step" in out.get("toy", {}) and "s_per_step" in out.get("trl", {}):
        out["trl_over_toy_step"] = out["trl"]["s_per_step"] / out["toy"]["s_per_step"]
        out["toy_over_trl_rss"] = out["toy"]["peak_rss_mb"] / out["trl"]["peak_rss_mb"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
