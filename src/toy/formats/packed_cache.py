"""A GGUF base's codes packed for generation (models/decode.py), kept in toy's cache.

Packing reads and reorders every block of the file (SmolLM2-135M Q4_1: 211 tensors), which
took a good part of a short reply's wait. It is done once per file: the packed parts are
written to CACHE/packed/KEY.safetensors, KEY the file's fingerprint (its size, first 4 MiB,
mtime and inode) and the packed layout's version. The write goes to a temporary file in the
same folder and is renamed into place (a reader never sees half a file); on read, a sha256
of every tensor's bytes, stored in the header, is checked, and so is each tensor's shape
against its spec (decode.pack). A cache that fails either check, or cannot be read or
written, is packed again from the file: the cache only ever saves time."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from toy.data.prep import cache_dir
from toy.models import decode
from toy.runs import file_key

LAYOUT = 1  # bump when decode.pack_parts changes what it writes


def path_for(model_path: Path) -> Path:
    return cache_dir() / "packed" / f"{file_key(model_path, LAYOUT, sys.byteorder)}.safetensors"


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        if t.numel():
            h.update(t.view(torch.uint8).reshape(-1).numpy().data)
    return h.hexdigest()


def read(path: Path) -> dict | None:
    """module name -> (codes, scales, offsets) from a cache file, or None where it is missing
    or fails its check."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
        names = json.loads(meta["modules"])
        if _digest(tensors) != meta["sha256"]:
            return None
        return {n: tuple(tensors[f"{n}.{p}"] for p in decode.PackedSpec.parts) for n in names}
    except (OSError, KeyError, ValueError, TypeError, RuntimeError):
        return None


def write(path: Path, packed: dict) -> None:
    """Write module name -> parts atomically; best effort (a read-only cache is left alone)."""
    from safetensors.torch import save_file

    tensors = {
        f"{n}.{p}": t.contiguous()
        for n, parts in packed.items()
        for p, t in zip(decode.PackedSpec.parts, parts)
    }
    meta = {"modules": json.dumps(sorted(packed)), "sha256": _digest(tensors)}
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def pack(model: torch.nn.Module, model_path: Path) -> tuple[int, str]:
    """decode.pack with the cache: read the packed parts where a good copy is kept, else pack
    from the file and keep them. Returns (tensors packed, 'cache' or 'file')."""
    path = path_for(model_path)
    stored = read(path) if path.is_file() else None
    out: dict = {}
    n = decode.pack(model, stored, out)
    fresh = {k: v for k, v in out.items() if stored is None or stored.get(k) is not v}
    if fresh:
        write(path, out)
    return n, "file" if fresh else "cache"
