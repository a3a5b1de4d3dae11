"""Write the 1.07B-parameter Q4_0 llama the quantized-base bench trains: TinyLlama-1.1B's
blocks (22 layers, width 2048, ffn 5632, 32 heads, 4 kv heads) with SmolLM2's
vocabulary and tokenizer metadata (49152 tokens, tied embedding), random weights
(N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers) as toy's init), every
matrix quantized to Q4_0 with `gguf.quants.quantize`, norms F32.

    python bench/make_big_llama.py --smollm2 SmolLM2.gguf --out build/bench/big-q4_0.gguf

Tensors are made and quantized one at a time (bounded memory), in llama.cpp's layout
(Q/K rows are random, so their interleaving does not matter).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType

LAYERS, WIDTH, FFN, HEADS, KV = 22, 2048, 5632, 32, 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--smollm2", type=Path, required=True, help="SmolLM2 GGUF: its tokenizer metadata is copied"
    )
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    from toy.formats.gguf_header import read_gguf_header

    t0 = time.perf_counter()
    src = read_gguf_header(a.smollm2)
    vocab = len(src.metadata["tokenizer.ggml.tokens"])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("toy bench llama 1.07B (random, Q4_0)")
    for k, v in {
        "context_length": 2048,
        "embedding_length": WIDTH,
        "feed_forward_length": FFN,
        "block_count": LAYERS,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV,
        "rope.dimension_count": WIDTH // HEADS,
        "vocab_size": vocab,
    }.items():
        w.add_uint32(f"llama.{k}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_uint32("general.file_type", int(gguf.LlamaFileType.MOSTLY_Q4_0))
    for k, v in src.metadata.items():
        if k.startswith("tokenizer.") and k != "tokenizer.chat_template":
            vtype, item = src.kv_types[k]
            w.add_key_value(k, v, vtype, item) if item is None else w.add_key_value(
                k, list(v), vtype, item
            )
    rng = np.random.default_rng(0)
    n_params = 0

    def matrix(name: str, rows: int, cols: int, std: float = 0.02) -> None:
        nonlocal n_params
        x = rng.standard_normal((rows, cols), dtype=np.float32) * std
        w.add_tensor(
            name,
            gguf.quants.quantize(x, GGMLQuantizationType.Q4_0),
            raw_dtype=GGMLQuantizationType.Q4_0,
        )
        n_params += rows * cols

    def norm(name: str) -> None:
        nonlocal n_params
        w.add_tensor(name, np.ones(WIDTH, dtype=np.float32))
        n_params += WIDTH

    hd = WIDTH // HEADS
    out_std = 0.02 / math.sqrt(2 * LAYERS)
    matrix("token_embd.weight", vocab, WIDTH)
    norm("output_norm.weight")
    for i in range(LAYERS):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight")
        matrix(b + "attn_q.weight", HEADS * hd, WIDTH)
        matrix(b + "attn_k.weight", KV * hd, WIDTH)
        matrix(b + "attn_v.weight", KV * hd, WIDTH)
        matrix(b + "attn_output.weight", WIDTH, HEADS * hd, out_std)
        norm(b + "ffn_norm.weight")
        matrix(b + "ffn_gate.weight", FFN, WIDTH)
        matrix(b + "ffn_up.weight", FFN, WIDTH)
        matrix(b + "ffn_down.weight", WIDTH, FFN, out_std)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(a.out)
    print(
        f"wrote {a.out}: {n_params / 1e9:.3f}B parameters, {a.out.stat().st_size / 1e6:.0f} MB, "
        f"{time.perf_counter() - t0:.0f} s"
    )


if __name__ == "__main__":
    main()
