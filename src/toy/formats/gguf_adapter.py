"""What a llama.cpp LoRA adapter GGUF holds, from its header alone (no tensor is read).

llama.cpp's layout (llama-adapter.cpp; toy writes it in gguf_write.write_lora_gguf):
`general.type = "adapter"`, `adapter.type = "lora"`, `adapter.lora.alpha`, and for each
adapted matrix `<base tensor>.lora_a` with ne (in, r) and `<base tensor>.lora_b` with
ne (r, out), so the torch-order shapes are A (r, in) and B (out, r).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from typing import Any

from toy.formats.gguf_header import GGUFHeader, read_gguf_header

_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


def describe_adapter(source: str | os.PathLike | GGUFHeader) -> dict[str, Any]:
    """Rank, alpha, the adapted tensors (by kind, e.g. `attn_q.weight` x 30 layers) and the
    base architecture of an adapter GGUF, plus `problems`: what would stop llama.cpp from
    applying it (a lora_a without its lora_b, A and B of different ranks, no tensors), and
    `notes`: what it would apply differently than intended (no alpha: scale 1)."""
    h = source if isinstance(source, GGUFHeader) else read_gguf_header(source)
    meta = h.metadata
    pairs: dict[str, dict[str, Any]] = {}
    other: list[str] = []
    for name, ti in h.tensors.items():
        base, dot, kind = name.rpartition(".")
        if dot and kind in ("lora_a", "lora_b"):
            pairs.setdefault(base, {})[kind] = ti
        else:
            other.append(name)
    problems: list[str] = []
    notes: list[str] = []
    ranks: Counter = Counter()
    kinds: Counter = Counter()
    layers: set[int] = set()
    for base, ab in pairs.items():
        if set(ab) != {"lora_a", "lora_b"}:
            problems.append(
                f"{base} has {'lora_a' if 'lora_a' in ab else 'lora_b'} without "
                f"{'lora_b' if 'lora_a' in ab else 'lora_a'}"
            )
            continue
        a, b = ab["lora_a"].shape, ab["lora_b"].shape  # (r, in), (out, r)
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            problems.append(f"{base}: lora_a {a} and lora_b {b} do not share a rank")
            continue
        ranks[a[0]] += 1
        m = _LAYER.match(base)
        if m:
            layers.add(int(m.group(1)))
            kinds[m.group(2)] += 1
        else:
            kinds[base] += 1
    alpha = meta.get("adapter.lora.alpha")
    if meta.get("adapter.type", "lora") == "lora":
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            notes.append(
                "no adapter.lora.alpha key: llama.cpp scales the update by 1, not alpha/rank"
            )
            alpha = None
        if not pairs:
            problems.append("no lora_a / lora_b tensors")
    rank = ranks.most_common(1)[0][0] if ranks else None
    return {
        "path": str(h.path),
        "file_size": h.file_size,
        "gguf_version": h.version,
        "type": "adapter",
        "adapter_type": meta.get("adapter.type"),
        "arch": meta.get("general.architecture"),
        "name": meta.get("general.name"),
        "rank": rank,
        "ranks": {int(r): n for r, n in sorted(ranks.items())},
        "alpha": float(alpha) if alpha is not None else None,
        "scale": float(alpha) / rank if alpha is not None and rank else None,
        "n_matrices": sum(ranks.values()),
        "n_layers": len(layers),
        "targets": dict(sorted(kinds.items())),
        "other_tensors": other,
        "n_params": sum(ti.n_elements for ti in h.tensors.values()),
        "n_tensors": len(h.tensors),
        "tensor_types": dict(Counter(ti.qtype.name for ti in h.tensors.values()).most_common()),
        "problems": problems,
        "notes": notes,
    }
