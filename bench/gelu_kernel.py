"""The tanh GELU on bf16 values: toy's C kernel (models/gelu_bf16.c through layers.gelu_tanh)
against torch's F.gelu(x, approximate="tanh") and its gradient, in one run.

    python bench/gelu_kernel.py [--shape 8,256,1536] [--repeats 40]

Each call is timed right after the (tokens x d_model) @ (d_model x d_ff) product that makes
its input in a step (the fc of a GPT-2 MLP), so both meet the threads and caches that product
leaves, as in training; medians. Prints one JSON line: the CPU kind, milliseconds a call for
each, and toy over torch. Run it with nothing else running."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from toy.models import layers, native
from toy.train.device import cpu_kind


def timed(make, fn, repeats: int) -> float:
    out = []
    for _ in range(repeats + 3):
        x = make()  # the product before it, untimed
        t = time.perf_counter()
        fn(x)
        out.append(time.perf_counter() - t)
    return statistics.median(out[3:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8,256,1536", help="B,T,d_ff (bench/scratch_step's)")
    ap.add_argument("--repeats", type=int, default=40)
    a = ap.parse_args()
    B, T, d_ff = (int(v) for v in a.shape.split(","))
    if native.gelu_bf16() is None:
        raise SystemExit("no C compiler built toy's kernel here: nothing to compare")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B * T, d_ff // 4, generator=g).bfloat16()
    w = (torch.randn(d_ff, d_ff // 4, generator=g) * 0.05).bfloat16()
    grad = torch.randn(B * T, d_ff, generator=g).bfloat16()

    def make():
        return h @ w.T

    torch_fwd = timed(make, lambda x: F.gelu(x, approximate="tanh"), a.repeats)
    toy_fwd = timed(make, layers.gelu_tanh, a.repeats)
    torch_bwd = timed(
        make, lambda x: torch.ops.aten.gelu_backward(grad, x, approximate="tanh"), a.repeats
    )
    toy_bwd = timed(make, lambda x: layers._gelu_call("toy_gelu_backward_bf16", x, grad), a.repeats)
    print(
        json.dumps(
            {
                "cpu_kind": cpu_kind(),
                "threads": torch.get_num_threads(),
                "values": B * T * d_ff,
                "forward_ms": {"torch": round(torch_fwd, 3), "toy": round(toy_fwd, 3)},
                "backward_ms": {"torch": round(torch_bwd, 3), "toy": round(toy_bwd, 3)},
                "toy_speedup": {
                    "forward": round(torch_fwd / toy_fwd, 2),
                    "backward": round(torch_bwd / toy_bwd, 2),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
