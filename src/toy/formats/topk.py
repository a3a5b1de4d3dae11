"""The teacher's top-K log-probs a distillation run keeps (--teacher-top-k): one
safetensors file in the run directory, and beside it a JSON of what it was made from
(teacher, data, K, temperature, the positions' count) with the sha256 of the file's bytes,
written after it. Both are written atomically, so a reader sees a whole file or none; a
file whose JSON is missing, whose bytes or whose origin differ is never trusted:
`read_topk` says why and the run makes it again."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from toy.formats.checkpoint import file_sha256, load_tensors, save_tensors
from toy.runs import write_json_atomic

TOPK_FILE = "teacher_top_k.safetensors"


def _meta_path(path: Path) -> Path:
    return path.with_suffix(".json")


def write_topk(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """The tensors, then the JSON of `meta` and their bytes' sha256 (last: its presence
    says the tensors are whole)."""
    save_tensors(path, tensors)
    write_json_atomic(_meta_path(path), {"made_from": meta, "sha256": file_sha256(path)})


def read_topk(path: Path, meta: dict[str, Any]) -> tuple[dict[str, torch.Tensor] | None, str]:
    """(the tensors, "") where the file is whole and was made from `meta`; else (None, why
    not)."""
    side = _meta_path(path)
    if not path.is_file() or not side.is_file():
        return None, "none kept yet"
    try:
        record = json.loads(side.read_text())
    except (OSError, ValueError):
        return None, f"{side.name} is unreadable"
    if not isinstance(record, dict) or record.get("made_from") != meta:
        return None, "it was made from another teacher, data or flags"
    if record.get("sha256") != file_sha256(path):
        return None, f"{path.name}'s bytes changed since it was written"
    return load_tensors(path), ""
