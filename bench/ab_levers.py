"""A/B of issue 33's bf16 levers in ONE process, alternating step by step, medians: on a
machine shared with other work, drift then hits every variant alike.

    python bench/ab_levers.py scratch-gpt2|scratch-llama|lora [--rounds 5] [--threads N]
        [--nanogpt DIR] [--no-peer] [--no-float32]

Variants (each one training step of the bench's shape, built by bench/profile_step.py):
  toy float32, toy bf16 (the default where the CPU has bf16 units), the peer (transformers,
  + PEFT for lora) in float32 and under bf16 autocast, and toy bf16 with one lever undone:
  `bf16 -dequant` (lora: GGUF blocks dequantized to float32, then cast, as before) and
  `bf16 -normcast` (the norm's output cast by each consumer, as before), `bf16 -headgrad`
  (the trained head's weight gradient as a float32 matmul, as before), `bf16 -gelu`
  (scratch-gpt2: torch's tanh GELU instead of toy's C kernel, models/gelu_bf16.c).
  --nanogpt DIR (scratch-gpt2): the peer is nano_gpt's GPT (unpacked in DIR, as bench/run.py
  fetches it) instead of transformers' GPT2, as bench/scratch_step.py --impl nanogpt.
Prints the median seconds a step and tokens/s of each, the CPU kind, and each variant against
toy bf16 step by step (the median of the rounds' ratios: drift between rounds cancels).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


@contextmanager
def old_dequant():
    """quant's kernels as before issue 33: q.float() * s (+ z) in float32, then cast."""
    from toy.models import quant

    saved = dict(quant._KERNELS)

    def before(qtype):
        block = quant.QUANT_TYPES[qtype][0]

        def kernel(b, dtype=torch.float32):
            q, s, z = quant.CODES[qtype](b)
            x = q.float().mul_(s)
            return (x if z is None else x.add_(z)).view(b.shape[0], block).to(dtype)

        return kernel

    quant._KERNELS.update({t: before(t) for t in saved})
    try:
        yield
    finally:
        quant._KERNELS.update(saved)


@contextmanager
def old_normcast():
    """RMSNorm returning float32 under autocast (each consumer casts it), as before."""
    from toy.models import layers

    new = layers.RMSNorm.forward

    def before(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    layers.RMSNorm.forward = before
    try:
        yield
    finally:
        layers.RMSNorm.forward = new


@contextmanager
def old_gelu():
    """torch's F.gelu for the tanh GELU on bf16 values, as before models/gelu_bf16.c."""
    from toy.models import native

    saved = native.gelu_bf16
    native.gelu_bf16 = lambda: None
    try:
        yield
    finally:
        native.gelu_bf16 = saved


@contextmanager
def old_headgrad():
    """The trained head's weight gradient as a float32 matmul under autocast, as before."""
    from toy.models import losses

    losses.HEAD_GRAD_IN_COMPUTE_DTYPE = False
    try:
        yield
    finally:
        losses.HEAD_GRAD_IN_COMPUTE_DTYPE = True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("scratch-gpt2", "scratch-llama", "lora"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--no-float32", action="store_true", help="bf16 variants only")
    ap.add_argument(
        "--nanogpt", type=Path, metavar="DIR", help="scratch-gpt2: nano_gpt as the peer"
    )
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    import profile_step as P

    from toy.train.device import cpu_kind

    toy = P.toy_step(a.what, False)
    variants = {} if a.no_float32 else {"toy float32": lambda k: toy(k)}
    variants["toy bf16"] = lambda k: _under(toy, k)
    if a.what != "lora":
        variants["toy bf16 -headgrad"] = lambda k: _under(toy, k, old_headgrad())
    if a.what == "scratch-gpt2":
        variants["toy bf16 -gelu"] = lambda k: _under(toy, k, old_gelu())
    if a.what == "lora":
        variants["toy bf16 -dequant"] = lambda k: _under(toy, k, old_dequant())
    if a.what != "scratch-gpt2":
        variants["toy bf16 -normcast"] = lambda k: _under(toy, k, old_normcast())
    if not a.no_peer:
        if a.nanogpt and a.what == "scratch-gpt2":
            import tempfile

            import scratch_step as S

            path = S.corpus(Path(tempfile.mkdtemp()) / "synthetic.bin")
            peer = S.nanogpt_peer(path, a.nanogpt)[1]
        else:
            peer = P.peer_step(a.what)
        if not a.no_float32:
            variants["peer float32"] = lambda k: peer(k)
        variants["peer bf16"] = lambda k: _under(peer, k)
    times: dict[str, list[float]] = {v: [] for v in variants}
    tokens = 0
    for step in variants.values():  # warm-up: two steps each
        step(0), step(1)
    for r in range(a.rounds):
        for v, step in variants.items():
            t = time.perf_counter()
            tokens = step(2 + r)
            times[v].append(time.perf_counter() - t)
    print(
        f"{a.what}: {a.rounds} rounds alternating, medians; {torch.get_num_threads()} threads; "
        f"CPU kind {cpu_kind()}"
    )
    ref = times["toy bf16"]
    for v, ts in times.items():
        m = statistics.median(ts)
        paired = statistics.median(b / t for t, b in zip(ts, ref))  # toy bf16 / this, a round
        print(
            f"  {v:22s} {m:7.3f} s/step  {tokens / m:8,.0f} tok/s  "
            f"toy bf16 is {1 / paired:5.3f}x its speed (rounds' median)"
        )


def _under(step, k, lever=None):
    """step(k) under CPU bf16 autocast, with `lever` (a context that undoes one) around it."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if lever is None:
            return step(k)
        with lever:
            return step(k)


if __name__ == "__main__":
    main()
