"""The packed-code kernels alone (models/decode.py: one token's product W x on a GGUF
block type's codes), against the float32 product on the same weight dequantized (what a
float32 base runs), in one run. A loop over distinct matrices (40 of each block shape, 2 of a
head's), so that they are read from memory as a model's layers are, not from cache.

    python bench/nibble_kernel.py [--threads 2] [--repeats 5]

Prints one JSON line per (type, shape): microseconds a product packed and float32, the
packed kernel's G codes/s and GB/s, and packed over float32 speed; where decode_step.c builds,
its product on the same codes in its blocked order too (c_us, c_gb_per_s, c_over_packed: what
a llama reply's blocks and head run, models/decode_native.py). Run it with nothing else
running; it builds each kernel first (a cold build is seconds)."""

from __future__ import annotations

import argparse
import json
import time

import gguf
import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as T

from toy.models import decode, decode_native
from toy.models.quant import QuantLinear, QuantSpec, parts_of
from toy.train.device import cpu_kind

SHAPES = ((1536, 576, 40), (576, 1536, 40), (49152, 576, 2))  # SmolLM2's gate/up, down, head


def matrices(qtype, rows: int, cols: int, n: int) -> tuple[list[QuantLinear], list]:
    """n packed QuantLinears of random weights in this block type, and their float32 weights."""
    rng = np.random.default_rng(rows * cols)
    packed, dense = [], []
    for _ in range(n):
        w = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
        raw = torch.from_numpy(gguf.quants.quantize(w, qtype))
        lin = QuantLinear(raw, QuantSpec(int(qtype), (rows, cols)))
        dense.append(lin.dequantized())
        decode.pack(lin)
        packed.append(lin)
    return packed, dense


def per_product(fn, items: list, repeats: int) -> float:
    for it in items:  # built (or loaded) and warm
        fn(it)
    t = time.perf_counter()
    for _ in range(repeats):
        for it in items:
            fn(it)
    return (time.perf_counter() - t) / (repeats * len(items))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    kind = cpu_kind()
    for qtype in (T.Q4_0, T.Q4_1, T.Q8_0):
        for rows, cols, n in SHAPES:
            packed, dense = matrices(qtype, rows, cols, n)
            blocked = None
            if decode_native.library() is not None:  # the same weights, in the C step's order
                blocked = matrices(qtype, rows, cols, n)[0]
                decode_native.to_blocked(blocked)
            x = torch.randn(1, 1, cols, generator=torch.Generator().manual_seed(0))
            xv = x.view(cols)
            with torch.no_grad():
                s_packed = per_product(lambda lin, x=x: lin(x), packed, a.repeats)
                s_f32 = per_product(lambda w, xv=xv: torch.mv(w, xv), dense, a.repeats)
                s_c = per_product(lambda lin, x=x: lin(x), blocked, a.repeats) if blocked else None
            nbytes = sum(p.numel() * p.element_size() for p in parts_of(packed[0]) if p.numel())
            row = {
                "cpu_kind": kind,
                "threads": a.threads,
                "type": qtype.name,
                "shape": f"{rows}x{cols}",
                "packed_us": round(s_packed * 1e6, 1),
                "float32_us": round(s_f32 * 1e6, 1),
                "packed_over_float32": round(s_f32 / s_packed, 2),
                "packed_gcodes_per_s": round(rows * cols / s_packed / 1e9, 2),
                "packed_gb_per_s": round(nbytes / s_packed / 1e9, 2),
            }
            if s_c is not None:  # decode_step.c's product (a llama reply's), on the same codes
                row |= {
                    "c_us": round(s_c * 1e6, 1),
                    "c_gb_per_s": round(nbytes / s_c / 1e9, 2),
                    "c_over_packed": round(s_packed / s_c, 2),
                }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
