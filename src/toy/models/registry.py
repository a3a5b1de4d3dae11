"""Named architectures and presets. Unknown names list the valid ones."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from toy.models.llama import Llama, LlamaConfig

ARCHS = {"llama": (LlamaConfig, Llama)}

# Presets give model shape only; vocab_size comes from the data's tokenizer.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "llama": {
        # 2 layers, tiny widths: for tests.
        "tiny": dict(n_layer=2, d_model=64, n_head=4, n_kv_head=2, max_seq_len=64),
        # The demo and default: trains in minutes on a 2-core CPU.
        "small": dict(n_layer=4, d_model=256, n_head=8, n_kv_head=4, max_seq_len=256),
        "llama-25m": dict(n_layer=8, d_model=512, n_head=8, n_kv_head=4, max_seq_len=512),
        # SmolLM2-135M's shape (30 layers, width 576, 9 query / 3 kv heads).
        "smollm2-135m": dict(n_layer=30, d_model=576, n_head=9, n_kv_head=3, d_ff=1536,
                             max_seq_len=2048, rope_theta=100000.0),
    },
}
DEFAULT_PRESET = {"llama": "small"}


def arch_names() -> list[str]:
    return sorted(ARCHS)


def preset_names(arch: str) -> list[str]:
    return sorted(PRESETS.get(arch, {}))


def build_config(arch: str, preset: str | None, vocab_size: int, **overrides: Any):
    """Config for `arch` from `preset`, then the non-None overrides. Raises KeyError with
    the valid names for an unknown arch or preset (the CLI turns it into exit 2)."""
    if arch not in ARCHS:
        raise KeyError(f"unknown arch {arch!r}; valid: {', '.join(arch_names())}")
    presets = PRESETS.get(arch, {})
    preset = preset or DEFAULT_PRESET.get(arch)
    if preset not in presets:
        raise KeyError(f"unknown preset {preset!r} for arch {arch}; valid: {', '.join(sorted(presets))}")
    fields = dict(presets[preset])
    fields.update({k: v for k, v in overrides.items() if v is not None})
    fields["vocab_size"] = vocab_size
    cfg_cls, _ = ARCHS[arch]
    return cfg_cls(**fields)


def build_model(cfg) -> nn.Module:
    _, model_cls = ARCHS[cfg.arch]
    return model_cls(cfg)


def config_from_dict(d: dict):
    arch = d.get("arch", "llama")
    if arch not in ARCHS:
        raise KeyError(f"unknown arch {arch!r}; valid: {', '.join(arch_names())}")
    cfg_cls, _ = ARCHS[arch]
    return cfg_cls(**d)


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
