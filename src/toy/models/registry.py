"""Every model family, found once: each module of toy.models that declares a `FAMILY`
(models/family.py). Lookups by name list the valid names when a name is unknown."""

from __future__ import annotations

import pkgutil
from functools import cache
from importlib import import_module
from typing import Any

import torch.nn as nn

from toy.models.family import Arch, Family


@cache
def families() -> dict[str, Family]:
    """name -> Family, for every family file in toy.models."""
    import toy.models as pkg

    found = {}
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        fam = getattr(import_module(f"toy.models.{info.name}"), "FAMILY", None)
        if isinstance(fam, Family):
            found[fam.name] = fam
    return found


def family(name: str) -> Family:
    fams = families()
    if name not in fams:
        raise KeyError(f"unknown model family {name!r}; valid: {', '.join(fams)}")
    return fams[name]


def gguf_archs() -> dict[str, tuple[Family, Arch]]:
    """GGUF general.architecture -> (its family, how the family reads it)."""
    return {a: (f, arch) for f in families().values() for a, arch in f.archs.items()}


def lora_targets() -> tuple[str, ...]:
    """Every family's LoRA targets (a model takes the ones it has)."""
    out: list[str] = []
    for f in families().values():
        out += [t for t in f.targets if t not in out]
    return tuple(out)


# ------------------------------------------------------------------ presets (from scratch)


def arch_names() -> list[str]:
    """What `--arch` takes: the families with presets."""
    return sorted(n for n, f in families().items() if f.presets)


def lm_archs() -> tuple[str, ...]:
    """The decoder language models that train from scratch."""
    return tuple(n for n in arch_names() if families()[n].language_model)


def preset_names(arch: str) -> list[str]:
    return sorted(families()[arch].presets) if arch in families() else []


def preset(arch: str, name: str) -> dict[str, Any]:
    return dict(family(arch).presets[name])


def build_config(arch: str, preset: str | None, vocab_size: int, **overrides: Any):
    """Config for `arch` from `preset`, then the non-None overrides. Raises KeyError with
    the valid names for an unknown arch or preset (the CLI turns it into exit 2)."""
    if arch not in arch_names():
        raise KeyError(f"unknown arch {arch!r}; valid: {', '.join(arch_names())}")
    fam = families()[arch]
    preset = preset or fam.default_preset
    if preset not in fam.presets:
        raise KeyError(
            f"unknown preset {preset!r} for arch {arch}; valid: {', '.join(sorted(fam.presets))}"
        )
    fields = dict(fam.presets[preset])
    fields.update({k: v for k, v in overrides.items() if v is not None})
    fields["vocab_size"] = vocab_size
    return fam.config(**fields)


def build_model(cfg) -> nn.Module:
    return family(cfg.arch).model(cfg)


def config_from_dict(d: dict):
    """A config from its to_dict() (a final/ directory's config.json)."""
    return family(d.get("arch", "llama")).config(**d)


def check_config(cfg) -> list[str]:
    """Every shape problem at once, named by the flag that sets it."""
    p = []
    for name, flag in (("n_layer", "--n-layer"), ("d_model", "--d-model"), ("n_head", "--n-head")):
        v = getattr(cfg, name, 1)
        if v < 1:
            p.append(f"{flag} must be >= 1, got {v}")
    if p:
        return p
    if cfg.d_model % cfg.n_head:
        p.append(f"--d-model {cfg.d_model} must be divisible by --n-head {cfg.n_head}")
    kv = getattr(cfg, "n_kv_head", cfg.n_head)
    if kv < 1 or cfg.n_head % kv:
        p.append(f"--n-kv-head {kv} must divide --n-head {cfg.n_head}")
    hd = getattr(cfg, "head_dim", 2)
    if getattr(cfg, "arch", "") == "llama" and hd % 2:
        p.append(f"head size {hd} (--d-model / --n-head) must be even for rotary positions")
    return p
