"""toy -> GGUF: full models (llama, gpt2) and LoRA adapters that llama.cpp loads.

    write_model_gguf("m.gguf", model, tok, dtype="f16")      # a toy Llama or GPT2 + its tokenizer
    write_lora_gguf("a.gguf", lora_sd, alpha=16, base=cfg)    # llama.cpp's adapter layout
    read_lora_gguf("a.gguf", base=cfg)                        # back to toy's adapter tensors

Files are written with `gguf.GGUFWriter` to a temp file beside the target, fsynced and
renamed: a reader sees the old file or the whole new one.

Layouts, at each point (the reason LoRA export is easy to get wrong):

- toy (and HF) keep Q/K rows of each head in "half-split" order: rotary pairs dim i
  with dim i + D/2. llama.cpp's `llama` architecture uses ggml's "normal" rope, which
  pairs ADJACENT dims (2i, 2i+1); its converter therefore interleaves the rows of each
  head (`permute_qk`). Every attn_q / attn_k weight (and bias) written under the
  `llama` architecture is permuted here; `toy.formats.gguf.read_gguf` undoes it.
  (qwen2 runs with NEOX rope = half-split: nothing is permuted for it.)
- A LoRA update is dW = B @ A * alpha/r with A (r, in) and B (out, r). Permuting the
  rows of dW is permuting the rows of B: P(B A) = (P B) A. So for q/k adapters B gets
  the same per-head row permutation as the base weight, and A is written as it is.
- torch shape (out, in) is GGUF ne [in, out] (ne[0] is the contiguous dimension). A
  (r, in) is ne [in, r] and B (out, r) is ne [r, out]; llama-adapter.cpp checks
  base.ne[0] == a.ne[0], base.ne[1] == b.ne[1] and a.ne[1] == b.ne[0]. It computes
  W x + scale * B (A x) with scale = alpha / rank, rank = b.ne[0] -- toy's formula.

dtypes: f32, f16, q8_0. 1-D tensors (norms, biases) stay f32 as llama.cpp's converter
keeps them; q8_0 packs rows in blocks of 32, so a matrix whose rows (ne[0]) are not a
multiple of 32 falls back to f16, and the report says which. A merged model also takes
keep (its default: the base's bytes where the adapter does not reach, f16 where it does)
and base (the adapted tensors requantized to the base's types: lossy, see
write_merged_gguf).

Tokenizer: a byte-level BPE from HF `tokenizers` is written as llama.cpp's `gpt2`
tokenizer model. The `tokenizer.ggml.pre` name decides how llama.cpp splits text
before BPE, so it must be the one whose regex equals the tokenizer's own split:
toy's `train_bpe` uses HF's ByteLevel regex, which is GPT-2's, and llama.cpp's name for
exactly that regex is "gpt-2" (its "default" is a different, punctuation-first split).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.constants import (
    GGML_QUANT_VERSION,
    GGMLQuantizationType,
    GGUFValueType,
    LlamaFileType,
    TokenType,
)
from tokenizers import Tokenizer

from toy.errors import InputError, UsageError
from toy.formats.base import Base
from toy.formats.checkpoint import write_file_atomic
from toy.formats.gguf import _load_tensor, _map, permute_qk, unpermute_qk
from toy.formats.gguf_describe import check_tensors, config_from_header, tensor_name_map
from toy.formats.gguf_header import read_gguf_header
from toy.formats.gguf_plan import family_of, gguf_families
from toy.formats.hf_write import update_note
from toy.models.family import Planned
from toy.models.gpt2 import GPT2, GPT2Config
from toy.models.llama import Llama, LlamaConfig
from toy.tokenizer import EOS_TOKEN, from_gguf_metadata

DTYPES = ("f32", "f16", "q8_0")
ADAPTER_DTYPES = ("f32", "f16")
_FILE_TYPE = {
    "f32": LlamaFileType.ALL_F32,
    "f16": LlamaFileType.MOSTLY_F16,
    "q8_0": LlamaFileType.MOSTLY_Q8_0,
}
_Q8_BLOCK = 32
# Pre-tokenizer names toy writes, each a llama.cpp name whose split toy's
# `from_gguf_metadata` reproduces exactly (checked against the tokenizer being written).
_EXPORT_PRE = ("gpt-2", "smollm", "llama-bpe", "qwen2")
# Tokens tried, in order, as end-of-text when a tokenizer does not declare one.
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|eot_id|>", "<|im_end|>", "<|end|>")


@dataclass
class WriteReport:
    """What was written: path, tensor types (GGML names -> count), parameter count and
    notes (dtype fallbacks, padded vocabulary) to show the user."""

    path: Path
    arch: str
    tensor_types: Counter = field(default_factory=Counter)
    n_params: int = 0
    notes: list[str] = field(default_factory=list)
    modelfile: Path | None = None  # the Ollama Modelfile written beside it
    # A merged model, over its adapted tensors (W the base's, dW the adapter's update, V
    # what was written): the share of the update kept, <V - W, dW> / ||dW||^2 (1: all
    # of it, 0: rounded away), and the error, ||V - (W + dW)|| / ||dW|| (rounding noise
    # and lost update together). None for other files.
    update_kept: float | None = None
    update_error: float | None = None


# ------------------------------------------------------------------ writing


def _check_dtype(dtype: str, allowed: tuple[str, ...] = DTYPES, what: str = "a GGUF model") -> None:
    if dtype not in allowed:
        raise UsageError(
            f"--dtype {dtype!r} is not offered for {what}; choose from: {', '.join(allowed)}"
        )


def _encode(
    name: str, arr: np.ndarray, dtype: str, notes: list[str]
) -> tuple[np.ndarray, GGMLQuantizationType]:
    """`arr` (float32, torch order) in the file's type. 1-D stays f32; q8_0 needs rows
    (the last torch dim = ne[0]) in whole blocks of 32, else that tensor falls back to f16."""
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if arr.ndim == 1 or dtype == "f32":
        return arr, GGMLQuantizationType.F32
    if dtype == "q8_0":
        if arr.shape[-1] % _Q8_BLOCK == 0:
            return gguf.quants.quantize(arr, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
        notes.append(
            f"{name}: rows of {arr.shape[-1]} are not a multiple of {_Q8_BLOCK}, written as f16 "
            "instead of q8_0"
        )
    return arr.astype(np.float16), GGMLQuantizationType.F16


def _add_kv(w: gguf.GGUFWriter, key: str, value: Any) -> None:
    """A metadata value with the type llama.cpp reads it as: token ids u32, flags bool,
    token types i32, scores f32, strings and string arrays as such."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        # Token ids and every other tokenizer integer llama.cpp reads are u32.
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        if not value:
            return  # GGUF has no typed empty array; llama.cpp treats a missing key as empty
        first = value[0]
        sub = (
            GGUFValueType.STRING
            if isinstance(first, str)
            else GGUFValueType.BOOL
            if isinstance(first, bool)
            else GGUFValueType.INT32
            if isinstance(first, int)
            else GGUFValueType.FLOAT32
        )
        w.add_key_value(key, list(value), GGUFValueType.ARRAY, sub)
    else:
        raise TypeError(f"cannot write GGUF metadata {key!r} of type {type(value).__name__}")


def _write(
    path: Path,
    arch: str,
    kv: dict[str, Any],
    tensors: list[tuple[str, np.ndarray, GGMLQuantizationType]],
    general_type: str | None = None,
    kv_types: dict | None = None,
) -> None:
    """Write a GGUF atomically. `kv_types` (key -> (value type, array item type), from a
    header) keeps keys copied from another file in their own types."""

    def fill(tmp: Path) -> None:
        w = gguf.GGUFWriter(str(tmp), arch)  # adds general.architecture
        if general_type:
            w.add_type(general_type)
        for k, v in kv.items():
            if kv_types and k in kv_types and not (k == "general.type" and general_type):
                vtype, item = kv_types[k]
                if vtype == GGUFValueType.ARRAY:
                    if v:
                        w.add_key_value(k, list(v), vtype, item)
                else:
                    w.add_key_value(k, v, vtype)
            else:
                _add_kv(w, k, v)
        for name, data, qtype in tensors:
            if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                w.add_tensor(name, data)  # the numpy dtype says F32/F16
            else:
                w.add_tensor(name, data, raw_dtype=qtype)  # bytes; the writer derives the shape
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    write_file_atomic(Path(path), fill)


# ------------------------------------------------------------------ tokenizer


def _probe_pre(pre: str) -> dict:
    """normalizer / pre-tokenizer / ignore_merges of the tokenizer toy rebuilds from a
    GGUF declaring `pre`: what an exported tokenizer must equal for that name."""
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.token_type": [1, 1, 1],
    }
    j = json.loads(from_gguf_metadata(meta).to_str())
    return {
        "normalizer": j.get("normalizer"),
        "pre_tokenizer": j.get("pre_tokenizer"),
        "ignore_merges": bool(j["model"].get("ignore_merges")),
    }


def _pre_name(j: dict, source: str) -> str:
    model = j.get("model") or {}
    problems = []
    if model.get("type") != "BPE":
        problems.append(f"model is {model.get('type')!r}, not BPE")
    if model.get("byte_fallback"):
        problems.append("byte_fallback BPE (sentencepiece style)")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        problems.append("subword prefixes/suffixes")
    if model.get("dropout"):
        problems.append("BPE dropout")
    if not problems:
        mine = {
            "normalizer": j.get("normalizer"),
            "pre_tokenizer": j.get("pre_tokenizer"),
            "ignore_merges": bool(model.get("ignore_merges")),
        }
        for pre in _EXPORT_PRE:
            try:
                if _probe_pre(pre) == mine:
                    return pre
            except InputError:  # a name this toy's reader does not know: skip it
                continue
        pt = j.get("pre_tokenizer") or {}
        problems.append(
            f"its pre-tokenizer ({pt.get('type', 'none')}) matches none of llama.cpp's "
            f"{', '.join(_EXPORT_PRE)} splits"
        )
    raise UsageError(
        f"{source}: cannot be written as a llama.cpp gpt2 (byte-level BPE) tokenizer: "
        f"{'; '.join(problems)}; train the model with a tokenizer from `toy prep` or a GGUF"
    )


def _template_specials(j: dict) -> tuple[str | None, str | None]:
    """(bos, eos) tokens the post-processor puts around a single sequence, if any."""
    pp = j.get("post_processor") or {}
    if pp.get("type") != "TemplateProcessing":
        return None, None
    single = pp.get("single") or []
    pos = next((i for i, p in enumerate(single) if "Sequence" in p), None)
    if pos is None:
        return None, None
    before = [p["SpecialToken"]["id"] for p in single[:pos] if "SpecialToken" in p]
    after = [p["SpecialToken"]["id"] for p in single[pos + 1 :] if "SpecialToken" in p]
    return (before[0] if before else None), (after[-1] if after else None)


def tokenizer_metadata(
    tok: Tokenizer, n_vocab: int, source: str = "tokenizer"
) -> tuple[dict[str, Any], list[str]]:
    """`tokenizer.ggml.*` keys for an HF byte-level BPE, and notes. `n_vocab` is the
    model's embedding rows: the token list is padded to it with unused `[PADn]` tokens
    (llama.cpp needs one token per row), and may not exceed it."""
    j = json.loads(tok.to_str())
    pre = _pre_name(j, source)
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise UsageError(
            f"{source}: token ids are not 0..{len(tokens) - 1} without gaps; llama.cpp needs a "
            "dense vocabulary"
        )
    if len(tokens) > n_vocab:
        raise UsageError(
            f"{source}: {len(tokens)} tokens but the model has only {n_vocab} embedding rows; "
            "the tokenizer does not belong to this model"
        )
    added = {a["content"]: bool(a.get("special")) for a in j.get("added_tokens") or []}
    types = [
        int(TokenType.CONTROL if added[t] else TokenType.USER_DEFINED)
        if t in added
        else int(TokenType.NORMAL)
        for t in tokens
    ]
    notes = []
    if len(tokens) < n_vocab:
        notes.append(
            f"vocabulary padded from {len(tokens)} to the model's {n_vocab} rows with unused tokens"
        )
        for i in range(len(tokens), n_vocab):
            tokens.append(f"[PAD{i}]")
            types.append(int(TokenType.UNUSED))
    merges = [m if isinstance(m, str) else " ".join(m) for m in j["model"].get("merges") or []]
    if not merges:
        raise UsageError(
            f"{source}: the BPE has no merges; llama.cpp's gpt2 tokenizer needs them "
            "(prep with a larger --vocab-size)"
        )
    bos_tok, eos_tok = _template_specials(j)
    if eos_tok is None:
        eos_tok = next((t for t in _EOS_CANDIDATES if t in vocab), None)
    kv: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
    }
    if eos_tok is not None:
        kv["tokenizer.ggml.eos_token_id"] = vocab[eos_tok]
    else:
        notes.append(
            "the tokenizer has no end-of-text token: llama.cpp will not stop generation by itself"
        )
    # GPT-2 convention: without a declared BOS, BOS is the end-of-text token (never added).
    bos = bos_tok if bos_tok is not None else eos_tok
    if bos is not None:
        kv["tokenizer.ggml.bos_token_id"] = vocab[bos]
    # Only what toy's tokenizer adds itself: llama.cpp must encode a prompt to the same ids.
    kv["tokenizer.ggml.add_bos_token"] = bos_tok is not None
    kv["tokenizer.ggml.add_eos_token"] = _template_specials(j)[1] is not None
    return kv, notes


# ------------------------------------------------------------------ full models


def _arch_kv(arch: str, pairs: dict[str, Any]) -> dict[str, Any]:
    return {f"{arch}.{k}": v for k, v in pairs.items()}


def _shape_hp(cfg, n_kv_head: int) -> dict[str, Any]:
    """The `{arch}.*` shape keys llama.cpp reads for every decoder (toy configs share
    these field names)."""
    return {
        "vocab_size": cfg.vocab_size,
        "context_length": cfg.max_seq_len,
        "embedding_length": cfg.d_model,
        "feed_forward_length": cfg.d_ff,
        "block_count": cfg.n_layer,
        "attention.head_count": cfg.n_head,
        "attention.head_count_kv": n_kv_head,
    }


def _common_kv(name: str, dtype: str) -> dict[str, Any]:
    return {
        "general.name": name,
        "general.file_type": int(_FILE_TYPE[dtype]),
        "general.quantization_version": GGML_QUANT_VERSION,
    }


def _finish(path: Path, arch: str, kv: dict, tensors: list, notes: list[str]) -> WriteReport:
    _write(path, arch, kv, tensors)
    types = Counter(q.name for _, _, q in tensors)
    n = 0
    for _, data, q in tensors:
        n += (
            int(np.prod(data.shape))
            if q in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
            else int(np.prod(data.shape[:-1]))
            * data.shape[-1]
            // gguf.GGML_QUANT_SIZES[q][1]
            * gguf.GGML_QUANT_SIZES[q][0]
        )
    return WriteReport(Path(path), arch, types, n, notes)


def write_llama_gguf(
    path: str | os.PathLike,
    model: Llama,
    tokenizer: Tokenizer | None = None,
    *,
    dtype: str = "f32",
    chat_template: str | None = None,
    tokenizer_kv: dict[str, Any] | None = None,
    arch: str | None = None,
    name: str = "toy",
) -> WriteReport:
    """A toy Llama as llama.cpp's `llama` (or `qwen2`, for q/k/v biases) architecture.

    The tokenizer comes from `tokenizer` (an HF byte-level BPE) or, for a model read
    from a GGUF, `tokenizer_kv` (that file's `tokenizer.*` keys, copied as they are)."""
    _check_dtype(dtype)
    cfg: LlamaConfig = model.cfg
    arch = arch or ("qwen2" if cfg.qkv_bias else "llama")
    if arch not in ("llama", "qwen2"):
        raise UsageError(
            f"cannot write a toy llama as GGUF architecture {arch!r}; use llama or qwen2"
        )
    notes: list[str] = []
    hp: dict[str, Any] = {
        **_shape_hp(cfg, cfg.n_kv_head),
        "attention.layer_norm_rms_epsilon": float(cfg.norm_eps),
        "rope.freq_base": float(cfg.rope_theta),
        "rope.dimension_count": cfg.head_dim,
    }
    if cfg.head_dim != cfg.d_model // cfg.n_head:
        hp["attention.key_length"] = cfg.head_dim
        hp["attention.value_length"] = cfg.head_dim
    kv = {**_common_kv(name, dtype), **_arch_kv(arch, hp)}
    kv.update(_tokenizer_kv(tokenizer, tokenizer_kv, cfg.vocab_size, notes))
    if chat_template:
        kv["tokenizer.chat_template"] = chat_template

    sd = model.state_dict()
    tensors = []
    for gname, (tname, shape) in tensor_name_map(cfg, "llama").items():
        t = sd[tname].detach().to("cpu", torch.float32)
        if tuple(t.shape) != shape:
            raise UsageError(f"model tensor {tname} has shape {tuple(t.shape)}, expected {shape}")
        # toy's half-split Q/K rows -> llama.cpp's interleaved rows (see the module doc).
        if arch == "llama" and ".attn_q." in gname:
            t = permute_qk(t, cfg.n_head)
        elif arch == "llama" and ".attn_k." in gname:
            t = permute_qk(t, cfg.n_kv_head)
        data, q = _encode(gname, t.numpy(), dtype, notes)
        tensors.append((gname, data, q))
    return _finish(Path(path), arch, kv, tensors, notes)


def _tokenizer_kv(
    tokenizer: Tokenizer | None, tokenizer_kv: dict[str, Any] | None, n_vocab: int, notes: list[str]
) -> dict[str, Any]:
    if tokenizer_kv is not None:
        return dict(tokenizer_kv)
    if tokenizer is None:
        raise UsageError(
            "a GGUF for llama.cpp needs the model's tokenizer; the run has no tokenizer.json"
        )
    kv, more = tokenizer_metadata(tokenizer, n_vocab)
    notes.extend(more)
    return kv


def gpt2_tensor_map(cfg: GPT2Config) -> dict[str, str]:
    """llama.cpp `gpt2` tensor name -> toy GPT2 parameter name. toy's projections are
    nn.Linear (out, in) = GGUF ne [in, out], as llama.cpp wants them (HF's Conv1D would
    need a transpose). c_attn's rows are q, k, v stacked: llama.cpp's fused attn_qkv
    views its output in the same order."""
    m = {
        "token_embd.weight": "wte.weight",
        "position_embd.weight": "wpe.weight",
        "output_norm.weight": "ln_f.weight",
        "output_norm.bias": "ln_f.bias",
    }
    if not cfg.tie_embeddings:
        m["output.weight"] = "lm_head.weight"
    for i in range(cfg.n_layer):
        b, t = f"blk.{i}.", f"h.{i}."
        m.update(
            {
                b + "attn_norm.weight": t + "ln_1.weight",
                b + "attn_norm.bias": t + "ln_1.bias",
                b + "attn_qkv.weight": t + "attn.c_attn.weight",
                b + "attn_qkv.bias": t + "attn.c_attn.bias",
                b + "attn_output.weight": t + "attn.c_proj.weight",
                b + "attn_output.bias": t + "attn.c_proj.bias",
                b + "ffn_norm.weight": t + "ln_2.weight",
                b + "ffn_norm.bias": t + "ln_2.bias",
                b + "ffn_up.weight": t + "mlp.c_fc.weight",
                b + "ffn_up.bias": t + "mlp.c_fc.bias",
                b + "ffn_down.weight": t + "mlp.c_proj.weight",
                b + "ffn_down.bias": t + "mlp.c_proj.bias",
            }
        )
    return m


def write_gpt2_gguf(
    path: str | os.PathLike,
    model: GPT2,
    tokenizer: Tokenizer | None,
    *,
    dtype: str = "f32",
    chat_template: str | None = None,
    name: str = "toy",
) -> WriteReport:
    """A toy GPT2 as llama.cpp's `gpt2` architecture (LayerNorm with bias, learned
    positions, fused qkv, GELU MLP). llama.cpp requires every bias: a model built with
    bias=False gets zero biases, which computes the same function."""
    _check_dtype(dtype)
    cfg: GPT2Config = model.cfg
    notes: list[str] = []
    hp = {**_shape_hp(cfg, cfg.n_head), "attention.layer_norm_epsilon": float(cfg.norm_eps)}
    kv = {**_common_kv(name, dtype), **_arch_kv("gpt2", hp)}
    kv.update(_tokenizer_kv(tokenizer, None, cfg.vocab_size, notes))
    if chat_template:
        kv["tokenizer.chat_template"] = chat_template
    sd = model.state_dict()
    tensors = []
    zeros = []
    for gname, tname in gpt2_tensor_map(cfg).items():
        if tname in sd:
            t = sd[tname].detach().to("cpu", torch.float32)
        else:  # a bias of a bias=False model
            width = sd[tname[: -len("bias")] + "weight"].shape[0]
            t = torch.zeros(width)
            zeros.append(gname)
        data, q = _encode(gname, t.numpy(), dtype, notes)
        tensors.append((gname, data, q))
    if zeros:
        notes.append(
            f"the model has no biases; wrote {len(zeros)} zero biases, "
            "which llama.cpp's gpt2 requires"
        )
    return _finish(Path(path), "gpt2", kv, tensors, notes)


def write_model_gguf(
    path: str | os.PathLike,
    model: torch.nn.Module,
    tokenizer: Tokenizer | None,
    *,
    dtype: str = "f32",
    chat_template: str | None = None,
    name: str = "toy",
    tokenizer_kv: dict[str, Any] | None = None,
) -> WriteReport:
    """Dispatch on the model's architecture; anything but a decoder LM is refused.
    `tokenizer_kv`: a GGUF's `tokenizer.*` keys, copied as they are (a llama's)."""
    arch = getattr(getattr(model, "cfg", None), "arch", None)
    if isinstance(model, Llama):
        return write_llama_gguf(
            path, model, tokenizer, dtype=dtype, chat_template=chat_template, name=name,
            tokenizer_kv=tokenizer_kv,
        )  # fmt: skip
    if isinstance(model, GPT2):
        return write_gpt2_gguf(
            path, model, tokenizer, dtype=dtype, chat_template=chat_template, name=name
        )
    raise UsageError(
        f"a {arch or type(model).__name__} model cannot be written as GGUF: llama.cpp runs "
        "language models (toy's llama and gpt2)"
    )


# ------------------------------------------------------------------ LoRA adapters


def _adaptable(cfg, arch: str) -> dict[str, tuple[str, Planned]]:
    """toy module name (`layers.0.self_attn.q_proj`) -> (GGUF base tensor name, plan),
    for every linear layer of the body of `arch`'s family."""
    out = {}
    for gname, p in gguf_families()[arch].plan(cfg).items():
        if p.name.startswith("layers.") and p.name.endswith(".weight") and len(p.shape) == 2:
            out[p.name[: -len(".weight")]] = (gname, p)
    return out


def write_lora_gguf(
    path: str | os.PathLike,
    lora_sd: dict[str, torch.Tensor],
    *,
    alpha: float,
    base,
    arch: str = "llama",
    dtype: str = "f32",
    name: str = "toy-lora",
) -> WriteReport:
    """A LoRA adapter in llama.cpp's layout (llama-adapter.cpp): `general.type=adapter`,
    `adapter.type=lora`, `adapter.lora.alpha`, tensors `<base tensor>.lora_a` (r, in)
    and `.lora_b` (out, r, rows permuted like the base where llama.cpp's converter
    permuted the base: llama's attn_q/attn_k).

    `lora_sd` uses toy names (`layers.0.self_attn.q_proj.lora_A`, as
    `toy.lora.lora_state_dict` and `toy.formats.peft.load_peft_adapter` give); `base` is
    the config of the model it adapts and `arch` its GGUF architecture (any family)."""
    _check_dtype(
        dtype, ADAPTER_DTYPES, "a LoRA adapter (it is small; q8_0 would only lose precision)"
    )
    names = _adaptable(base, arch)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for k, t in lora_sd.items():
        module, _, kind = k.rpartition(".")
        if kind not in ("lora_A", "lora_B"):
            raise UsageError(f"adapter tensor {k!r} is not <module>.lora_A / .lora_B")
        modules.setdefault(module, {})[kind] = t
    problems = []
    tensors = []
    ranks = set()
    for module in sorted(modules, key=_module_order):
        ab = modules[module]
        if module.endswith(("lm_head", "embed_tokens")):
            problems.append(
                f"{module}: adapters on the (tied) embedding/output are never exported "
                "(llama.cpp's converter mishandles an adapter on a tied output)"
            )
            continue
        if module not in names:
            problems.append(f"{module} is not a linear layer of the base model")
            continue
        gname, plan = names[module]
        if set(ab) != {"lora_A", "lora_B"}:
            problems.append(f"{module} lacks {'lora_B' if 'lora_A' in ab else 'lora_A'}")
            continue
        a = ab["lora_A"].detach().to("cpu", torch.float32)  # (r, in)
        b = ab["lora_B"].detach().to("cpu", torch.float32)  # (out, r)
        out_f, in_f = plan.shape
        if (
            a.dim() != 2
            or b.dim() != 2
            or a.shape[1] != in_f
            or b.shape[0] != out_f
            or a.shape[0] != b.shape[1]
        ):
            problems.append(
                f"{module}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit the base's "
                f"{gname} (out {out_f}, in {in_f})"
            )
            continue
        ranks.add(a.shape[0])
        if plan.qk_heads:
            b = permute_qk(b, plan.qk_heads)  # rows of dW = B A follow the base's interleaved rows
        notes: list[str] = []
        tensors.append((gname + ".lora_a", *_encode(gname + ".lora_a", a.numpy(), dtype, notes)))
        tensors.append((gname + ".lora_b", *_encode(gname + ".lora_b", b.numpy(), dtype, notes)))
    if not modules:
        problems.append("no adapter tensors")
    if problems:
        raise UsageError("cannot write the LoRA adapter GGUF: " + "; ".join(problems[:4]))
    kv = {
        "general.name": name,
        "adapter.type": "lora",
        "adapter.lora.alpha": float(alpha),
        "general.file_type": int(_FILE_TYPE[dtype]),
        "general.quantization_version": GGML_QUANT_VERSION,
    }
    _write(Path(path), arch, kv, tensors, general_type="adapter")
    n = sum(int(np.prod(d.shape)) for _, d, _ in tensors)
    return WriteReport(
        Path(path),
        arch,
        Counter(q.name for _, _, q in tensors),
        n,
        [
            f"{len(tensors) // 2} adapted matrices, rank {', '.join(map(str, sorted(ranks)))}, "
            f"alpha {alpha:g}"
        ],
    )


def _module_order(module: str) -> tuple:
    parts = module.split(".")
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1, module)


@dataclass
class LoraGGUF:
    """An adapter GGUF read back. `pairs` is in the FILE's layout: base tensor name ->
    (A (r, in), B (out, r)), B rows still permuted for llama q/k. `lora_sd` is toy's
    layout (un-permuted, toy names)."""

    alpha: float
    arch: str
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    lora_sd: dict[str, torch.Tensor]
    rank: int


def read_lora_gguf(path: str | os.PathLike, base) -> LoraGGUF:
    """Read a llama.cpp LoRA adapter GGUF against the config of its base model, checking
    what llama-adapter.cpp checks (type keys, pairs, shapes)."""
    h = read_gguf_header(path)
    meta = h.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise InputError(
            f"{h.path}: not a LoRA adapter GGUF (general.type={meta.get('general.type')!r}, "
            f"adapter.type={meta.get('adapter.type')!r})"
        )
    arch = meta.get("general.architecture")
    if arch not in gguf_families():
        raise InputError(
            f"{h.path}: adapter for architecture {arch!r}, which toy does not read; supported: "
            f"{', '.join(gguf_families())}"
        )
    alpha = meta.get("adapter.lora.alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise InputError(f"{h.path}: adapter.lora.alpha is missing or not a number")
    to_toy = {g: (m, p) for m, (g, p) in _adaptable(base, arch).items()}
    buf = _map(h)
    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, ti in h.tensors.items():
        stem, _, kind = name.rpartition(".")
        if kind not in ("lora_a", "lora_b") or stem not in to_toy:
            raise InputError(
                f"{h.path}: unexpected tensor {name!r}; expected <base tensor>.lora_a/.lora_b"
            )
        found.setdefault(stem, {})[kind] = _load_tensor(buf, ti).clone()
    pairs, sd, ranks = {}, {}, set()
    for stem, ab in found.items():
        if set(ab) != {"lora_a", "lora_b"}:
            raise InputError(f"{h.path}: {stem} has only {', '.join(ab)}")
        a, b = ab["lora_a"], ab["lora_b"]
        module, plan = to_toy[stem]
        out_f, in_f = plan.shape
        # GGUF ne: a [in, r], b [r, out]; torch order reverses them.
        if a.shape[1] != in_f or b.shape[0] != out_f or a.shape[0] != b.shape[1]:
            raise InputError(
                f"{h.path}: {stem}: lora_a {tuple(a.shape)} / lora_b {tuple(b.shape)} do not fit "
                f"the base ({out_f} x {in_f})"
            )
        ranks.add(a.shape[0])
        pairs[stem] = (a, b)
        sd[module + ".lora_A"] = a
        sd[module + ".lora_B"] = unpermute_qk(b, plan.qk_heads) if plan.qk_heads else b
    if len(ranks) > 1:
        raise InputError(
            f"{h.path}: mixed ranks {sorted(ranks)}; toy's LoRA has one rank per adapter"
        )
    return LoraGGUF(float(alpha), str(arch), pairs, sd, ranks.pop() if ranks else 0)


def base_config(path: str | os.PathLike) -> tuple[Any, str, dict[str, Any]]:
    """A base GGUF's (config, architecture, metadata) from its header alone."""
    h = read_gguf_header(path)
    return config_from_header(h), str(h.metadata.get("general.architecture")), h.metadata


# ------------------------------------------------------------------ merged models

MERGED_DTYPES = ("keep", "base") + DTYPES
# What llama.cpp must not find twice or stale in a merged file: the writer sets these.
_OWN_KEYS = (
    "general.architecture",
    "general.name",
    "general.file_type",
    "general.quantization_version",
    "general.alignment",
)


def _quantizable(qtype: GGMLQuantizationType) -> bool:
    """Whether gguf.quants can write this type (it cannot write the K-quants)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.quantize(np.zeros((1, block), dtype=np.float32), qtype)
        return True
    except (NotImplementedError, ValueError, TypeError, KeyError):
        return False


def _kept_type(qtype: GGMLQuantizationType) -> str:
    """--dtype keep: the type an adapted tensor is written in, as llama.cpp's own
    export-lora writes merged tensors: f32 where the base's is f32, else f16. A LoRA
    update is far below a 4-bit (even an 8-bit) quantization step of the base, so only a
    float type keeps it; f16 keeps it to ~0.1%."""
    return "f32" if qtype == GGMLQuantizationType.F32 else "f16"


def _as_written(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """The float32 values a reader gets back from tensor data `data` of type `qtype`."""
    if qtype == GGMLQuantizationType.F32:
        return data
    if qtype == GGMLQuantizationType.F16:
        return data.astype(np.float32)
    return gguf.quants.dequantize(data, qtype)


def write_merged_gguf(
    path: str | os.PathLike,
    base: Base | str | os.PathLike,
    lora_sd: dict[str, torch.Tensor],
    *,
    rank: int,
    alpha: float,
    dtype: str = "keep",
    name: str = "toy-merged",
) -> WriteReport:
    """The base GGUF with the adapter folded in (W += B A * alpha/r), in the base's own
    architecture: every key of the base is kept (with its type), and tensors come in
    the base's order. `dtype`:
    - "keep" (the default): each tensor the adapter does not touch is copied byte for
      byte; each one it changes is written as f16 (f32 where the base's is f32), which
      keeps the update: what llama.cpp's export-lora does;
    - "base": untouched tensors copied as for keep; each changed one requantized to the
      base's type where `gguf.quants` can write that type, else to q8_0 (or f16 where its
      rows do not fill q8_0 blocks). The smallest file, but a 4-bit type rounds most of
      a LoRA update away (SmolLM2's Q4_1: 6% kept; the report says how much, with a note);
    - f32 / f16 / q8_0: every 2-D tensor in that type (dequantized first).
    The report's `update_kept` and `update_error` say what the written adapted tensors
    kept of the update (see WriteReport)."""
    _check_dtype(dtype, MERGED_DTYPES, "a merged model")
    base_path = base.path if isinstance(base, Base) else Path(base)
    h = read_gguf_header(base_path)
    fam = family_of(h)
    cfg = fam.config(h)
    check_tensors(h, cfg)  # the base must be one toy can read
    targets = _adaptable(cfg, fam.name)
    scale = alpha / rank
    deltas: dict[str, torch.Tensor] = {}
    modules = sorted({k.rsplit(".", 1)[0] for k in lora_sd})
    for module in modules:
        if module not in targets:
            raise InputError(
                f"adapter module {module} is not a linear layer of {base_path} ({fam.name})"
            )
        a, b = lora_sd.get(module + ".lora_A"), lora_sd.get(module + ".lora_B")
        gname, p = targets[module]
        if a is None or b is None or tuple((b @ a).shape) != p.shape:
            raise InputError(
                f"adapter module {module} does not fit {gname} {list(p.shape)} of {base_path}"
            )
        d = (b.float() @ a.float()) * scale  # toy's layout (half-split Q/K rows)
        deltas[gname] = permute_qk(d, p.qk_heads) if p.qk_heads else d
    buf = _map(h)
    notes: list[str] = []
    tensors = []
    fallback = Counter()
    adapted_types = Counter()
    err2 = upd2 = dot = 0.0
    for gname, ti in h.tensors.items():
        if gname in deltas:
            w = _load_tensor(buf, ti) + deltas[gname]  # the file's layout, float32
            if dtype == "keep":
                data, q = _encode(gname, w.numpy(), _kept_type(ti.qtype), notes)
            elif dtype == "base":
                if ti.qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                    data, q = _encode(
                        gname,
                        w.numpy(),
                        "f32" if ti.qtype == GGMLQuantizationType.F32 else "f16",
                        notes,
                    )
                elif (
                    _quantizable(ti.qtype) and w.shape[-1] % gguf.GGML_QUANT_SIZES[ti.qtype][0] == 0
                ):
                    data, q = gguf.quants.quantize(w.numpy(), ti.qtype), ti.qtype
                else:
                    fallback[ti.qtype.name] += 1
                    data, q = _encode(gname, w.numpy(), "q8_0", notes)
            else:
                data, q = _encode(gname, w.numpy(), dtype, notes)
            adapted_types[q.name] += 1
            d64 = deltas[gname].double().numpy()
            off = _as_written(data, q).astype(np.float64) - w.numpy()  # V - (W + dW)
            err2 += float(np.square(off).sum())
            upd2 += float(np.square(d64).sum())
            dot += float(((off + d64) * d64).sum())  # <V - W, dW>
        elif dtype in ("keep", "base") or len(ti.ne) == 1:
            raw = np.asarray(buf[ti.offset : ti.offset + ti.nbytes])
            if ti.qtype == GGMLQuantizationType.F32:
                data = raw.view(np.float32).reshape(ti.shape)
            elif ti.qtype == GGMLQuantizationType.F16:
                data = raw.view(np.float16).reshape(ti.shape)
            else:
                block, size = gguf.GGML_QUANT_SIZES[ti.qtype]
                data = raw.reshape(*ti.shape[:-1], ti.shape[-1] // block * size)
            q = ti.qtype
        else:
            data, q = _encode(gname, _load_tensor(buf, ti).numpy(), dtype, notes)
        tensors.append((gname, data, q))
    if fallback:
        notes.append(
            f"{sum(fallback.values())} adapted tensors of type {', '.join(fallback)} written as "
            "q8_0: gguf cannot quantize that type (the others keep the base's bytes)"
        )
    kv = {k: v for k, v in h.metadata.items() if k not in _OWN_KEYS}
    kv["general.name"] = name
    kv["general.quantization_version"] = GGML_QUANT_VERSION
    file_type = (
        h.metadata.get("general.file_type") if dtype in ("keep", "base") else int(_FILE_TYPE[dtype])
    )
    if isinstance(file_type, int):
        kv["general.file_type"] = file_type
    types = {k: t for k, t in h.kv_types.items() if k in kv}
    _write(Path(path), fam.name, kv, tensors, kv_types=types)
    counts = Counter(q.name for _, _, q in tensors)
    n = sum(ti.n_elements for ti in h.tensors.values())
    kept, error = (dot / upd2, (err2 / upd2) ** 0.5) if upd2 > 0 else (1.0, 0.0)
    written = ", ".join(f"{k} x{v}" for k, v in adapted_types.most_common())
    notes.insert(
        0,
        f"{len(deltas)} tensors of {fam.name} base {Path(base_path).name} merged with the adapter, "
        f"written as {written}: "
        + update_note(kept, error)
        + ("; every other tensor is the base's own bytes" if dtype in ("keep", "base") else ""),
    )
    lossy = sorted(k for k in adapted_types if k not in ("F32", "F16", "BF16"))
    if dtype == "base" and lossy:
        notes.insert(
            1,
            f"--dtype base: the adapted tensors requantized to {', '.join(lossy)} keep {kept:.0%} "
            "of the adapter's update (a 4-bit step is far above a LoRA update: llama.cpp may "
            "answer as the base model does); the default --dtype keep writes them as f16",
        )
    return WriteReport(Path(path), fam.name, counts, n, notes, update_kept=kept, update_error=error)
