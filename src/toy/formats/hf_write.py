"""A LoRA adapter merged into a directory base, written as a directory of the same kind:

- transformers: every tensor as the base stores it (same names, dtypes and shards), the
  adapted linears replaced by W + B A * alpha / r computed in float32.
- MLX: each adapted module dequantized (bit-identical to mx.dequantize) and the update added.

How the adapted linears are written (`dtype`), as the GGUF merge does (gguf_write.py):
- "keep" (the default): at a width that holds the update. A LoRA update is about 1e-3 of a
  weight: bfloat16 (8 bits of mantissa) rounds most of it away, and a 4-bit (even an 8-bit)
  re-quantization all of it; float16 keeps it to a few percent. So MLX: unquantized, in
  float16, or in float32 where the module's scales are float32 (a float32 base, as `toy fetch
  --as mlx` writes; mlx_lm.fuse --dequantize, too, writes the scales' dtype); mlx-lm leaves a
  module without `scales` unquantized and config.json's quantization marks it false;
  transformers: float32 where the base is half precision, with config.json's dtype float32 so
  that transformers does not round them back to the base's dtype when it loads them.
- "base": in the base's own form: its dtype; MLX re-quantized to the base's bits and group
  size (bit-identical to mx.quantize), as mlx_lm.fuse does. The smallest, but lossy.
The report says how much of the update the written tensors keep (update_kept, update_error).

The output is written beside its final path and renamed into place: it holds a whole
model or nothing.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
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

MERGE_DTYPES = ("keep", "base")


@dataclass
class MergeReport:
    path: Path
    kind: str
    adapted: int  # tensors the adapter changed
    notes: list[str] = field(default_factory=list)
    # As gguf_write.WriteReport: over the adapted tensors (W the base's, dW the update, V
    # what was written), <V - W, dW> / ||dW||^2 and ||V - (W + dW)|| / ||dW||.
    update_kept: float = 1.0
    update_error: float = 0.0


class _Update:
    """What the written tensors keep of the update, summed over the adapted tensors."""

    def __init__(self) -> None:
        self.dot = self.err2 = self.upd2 = 0.0

    def add(self, w: torch.Tensor, delta: torch.Tensor, v: torch.Tensor) -> None:
        d = delta.double()
        off = v.double() - (w.double() + d)  # V - (W + dW)
        self.err2 += float(off.square().sum())
        self.upd2 += float(d.square().sum())
        self.dot += float(((off + d) * d).sum())  # <V - W, dW>

    def figures(self) -> tuple[float, float]:
        if self.upd2 == 0:
            return 1.0, 0.0
        return self.dot / self.upd2, (self.err2 / self.upd2) ** 0.5


def update_note(kept: float, error: float) -> str:
    """The share of an update a merge kept, in words (gguf_write says it the same way)."""
    return (
        f"the merged weights keep {kept:.0%} of the adapter's update (their distance from "
        f"base + update is {error:.0%} of the update's size: rounding)"
    )


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
    out: Path,
    base: Base,
    lora_sd: dict[str, torch.Tensor],
    rank: int,
    alpha: float,
    dtype: str = "keep",
) -> MergeReport:
    """Write `base` (a transformers or MLX directory) with the adapter folded in to `out`,
    replacing an earlier `out` whole (whether it may is the caller's policy: toy export's);
    `dtype` is how the adapted linears are written (see the module's docstring)."""
    if dtype not in MERGE_DTYPES:
        raise UsageError(
            f"--dtype {dtype!r} is not offered for a merged directory; choose from: "
            f"{', '.join(MERGE_DTYPES)}"
        )
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
    update = _Update()
    written: Counter = Counter()
    widened: list[str] = []  # MLX modules written unquantized
    widened_dtype = False  # transformers: half-precision linears written in float32
    keep_width = "float16"  # MLX: the dtype --dtype keep writes the adapted linears in
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
                    if s_file is not sf or b_file is not sf:
                        raise InputError(
                            f"{base.path}: {module}'s weight, scales and biases are in different "
                            "files; toy merges only modules kept in one file"
                        )
                    scales = tensors[module + ".scales"]
                    # keep's width: float16 holds the update; a float32 base's own is float32.
                    wide = torch.float32 if scales.dtype == torch.float32 else torch.float16
                    keep_width = str(wide).removeprefix("torch.")
                    w = mlx_quant.dequantize(
                        tensors[name], scales, tensors[module + ".biases"], group, bits
                    )
                    if dtype == "base":  # as mlx_lm.fuse: the update added in the weights' dtype
                        wq, s, b = mlx_quant.quantize(w + delta.to(w.dtype), group, bits)
                        tensors[name], tensors[module + ".scales"], tensors[module + ".biases"] = (
                            wq,
                            s,
                            b,
                        )
                        v = mlx_quant.dequantize(wq, s, b, group, bits)
                        written[f"{bits}-bit"] += 1
                    else:  # unquantized, at a width that holds the update
                        v = (w.float() + delta).to(wide)
                        tensors[name] = v
                        del tensors[module + ".scales"], tensors[module + ".biases"]
                        widened.append(module)
                        written[keep_width] += 1
                else:
                    w = tensors[name]
                    wide = w.dtype if dtype == "base" or w.dtype == torch.float32 else torch.float32
                    widened_dtype |= wide != w.dtype
                    v = (w.float() + delta).to(wide)
                    tensors[name] = v
                    written[str(wide).removeprefix("torch.")] += 1
                update.add(w.float(), delta, v.float())
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
        if widened or widened_dtype:
            _mark_config(tmp / "config.json", widened, widened_dtype)
    kept, error = update.figures()
    types = ", ".join(f"{k} x{v}" for k, v in written.most_common())
    notes = [
        f"{done} adapted tensors written as {types}; every other tensor as the base: "
        + update_note(kept, error)
    ]
    if dtype == "base" and quant is not None:
        notes.append(
            f"--dtype base: the adapted tensors re-quantized to {quant.get('bits')} bits (as "
            "mlx_lm.fuse does); a quantization step is far above a LoRA update, so the merged "
            "model may answer as the base does; the default --dtype keep writes them "
            f"unquantized in {keep_width}"
        )
    elif dtype == "base" and kept < 0.9:
        notes.append(
            f"--dtype base: the base's {', '.join(written)} rounds part of the update away; the "
            "default --dtype keep writes the adapted tensors in float32"
        )
    elif widened:
        notes.append(
            f"the adapted linears are unquantized ({types}), as mlx_lm.fuse --dequantize writes "
            "them, which keeps the fine-tune; --dtype base re-quantizes them to the base's "
            f"{quant.get('bits')} bits as mlx_lm.fuse does (smaller, lossy)"
        )
    elif widened_dtype:
        notes.append(
            "the adapted linears are float32 and config.json's dtype float32, so that "
            "transformers keeps the update when it loads them (the base's half precision "
            "would round most of it away); --dtype base writes them in the base's dtype "
            "(smaller, lossy)"
        )
    return MergeReport(out, base.kind, done, notes, update_kept=kept, update_error=error)


def _mark_config(path: Path, unquantized: list[str], float32: bool) -> None:
    """config.json of a merged directory: the MLX modules written unquantized marked false in
    its quantization (mlx-lm's per-module override), or transformers' dtype float32."""
    config = json.loads(path.read_text())
    for key in ("quantization", "quantization_config"):
        if isinstance(config.get(key), dict):
            for module in unquantized:
                config[key][module] = False
    if float32:
        for c in (config, config.get("text_config")):
            for key in ("dtype", "torch_dtype"):
                if isinstance(c, dict) and key in c:
                    c[key] = "float32"
    path.write_text(json.dumps(config, indent=4))
