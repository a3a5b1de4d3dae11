"""Where a training step's time goes: torch.profiler over toy's real job, grouped.

    python bench/profile_step.py scratch-llama|scratch-gpt2|lora|chat [--steps 2] [--compile]
        [--top 15] [--peer] [--precision float32|bf16]

--peer profiles the bench's peer on the same shape instead (transformers, + peft for
lora), so the two splits can be set side by side.

LoRA jobs hold SmolLM2 as toy's default does for --precision (float32: its quantized
blocks; bf16: a bf16 copy); the line "of which: GGUF dequantization" is the time spent
turning blocks into floats inside the step.

Builds the same jobs as the bench children (scratch 6x384 T256 B8 V8192; SmolLM2 LoRA
r8 q,v on a token stream B4 T256, or on the bench's chat JSONL), runs warm-up steps,
then profiles --steps steps and prints: the share of each kind of work (matmul,
attention, loss, optimizer, the rest), the matmuls' own FLOP/s against the machine's
fp32 matmul ceiling, and the top ops. docs/performance.md quotes its output.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

KINDS = [
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::addmm_", "aten::linear")),
    ("attention", ("scaled_dot_product",)),
    (
        "optimizer",
        (
            "addcdiv",
            "addcmul",
            "lerp",
            "_foreach",
            "_fused_adam",
            "sqrt",
            "linalg_vector_norm",
            "clamp",
        ),
    ),
    ("loss", ("logsumexp", "log_softmax", "exp_", "scatter_add", "gather", "nll_loss")),
]


# The chunked head's autograd functions (models/losses.py): loss and gradient in forward.
HEAD_FUNCTIONS = ("_HeadRowsCrossEntropy", "_LinearCrossEntropy", "_TokenLogprobs")


def kind(name: str) -> str:
    for k, keys in KINDS:
        if any(s in name for s in keys):
            return k
    return "elementwise and the rest"


def build(what: str, precision: str = "float32"):
    """The Job the bench child for `what` trains (a LoRA base held as toy's default holds it
    for `precision`: a bf16 copy of SmolLM2 under bf16 on a CPU with the units)."""
    from toy.recipes import load_recipe
    from toy.runs import Project

    if what.startswith("scratch"):
        import scratch_step as S

        from toy.recipes import from_scratch

        arch = what.split("-")[1]
        path = S.corpus(Path(tempfile.mkdtemp()) / "synthetic.bin")
        opts = load_recipe("from-scratch").config(
            corpus=str(path),
            arch=arch,
            preset="small",
            n_layer=S.L,
            d_model=S.D,
            n_head=S.H,
            n_kv_head=S.H if arch == "llama" else None,
            seq_len=S.T,
            batch_size=S.B,
            seed=0,
            eval_batches=1,
        )
        return from_scratch.build(opts, Project(root=None)).job
    from toy.recipes import lora

    model = Path.home() / ".cache" / "toy" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if what == "lora":
        opts = lora.RECIPE.config(
            model=str(model),
            corpus=str(ROOT / "build" / "bench" / "smol.bin"),
            seed=0,
            seq_len=256,
            batch_size=4,
            eval_batches=1,
            device="cpu",
            precision=precision,
        )
    else:
        data = ROOT / "build" / "bench" / "chat.jsonl"
        opts = lora.RECIPE.config(
            model=str(model),
            data=str(data),
            val_data=str(data),
            seed=0,
            seq_len=512,
            batch_size=4,
            eval_batches=1,
            device="cpu",
            precision=precision,
        )
    return lora.build(opts, Project(root=None)).job


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("scratch-llama", "scratch-gpt2", "lora", "chat"))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument(
        "--peer", action="store_true", help="profile the peer (transformers) instead of toy"
    )
    ap.add_argument(
        "--precision",
        choices=("float32", "bf16"),
        default="float32",
        help="bf16: the step under CPU bf16 autocast (toy's loop and the peer alike)",
    )
    a = ap.parse_args()

    if a.peer:
        step = peer_step(a.what)
    else:
        step = toy_step(a.what, a.compile, a.precision)
    if a.precision == "bf16":
        plain = step

        def step(k: int) -> int:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return plain(k)

    for k in range(3):
        step(k)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        t0 = time.perf_counter()
        tokens = sum(step(3 + k) for k in range(a.steps))
        wall = time.perf_counter() - t0
    report(prof, tokens, wall, a)


def peer_step(what: str):
    if what.startswith("scratch"):
        import scratch_step as S

        return S.peer(what.split("-")[1], S.corpus(Path(tempfile.mkdtemp()) / "synthetic.bin"))[1]
    if what != "lora":
        raise SystemExit("--peer: scratch-llama, scratch-gpt2 or lora")
    import lora_step

    model = Path.home() / ".cache" / "toy" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return lora_step.peer(model, ROOT / "build" / "bench" / "smol.bin", 4, 256)[1]


def toy_step(what: str, compile: bool, precision: str = "float32"):
    from toy.train.loop import compile_blocks
    from toy.train.schedule import make_adamw

    job = build(what, precision)
    model = job.model
    if compile:
        print(compile_blocks(model, torch.device("cpu")))
    opt = make_adamw(
        job.trainable(), 1e-4, 0.0, job.decays, fused=precision == "bf16"
    )  # as the loop makes it

    def step(k: int) -> int:
        b = job.micro_batch(k)
        n = job.count(b)
        ls, _ = job.loss(model, b)
        (ls / n).backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in job.trainable()], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ls.item()
        return int(b["ids"].numel())

    return step


def report(prof, tokens: int, wall: float, a) -> None:
    from run import matmul_ceiling  # bench/run.py

    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    by_kind: dict[str, float] = defaultdict(float)
    for e in events:
        by_kind[kind(e.key)] += e.self_cpu_time_total
    mm_us = sum(e.self_cpu_time_total for e in events if kind(e.key) == "matmul")
    mm_flops = sum(e.flops for e in events if kind(e.key) == "matmul" and e.flops)
    from toy.train.device import cpu_kind

    dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32
    ceiling = matmul_ceiling(dtype=dtype)
    who = "peer" if a.peer else "toy"
    print(
        f"{a.what} {who}{' --compile' if a.compile else ''} {a.precision}: {a.steps} steps, "
        f"{tokens / wall:,.0f} tokens/s under the profiler; {torch.get_num_threads()} threads; "
        f"CPU kind {cpu_kind()}"
    )
    for k, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {k:26s} {us / 1e6 / a.steps:7.3f} s/step  {us / total:6.1%}")
    deq = [e for e in events if e.key == "toy::dequantize"]
    if deq:
        us = sum(e.cpu_time_total for e in deq)
        print(
            f"  {'of which: GGUF dequantization':26s} {us / 1e6 / a.steps:7.3f} s/step  "
            f"{us / total:6.1%}  "
            f"({sum(e.count for e in deq) // a.steps} calls a step: each quantized layer in "
            "forward and again in backward, the head's vocabulary chunks twice)"
        )
    att = [e for e in events if e.key in ("CausalAttention", "CausalAttentionBackward")]
    if att:  # models/cpu_attention.py: its bmm count as matmul above, its softmax as the rest
        us = sum(e.cpu_time_total for e in att)
        print(
            f"  {'of which: bf16 attention':26s} {us / 1e6 / a.steps:7.3f} s/step  "
            f"{us / total:6.1%}  (models/cpu_attention.py, forward and backward: its "
            "matmuls are counted as matmul above, its softmax and casts as the rest)"
        )
    head = [e for e in events if e.key in HEAD_FUNCTIONS]
    if head:  # models/losses.py: the head's matmuls count as matmul, its softmax as the rest
        us = sum(e.cpu_time_total for e in head)
        print(
            f"  {'of which: head and loss':26s} {us / 1e6 / a.steps:7.3f} s/step  "
            f"{us / total:6.1%}  (models/losses.py, the chunked head with its loss and "
            "gradient: its matmuls are counted as matmul above, under bf16 its softmax as "
            "the rest)"
        )
    if mm_us:
        print(
            f"  matmuls run at {mm_flops / (mm_us / 1e6) / 1e9:,.1f} GFLOP/s; the {a.precision} "
            "matmul ceiling "
            f"is {ceiling / 1e9:,.1f} GFLOP/s ({mm_flops / (mm_us / 1e6) / ceiling:.0%})"
        )
    print(events.table(sort_by="self_cpu_time_total", row_limit=a.top))


if __name__ == "__main__":
    main()
