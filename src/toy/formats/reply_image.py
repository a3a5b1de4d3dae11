"""A llama GGUF as models/reply_c.py steps it, kept in toy's cache: what lets a later reply
start without torch.

A first packed reply on a llama GGUF puts its codes in decode_step.c's blocked order (models/
decode_native.py); that order, the norms, the rotary tables and what the reply reads from the
file's header (its tokenizer, chat template, special tokens, sizes) are written here once,
to CACHE/reply/KEY.bin (KEY: the file's fingerprint, size, mtime and inode, this layout's
version, and a digest of toy's own sources). A later `toy infer` on the same file maps it
and replies without importing torch (cli/reply_fast.py).

The file: b"TOYREPLY", the header's length (8 bytes, little-endian), the header (JSON: the
plan, the meta, each array's dtype, shape and offset, the sha256 of the data), then the data,
each array 64-byte aligned. Written to a temporary file in the same folder and renamed into
place (a reader never sees half a file); on read the sha256 of the header and the data is
checked (and reply_c.Model checks every array's shape against the plan), and anything
that fails to read or check is None: the caller takes torch's path, which writes it again.
The cache only ever saves time."""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from toy import __version__
from toy.runs import cache_dir, file_key

MAGIC = b"TOYREPLY"
LAYOUT = 1  # bump when what is written (the plan, the meta, the blocked order) changes
ALIGN = 64


@functools.lru_cache(maxsize=1)
def _code() -> str:
    """A digest of toy's own sources (every .py, .c and .h of the package): what is kept
    here comes from many of them (the tokenizer's rebuild, the chat templates, the packing,
    the plan), so a changed toy keeps its models anew rather than trust an old one's."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(p for ext in ("py", "c", "h") for p in root.rglob(f"*.{ext}")):
        h.update(f"{f.relative_to(root)}:".encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def path_for(model_path: Path) -> Path:
    key = file_key(model_path, "reply", LAYOUT, __version__, _code(), sys.byteorder)
    return cache_dir() / "reply" / f"{key}.bin"


def _digest(head: dict, arrays: list[np.ndarray]) -> str:
    """sha256 of the header's plan, meta and table (its canonical JSON) and of the data."""
    h = hashlib.sha256(json.dumps(head, sort_keys=True).encode())
    for a in arrays:
        h.update(a.data)
    return h.hexdigest()


def _arrays_of(plan: dict) -> list[str]:
    """The array names a plan points at, each once, in a fixed order."""
    names: list[str] = []

    def matrix(d: dict) -> None:
        names.extend(d[k] for k in ("words", "s", "z") if d.get(k))

    for b in plan["blocks"]:
        for p in ("q", "k", "v", "o", "gate", "up", "down"):
            matrix(b[p])
        names.extend((b["norm1"], b["norm2"]))
    matrix(plan["head"])
    matrix(plan["embed"])
    names.extend((plan["norm"], plan["cos"], plan["sin"]))
    return list(dict.fromkeys(names))


def write(path: Path, plan: dict, arrays: dict[str, np.ndarray], meta: dict) -> bool:
    """Write a model's plan, arrays and meta atomically; best effort (False where it could
    not: a read-only or full cache is left as it was)."""
    names = _arrays_of(plan)
    table, offset = {}, 0
    for n in names:
        a = arrays[n]
        table[n] = {"dtype": a.dtype.str, "shape": list(a.shape), "offset": offset}
        offset += -(-a.nbytes // ALIGN) * ALIGN
    head = {"plan": plan, "meta": meta, "arrays": table, "size": offset}
    digest = _digest(head, [np.ascontiguousarray(arrays[n]) for n in names])
    head = json.dumps({**head, "sha256": digest}).encode()
    start = -(-(len(MAGIC) + 8 + len(head)) // ALIGN) * ALIGN
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".bin")
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + len(head).to_bytes(8, "little") + head)
            f.write(b"\0" * (start - f.tell()))
            for n in names:
                a = np.ascontiguousarray(arrays[n])
                f.write(a.data)
                f.write(b"\0" * (-a.nbytes % ALIGN))
        os.replace(tmp, path)
        tmp = None
        return True
    except OSError:
        return False
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def read(path: Path) -> tuple[dict, dict[str, np.ndarray], dict] | None:
    """(plan, arrays, meta) from a kept file, the arrays read-only views of its map; None
    where it is missing, damaged or of another layout."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if f.read(len(MAGIC)) != MAGIC:
                return None
            n = int.from_bytes(f.read(8), "little")
            if n > size - len(MAGIC) - 8:
                return None
            head = json.loads(f.read(n))
            start = -(-(len(MAGIC) + 8 + n) // ALIGN) * ALIGN
            if size != start + head["size"]:
                return None
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        data = memoryview(mm)[start:]
        arrays = {}
        for name in _arrays_of(head["plan"]):
            t = head["arrays"][name]
            dtype = np.dtype(t["dtype"])
            count = int(np.prod(t["shape"], dtype=np.int64))
            arrays[name] = np.frombuffer(data, dtype, count, t["offset"]).reshape(t["shape"])
        want = head.pop("sha256")
        if _digest(head, list(arrays.values())) != want:
            return None
        return head["plan"], arrays, head["meta"]
    except Exception:  # anything unreadable, whatever raised it: not trusted, never fatal
        return None
