"""mlx-lm LoRA adapters: `adapters.safetensors` + `adapter_config.json`, as
`mlx_lm.load(model, adapter_path=DIR)`, `mlx_lm.generate --adapter-path`, `mlx_lm.chat` and
`mlx_lm.fuse` read them (mlx_lm/tuner/utils.py `load_adapters`).

    toy:  layers.3.self_attn.q_proj.lora_A  (r, in)    lora_B  (out, r)    y += B A x * alpha / r
    MLX:  model.layers.3.self_attn.q_proj.lora_a  (in, r)   lora_b  (r, out)   y += scale * x a b

so `lora_a = A^T`, `lora_b = B^T` and `scale = alpha / r` (mlx-lm applies `scale` as it is).
adapter_config.json needs `num_layers` (mlx-lm adapts the LAST num_layers blocks: an
adapter of toy's covers every block, or the last N with `--num-layers N`) and
`lora_parameters` {rank, scale, dropout, keys}, `keys` naming the adapted modules relative
to a block ("self_attn.q_proj").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from toy.errors import InputError, UsageError
from toy.runs import write_file_atomic

WEIGHTS_NAME = "adapters.safetensors"
CONFIG_NAME = "adapter_config.json"
# mlx-lm's models hold the body under `model` (a multimodal Gemma 3 directory's under
# `language_model.model`: its Base's mlx_prefix).
PREFIX = "model."


def _split(name: str) -> tuple[int, str]:
    """'layers.3.self_attn.q_proj' -> (3, 'self_attn.q_proj')."""
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != "layers" or not parts[1].isdigit():
        raise UsageError(
            f"cannot write an mlx-lm adapter for {name!r}: mlx-lm adapts modules inside the blocks"
        )
    return int(parts[1]), ".".join(parts[2:])


def save_mlx_adapter(
    out: Path,
    lora_sd: dict[str, torch.Tensor],
    rank: int,
    alpha: float,
    dropout: float,
    n_layers: int,
    prefix: str = PREFIX,
    weights_name: str = WEIGHTS_NAME,
    model: str | None = None,
) -> Path:
    """Write `weights_name` and adapter_config.json into directory `out` (made if needed)
    from toy-named adapter tensors (`<module>.lora_A` (r, in), `.lora_B` (out, r)).
    `model`: the base, recorded under mlx_lm.lora's own key (mlx-lm's loader does not
    read it; `toy list` takes the adapter's architecture from it). Returns the weights
    file."""
    tensors, keys, layers = {}, set(), set()
    for name, t in sorted(lora_sd.items()):
        module, _, kind = name.rpartition(".")
        layer, key = _split(module)
        layers.add(layer)
        keys.add(key)
        mlx = {"lora_A": "lora_a", "lora_B": "lora_b"}.get(kind)
        if mlx is None:
            raise UsageError(f"not a toy LoRA tensor (want <module>.lora_A / .lora_B): {name!r}")
        tensors[f"{prefix}{module}.{mlx}"] = t.detach().float().T.contiguous().cpu()
    if not tensors:
        raise UsageError("no adapter tensors to write")
    if layers != set(range(n_layers - len(layers), n_layers)):
        raise UsageError(
            f"the adapter covers blocks {sorted(layers)[:8]} of the model's {n_layers}: mlx-lm "
            "adapts the last num_layers blocks, a run ending at the last; export it as PEFT "
            "or gguf-lora instead"
        )
    config: dict[str, Any] = {
        "fine_tune_type": "lora",
        "num_layers": len(layers),
        "lora_parameters": {
            "rank": int(rank),
            "scale": float(alpha) / int(rank),
            "dropout": float(dropout),
            "keys": sorted(keys),
        },
    }
    if model:
        config["model"] = model
    out.mkdir(parents=True, exist_ok=True)
    weights = out / weights_name
    # Weights first, config last: a directory with a config is a complete adapter.
    write_file_atomic(weights, lambda p: save_file(tensors, str(p), metadata={"format": "mlx"}))
    write_file_atomic(
        out / CONFIG_NAME, lambda p: Path(p).write_text(json.dumps(config, indent=2) + "\n")
    )
    return weights


def load_mlx_adapter(
    d: Path, prefix: str | None = None, weights_name: str = WEIGHTS_NAME
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An mlx-lm adapter (directory `d`: `weights_name` + adapter_config.json) as toy-named
    tensors and its config (rank, alpha = scale * rank): save_mlx_adapter inverted. `prefix`
    None: the one its tensors carry (what precedes `layers.`: `model.`, or a multimodal
    Gemma 3's `language_model.model.`), the same for all of them. Checked as PEFT adapters
    are: LoRA only, every module with both matrices of the config's rank."""
    cfg_path, w_path = d / CONFIG_NAME, d / weights_name
    try:
        config = json.loads(cfg_path.read_text())
        params = config["lora_parameters"]
        rank, scale = int(params["rank"]), float(params["scale"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{cfg_path}: not an mlx-lm LoRA adapter config ({e})")
    tune = config.get("fine_tune_type", "lora")
    if tune != "lora" or rank < 1:
        what = f"rank {rank}" if tune == "lora" else f"fine_tune_type {tune!r}"
        raise InputError(f"{cfg_path}: {what}; toy reads LoRA adapters of rank >= 1 only")
    try:
        with safe_open(str(w_path), framework="pt") as f:
            raw = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise InputError(f"{w_path}: not a readable safetensors file ({str(e).splitlines()[0]})")
    if not raw:
        raise InputError(f"{w_path}: no tensors")
    if prefix is None:
        first = min(raw)
        prefix = first[: first.find("layers.")] if "layers." in first else PREFIX
    sd = {}
    for k, t in raw.items():
        if not k.startswith(prefix) or not k.endswith((".lora_a", ".lora_b")):
            raise InputError(f"{w_path}: {k!r} is not an mlx-lm LoRA tensor under {prefix!r}")
        module, _, kind = k[len(prefix) :].rpartition(".")
        sd[f"{module}.{'lora_A' if kind == 'lora_a' else 'lora_B'}"] = t.float().T.contiguous()
    # mlx-lm's a (in, r) and b (r, out), read back as A (r, in) and B (out, r).
    for m in sorted({k.rpartition(".")[0] for k in sd}):
        a, b = sd.get(m + ".lora_A"), sd.get(m + ".lora_B")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2:
            raise InputError(f"{w_path}: {prefix}{m} needs a 2-D lora_a and lora_b")
        if a.shape[0] != rank or b.shape[1] != rank:
            raise InputError(
                f"{w_path}: {prefix}{m}: lora_a {tuple(a.T.shape)}, lora_b {tuple(b.T.shape)} "
                f"do not match the rank {rank} of {cfg_path}"
            )
    return sd, {"r": rank, "lora_alpha": scale * rank, "num_layers": config.get("num_layers")}
