"""The GGUF header: key/values and tensor infos, parsed with every count, length and
offset checked against the file's size before anything is read, so a hostile or
truncated file fails in bounded time and memory with an `InputError`. (The families read
their `<arch>.*` keys through models/family.py's `Keys`, via formats/gguf_plan.py.)

Why not `gguf.GGUFReader` for the header: it trusts the counts it reads (an array
claiming 2**60 elements at the end of the file makes it loop for ever, growing a list),
and it walks every element of the token and merge arrays through numpy views, which
takes ~5 s for SmolLM2's 49k tokens + 49k merges against ~0.1 s here. The constants
(value types, quant types, block sizes) still come from the `gguf` package.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)

from toy.errors import InputError

SUPPORTED_VERSIONS = (2, 3)

# ggml tensors have at most 4 dimensions (GGML_MAX_DIMS).
_MAX_DIMS = 4
# Sanity caps on what a header may claim, far above any real file. Everything is also
# checked against the file's size; these only keep the error message sensible.
_MAX_COUNT = 1 << 24
_MAX_KEY_LEN = 1 << 16
_MAX_ARRAY_DEPTH = 3

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.FLOAT64: "d",
    GGUFValueType.BOOL: "?",
}
_NUMPY_DTYPES: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.FLOAT64: "<f8",
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
    # Each key's GGUF value type (and an array's item type): a file written from this
    # header keeps them, as llama.cpp reads some keys with a fixed type.
    kv_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = field(default_factory=dict)


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
            raise InputError(
                f"{self.path}: truncated GGUF: {what} at byte {self.pos} needs {n} bytes, "
                f"only {self.size - self.pos} left; {_TRUNCATED_FIX}"
            )

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
            raise InputError(
                f"{self.path}: corrupt GGUF header: {what} claims {n} bytes (limit {max_len}); "
                "the file is damaged or not a GGUF model"
            )
        self.need(n, what)
        raw = self.view[self.pos : self.pos + n]
        self.pos += n
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise InputError(
                f"{self.path}: corrupt GGUF header: {what} at byte {self.pos - n} is not valid "
                "UTF-8; the file is damaged"
            )


def _value_type(raw: int, cur: _Cursor, key: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise InputError(
            f"{cur.path}: corrupt GGUF header: key {_show(key)} has unknown value type {raw}; "
            "the file is damaged or from a newer GGUF version"
        )


def _read_value(cur: _Cursor, vtype: GGUFValueType, key: str, depth: int = 0) -> Any:
    if vtype == GGUFValueType.STRING:
        return cur.string(f"value of {_show(key)}")
    if vtype in _SCALAR_FORMATS:
        return cur.scalar(_SCALAR_FORMATS[vtype], f"value of {_show(key)}")
    # ARRAY: item type, count, items.
    if depth >= _MAX_ARRAY_DEPTH:
        raise InputError(
            f"{cur.path}: corrupt GGUF header: arrays nested deeper than {_MAX_ARRAY_DEPTH} "
            f"in key {_show(key)}; the file is damaged"
        )
    itype = _value_type(cur.u32(f"array type of {_show(key)}"), cur, key)
    count = cur.u64(f"array length of {_show(key)}")
    # Each item takes at least this many bytes, so a count the file cannot hold is caught
    # before the loop: no header can make us spin or allocate beyond the file's size.
    min_item = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}.get(itype) or struct.calcsize(
        "<" + _SCALAR_FORMATS[itype]
    )
    if count > _MAX_COUNT or count * min_item > cur.size - cur.pos:
        raise InputError(
            f"{cur.path}: corrupt or truncated GGUF header: array {_show(key)} claims {count} "
            f"items but only {cur.size - cur.pos} bytes are left; {_TRUNCATED_FIX}"
        )
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
        raise InputError(
            f"{cur.path}: corrupt GGUF header: item {len(out)} of {_show(key)} is not valid UTF-8; "
            "the file is damaged"
        )
    if len(out) < count:
        raise InputError(
            f"{cur.path}: truncated GGUF: array {_show(key)} ends after {len(out)} of {count} "
            f"strings; {_TRUNCATED_FIX}"
        )
    cur.pos = pos
    return out


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Key/values and tensor infos of a GGUF file, validated against its size. Reads no
    tensor data. Raises InputError (one line, naming the file) on anything malformed."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise InputError(
            f"{path}: GGUF file not found; "
            "check the path (`toy fetch smollm2` fetches a small model)"
        )
    except OSError as e:
        raise InputError(
            f"{path}: cannot read GGUF file ({e.strerror}); check the path and its permissions"
        )
    if path.is_dir():
        raise InputError(f"{path}: is a directory, not a GGUF file; pass the .gguf file itself")
    if size < 24:  # magic + version + tensor count + kv count
        raise InputError(
            f"{path}: not a GGUF file ({size} bytes, too small for a GGUF header); "
            "pass a .gguf model file"
        )
    try:
        buf = np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as e:
        raise InputError(
            f"{path}: cannot read GGUF file ({e.strerror or e}); check the path and its permissions"
        )
    cur = _Cursor(buf, path)

    magic = cur.u32("magic")
    if magic != GGUF_MAGIC:
        head = bytes(buf[:4])
        raise InputError(
            f"{path}: not a GGUF file (starts with {head!r}, expected b'GGUF'); "
            "pass a .gguf model file"
        )
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and (version >> 16) in SUPPORTED_VERSIONS:
            raise InputError(
                f"{path}: big-endian GGUF is not supported; convert it to little-endian with "
                "llama.cpp's gguf tools"
            )
        raise InputError(
            f"{path}: GGUF version {version} is not supported (supported: "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}); re-convert it with a current llama.cpp"
        )
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("key/value count")
    left = size - cur.pos
    # Smallest possible entries: a key/value is 8 (key length) + 4 (type) + 1 (a u8 value);
    # a tensor info is 8 (name length) + 4 (n_dims) + 8 (one dim) + 4 (type) + 8 (offset).
    if n_kv > _MAX_COUNT or n_kv * 13 > left or n_tensors > _MAX_COUNT or n_tensors * 32 > left:
        raise InputError(
            f"{path}: corrupt GGUF header: it claims {n_kv} key/values and {n_tensors} tensors, "
            f"which cannot fit in a {size}-byte file; the file is damaged or truncated"
        )

    metadata: dict[str, Any] = {}
    kv_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
    for _ in range(n_kv):
        key = cur.string("key name", max_len=_MAX_KEY_LEN)
        vtype = _value_type(cur.u32(f"type of key {_show(key)}"), cur, key)
        if key in metadata:
            raise InputError(
                f"{path}: corrupt GGUF header: key {_show(key)} appears twice; the file is damaged"
            )
        item = None
        if vtype == GGUFValueType.ARRAY:  # peek at the item type; _read_value reads it again
            (raw,) = (
                struct.unpack_from("<I", cur.buf, cur.pos) if cur.size - cur.pos >= 4 else (None,)
            )
            item = GGUFValueType(raw) if raw in GGUFValueType._value2member_map_ else None
        metadata[key] = _read_value(cur, vtype, key)
        kv_types[key] = (vtype, item)

    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if (
        not isinstance(alignment, int)
        or isinstance(alignment, bool)
        or alignment <= 0
        or alignment & (alignment - 1)
    ):
        raise InputError(
            f"{path}: corrupt GGUF header: general.alignment {alignment!r} is not a power of two"
        )

    raw_infos = []
    for _ in range(n_tensors):
        name = cur.string("tensor name", max_len=_MAX_KEY_LEN)
        n_dims = cur.u32(f"dimension count of tensor {_show(name)}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise InputError(
                f"{path}: corrupt GGUF header: tensor {_show(name)} claims {n_dims} dimensions "
                f"(ggml allows 1..{_MAX_DIMS}); the file is damaged"
            )
        ne = tuple(cur.u64(f"shape of tensor {_show(name)}") for _ in range(n_dims))
        raw_type = cur.u32(f"type of tensor {_show(name)}")
        offset = cur.u64(f"data offset of tensor {_show(name)}")
        raw_infos.append((name, ne, raw_type, offset))

    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, ne, raw_type, offset in raw_infos:
        if name in tensors:
            raise InputError(
                f"{path}: corrupt GGUF header: tensor {_show(name)} appears twice; "
                "the file is damaged"
            )
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise InputError(
                f"{path}: tensor {_show(name)} has unknown quant type id {raw_type}; the file is "
                "damaged or needs a newer `gguf` package (pip install -U gguf)"
            )
        if any(d < 1 for d in ne) or ne[0] % block:
            raise InputError(
                f"{path}: misshapen tensor {_show(name)}: GGUF shape {list(ne)} is not valid for "
                f"{qtype.name} (blocks of {block} along ne[0]); the file is damaged"
            )
        n_el = 1
        for d in ne:
            n_el *= d
        nbytes = n_el // block * type_size
        start = data_start + offset
        if offset % alignment:
            raise InputError(
                f"{path}: corrupt GGUF header: tensor {_show(name)} data offset {offset} is not "
                f"aligned to {alignment} bytes; the file is damaged"
            )
        if start + nbytes > size:
            raise InputError(
                f"{path}: truncated GGUF: tensor {_show(name)} needs bytes "
                f"{start}..{start + nbytes} but the file has {size}; {_TRUNCATED_FIX}"
            )
        tensors[name] = TensorInfo(name, ne, qtype, start, nbytes)
    return GGUFHeader(path, version, size, metadata, tensors, alignment, data_start, kv_types)
