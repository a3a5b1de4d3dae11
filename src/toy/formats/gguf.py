"""GGUF (llama.cpp, Ollama) -> toy: a llama config, a float32 state dict with toy's
parameter names, the tokenizer metadata and the chat template.

    m = read_gguf("model.gguf")          # GGUFModel: config, state_dict, metadata, ...
    model = m.build_model()              # toy.models.llama.Llama, weights loaded
    tok = read_gguf_tokenizer("model.gguf")   # or toy.tokenizer.from_gguf_metadata(m.metadata)
    describe_gguf("model.gguf")          # header only: no tensor is dequantized

The file is untrusted input. The header (key/values and tensor infos) is parsed here
with every count, length and offset checked against the file's size before anything is
read, so a hostile or truncated header fails in bounded time and memory with an
`InputError`. The tensor bytes are memory-mapped and dequantized with
`gguf.quants.dequantize`, so every quant type the `gguf` package knows works.

Why not `gguf.GGUFReader` for the header: it trusts the counts it reads (an array
claiming 2**60 elements at the end of the file makes it loop for ever, growing a list),
and it walks every element of the token and merge arrays through numpy views, which
takes ~5 s for SmolLM2's 49k tokens + 49k merges against ~0.1 s here. The constants
(value types, quant types, block sizes) still come from the `gguf` package.
"""

from __future__ import annotations

import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize
from tokenizers import Tokenizer

from toy.errors import InputError
from toy.models.layers import Rotary
from toy.models.llama import Llama, LlamaConfig
from toy.tokenizer import from_gguf_metadata

SUPPORTED_ARCHS = ("llama", "qwen2")
SUPPORTED_VERSIONS = (2, 3)

# ggml tensors have at most 4 dimensions (GGML_MAX_DIMS).
_MAX_DIMS = 4
# Sanity caps on what a header may claim, far above any real file. Everything is also
# checked against the file's size; these only keep the error message sensible.
_MAX_COUNT = 1 << 24
_MAX_KEY_LEN = 1 << 16
_MAX_ARRAY_DEPTH = 3
# context_length sizes toy's rotary tables (max_seq_len x head_dim floats); it is the one
# hyper-parameter not bounded by the tensors actually present in the file.
_MAX_CONTEXT = 1 << 20

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT32: "f", GGUFValueType.FLOAT64: "d",
    GGUFValueType.BOOL: "?",
}
_NUMPY_DTYPES: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.FLOAT64: "<f8",
    GGUFValueType.BOOL: "?",
}

_TRUNCATED_FIX = "the file is truncated (an interrupted download?); fetch it again"


def _show(s: str, n: int = 80) -> str:
    """A name read from the file, safe for a one-line message (no newlines, bounded)."""
    r = repr(s)
    return r if len(r) <= n else r[: n - 4] + "...'"


# ------------------------------------------------------------------ header

@dataclass(frozen=True)
class TensorInfo:
    name: str
    ne: tuple[int, ...]  # GGUF order: ne[0] is the fastest-varying (innermost) dimension
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """torch/numpy order: ne reversed, so a linear weight reads (out_features, in_features)."""
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n


@dataclass
class GGUFHeader:
    path: Path
    version: int
    file_size: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]  # in file order
    alignment: int
    data_start: int


class _Cursor:
    """Bounds-checked little-endian reads over the memory-mapped file."""

    def __init__(self, buf: np.ndarray, path: Path):
        self.buf = buf
        self.view = memoryview(buf)  # slicing a memoryview is much cheaper than slicing a memmap
        self.size = int(buf.shape[0])
        self.pos = 0
        self.path = path

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.size - self.pos:
            raise InputError(f"{self.path}: truncated GGUF: {what} at byte {self.pos} needs {n} bytes, "
                             f"only {self.size - self.pos} left; {_TRUNCATED_FIX}")

    def scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize("<" + fmt)
        self.need(n, what)
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.scalar("I", what)

    def u64(self, what: str) -> int:
        return self.scalar("Q", what)

    def string(self, what: str, max_len: int | None = None) -> str:
        n = self.u64(f"length of {what}")
        if max_len is not None and n > max_len:
            raise InputError(f"{self.path}: corrupt GGUF header: {what} claims {n} bytes (limit {max_len}); "
                             "the file is damaged or not a GGUF model")
        self.need(n, what)
        raw = self.view[self.pos : self.pos + n]
        self.pos += n
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise InputError(f"{self.path}: corrupt GGUF header: {what} at byte {self.pos - n} is not valid UTF-8; "
                             "the file is damaged")


def _value_type(raw: int, cur: _Cursor, key: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise InputError(f"{cur.path}: corrupt GGUF header: key {_show(key)} has unknown value type {raw}; "
                         "the file is damaged or from a newer GGUF version")


def _read_value(cur: _Cursor, vtype: GGUFValueType, key: str, depth: int = 0) -> Any:
    if vtype == GGUFValueType.STRING:
        return cur.string(f"value of {_show(key)}")
    if vtype in _SCALAR_FORMATS:
        return cur.scalar(_SCALAR_FORMATS[vtype], f"value of {_show(key)}")
    # ARRAY: item type, count, items.
    if depth >= _MAX_ARRAY_DEPTH:
        raise InputError(f"{cur.path}: corrupt GGUF header: arrays nested deeper than {_MAX_ARRAY_DEPTH} "
                         f"in key {_show(key)}; the file is damaged")
    itype = _value_type(cur.u32(f"array type of {_show(key)}"), cur, key)
    count = cur.u64(f"array length of {_show(key)}")
    # Each item takes at least this many bytes, so a count the file cannot hold is caught
    # before the loop: no header can make us spin or allocate beyond the file's size.
    min_item = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}.get(itype) or struct.calcsize(
        "<" + _SCALAR_FORMATS[itype])
    if count > _MAX_COUNT or count * min_item > cur.size - cur.pos:
        raise InputError(f"{cur.path}: corrupt or truncated GGUF header: array {_show(key)} claims {count} items "
                         f"but only {cur.size - cur.pos} bytes are left; {_TRUNCATED_FIX}")
    if itype in _NUMPY_DTYPES:
        n = count * min_item
        arr = np.frombuffer(cur.buf, dtype=_NUMPY_DTYPES[itype], count=count, offset=cur.pos)
        cur.pos += n
        return arr.tolist()
    if itype == GGUFValueType.STRING:
        return _read_string_array(cur, count, key)
    return [_read_value(cur, itype, key, depth + 1) for _ in range(count)]


def _read_string_array(cur: _Cursor, count: int, key: str) -> list[str]:
    # The hot loop of the header (tokens and merges: ~100k strings for a small model),
    # so the bounds check is inlined rather than going through _Cursor.string.
    view, size, pos = cur.view, cur.size, cur.pos
    unpack = struct.Struct("<Q").unpack_from
    out: list[str] = []
    try:
        for _ in range(count):
            if pos + 8 > size:
                break
            (n,) = unpack(view, pos)
            pos += 8
            if n > size - pos:
                break
            out.append(str(view[pos : pos + n], "utf-8"))
            pos += n
    except UnicodeDecodeError:
        raise InputError(f"{cur.path}: corrupt GGUF header: item {len(out)} of {_show(key)} is not valid UTF-8; "
                         "the file is damaged")
    if len(out) < count:
        raise InputError(f"{cur.path}: truncated GGUF: array {_show(key)} ends after {len(out)} of {count} strings; "
                         f"{_TRUNCATED_FIX}")
    cur.pos = pos
    return out


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Key/values and tensor infos of a GGUF file, validated against its size. Reads no
    tensor data. Raises InputError (one line, naming the file) on anything malformed."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise InputError(f"{path}: GGUF file not found; check the path (scripts/get-smollm2.sh fetches a small model)")
    except OSError as e:
        raise InputError(f"{path}: cannot read GGUF file ({e.strerror}); check the path and its permissions")
    if path.is_dir():
        raise InputError(f"{path}: is a directory, not a GGUF file; pass the .gguf file itself")
    if size < 24:  # magic + version + tensor count + kv count
        raise InputError(f"{path}: not a GGUF file ({size} bytes, too small for a GGUF header); "
                         "pass a .gguf model file")
    try:
        buf = np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as e:
        raise InputError(f"{path}: cannot read GGUF file ({e.strerror or e}); check the path and its permissions")
    cur = _Cursor(buf, path)

    magic = cur.u32("magic")
    if magic != GGUF_MAGIC:
        head = bytes(buf[:4])
        raise InputError(f"{path}: not a GGUF file (starts with {head!r}, expected b'GGUF'); pass a .gguf model file")
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and (version >> 16) in SUPPORTED_VERSIONS:
            raise InputError(f"{path}: big-endian GGUF is not supported; convert it to little-endian with "
                             "llama.cpp's gguf tools")
        raise InputError(f"{path}: GGUF version {version} is not supported (supported: "
                         f"{', '.join(map(str, SUPPORTED_VERSIONS))}); re-convert it with a current llama.cpp")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("key/value count")
    left = size - cur.pos
    # Smallest possible entries: a key/value is 8 (key length) + 4 (type) + 1 (a u8 value);
    # a tensor info is 8 (name length) + 4 (n_dims) + 8 (one dim) + 4 (type) + 8 (offset).
    if n_kv > _MAX_COUNT or n_kv * 13 > left or n_tensors > _MAX_COUNT or n_tensors * 32 > left:
        raise InputError(f"{path}: corrupt GGUF header: it claims {n_kv} key/values and {n_tensors} tensors, "
                         f"which cannot fit in a {size}-byte file; the file is damaged or truncated")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("key name", max_len=_MAX_KEY_LEN)
        vtype = _value_type(cur.u32(f"type of key {_show(key)}"), cur, key)
        if key in metadata:
            raise InputError(f"{path}: corrupt GGUF header: key {_show(key)} appears twice; the file is damaged")
        metadata[key] = _read_value(cur, vtype, key)

    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise InputError(f"{path}: corrupt GGUF header: general.alignment {alignment!r} is not a power of two")

    raw_infos = []
    for _ in range(n_tensors):
        name = cur.string("tensor name", max_len=_MAX_KEY_LEN)
        n_dims = cur.u32(f"dimension count of tensor {_show(name)}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise InputError(f"{path}: corrupt GGUF header: tensor {_show(name)} claims {n_dims} dimensions "
                             f"(ggml allows 1..{_MAX_DIMS}); the file is damaged")
        ne = tuple(cur.u64(f"shape of tensor {_show(name)}") for _ in range(n_dims))
        raw_type = cur.u32(f"type of tensor {_show(name)}")
        offset = cur.u64(f"data offset of tensor {_show(name)}")
        raw_infos.append((name, ne, raw_type, offset))

    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, ne, raw_type, offset in raw_infos:
        if name in tensors:
            raise InputError(f"{path}: corrupt GGUF header: tensor {_show(name)} appears twice; the file is damaged")
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise InputError(f"{path}: tensor {_show(name)} has unknown quant type id {raw_type}; the file is "
                             "damaged or needs a newer `gguf` package (pip install -U gguf)")
        if any(d < 1 for d in ne) or ne[0] % block:
            raise InputError(f"{path}: misshapen tensor {_show(name)}: GGUF shape {list(ne)} is not valid for "
                             f"{qtype.name} (blocks of {block} along ne[0]); the file is damaged")
        n_el = 1
        for d in ne:
            n_el *= d
        nbytes = n_el // block * type_size
        start = data_start + offset
        if offset % alignment:
            raise InputError(f"{path}: corrupt GGUF header: tensor {_show(name)} data offset {offset} is not "
                             f"aligned to {alignment} bytes; the file is damaged")
        if start + nbytes > size:
            raise InputError(f"{path}: truncated GGUF: tensor {_show(name)} needs bytes {start}..{start + nbytes} "
                             f"but the file has {size}; {_TRUNCATED_FIX}")
        tensors[name] = TensorInfo(name, ne, qtype, start, nbytes)
    return GGUFHeader(path, version, size, metadata, tensors, alignment, data_start)


# ------------------------------------------------------------------ config

def _meta_int(h: GGUFHeader, key: str, default: int | None = None) -> int:
    v = h.metadata.get(key)
    if v is None:
        if default is None:
            raise InputError(f"{h.path}: GGUF key {key!r} is missing; the file is not a complete "
                             f"{h.metadata.get('general.architecture')} model")
        return default
    if isinstance(v, list):  # per-layer values (some archs): toy needs them all equal
        if not v or any(x != v[0] for x in v):
            raise InputError(f"{h.path}: GGUF key {key!r} varies per layer ({v[:8]}...); toy's llama needs one value")
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InputError(f"{h.path}: GGUF key {key!r} is {v!r}; expected a positive integer")
    return v


def _meta_float(h: GGUFHeader, key: str, default: float) -> float:
    v = h.metadata.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and v < float("inf")):
        raise InputError(f"{h.path}: GGUF key {key!r} is {v!r}; expected a positive number")
    return float(v)


def _check_arch(h: GGUFHeader) -> str:
    arch = h.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise InputError(f"{h.path}: GGUF key 'general.architecture' is missing; the file is not a GGUF model")
    if arch not in SUPPORTED_ARCHS:
        raise InputError(f"{h.path}: architecture {_show(arch)} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHS)}")
    if h.metadata.get("general.type") == "adapter":
        raise InputError(f"{h.path}: is a LoRA adapter GGUF, not a model; pass the base model's GGUF here")
    return arch


def config_from_header(h: GGUFHeader) -> LlamaConfig:
    """toy's LlamaConfig from the `<arch>.*` keys. Raises InputError for a missing key or
    a feature toy's llama does not have (rope scaling, partial rotary)."""
    arch = _check_arch(h)
    a = arch + "."
    d_model = _meta_int(h, a + "embedding_length")
    n_head = _meta_int(h, a + "attention.head_count")
    n_kv_head = _meta_int(h, a + "attention.head_count_kv", default=n_head)
    if n_head > d_model and a + "attention.key_length" not in h.metadata:
        raise InputError(f"{h.path}: head_count {n_head} exceeds embedding_length {d_model}; the file is damaged")
    head_dim = _meta_int(h, a + "attention.key_length", default=d_model // n_head)
    value_len = _meta_int(h, a + "attention.value_length", default=head_dim)
    if value_len != head_dim:
        raise InputError(f"{h.path}: key length {head_dim} != value length {value_len}; "
                         "toy's attention needs them equal")
    rope_dims = _meta_int(h, a + "rope.dimension_count", default=head_dim)
    if rope_dims != head_dim:
        raise InputError(f"{h.path}: partial rotary ({rope_dims} of {head_dim} head dims) is not supported "
                         "by toy's llama")
    scaling = h.metadata.get(a + "rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in h.tensors:
        raise InputError(f"{h.path}: rope scaling ({scaling if scaling != 'none' else 'rope_freqs.weight'}) is not "
                         "supported by toy's llama; use a model without long-context rope scaling")
    if n_head % n_kv_head:
        raise InputError(f"{h.path}: head_count {n_head} is not a multiple of head_count_kv {n_kv_head}")
    if head_dim % 2:
        raise InputError(f"{h.path}: head size {head_dim} is odd; rotary positions need an even head size")
    n_layer = _meta_int(h, a + "block_count")
    if n_layer > len(h.tensors):  # checked before anything loops over the layers
        raise InputError(f"{h.path}: block_count {n_layer} cannot be right: the file holds only "
                         f"{len(h.tensors)} tensors; the file is damaged")
    context = _meta_int(h, a + "context_length", default=2048)
    if context > _MAX_CONTEXT:
        raise InputError(f"{h.path}: context_length {context} is beyond toy's limit of {_MAX_CONTEXT}; "
                         "the file is damaged or needs rope scaling toy lacks")
    emb = h.tensors.get("token_embd.weight")
    if emb is None:
        raise InputError(f"{h.path}: missing tensor 'token_embd.weight'; the file is not a complete {arch} model")
    if len(emb.ne) != 2:
        raise InputError(f"{h.path}: misshapen tensor 'token_embd.weight': expected 2 dims [vocab, {d_model}], "
                         f"found {list(emb.shape)}")
    # The embedding's rows are the model's vocabulary; the token list may be shorter
    # (padding rows) but a model cannot have fewer rows than tokens it can emit.
    vocab = emb.shape[0]
    tokens = h.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > vocab:
        raise InputError(f"{h.path}: {len(tokens)} tokens but token_embd.weight has only {vocab} rows; "
                         "the file is damaged")
    return LlamaConfig(
        vocab_size=vocab,
        n_layer=n_layer,
        d_model=d_model,
        n_head=n_head,
        n_kv_head=n_kv_head,
        d_ff=_meta_int(h, a + "feed_forward_length"),
        max_seq_len=context,
        rope_theta=_meta_float(h, a + "rope.freq_base", 10000.0),
        norm_eps=_meta_float(h, a + "attention.layer_norm_rms_epsilon", 1e-5),
        tie_embeddings="output.weight" not in h.tensors,
        qkv_bias=arch == "qwen2",
        head_dim=head_dim,
        arch="llama",  # toy's model class; GGUFModel.arch keeps the file's name
    )


def tensor_name_map(cfg: LlamaConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF tensor name -> (toy parameter name, torch shape) for every tensor the model needs."""
    D, H, K, C, F = cfg.head_dim, cfg.n_head, cfg.n_kv_head, cfg.d_model, cfg.d_ff
    m = {
        "token_embd.weight": ("embed_tokens.weight", (cfg.vocab_size, C)),
        "output_norm.weight": ("norm.weight", (C,)),
    }
    if not cfg.tie_embeddings:
        m["output.weight"] = ("lm_head.weight", (cfg.vocab_size, C))
    for i in range(cfg.n_layer):
        b, t = f"blk.{i}.", f"layers.{i}."
        m.update({
            b + "attn_norm.weight": (t + "input_layernorm.weight", (C,)),
            b + "attn_q.weight": (t + "self_attn.q_proj.weight", (H * D, C)),
            b + "attn_k.weight": (t + "self_attn.k_proj.weight", (K * D, C)),
            b + "attn_v.weight": (t + "self_attn.v_proj.weight", (K * D, C)),
            b + "attn_output.weight": (t + "self_attn.o_proj.weight", (C, H * D)),
            b + "ffn_norm.weight": (t + "post_attention_layernorm.weight", (C,)),
            b + "ffn_gate.weight": (t + "mlp.gate_proj.weight", (F, C)),
            b + "ffn_up.weight": (t + "mlp.up_proj.weight", (F, C)),
            b + "ffn_down.weight": (t + "mlp.down_proj.weight", (C, F)),
        })
        if cfg.qkv_bias:
            m.update({
                b + "attn_q.bias": (t + "self_attn.q_proj.bias", (H * D,)),
                b + "attn_k.bias": (t + "self_attn.k_proj.bias", (K * D,)),
                b + "attn_v.bias": (t + "self_attn.v_proj.bias", (K * D,)),
            })
    return m


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py, `LlamaModel.permute`).

    ggml's "normal" rope for llama rotates ADJACENT pairs (2i, 2i+1) of a head, while HF
    (and toy's `Rotary`) rotates dimension i with i + D/2. The converter therefore
    interleaves each head's rows: row 2i holds HF row i, row 2i+1 holds HF row i + D/2.
    Here we split each head back into its two halves. `n_head` is the number of heads
    those rows belong to (query heads for Q, kv heads for K). Works on weights (rows, in)
    and on 1-D biases.
    """
    rows = w.shape[0]
    d = rows // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The converter's direction (HF half-split -> interleaved), for writing GGUF files."""
    rows = w.shape[0]
    d = rows // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _check_dequantizable(h: GGUFHeader, infos: list[TensorInfo]) -> None:
    # Probe each quant type once with one zero block, before any real work: a file with an
    # exotic type fails at once, naming the tensor, rather than after minutes of loading.
    seen: set[GGMLQuantizationType] = set()
    for ti in infos:
        if ti.qtype in seen:
            continue
        block, type_size = GGML_QUANT_SIZES[ti.qtype]
        try:
            dequantize(np.zeros((1, type_size), dtype=np.uint8), ti.qtype)
        except (NotImplementedError, ValueError, TypeError):
            raise InputError(f"{h.path}: tensor {_show(ti.name)} has quant type {ti.qtype.name}, which the `gguf` "
                             "package cannot dequantize; re-quantize the model to F16, Q8_0 or a K-quant")
        seen.add(ti.qtype)


def _load_tensor(buf: np.ndarray, ti: TensorInfo) -> torch.Tensor:
    block, type_size = GGML_QUANT_SIZES[ti.qtype]
    raw = buf[ti.offset : ti.offset + ti.nbytes]
    # Rows of ne[0] elements are contiguous; for quant types a row is ne[0]/block blocks.
    shape = ti.shape
    raw = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
    arr = dequantize(raw, ti.qtype)
    arr = np.asarray(arr, dtype=np.float32).reshape(shape)
    if not arr.flags.writeable or not arr.flags.c_contiguous:  # F32 comes back as a view of the read-only map
        arr = np.array(arr, dtype=np.float32, order="C")
    return torch.from_numpy(arr)


@dataclass
class GGUFModel:
    config: LlamaConfig
    state_dict: dict[str, torch.Tensor]  # float32, toy names; no lm_head.weight when tied
    metadata: dict[str, Any]  # every key/value of the file, arrays as lists
    chat_template: str | None
    arch: str  # the file's architecture name (llama, qwen2)
    tensor_types: Counter = field(default_factory=Counter)  # quant type name -> tensor count
    path: Path | None = None

    def build_model(self, device: torch.device | str = "cpu") -> Llama:
        """A toy Llama with these weights (tied lm_head shares the embedding)."""
        # A big model is built on the meta device: its random init (seconds for 135M
        # parameters) would be thrown away by the load below. A small one is built
        # directly: the meta device's one-time setup (~2 s of imports) costs more.
        big = sum(t.numel() for t in self.state_dict.values()) > 20_000_000
        if big:
            # assign=True makes the dequantized tensors the parameters themselves: the
            # float32 base exists once, not twice at the peak (half a GB for 135M).
            with torch.device("meta"):
                model = Llama(self.config)
            res = model.load_state_dict(self.state_dict, strict=False, assign=True)
        else:
            model = Llama(self.config)
            res = model.load_state_dict(self.state_dict, strict=False)
        tied = self.config.tie_embeddings
        missing = [k for k in res.missing_keys if not (tied and k == "lm_head.weight")]
        if missing or res.unexpected_keys:
            raise InputError(f"{self.path}: weights do not fit toy's llama (missing {missing[:3]}, "
                             f"unexpected {res.unexpected_keys[:3]})")
        if big:
            if tied:  # the meta head was never assigned: share the embedding again
                model.lm_head.weight = model.embed_tokens.weight
            # The rotary tables are buffers computed from the config, not weights; on the
            # meta device they were never computed, so build them here.
            c = self.config
            model.rotary = Rotary(c.head_dim, c.max_seq_len, c.rope_theta)
        model = model.to(device)
        return model.eval()


def read_gguf(path: str | os.PathLike) -> GGUFModel:
    """Read a llama-family GGUF into toy: config, float32 state dict (dequantized, Q/K
    un-permuted), metadata and chat template. Raises InputError on any bad input."""
    h = read_gguf_header(path)
    arch = _check_arch(h)
    cfg = config_from_header(h)
    wanted = tensor_name_map(cfg)

    for gname in wanted:
        if gname not in h.tensors:
            raise InputError(f"{h.path}: missing tensor {gname!r}; the file is not a complete {arch} model "
                             f"with {cfg.n_layer} layers")
    extra = [n for n in h.tensors if n not in wanted]
    if extra:
        raise InputError(f"{h.path}: unexpected tensor {_show(extra[0])} ({len(extra)} in all); toy's {arch} has "
                         "no place for it (a different architecture or an unsupported variant)")
    for gname, (tname, shape) in wanted.items():
        found = h.tensors[gname].shape
        if found != shape:
            raise InputError(f"{h.path}: misshapen tensor {gname!r}: expected {list(shape)}, found {list(found)} "
                             "(torch order, out x in); the header's hyper-parameters do not match the weights")
    infos = [h.tensors[g] for g in wanted]
    _check_dequantizable(h, infos)

    buf = np.memmap(h.path, dtype=np.uint8, mode="r")
    if buf.shape[0] != h.file_size:
        raise InputError(f"{h.path}: the file changed size while being read; read it again once it is complete")
    sd: dict[str, torch.Tensor] = {}
    for gname, (tname, _) in wanted.items():
        try:
            t = _load_tensor(buf, h.tensors[gname])
        except (ValueError, TypeError, NotImplementedError) as e:
            raise InputError(f"{h.path}: tensor {gname!r} ({h.tensors[gname].qtype.name}) could not be "
                             f"dequantized ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                             "the file is damaged")
        if arch == "llama" and ".attn_q." in gname:
            t = unpermute_qk(t, cfg.n_head)
        elif arch == "llama" and ".attn_k." in gname:
            t = unpermute_qk(t, cfg.n_kv_head)
        # qwen2 needs nothing: llama.cpp runs it with NEOX (half-split) rope, so its
        # converter leaves Q/K rows in HF order.
        sd[tname] = t
    del buf
    tmpl = h.metadata.get("tokenizer.chat_template")
    return GGUFModel(
        config=cfg,
        state_dict=sd,
        metadata=h.metadata,
        chat_template=tmpl if isinstance(tmpl, str) else None,
        arch=arch,
        tensor_types=Counter(ti.qtype.name for ti in h.tensors.values()),
        path=h.path,
    )


def describe_gguf(path: str | os.PathLike) -> dict[str, Any]:
    """What a GGUF holds, from its header alone (nothing is dequantized): architecture,
    hyper-parameters, parameter count, tensor types, tokenizer and special tokens."""
    h = read_gguf_header(path)
    cfg = config_from_header(h)
    meta = h.metadata
    tokens = meta.get("tokenizer.ggml.tokens")
    tokens = tokens if isinstance(tokens, list) else []

    def special(key: str) -> dict[str, Any] | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if not isinstance(i, int) or isinstance(i, bool):
            return None
        return {"id": i, "token": tokens[i] if 0 <= i < len(tokens) else None}

    return {
        "path": str(h.path),
        "file_size": h.file_size,
        "gguf_version": h.version,
        "arch": meta.get("general.architecture"),
        "name": meta.get("general.name"),
        "hyperparameters": {
            "n_layer": cfg.n_layer,
            "d_model": cfg.d_model,
            "n_head": cfg.n_head,
            "n_kv_head": cfg.n_kv_head,
            "head_dim": cfg.head_dim,
            "d_ff": cfg.d_ff,
            "context_length": cfg.max_seq_len,
            "rope_theta": cfg.rope_theta,
            "norm_eps": cfg.norm_eps,
            "vocab_size": cfg.vocab_size,
            "tie_embeddings": cfg.tie_embeddings,
            "qkv_bias": cfg.qkv_bias,
        },
        # Each tensor is stored once, so a tied embedding is counted once.
        "n_params": sum(ti.n_elements for ti in h.tensors.values()),
        "n_tensors": len(h.tensors),
        "tensor_types": dict(Counter(ti.qtype.name for ti in h.tensors.values()).most_common()),
        "tokenizer": {
            "model": meta.get("tokenizer.ggml.model"),
            "pre": meta.get("tokenizer.ggml.pre"),
            "vocab_size": len(tokens),
            "n_merges": len(meta.get("tokenizer.ggml.merges") or []),
            "special_tokens": {k: special(key) for k, key in
                               (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))},
        },
        "chat_template": isinstance(meta.get("tokenizer.chat_template"), str),
    }


def read_gguf_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer a GGUF describes (header only, no tensor is read)."""
    h = read_gguf_header(path)
    return from_gguf_metadata(h.metadata, source=str(h.path))


def read_gguf_tensor(source: str | os.PathLike | GGUFHeader, name: str) -> torch.Tensor:
    """One tensor of a GGUF as float32, in torch order (ne reversed) and in the file's own
    layout (no Q/K un-permutation). Only that tensor's bytes are read and dequantized, so
    memory stays bounded by its size: `read_gguf_tensor(header, "token_embd.weight")`
    takes SmolLM2's 49152 x 576 table without touching its 30 layers. Pass a header from
    `read_gguf_header` to avoid parsing the file twice."""
    h = source if isinstance(source, GGUFHeader) else read_gguf_header(source)
    ti = h.tensors.get(name)
    if ti is None:
        raise InputError(f"{h.path}: has no tensor {_show(name)} ({len(h.tensors)} tensors in the file); "
                         "pass a GGUF model that has it")
    _check_dequantizable(h, [ti])
    try:
        buf = np.memmap(h.path, dtype=np.uint8, mode="r")
    except OSError as e:
        raise InputError(f"{h.path}: cannot read GGUF file ({e.strerror or e}); check the path and its permissions")
    if buf.shape[0] != h.file_size:
        raise InputError(f"{h.path}: the file changed size since its header was read; read it again once it is complete")
    try:
        t = _load_tensor(buf, ti)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise InputError(f"{h.path}: tensor {_show(name)} ({ti.qtype.name}) could not be dequantized "
                         f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); the file is damaged")
    del buf
    return t
