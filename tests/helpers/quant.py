"""GGUF quantized blocks: every block type (BLOCK_TYPES), random valid blocks (`random_blocks`)
and a tiny GGUF of quantized matrices (the `quant_gguf` fixture)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.constants import GGMLQuantizationType as T

T = GGMLQuantizationType


BLOCK_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


# byte offsets of the f16 scale (and minimum) fields inside one block
F16_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}


def random_blocks(qtype, rows: int, cols: int, scales: np.ndarray | None, seed: int) -> np.ndarray:
    """Random bytes in every quant field; the f16 fields drawn from `scales` (finite random
    halves when None)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        if scales is None:
            halves = rng.integers(0, 1 << 16, size=raw.shape[0], dtype=np.uint16)
            halves[(halves & 0x7C00) == 0x7C00] &= 0xBFFF  # exponent 31 (inf/NaN) -> finite
        else:
            halves = rng.choice(scales, size=raw.shape[0])
        raw[:, at : at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


@pytest.fixture(scope="module")
def quant_gguf(tmp_path_factory):
    """A tiny llama GGUF with Q4_0, Q4_1 and Q8_0 matrices (tied embedding Q8_0)."""
    from helpers.gguf_fixtures import gguf_name, tiny_model, write_llama_gguf
    from toy.data.prep import bundled_text_paths
    from toy.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("decode")
    text = bundled_text_paths()[0].read_text()[:40000]
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    model = tiny_model(
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        n_layer=2,
        d_model=128,
        n_head=4,
        n_kv_head=2,
        d_ff=384,
        max_seq_len=512,
        seed=3,
    )
    kinds = {"mlp": "Q4_0", "self_attn": "Q4_1", "embed": "Q8_0"}
    qtypes = {
        gguf_name(n): next(v for k, v in kinds.items() if k in n)
        for n, p in model.named_parameters()
        if p.dim() == 2
    }
    return write_llama_gguf(d / "q.gguf", model, tok, qtypes=qtypes)
