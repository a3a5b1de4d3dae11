"""The GGUF tensor types toy's torch kernels (models/quant.py) dequantize, torch-free:
what a header alone can be checked against (describe, resident sizes)."""

from __future__ import annotations

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 10, 11, 12, 13, 14, 30
QK_K = 256

# ggml type id -> (block_size, type_size in bytes, name); the same numbers as gguf.constants
QUANT_TYPES: dict[int, tuple[int, int, str]] = {
    F32: (1, 4, "F32"),
    F16: (1, 2, "F16"),
    BF16: (1, 2, "BF16"),
    Q4_0: (32, 18, "Q4_0"),
    Q4_1: (32, 20, "Q4_1"),
    Q5_0: (32, 22, "Q5_0"),
    Q5_1: (32, 24, "Q5_1"),
    Q8_0: (32, 34, "Q8_0"),
    Q2_K: (QK_K, 84, "Q2_K"),
    Q3_K: (QK_K, 110, "Q3_K"),
    Q4_K: (QK_K, 144, "Q4_K"),
    Q5_K: (QK_K, 176, "Q5_K"),
    Q6_K: (QK_K, 210, "Q6_K"),
}


# Other ggml types, named only so the error for them says what they are
OTHER_TYPE_NAMES = {
    9: "Q8_1",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
}

# How a frozen base is held in memory (--base-dtype): the file's own blocks, memory-mapped
# and dequantized per use, or dequantized once at load to bfloat16 or float32.
BASE_DTYPES = ("quantized", "bfloat16", "float32")
