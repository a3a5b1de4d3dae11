"""The base readers, in one table: kind -> probe, read, describe. Every caller that takes
a base (an adapter recipe's base, a donor, a teacher, `toy infer`, `toy export`, `toy describe`)
asks this table which kind a path is and how to read or describe it; the readers never
import each other (formats/base.py holds what they share).

    base = read_base("model.gguf" | "Qwen3-0.6B/" | "SmolLM2-mlx-4bit/", "quantized")
    d = describe_base(path)         # headers only; what a base toy cannot load still describes

A new kind of base is one reader module (probe, read, describe) and one line in READERS.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toy.errors import InputError
from toy.formats import gguf, gguf_describe, hf_dir
from toy.formats.base import Base


@dataclass(frozen=True)
class BaseReader:
    kind: str
    # Whether a path is this kind (an InputError where it is plainly meant as one but cannot
    # be: a directory without config.json, a config.json that is not JSON).
    probe: Callable[[Path], bool]
    read: Callable[[Path, str], Base]  # (path, --base-dtype) -> the base
    describe: Callable[[Path], dict[str, Any]]  # headers only; `load_error` when it cannot load


READERS: dict[str, BaseReader] = {
    r.kind: r
    for r in (
        BaseReader("gguf", Path.is_file, gguf.read_gguf, gguf_describe.describe_gguf),
        BaseReader(
            "transformers", hf_dir.is_transformers, hf_dir.read_model_dir, hf_dir.describe_dir
        ),
        BaseReader("mlx", hf_dir.is_mlx, hf_dir.read_model_dir, hf_dir.describe_dir),
    )
}
KINDS = tuple(READERS)


def reader_of(path: str | os.PathLike) -> BaseReader:
    """The reader of the base at `path`; an InputError saying what is supported otherwise."""
    p = Path(path)
    if p.exists():
        for r in READERS.values():
            if r.probe(p):
                return r
    raise InputError(
        f"{p}: no such file or directory; give a GGUF file, a transformers directory or an MLX "
        "directory (config.json + safetensors)"
    )


def base_kind(path: str | os.PathLike) -> str:
    """What a base path is: one of KINDS."""
    return reader_of(path).kind


def read_base(path: str | os.PathLike, base_dtype: str = "float32") -> Base:
    """The base at `path`, of any kind, its weights held as `base_dtype` asks."""
    return reader_of(path).read(Path(path), base_dtype)


def describe_base(path: str | os.PathLike) -> dict[str, Any]:
    """What the base at `path` holds, from its headers (see each reader's describe)."""
    return reader_of(path).describe(Path(path))


def held_as(probe: Base, path: str | os.PathLike, dtype: str) -> Base:
    """The base `probe` (read as stored, `read_base(path, "quantized")`) held as `dtype`
    asks. A GGUF's blocks are dequantized from the probe, with the dequantization and row
    order read_gguf's float path uses (the same bits, tested), rather than read again: its
    header parsed and its tokenizer built from 49k merges a second time took ~0.25 s of a
    float32 reply (loaded 2-core Zen 4). Other kinds are read again.

    Each weight is written into one tensor piece by piece (quant.dequantize_held: no heap
    holes between the weights), and its blocks' pages leave this process once read
    (probe.drop_pages; touched again, they are read from the file again). A SmolLM2-135M
    float32 reply peaked here at its weights plus the whole file's pages (92 MiB) plus
    57-80 MiB of heap holes (docs/performance.md)."""
    import dataclasses

    import torch

    from toy.formats.base import QuantTensor
    from toy.models.quant import QuantSpec, dequantize_held

    if dtype == "quantized":
        return probe
    tensors = probe.state_dict.values()
    if (
        probe.kind != "gguf"
        or dtype not in ("float32", "bfloat16")
        or any(isinstance(t, QuantTensor) and not isinstance(t.spec, QuantSpec) for t in tensors)
    ):
        return read_base(path, dtype)
    sd = {}
    for name, t in probe.state_dict.items():
        if isinstance(t, QuantTensor):
            # straight in bfloat16: the same bits as the float32 weight cast, as read_gguf's
            w = dequantize_held(
                t.parts[0], t.spec, torch.bfloat16 if dtype == "bfloat16" else torch.float32
            )
            if probe.drop_pages is not None:
                probe.drop_pages(t.parts[0])
            t = w
        elif dtype == "bfloat16" and t.dim() == 2:  # the norms stay float32, as read_gguf's
            t = t.to(torch.bfloat16)
        sd[name] = t.contiguous()
    return dataclasses.replace(probe, state_dict=sd, base_dtype=dtype, notes=[], drop_pages=None)
