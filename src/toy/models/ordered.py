"""Products whose long inner sum is the same bytes at any thread count.

A product's long inner sum (a batch's tokens in an adapter's weight gradient, a vocabulary
chunk's rows in a head's input gradient) is split across threads by MKL and oneDNN where
the other two sides leave too little to share out, so its bytes followed the thread count,
which the busy-machine rule changes within a run (train/device.py, Threads): SmolLM2's
float32 LoRA gradients were other bytes at 1 and 2 threads from the first step. `ordered_mm`
sums such a product in fixed runs of SUM_RUN, in order, in float32: no product of 256 inner
terms was split at 1-16 threads on Intel AMX (float32 and bf16, 60-5440 rows, 64-2048
columns; 512 already was), so a float32 step's gradients are the same bytes at any thread
count (tests/models/test_ordered.py). Not covered (docs/architecture.md, "Threads and the
same bytes"): bf16 products (oneDNN blocks even a 576-long sum by thread count), float32
products of a few rows over a long sum (a sampler's), a from-scratch model's own weights.
"""

from __future__ import annotations

import torch

SUM_RUN = 256


def ordered_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (a: (..., k), b: (k, n)) with its k-long sum in runs of SUM_RUN added in order
    in float32; a @ b itself, to the bit, where k is one run."""
    acc = a[..., :SUM_RUN] @ b[:SUM_RUN]
    if a.shape[-1] <= SUM_RUN:
        return acc
    acc = acc.float()
    for s in range(SUM_RUN, a.shape[-1], SUM_RUN):
        acc += a[..., s : s + SUM_RUN] @ b[s : s + SUM_RUN]
    return acc


def ordered(x: torch.Tensor) -> bool:
    """Whether products on x take `ordered_mm`: on the CPU, outside a compiled graph (whose
    own kernels decide its sums)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()
