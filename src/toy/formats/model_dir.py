"""A trained model directory (`final/`): `model.safetensors`, `config.json`,
`tokenizer.json`, and for a model whose tokenizer came from a GGUF (a distilled student of
a GGUF teacher) `gguf_tokenizer.json`, that file's `tokenizer.*` keys, which a GGUF export
copies whole. What `toy infer` and `toy export` read; `final_dir` finds it (or a
LoRA run's adapter) from whatever directory the user names."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.nn as nn
from tokenizers import Tokenizer

from toy import tokenizer as toktools
from toy.errors import InputError
from toy.formats.checkpoint import atomic_dir, load_tensors, read_json, save_tensors, write_json
from toy.models import registry
from toy.runs import RUNNING, dir_status


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """State dict with tied tensors stored once (safetensors refuses shared storage)."""
    sd = model.state_dict()
    cfg = getattr(model, "cfg", None)
    if cfg is not None and getattr(cfg, "tie_embeddings", False):
        sd.pop("lm_head.weight", None)
    return sd


GGUF_TOKENIZER = "gguf_tokenizer.json"


def save_model_dir(
    out: Path,
    model: nn.Module,
    extra: dict | None = None,
    tokenizer: Tokenizer | Path | None = None,
    files: dict[str, dict] | None = None,
) -> None:
    """Write atomically: `out` holds a complete model or nothing. `files`: more JSON
    files, by name."""
    with atomic_dir(out) as d:
        for name, obj in (files or {}).items():
            write_json(d / name, obj)
        save_tensors(d / "model.safetensors", model_state(model), metadata={"format": "pt"})
        write_json(d / "config.json", {"model": model.cfg.to_dict(), **(extra or {})})
        if isinstance(tokenizer, Tokenizer):
            tokenizer.save(str(d / "tokenizer.json"))
        elif tokenizer is not None:
            shutil.copyfile(tokenizer, d / "tokenizer.json")


def final_dir(path: str | Path, flag: str = "") -> Path:
    """The directory a user means by PATH: a run directory stands for its `final/` (a
    model, or a LoRA run's PEFT adapter); any other directory (a final/ itself, a PEFT
    adapter from elsewhere) is taken as it is. A run with no final/ yet is refused, saying
    so. `flag` (e.g. "--adapter") prefixes the messages."""
    d = Path(path)
    where = f"{flag} {d}" if flag else str(d)
    if not d.exists():
        what = "run or adapter directory" if flag == "--adapter" else "run directory"
        raise InputError(
            f"{where}: no such {what}; pass a run made by `toy train` (`toy list` shows them) "
            "or its final/"
        )
    if not d.is_dir():
        raise InputError(f"{where}: not a directory; pass a run directory (or its final/)")
    if (d / "final").is_dir():
        return d / "final"
    if any((d / name).exists() for name in ("run.json", "events.jsonl", "checkpoints")):
        if dir_status(d) == RUNNING:
            raise InputError(
                f"{where}: has no final/ yet (the run is still training: `toy runs` shows it "
                "running); wait for it to finish"
            )
        hint = (
            f"resume it with `toy train --resume {d}`"
            if (d / "checkpoints").is_dir()
            else "it stopped before its first checkpoint: train it again"
        )
        raise InputError(f"{where}: has no final/ yet (the run did not finish); {hint}")
    return d


def load_model_dir(
    d: Path, device: torch.device | str = "cpu"
) -> tuple[nn.Module, dict, Tokenizer | None]:
    d = Path(d)
    if not (d / "config.json").is_file() or not (d / "model.safetensors").is_file():
        raise InputError(
            f"{d}: no model here (needs config.json and model.safetensors); "
            "point at a finished run's directory or its final/"
        )
    meta = read_json(d / "config.json")
    try:
        cfg = registry.config_from_dict(meta["model"])
    except (KeyError, TypeError) as e:
        raise InputError(f"{d / 'config.json'}: not a toy model config ({e})")
    model = registry.build_model(cfg)
    sd = load_tensors(d / "model.safetensors")
    try:
        res = model.load_state_dict(sd, strict=False)
    except RuntimeError as e:  # a shape mismatch
        raise InputError(
            f"{d / 'model.safetensors'}: does not match config.json "
            f"({str(e).splitlines()[1].strip()})"
        )
    tied = getattr(cfg, "tie_embeddings", False)
    missing = [k for k in res.missing_keys if not (tied and k == "lm_head.weight")]
    if missing or res.unexpected_keys:
        what = f"lacks {missing[0]}" if missing else f"has unexpected {res.unexpected_keys[0]}"
        raise InputError(f"{d / 'model.safetensors'}: {what}; it does not match config.json")
    tok = toktools.load(d / "tokenizer.json") if (d / "tokenizer.json").is_file() else None
    return model.to(device).eval(), meta, tok
