"""safetensors files read as memory maps: each tensor a zero-copy view of the file, so a
base's weights are read only as they are used and their pages shared with the page cache
(as a GGUF's are). The header is checked before anything is read: its length against the
file, every tensor's dtype, shape and byte range against the data that follows.

    where = open_weights(model_dir)             # tensor name -> the SafeFile holding it
    t = where["model.norm.weight"].tensor("model.norm.weight")   # a view, in the file's dtype

`safetensors.torch.load_file` would read every tensor into memory at once; its `safe_open`
copies a tensor per get. The format is simple (8-byte little-endian header length, a JSON
header, then the tensors' bytes), so toy maps it itself.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from toy.errors import InputError

DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I64": torch.int64,
    "I16": torch.int16,
    "U16": torch.uint16,
    "BOOL": torch.bool,
}
MAX_HEADER = 100 << 20  # bytes of JSON header: far more than any model's tensor table


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # safetensors' name (F32, BF16, U32, ...)
    shape: tuple[int, ...]
    start: int  # byte range in the file
    end: int


class SafeFile:
    """One safetensors file: its tensor table, and views of its bytes on demand."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    raise InputError(
                        f"{self.path}: too short for a safetensors file ({size} bytes)"
                    )
                (n,) = struct.unpack("<Q", head)
                if n > min(MAX_HEADER, size - 8):
                    raise InputError(
                        f"{self.path}: not a safetensors file (header length {n} for a "
                        f"{size}-byte file)"
                    )
                raw = fh.read(n)
        except OSError as e:
            raise InputError(f"{self.path}: cannot read ({e.strerror or e})")
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InputError(f"{self.path}: not a safetensors file (its header is not JSON: {e})")
        if not isinstance(header, dict):
            raise InputError(
                f"{self.path}: not a safetensors file (its header is not a JSON object)"
            )
        self.metadata = header.pop("__metadata__", None) or {}
        data_start, data_size = 8 + n, size - 8 - n
        self.entries: dict[str, TensorEntry] = {}
        for name, info in header.items():
            self.entries[name] = self._entry(name, info, data_start, data_size)
        self.size = size
        self._buf: np.ndarray | None = None

    def _entry(self, name: str, info, data_start: int, data_size: int) -> TensorEntry:
        bad = f"{self.path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise InputError(f"{bad}: its header entry is not an object; the file is damaged")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPES:
            raise InputError(
                f"{bad} has dtype {dtype!r}, which toy does not read; "
                f"supported: {', '.join(DTYPES)}"
            )
        if (
            not isinstance(shape, list)
            or not all(isinstance(d, int) and d >= 0 for d in shape)
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
        ):
            raise InputError(f"{bad}: malformed shape or data_offsets; the file is damaged")
        begin, end = offsets
        itemsize = torch.empty(0, dtype=DTYPES[dtype]).element_size()
        if not 0 <= begin <= end <= data_size or end - begin != math.prod(shape) * itemsize:
            raise InputError(
                f"{bad}: bytes {begin}..{end} do not hold a {dtype} tensor of shape {shape} within "
                f"the file's {data_size} data bytes; the file is truncated or damaged"
            )
        return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)

    def _map(self) -> np.ndarray:
        if self._buf is None:
            try:
                # Copy-on-write: views are writable for torch, pages come from the page cache.
                self._buf = np.memmap(self.path, dtype=np.uint8, mode="c")
            except OSError as e:
                raise InputError(f"{self.path}: cannot map ({e.strerror or e})")
            if self._buf.shape[0] != self.size:
                raise InputError(
                    f"{self.path}: the file changed size while being read; "
                    "read it again once complete"
                )
        return self._buf

    def tensor(self, name: str) -> torch.Tensor:
        """A zero-copy view of the tensor, in the file's dtype and shape."""
        e = self.entries[name]
        raw = torch.from_numpy(self._map()[e.start : e.end])
        return raw.view(DTYPES[e.dtype]).reshape(e.shape)

    def rows(self, name: str) -> torch.Tensor:
        """The tensor's bytes as (rows, row_bytes) uint8: a 2-D float weight as the block
        tensor of GGUF's F16/BF16/F32 types (models.quant dequantizes it per use)."""
        e = self.entries[name]
        raw = torch.from_numpy(self._map()[e.start : e.end])
        return raw.reshape(e.shape[0], -1)


def weight_files(d: Path) -> list[Path]:
    """The safetensors files of a model directory: the index's shards (each checked to
    exist), else model.safetensors, else every model*.safetensors (mlx-lm's way)."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
            files = sorted(set(wmap.values()))
        except (
            OSError,
            UnicodeDecodeError,
            json.JSONDecodeError,
            KeyError,
            TypeError,
            AttributeError,
        ) as e:
            raise InputError(f'{index}: not a safetensors index (needs a "weight_map" object): {e}')
        for f in files:
            if not isinstance(f, str) or "/" in f or f.startswith(".") or not (d / f).is_file():
                raise InputError(
                    f"{d / str(f)}: missing shard named in {index.name}; the download is incomplete"
                )
        return [d / f for f in files]
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    found = sorted(d.glob("model*.safetensors"))
    if found:
        return found
    pickled = [p.name for p in d.glob("pytorch_model*.bin")]
    hint = (
        f" (it has {pickled[0]}, a pickle toy never loads: "
        "save the model with safe_serialization=True)"
        if pickled
        else ""
    )
    raise InputError(f"{d}: no model.safetensors (nor an index of shards){hint}")


def open_weights(d: Path) -> dict[str, SafeFile]:
    """Every tensor of a directory's weight files: tensor name -> the file holding it. A
    tensor in two files is an error naming both."""
    where: dict[str, SafeFile] = {}
    for p in weight_files(d):
        sf = SafeFile(p)
        for name in sf.entries:
            if name in where:
                raise InputError(
                    f"{d}: tensor {name!r} is in both {where[name].path.name} and {p.name}"
                )
            where[name] = sf
    return where
