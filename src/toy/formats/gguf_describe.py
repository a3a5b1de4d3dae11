"""What a GGUF holds and whether toy can load it, from its header alone (nothing is read
or dequantized): `toy describe` and `toy list`.

- `config_from_header(h)`: toy's model config for the file's family;
- `check_tensors(h)`: the header's tensors are exactly the family's, with their shapes;
- `resident_size(h, base_dtype)`: what the base takes in memory in each --base-dtype;
- `describe_gguf(path)`: all of it as one dict (any GGUF describes, even one toy cannot
  load: `load_error` then says why).
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from toy.errors import InputError
from toy.formats.gguf_header import GGUFHeader, read_gguf_header
from toy.formats.gguf_plan import Planned, check_plan, family_of, gguf_families
from toy.models.quant_types import BASE_DTYPES, QUANT_TYPES  # noqa: F401  (BASE_DTYPES: importers take it here)


def config_from_header(h: GGUFHeader):
    """toy's model config for the file's family (Llama/Phi3/Gemma config), from the
    `<arch>.*` keys. Raises InputError for a missing key or an unsupported feature."""
    return family_of(h).config(h)


def tensor_name_map(cfg, arch: str = "llama") -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF tensor name -> (toy parameter name, torch shape), for `arch`'s family."""
    return {g: (p.name, p.shape) for g, p in gguf_families()[arch].plan(cfg).items()}


def check_tensors(h: GGUFHeader, cfg=None) -> dict[str, Planned]:
    """Whether the header's tensors are exactly the ones the family needs, each with the
    shape the hyper-parameters give: names and shapes only, nothing read or dequantized.
    Returns the plan; raises InputError naming the first tensor that does not fit.
    read_gguf refuses such a file with it, describe_gguf reports it."""
    fam = family_of(h)
    cfg = cfg if cfg is not None else fam.config(h)
    plan = fam.plan(cfg)
    check_plan(h, plan, fam.name, cfg.n_layer)
    return plan


def resident_size(h: GGUFHeader, base_dtype: str) -> int:
    """Bytes the base's weights take once loaded in `base_dtype`: the blocks as they are
    in the file (quantized, 1-D tensors in float32), or 4 / 2 bytes a weight."""
    total = 0
    for ti in h.tensors.values():
        if base_dtype == "quantized" and len(ti.ne) == 2 and int(ti.qtype) in QUANT_TYPES:
            total += ti.nbytes
        else:
            total += ti.n_elements * (2 if base_dtype == "bfloat16" and len(ti.ne) == 2 else 4)
    return total


def describe_gguf(path: str | os.PathLike) -> dict[str, Any]:
    """What a GGUF holds, from its header alone (nothing is dequantized): architecture,
    hyper-parameters, parameter count, tensor types, tokenizer and special tokens, the
    resident size of the base in each --base-dtype, and `load_error`: why toy cannot
    load (or train) the file, or None. Any GGUF describes, even an architecture toy does
    not support: the error then names it and the supported ones."""
    h = read_gguf_header(path)
    meta = h.metadata
    load_error, cfg = None, None
    try:
        cfg = config_from_header(h)
        check_tensors(h, cfg)
    except InputError as e:
        load_error = e.message
    tokens = meta.get("tokenizer.ggml.tokens")
    tokens = tokens if isinstance(tokens, list) else []

    def special(key: str) -> dict[str, Any] | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if not isinstance(i, int) or isinstance(i, bool):
            return None
        return {"id": i, "token": tokens[i] if 0 <= i < len(tokens) else None}

    hp = None
    if cfg is not None:
        hp = {k: v for k, v in cfg.to_dict().items() if k != "arch"}
        hp["context_length"] = hp.pop("max_seq_len")
    return {
        "path": str(h.path),
        "file_size": h.file_size,
        "gguf_version": h.version,
        "arch": meta.get("general.architecture"),
        "type": meta.get("general.type", "model"),
        "name": meta.get("general.name"),
        "hyperparameters": hp,
        # Each tensor is stored once, so a tied embedding is counted once.
        "n_params": sum(ti.n_elements for ti in h.tensors.values()),
        "n_tensors": len(h.tensors),
        "tensor_types": dict(Counter(ti.qtype.name for ti in h.tensors.values()).most_common()),
        "resident_bytes": {d: resident_size(h, d) for d in BASE_DTYPES},
        "tokenizer": {
            "model": meta.get("tokenizer.ggml.model"),
            "pre": meta.get("tokenizer.ggml.pre"),
            "vocab_size": len(tokens),
            "n_merges": len(meta.get("tokenizer.ggml.merges") or []),
            "special_tokens": {
                k: special(key)
                for k, key in (
                    ("bos", "bos"),
                    ("eos", "eos"),
                    ("pad", "padding"),
                    ("unk", "unknown"),
                )
            },
        },
        "chat_template": isinstance(meta.get("tokenizer.chat_template"), str),
        "load_error": load_error,
    }
