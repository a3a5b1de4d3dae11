"""Named architectures and presets. Unknown names list the valid ones."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from toy.models.gemma import Gemma, GemmaConfig
from toy.models.gpt2 import GPT2, GPT2Config
from toy.models.llama import Llama, LlamaConfig
from toy.models.phi3 import Phi3, Phi3Config
from toy.models.vit import ViT, VitConfig

ARCHS = {"llama": (LlamaConfig, Llama), "gpt2": (GPT2Config, GPT2), "vit": (VitConfig, ViT),
         # Read from GGUF files only (LoRA bases, donors): no presets, never trained from scratch.
         "phi3": (Phi3Config, Phi3), "gemma": (GemmaConfig, Gemma)}

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
    "gpt2": {
        "tiny": dict(n_layer=2, d_model=64, n_head=4, max_seq_len=64),
        "small": dict(n_layer=4, d_model=256, n_head=8, max_seq_len=256),
        # GPT-2 small's shape (HF `gpt2`).
        "gpt2-124m": dict(n_layer=12, d_model=768, n_head=12, max_seq_len=1024),
    },
    # ViT presets give shape only; n_classes comes from the image folder (the vit-tiny recipe builds them).
    "vit": {
        # ViT-Tiny/16 at 224 px: 196 patches, 12 layers, width 192, 3 heads.
        "vit-tiny": dict(image_size=224, patch_size=16, n_layer=12, d_model=192, n_head=3, d_ff=768),
        # ViT-Tiny at half its depth: what the vit-tiny recipe picks for a small image set,
        # where 6 layers learn faster per step than 12 (docs/results.md, Fashion-MNIST ViT).
        "vit-tiny-6": dict(image_size=224, patch_size=16, n_layer=6, d_model=192, n_head=3, d_ff=768),
        # 28 px, 7 px patches (16 of them), 2 layers: for tests.
        "tiny": dict(image_size=28, patch_size=7, n_layer=2, d_model=64, n_head=4, d_ff=256),
    },
}
DEFAULT_PRESET = {"llama": "small", "gpt2": "small", "vit": "vit-tiny"}


# Decoder language models (what from-scratch and warm-start train); vit is an image model.
LM_ARCHS = ("gpt2", "llama")


def arch_names() -> list[str]:
    """What `--arch` takes: the architectures with presets."""
    return sorted(PRESETS)


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
