"""HF PEFT LoRA adapters: `adapter_config.json` + `adapter_model.safetensors`.

Key names are what `PeftModel.save_pretrained` writes for a `LlamaForCausalLM`
(checked against peft 0.21): the PEFT wrapper's `base_model.model.` prefix, then the HF
module path (toy's name with HF's `model.` prefix), then `lora_A.weight` /
`lora_B.weight`. The adapter name ("default") is not in the file.

    toy:  layers.0.self_attn.q_proj.lora_A                       (r, in)
    PEFT: base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
    toy:  layers.0.mlp.down_proj.lora_B                          (out, r)
    PEFT: base_model.model.model.layers.0.mlp.down_proj.lora_B.weight

Both sides use the same math (y += B A x * alpha / r) and the same row order of the
weights (HF's and toy's Q/K layout agree; only GGUF's is permuted), so the tensors are
copied as they are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from toy.errors import InputError, UsageError
from toy.formats.checkpoint import write_file_atomic

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = "base_model.model.model."  # PEFT wrapper + LlamaForCausalLM's `model.`
_SUFFIXES = {"lora_A": ".lora_A.weight", "lora_B": ".lora_B.weight"}


def toy_to_peft_key(name: str) -> str:
    module, _, kind = name.rpartition(".")
    if kind not in _SUFFIXES or not module:
        raise ValueError(f"not a toy LoRA key (want <module>.lora_A / .lora_B): {name!r}")
    return PREFIX + module + _SUFFIXES[kind]


def peft_to_toy_key(key: str) -> str | None:
    """The toy name for a PEFT key, or None if the key is not a LoRA A/B of the model body."""
    if not key.startswith(PREFIX):
        return None
    rest = key[len(PREFIX) :]
    for kind, suffix in _SUFFIXES.items():
        if rest.endswith(suffix) and len(rest) > len(suffix):
            return rest[: -len(suffix)] + "." + kind
    return None


def _check_lora_sd(lora_sd: dict[str, torch.Tensor], rank: int, targets: list[str]) -> None:
    problems = []
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in lora_sd.items():
        module, _, kind = name.rpartition(".")
        if kind not in _SUFFIXES or not module:
            problems.append(f"{name!r} is not a <module>.lora_A/.lora_B key")
            continue
        if module.rsplit(".", 1)[-1] not in targets:
            problems.append(f"{name!r} is not one of --targets {','.join(targets)}")
        if t.dim() != 2:
            problems.append(f"{name} must be 2-D, got shape {tuple(t.shape)}")
        modules.setdefault(module, {})[kind] = t
    for module, ab in modules.items():
        if set(ab) != set(_SUFFIXES):
            problems.append(f"{module} has only {', '.join(ab)}")
        elif ab["lora_A"].dim() == 2 and ab["lora_B"].dim() == 2:
            if ab["lora_A"].shape[0] != rank or ab["lora_B"].shape[1] != rank:
                problems.append(
                    f"{module}: A {tuple(ab['lora_A'].shape)} / B {tuple(ab['lora_B'].shape)} "
                    f"do not have rank {rank}"
                )
    if not lora_sd:
        problems.append("no adapter tensors")
    if problems:
        raise UsageError("cannot save the PEFT adapter: " + "; ".join(problems[:5]))


def save_peft_adapter(
    out_dir: str | Path,
    lora_sd: dict[str, torch.Tensor],
    rank: int,
    alpha: float,
    dropout: float,
    targets: list[str],
    base_model_name_or_path: str,
    layers_to_transform: list[int] | None = None,
) -> Path:
    """Write a PEFT LoRA adapter that `PeftModel.from_pretrained(LlamaForCausalLM, out_dir)`
    loads. `lora_sd` uses toy names (as `toy.lora.lora_state_dict` returns).
    `layers_to_transform`: the blocks it covers where not every one (--num-layers; PEFT
    makes no modules elsewhere). Returns out_dir."""
    _check_lora_sd(lora_sd, rank, targets)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        toy_to_peft_key(k): v.detach().to("cpu").contiguous() for k, v in sorted(lora_sd.items())
    }
    # Only long-standing LoraConfig fields: older peft versions reject unknown keys.
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(set(targets)),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": layers_to_transform,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_rslora": False,
        "use_dora": False,
    }
    # Weights first, config last: a directory with a config is a complete adapter.
    write_file_atomic(
        out / WEIGHTS_NAME, lambda p: save_file(tensors, p, metadata={"format": "pt"})
    )
    write_file_atomic(
        out / CONFIG_NAME, lambda p: Path(p).write_text(json.dumps(config, indent=2) + "\n")
    )
    return out


def load_peft_adapter(adapter_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a PEFT LoRA adapter for a llama-family model: (lora_sd with toy names, config).

    Refuses what toy's LoRA cannot represent (DoRA, rsLoRA scaling, per-module rank or
    alpha, bias or embedding adapters, modules_to_save) with an InputError naming it.
    """
    d = Path(adapter_dir)
    cfg_path, w_path = d / CONFIG_NAME, d / WEIGHTS_NAME
    if not d.is_dir():
        raise InputError(
            f"{d}: no such adapter directory; "
            f"pass the folder holding {CONFIG_NAME} and {WEIGHTS_NAME}"
        )
    if not cfg_path.is_file():
        raise InputError(f"{d}: no {CONFIG_NAME}; not a PEFT adapter directory")
    if not w_path.is_file():
        if (d / "adapter_model.bin").is_file():
            raise InputError(
                f"{d}: adapter_model.bin is a pickle, which toy does not load; re-save it with "
                f"PEFT's save_pretrained(safe_serialization=True)"
            )
        raise InputError(f"{d}: no {WEIGHTS_NAME}")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{cfg_path}: not valid JSON ({str(e).splitlines()[0]})")
    if not isinstance(config, dict):
        raise InputError(f"{cfg_path}: expected a JSON object")
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(f"peft_type is {config.get('peft_type')!r}, toy reads only LORA")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        problems.append(f"r must be an integer >= 1, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        problems.append(f"lora_alpha must be > 0, got {alpha!r}")
    for flag in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if config.get(flag):
            problems.append(f"{flag}=true is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            problems.append(f"{key} (per-module rank/alpha) is not supported")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save {config['modules_to_save']} is not supported")
    if config.get("bias", "none") != "none":
        problems.append(f"bias={config['bias']!r} is not supported (only 'none')")
    if problems:
        raise InputError(f"{cfg_path}: " + "; ".join(problems))

    try:
        with safe_open(str(w_path), framework="pt") as f:
            raw = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise InputError(f"{w_path}: not a readable safetensors file ({str(e).splitlines()[0]})")
    sd: dict[str, torch.Tensor] = {}
    bad = []
    for k, t in raw.items():
        name = peft_to_toy_key(k)
        if name is None:
            bad.append(k)
        else:
            sd[name] = t
    if bad:
        hint = (
            " (lm_head is the tied embedding: toy never adapts it)"
            if any("lm_head" in k for k in bad)
            else ""
        )
        raise InputError(
            f"{w_path}: {len(bad)} keys are not LoRA A/B tensors of a llama body, first: "
            f"{', '.join(sorted(bad)[:3])}{hint}"
        )
    if not sd:
        raise InputError(f"{w_path}: no tensors")
    shape_problems = []
    modules = sorted({k.rpartition(".")[0] for k in sd})
    for m in modules:
        a, b = sd.get(m + ".lora_A"), sd.get(m + ".lora_B")
        if a is None or b is None:
            shape_problems.append(f"{m} lacks lora_{'A' if a is None else 'B'}")
        elif a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            shape_problems.append(
                f"{m}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)} do not match r={r}"
            )
    if shape_problems:
        raise InputError(f"{w_path}: " + "; ".join(shape_problems[:3]))
    return sd, config
