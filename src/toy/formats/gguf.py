"""GGUF (llama.cpp, Ollama) -> toy: the model (its family's class, weights loaded), the
tokenizer metadata and the chat template.

    m = read_gguf("model.gguf")                  # a Base (formats/base.py): config, family,
                                                 # weights, tokenizer
    model = m.build_model()                      # toy's Llama / Phi3 / Gemma, weights in place
    m = read_gguf("model.gguf", "quantized")     # the same, the base kept in its GGUF blocks
    tok = read_gguf_tokenizer("model.gguf")      # or toy.tokenizer.from_gguf_metadata(m.metadata)
    describe_gguf("model.gguf")                  # header only: any GGUF, even one toy cannot train

The header is parsed by formats/gguf_header.py (bounded, every count checked); which
tensors a family needs and what toy calls them comes from the family's own file in
models/, through formats/gguf_plan.py.

The base's weights come in one of three forms (`--base-dtype`):
- `quantized`: each 2-D weight stays in the file's own blocks, a uint8 tensor over the
  file's memory map (zero-copy: nothing is read until used, and pages are shared with
  the page cache), wrapped in models.quant's QuantLinear / QuantEmbedding, which
  dequantize in forward and backward. Q/K rows llama.cpp interleaved are un-interleaved
  at dequantization time, so the file's bytes are used as they are.
- `float32`: dequantized once at load (torch kernels, bit-identical to gguf.quants).
- `bfloat16`: the same, each 2-D weight cast to bfloat16 (CUDA's default; the norms stay
  float32), used in the activations' dtype at each use (formats/base.py's build_model).
Types toy's torch kernels lack (the IQ quants) are dequantized with gguf.quants at load,
in every mode.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from tokenizers import Tokenizer

from toy.errors import InputError
from toy.formats.base import Base, QuantTensor, Specials, stop_ids
from toy.formats.gguf_describe import check_tensors
from toy.formats.gguf_header import GGUFHeader, TensorInfo, _show, read_gguf_header
from toy.formats.gguf_plan import family_of
from toy.models import quant
from toy.models.quant import QuantSpec, half_split_rows
from toy.models.quant_types import BASE_DTYPES
from toy.tokenizer import from_gguf_metadata, gguf_special_ids


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py, `LlamaModel.permute`).

    ggml's "normal" rope for llama rotates ADJACENT pairs (2i, 2i+1) of a head, while HF
    (and toy's `Rotary`) rotates dimension i with i + D/2. The converter therefore
    interleaves each head's rows: row 2i holds HF row i, row 2i+1 holds HF row i + D/2.
    Here we split each head back into its two halves. `n_head` is the number of heads
    those rows belong to (query heads for Q, kv heads for K). Works on weights (rows, in)
    and on 1-D biases."""
    return half_split_rows(w, n_head)


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The converter's direction (HF half-split -> interleaved), for writing GGUF files."""
    rows = w.shape[0]
    d = rows // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _check_dequantizable(h: GGUFHeader, infos: list[TensorInfo]) -> None:
    # Probe each type once with one zero block, before any real work: a file with an
    # exotic type fails at once, naming the tensor, rather than after minutes of loading.
    seen: set[GGMLQuantizationType] = set()
    for ti in infos:
        if ti.qtype in seen or int(ti.qtype) in quant.QUANT_TYPES:
            continue
        block, type_size = GGML_QUANT_SIZES[ti.qtype]
        try:
            gguf_dequantize(np.zeros((1, type_size), dtype=np.uint8), ti.qtype)
        except (NotImplementedError, ValueError, TypeError):
            raise InputError(
                f"{h.path}: tensor {_show(ti.name)} has quant type {ti.qtype.name}, which the "
                "`gguf` package cannot dequantize; re-quantize the model to F16, Q8_0 or a K-quant"
            )
        seen.add(ti.qtype)


def _map(h: GGUFHeader) -> np.ndarray:
    """The file, memory-mapped copy-on-write: tensors made from it are writable views
    (torch wants that) whose pages are read from the page cache until someone writes."""
    try:
        buf = np.memmap(h.path, dtype=np.uint8, mode="c")
    except OSError as e:
        raise InputError(
            f"{h.path}: cannot read GGUF file ({e.strerror or e}); "
            "check the path and its permissions"
        )
    if buf.shape[0] != h.file_size:
        raise InputError(
            f"{h.path}: the file changed size since its header was read; "
            "read it again once it is complete"
        )
    return buf


def page_dropper(buf: np.ndarray) -> Callable[[torch.Tensor], None]:
    """drop(t): the pages of the file's map that lie wholly inside t (a view of `buf`) leave
    this process's memory (MADV_DONTNEED). The map is copy-on-write and nothing writes it,
    so no content is lost: the page cache keeps the file (the next run reads no disk), and
    a page touched again is read from the file again. For a base dequantized once from its
    blocks (base_readers.held_as): SmolLM2's 92 MiB of blocks were resident beside their
    float32 copy until the load returned. Anything not inside the map is left alone; a
    platform without madvise drops nothing. (MADV_PAGEOUT would also evict the page cache,
    and Python 3.11's mmap module may not name it.)"""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    lo = buf.ctypes.data
    hi = lo + buf.nbytes
    try:
        libc = ctypes.CDLL(None, use_errno=True) if advice is not None else None
        madvise = libc.madvise if libc is not None else None
    except (OSError, TypeError, AttributeError):
        madvise = None

    def drop(t: torch.Tensor) -> None:
        page = mmap.PAGESIZE
        start = -(-t.data_ptr() // page) * page
        end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
        if madvise is not None and t.device.type == "cpu" and lo <= start < end <= hi:
            madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(advice))

    return drop


def _blocks(buf: np.ndarray, ti: TensorInfo) -> torch.Tensor:
    """A tensor's bytes as (rows, row_bytes) uint8, zero-copy over the map."""
    block, type_size = GGML_QUANT_SIZES[ti.qtype]
    shape = ti.shape
    raw = buf[ti.offset : ti.offset + ti.nbytes].reshape(-1, shape[-1] // block * type_size)
    return torch.from_numpy(raw)


def _load_tensor(buf: np.ndarray, ti: TensorInfo) -> torch.Tensor:
    """One tensor as float32 in torch order (the file's layout, nothing un-permuted)."""
    if int(ti.qtype) in quant.QUANT_TYPES:
        w = quant.dequantize(_blocks(buf, ti), int(ti.qtype), ti.ne[0])
        return (
            w.reshape(ti.shape).clone()
            if ti.qtype == GGMLQuantizationType.F32
            else w.reshape(ti.shape)
        )
    block, type_size = GGML_QUANT_SIZES[ti.qtype]
    raw = np.asarray(buf[ti.offset : ti.offset + ti.nbytes]).reshape(
        *ti.shape[:-1], ti.shape[-1] // block * type_size
    )
    arr = np.array(gguf_dequantize(raw, ti.qtype), dtype=np.float32, order="C").reshape(ti.shape)
    return torch.from_numpy(arr)


def read_gguf(source: str | os.PathLike | GGUFHeader, base_dtype: str = "float32") -> Base:
    """Read a model GGUF of a supported family: config, weights in the form `base_dtype`
    asks (module docstring), metadata and chat template. Raises InputError on bad input.
    Pass a header from `read_gguf_header` to avoid parsing the file twice."""
    if base_dtype not in BASE_DTYPES:
        raise ValueError(f"base_dtype must be one of {BASE_DTYPES}, got {base_dtype!r}")
    h = source if isinstance(source, GGUFHeader) else read_gguf_header(source)
    fam = family_of(h)
    cfg = fam.config(h)
    plan = check_tensors(h, cfg)
    _check_dequantizable(h, [h.tensors[g] for g in plan])
    buf = _map(h)
    sd: dict[str, torch.Tensor | QuantTensor] = {}
    notes: list[str] = []
    slow = Counter()
    for gname, p in plan.items():
        ti = h.tensors[gname]
        qtype = int(ti.qtype)
        try:
            if (
                base_dtype == "quantized"
                and len(p.shape) == 2
                and qtype in quant.QUANT_TYPES
                and qtype != quant.F32
            ):
                sd[p.name] = QuantTensor((_blocks(buf, ti),), QuantSpec(qtype, p.shape, p.qk_heads))
                continue
            if qtype not in quant.QUANT_TYPES:
                slow[ti.qtype.name] += 1
            t = _load_tensor(buf, ti)
        except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:
            raise InputError(
                f"{h.path}: tensor {gname!r} ({ti.qtype.name}) could not be dequantized "
                f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); the file is damaged"
            )
        if p.qk_heads:
            t = unpermute_qk(t, p.qk_heads)
        if base_dtype == "bfloat16" and t.dim() == 2:  # the norms stay float32
            t = t.to(torch.bfloat16)
        sd[p.name] = t.contiguous()
    if slow and base_dtype == "quantized":
        notes.append(
            f"{', '.join(f'{k} x{v}' for k, v in slow.items())}: no torch kernel for this type; "
            "dequantized at load and kept in float32"
        )
    tmpl = h.metadata.get("tokenizer.chat_template")
    tok = from_gguf_metadata(h.metadata, source=str(h.path))
    ids = gguf_special_ids(h.metadata)
    special = Specials(
        bos=ids.bos,
        eos=ids.eos,
        pad=ids.pad,
        stops=stop_ids(tok, [ids.eos] if ids.eos is not None else []),
    )
    return Base(
        kind="gguf",
        path=h.path,
        arch=fam.name,
        family=fam.family,
        config=cfg,
        state_dict=sd,
        tokenizer=tok,
        special=special,
        chat_template=tmpl if isinstance(tmpl, str) else None,
        chat_format=fam.chat_format,
        metadata=h.metadata,
        tensor_types=Counter(ti.qtype.name for ti in h.tensors.values()),
        base_dtype=base_dtype,
        notes=notes,
        drop_pages=page_dropper(buf) if base_dtype == "quantized" else None,
    )


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
        raise InputError(
            f"{h.path}: has no tensor {_show(name)} ({len(h.tensors)} tensors in the file); "
            "pass a GGUF model that has it"
        )
    _check_dequantizable(h, [ti])
    buf = _map(h)
    try:
        return _load_tensor(buf, ti).clone()
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:
        raise InputError(
            f"{h.path}: tensor {_show(name)} ({ti.qtype.name}) could not be dequantized "
            f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); the file is damaged"
        )
