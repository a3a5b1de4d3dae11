"""A LoRA adapter merged into a directory base, written as a directory of the same kind:

- transformers: every tensor as the base stores it (same names, dtypes and shards), the
  adapted linears replaced by W + B A * alpha / r computed in float32 and rounded to the
  base's dtype once; config, tokenizer and template files copied.
- MLX: as `mlx_lm.fuse` does: each adapted module dequantized (bit-identical to
  mx.dequantize), the update added in the weights' dtype, then re-quantized to the base's
  own bits and group size (bit-identical to mx.quantize); config unchanged.

The output is written beside its final path and renamed into place: it holds a whole
model or nothing.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from toy.errors import InputError, UsageError
from toy.formats.base import Base
from toy.formats.checkpoint import atomic_dir
from toy.formats.safetensors_map import SafeFile, weight_files
from toy.models import mlx_quant
from toy.models.family import hf_name

WEIGHT_PATTERNS = ("model.safetensors", "model-", "model.safetensors.index.json")


@dataclass
class MergeReport:
    path: Path
    kind: str
    adapted: int  # tensors the adapter changed
    notes: list[str] = field(default_factory=list)


def _file_name(base: Base, toy_module: str, names: set[str]) -> str:
    """The file's name of a toy module's weight (a multimodal Gemma 3 keeps its own prefix)."""
    canon = hf_name(toy_module + ".weight")
    for candidate in (
        canon,
        "language_model." + canon,
        canon.replace("model.", "model.language_model.", 1),
    ):
        if candidate in names:
            return candidate
    raise InputError(
        f"{base.path}: no tensor for {toy_module!r}; the adapter does not fit this base"
    )


def merge_into_dir(
    out: Path, base: Base, lora_sd: dict[str, torch.Tensor], rank: int, alpha: float
) -> MergeReport:
    """Write `base` (a transformers or MLX directory) with the adapter folded in to `out`,
    replacing an earlier `out` whole (whether it may is the caller's policy: toy export's)."""
    if base.kind not in ("transformers", "mlx"):
        raise UsageError(
            f"{base.path}: merging into a directory needs a directory base, not a {base.kind} file"
        )
    scaling = alpha / rank
    modules = sorted({k.rpartition(".")[0] for k in lora_sd})
    files = weight_files(base.path)
    opened = [SafeFile(f) for f in files]
    names = {n for sf in opened for n in sf.entries}
    targets = {_file_name(base, m, names): m for m in modules}
    quant = base.metadata.get("quantization") if base.kind == "mlx" else None
    out.parent.mkdir(parents=True, exist_ok=True)
    done = 0
    with atomic_dir(out) as tmp:
        for src in base.path.iterdir():  # config, tokenizer, template, index, README: as they are
            if src.is_file() and not (
                src.name.endswith(".safetensors") and src.name.startswith("model")
            ):
                shutil.copyfile(src, tmp / src.name)
        for sf in opened:
            tensors = {n: sf.tensor(n) for n in sf.entries}
            for name in [n for n in sf.entries if n in targets]:
                m = targets[name]
                delta = (
                    lora_sd[m + ".lora_B"].float() @ lora_sd[m + ".lora_A"].float()
                ) * scaling  # (out, in)
                module = name[: -len(".weight")]
                if quant is not None and module + ".scales" in names:
                    own = quant.get(module)
                    q = own if isinstance(own, dict) else quant
                    bits, group = int(q["bits"]), int(q["group_size"])
                    s_file = next(o for o in opened if module + ".scales" in o.entries)
                    b_file = next(o for o in opened if module + ".biases" in o.entries)
                    w = mlx_quant.dequantize(
                        tensors[name],
                        s_file.tensor(module + ".scales"),
                        b_file.tensor(module + ".biases"),
                        group,
                        bits,
                    )
                    wq, s, b = mlx_quant.quantize(w + delta.to(w.dtype), group, bits)
                    if s_file is not sf or b_file is not sf:
                        raise InputError(
                            f"{base.path}: {module}'s weight, scales and biases are in different "
                            "files; toy merges only modules kept in one file"
                        )
                    tensors[name], tensors[module + ".scales"], tensors[module + ".biases"] = (
                        wq,
                        s,
                        b,
                    )
                else:
                    w = tensors[name]
                    tensors[name] = (w.float() + delta).to(w.dtype)
                done += 1
            save_file(
                {n: t.contiguous() for n, t in tensors.items()},
                str(tmp / sf.path.name),
                metadata=sf.metadata or {"format": "pt"},
            )
    if done != len(modules):
        raise InputError(
            f"{base.path}: only {done} of the adapter's {len(modules)} modules were found"
        )
    what = (
        f"re-quantized to {quant.get('bits')} bits, group {quant.get('group_size')} (as mlx_lm.fuse)"
        if quant is not None
        else "in the base's dtype"
    )
    return MergeReport(
        out, base.kind, done, [f"{done} adapted tensors {what}; every other tensor as the base"]
    )
