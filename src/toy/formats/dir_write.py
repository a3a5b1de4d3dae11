"""A GGUF model written whole as a transformers or an MLX directory (`toy fetch MODEL --as
transformers|mlx`), with toy's own readers and writers: no transformers, no mlx-lm.

- transformers: every weight dequantized to float32, which is the GGUF's model exactly
  (toy's dequantization is bit-identical to gguf.quants), Q/K rows in HF's order; the
  config.json the family writes (models/<family>.py's hf_config_out), tokenizer.json (the
  tokenizer toy builds from the GGUF's vocabulary, with its BOS rule), tokenizer_config.json,
  chat_template.jinja and generation_config.json (EOS).
- MLX: the same files, and each quantized weight carried over from its GGUF blocks as MLX
  affine groups of 32, code for code: Q4_0/Q4_1/Q4_K -> 4 bits, Q5_0/Q5_1/Q5_K -> 5 bits,
  Q8_0 -> 8 bits (a block's scale and offset become the group's scale and bias; float32,
  so that mx.dequantize gives the GGUF's values bit for bit). config.json's `quantization`
  holds the most common width and a per-module override for every other (mlx-lm's form).
  A 2-D weight of another type (Q2_K, Q3_K, Q6_K: sub-blocks of 16, which MLX groups cannot
  hold; F16, F32) is written unquantized in float32 and marked false there. Nothing is
  re-quantized, so nothing of the model is lost: a 4-bit model requantized by
  `mlx_lm.convert -q` (groups of 64) answers much worse (scripts/make_smollm2_dirs.py).

A trained model (a run's final/: from-scratch, warm-start, a distilled student) is
written the same way by `write_trained_dir`: its float32 weights, the family's config.json,
its tokenizer files; an MLX directory of it is unquantized (mlx-lm loads float weights as
they are).

The directory is written beside its final path and renamed into place: whole or nothing.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from toy.errors import UsageError
from toy.formats.base import Base, QuantTensor, Specials
from toy.formats.checkpoint import atomic_dir
from toy.models import mlx_quant, registry
from toy.models.family import BadConfig, hf_name
from toy.models.quant import (
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q8_0,
    QuantSpec,
    codes,
    half_split_rows,
)

KINDS = ("transformers", "mlx")
GROUP = 32  # MLX group size: the GGUF blocks' (and K-quants' sub-blocks') 32 weights
# GGUF type -> (MLX bits, the offset its codes carry: q - offset is what the type stores)
MLX_BITS = {
    Q4_0: (4, 8),
    Q4_1: (4, 0),
    Q4_K: (4, 0),
    Q5_0: (5, 16),
    Q5_1: (5, 0),
    Q5_K: (5, 0),
    Q8_0: (8, 128),
}


@dataclass
class DirReport:
    path: Path
    kind: str
    n_params: int
    tensor_types: Counter = field(default_factory=Counter)  # what was written, per tensor


def _mlx_parts(t: QuantTensor) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(bits, weight, scales, biases) of a GGUF block tensor as MLX affine groups of 32, the
    same codes; None for a type MLX groups cannot hold."""
    spec = t.spec
    if not isinstance(spec, QuantSpec) or spec.qtype not in MLX_BITS:
        return None
    bits, offset = MLX_BITS[spec.qtype]
    rows, cols = spec.shape
    q, s, z = codes(t.parts[0], spec.qtype)  # (blocks, subs, 32): w = q * s (+ z)
    if q.shape[-1] != GROUP:
        return None
    q = (q.to(torch.int32) + offset).reshape(rows, cols)
    s = s.reshape(rows, cols // GROUP).float()
    # w = s * (u - offset) = s * u - offset * s: exact in float32 (offset a power of two).
    b = (-offset * s) if z is None else z.reshape(rows, cols // GROUP).float()
    if spec.qk_heads:  # llama.cpp's interleaved rope rows back to HF's order
        q, s, b = (half_split_rows(x, spec.qk_heads) for x in (q, s, b))
    return bits, mlx_quant.pack(q.contiguous(), bits), s.contiguous(), b.contiguous()


def _float(t: torch.Tensor | QuantTensor) -> torch.Tensor:
    if isinstance(t, QuantTensor):
        return t.spec.dequantize(t.parts, torch.float32)
    return t.float()


def config_json(base: Base) -> dict:
    """The transformers config.json of a GGUF base; a UsageError where toy cannot write it."""
    fam = base.family
    if fam.hf_config_out is None:
        raise UsageError(
            f"{base.path}: a {base.arch} model cannot be written as a model directory yet "
            "(toy writes llama models); use the GGUF itself"
        )
    try:
        config = fam.hf_config_out(base.config, base.arch)
    except BadConfig as e:
        raise UsageError(f"{base.path}: {e}; use the GGUF itself")
    sp = base.special
    config.update(bos_token_id=sp.bos, eos_token_id=sp.eos, pad_token_id=sp.pad)
    return config


def write_model_dir(base: Base, out: Path, kind: str) -> DirReport:
    """Write `base` (a GGUF read with base_dtype "quantized") to `out` as a `kind`
    directory, replacing an earlier `out` whole."""
    if kind not in KINDS:
        raise UsageError(f"a model directory is one of {', '.join(KINDS)}, not {kind!r}")
    if base.kind != "gguf":
        raise UsageError(f"{base.path}: is already a {base.kind} directory")
    config = config_json(base)
    config["torch_dtype"] = "float32"
    tensors: dict[str, torch.Tensor] = {}
    written: Counter = Counter()
    quant: dict = {}
    widths: Counter = Counter()
    n_params = 0
    for name, t in base.state_dict.items():
        file_name = hf_name(name)
        n_params += t.spec.shape[0] * t.spec.shape[1] if isinstance(t, QuantTensor) else t.numel()
        mlx = _mlx_parts(t) if kind == "mlx" and isinstance(t, QuantTensor) else None
        if mlx is not None:
            bits, w, s, b = mlx
            module = file_name.removesuffix(".weight")
            tensors[file_name], tensors[module + ".scales"], tensors[module + ".biases"] = w, s, b
            quant[module] = {"group_size": GROUP, "bits": bits}
            widths[bits] += 1
            written[f"{bits}-bit"] += 1
            continue
        f = _float(t)
        if kind == "mlx" and f.dim() == 2:
            quant[file_name.removesuffix(".weight")] = False  # mlx-lm leaves it unquantized
        tensors[file_name] = f.contiguous()
        written["float32"] += 1
    if kind == "mlx":
        if not widths:
            raise UsageError(
                f"{base.path}: holds no weight in 4, 5 or 8-bit blocks of 32 (Q4_0, Q4_1, Q4_K, "
                "Q5_0, Q5_1, Q5_K, Q8_0), so an MLX directory would be float32 throughout; use "
                "--as transformers"
            )
        bits = widths.most_common(1)[0][0]
        q = {"group_size": GROUP, "bits": bits, "mode": "affine"}
        for module, own in quant.items():
            if own != {"group_size": GROUP, "bits": bits}:
                q[module] = own
        config["quantization"] = q
        config["quantization_config"] = q
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out) as tmp:
        weights = tmp / "model.safetensors"
        _io(lambda: save_file(tensors, str(weights), metadata={"format": "pt"}), weights)
        _json(tmp / "config.json", config)
        _tokenizer_files(tmp, base.tokenizer, base.special, base.chat_template,
                         base.config.max_seq_len)  # fmt: skip
    return DirReport(out, kind, n_params, written)


def _io(write, path: Path) -> None:
    """Run a writer of a Rust library (safetensors, tokenizers), turning the I/O error it
    raises as its own exception type ("... File too large (os error 27)", a full disk's
    "(os error 28)") into the OSError Python's own writes raise, which callers catch."""
    try:
        write()
    except OSError:
        raise
    except Exception as e:
        errno = re.search(r"\(os error (\d+)\)", str(e))
        if errno is None:
            raise
        n = int(errno.group(1))
        raise OSError(n, os.strerror(n), str(path)) from e


def _json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def write_trained_dir(
    model: torch.nn.Module,
    tokenizer,
    special: Specials,
    chat_template: str | None,
    out: Path,
    kind: str,
) -> DirReport:
    """A trained toy model (float weights) as a `kind` directory, replacing an earlier
    `out` whole: the family's config.json (a UsageError where the family writes none), its
    weights in float32 under HF's names, the tokenizer files."""
    if kind not in KINDS:
        raise UsageError(f"a model directory is one of {', '.join(KINDS)}, not {kind!r}")
    cfg = model.cfg
    fam = registry.family(cfg.arch)
    if fam.hf_config_out is None:
        raise UsageError(f"a {cfg.arch} model cannot be written as a model directory yet")
    try:
        config = fam.hf_config_out(cfg, cfg.arch)
    except BadConfig as e:
        raise UsageError(str(e))
    config.update(bos_token_id=special.bos, eos_token_id=special.eos, pad_token_id=special.pad)
    config["torch_dtype"] = "float32"
    sd = model.state_dict()
    if getattr(cfg, "tie_embeddings", False):
        sd.pop("lm_head.weight", None)
    tensors = {hf_name(k): v.detach().float().contiguous().cpu() for k, v in sd.items()}
    n_params = sum(t.numel() for t in tensors.values())
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out) as tmp:
        weights = tmp / "model.safetensors"
        _io(lambda: save_file(tensors, str(weights), metadata={"format": "pt"}), weights)
        _json(tmp / "config.json", config)
        _tokenizer_files(tmp, tokenizer, special, chat_template, cfg.max_seq_len)
    return DirReport(out, kind, n_params, Counter(float32=len(tensors)))


def _tokenizer_files(d: Path, tok, sp: Specials, chat_template: str | None, max_len: int) -> None:
    """tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json:
    what transformers' AutoTokenizer, mlx-lm and toy's own reader take."""
    _io(lambda: tok.save(str(d / "tokenizer.json")), d / "tokenizer.json")

    def token(i: int | None) -> str | None:
        return tok.id_to_token(i) if i is not None else None

    _json(
        d / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": token(sp.bos),
            "eos_token": token(sp.eos),
            "pad_token": token(sp.pad),
            "model_max_length": max_len,
            "clean_up_tokenization_spaces": False,
        },
    )
    if chat_template:
        (d / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    gen = {"bos_token_id": sp.bos, "eos_token_id": sp.eos, "pad_token_id": sp.pad}
    _json(d / "generation_config.json", {k: v for k, v in gen.items() if v is not None})
