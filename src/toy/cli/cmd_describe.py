"""`toy describe FILE.gguf | DIR`: what a model holds, from its headers (nothing
dequantized): a GGUF's or a transformers / MLX directory's architecture, size, tensor
types, memory as a LoRA base and tokenizer, or a llama.cpp LoRA adapter's rank, alpha,
target tensors and base architecture, or a PEFT or mlx-lm adapter directory's (read as
infer and export read it), or a run directory's (what trained, its status and held-out
figure, what final/ holds, its exports), as infer and export take a run. A model toy
cannot load (or an adapter llama.cpp could not apply) is still described, then refused
(exit 2) with the reason."""

from __future__ import annotations

import json
from pathlib import Path

from toy.cli.args import human_size, plural
from toy.errors import InputError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "describe",
        help="show a model's (GGUF, transformers or MLX directory) architecture, size, "
        "tokenizer (or an adapter's rank, alpha, targets)",
        description=__doc__,
    )
    p.add_argument(
        "model",
        metavar="FILE.gguf|DIR",
        help="a GGUF model, a LoRA adapter GGUF, a transformers or MLX model directory, a "
        "PEFT or mlx-lm adapter directory, or a run directory",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _text(v) -> str:
    """A string read from the file, safe to print on one line."""
    from toy.models.family import shown

    return shown(v)


def _row(label: str, text: str) -> str:
    return f"{label:<14}{text}"


def _shape(arch: str, hp: dict) -> list[str]:
    return [
        _row(
            "architecture",
            f"{arch}: {hp['n_layer']} layers, width {hp['d_model']}, {hp['n_head']} heads / "
            f"{hp['n_kv_head']} kv heads (head {hp['head_dim']}), ffn {hp['d_ff']}",
        ),
        _row(
            "",
            f"context {hp['context_length']}, rope theta {hp['rope_theta']:g}, "
            f"norm eps {hp['norm_eps']:g}, "
            f"tied output: {'yes' if hp['tie_embeddings'] else 'no'}",
        ),
    ]


def run(args) -> int:
    from toy.formats.base_readers import base_kind, describe_base

    if Path(args.model).is_dir() and (Path(args.model) / "run.json").is_file():
        return _run_dir(args)
    if Path(args.model).is_dir() and (Path(args.model) / "adapter_config.json").is_file():
        return _adapter_dir(args)
    kind = base_kind(args.model)
    d = describe_base(args.model)
    if kind != "gguf":
        return _directory(args, d)
    if d.get("type") == "adapter":
        return _adapter(args)
    if args.json:
        print(json.dumps({"format": "toy/describe-v1", **d}))
        return _verdict(d)
    hp = d["hyperparameters"]
    tok = d["tokenizer"]
    lines = [f"{d['path']}  ({human_size(d['file_size'])}, GGUF v{d['gguf_version']})"]
    if d.get("name"):
        lines.append(_row("name", _text(d["name"])))
    if hp:
        lines += _shape(_text(d["arch"]), hp)
    else:
        lines.append(_row("architecture", _text(d["arch"])))
    lines.append(_row("parameters", f"{d['n_params']:,} in {plural(d['n_tensors'], 'tensor')}"))
    rb = d["resident_bytes"]
    lines.append(
        _row(
            "LoRA base",
            f"{human_size(rb['quantized'])} resident quantized (--base-dtype quantized), "
            f"{human_size(rb['bfloat16'])} bfloat16, {human_size(rb['float32'])} float32",
        )
    )
    lines.append(_row("tensor types", ", ".join(f"{k} x{v}" for k, v in d["tensor_types"].items())))
    lines.append(
        _row(
            "tokenizer",
            f"{_text(tok['model'])} (pre: {_text(tok['pre'])}), vocab {tok['vocab_size']:,}, "
            f"{plural(tok['n_merges'], 'merge')}",
        )
    )
    specials = ", ".join(
        f"{k}={v['token']!r} ({v['id']})" for k, v in tok["special_tokens"].items() if v
    )
    lines.append(_row("special", specials or "none"))
    lines.append(_row("chat template", "yes" if d["chat_template"] else "no"))
    print("\n".join(lines))  # print adds the final newline
    return _verdict(d)


def _directory(args, d: dict) -> int:
    if args.json:
        print(json.dumps({"format": "toy/describe-v1", **d}))
        return _verdict(d)
    what = {"mlx": "MLX directory", "transformers": "transformers directory"}[d["kind"]]
    lines = [
        f"{d['path']}  ({human_size(d['file_size'])} in "
        f"{plural(d['n_files'], 'weight file')}, {what})"
    ]
    hp = d["hyperparameters"]
    if hp:
        lines += _shape(f"{_text(d['arch'])} (toy's {d['family']})", hp)
        lines.append(_row("parameters", f"{d['n_params']:,} in {plural(d['n_tensors'], 'tensor')}"))
        rb = d["resident_bytes"]
        lines.append(
            _row(
                "LoRA base",
                f"{human_size(rb['quantized'])} resident as stored (--base-dtype quantized), "
                f"{human_size(rb['bfloat16'])} bfloat16, {human_size(rb['float32'])} float32",
            )
        )
        lines.append(
            _row("tensor types", ", ".join(f"{k} x{v}" for k, v in d["tensor_types"].items()))
        )
        tok = d["tokenizer"]
        specials = ", ".join(
            f"{k}={v['token']!r} ({v['id']})" for k, v in tok["special_tokens"].items() if v
        )
        lines.append(
            _row(
                "tokenizer",
                f"tokenizer.json, vocab {tok['vocab_size']:,}; {specials or 'no specials'}",
            )
        )
        lines.append(_row("chat template", "yes" if d["chat_template"] else "no"))
        lines += [_row("note", n) for n in d["notes"]]
    else:
        lines.append(_row("architecture", _text(d["arch"])))
    print("\n".join(lines))
    return _verdict(d)


def _adapter(args) -> int:
    from toy.formats.gguf_adapter import describe_adapter

    a = describe_adapter(Path(args.model))
    if args.json:
        print(json.dumps({"format": "toy/describe-v1", **a}))
        return _adapter_verdict(a)
    kind = "LoRA" if a["adapter_type"] in (None, "lora") else _text(a["adapter_type"])
    what = f"{kind} adapter for a {_text(a['arch'])} base"
    if a["rank"] is not None:
        ranks = a["ranks"]
        what += (
            f": rank {a['rank']}" if len(ranks) == 1 else f": ranks {', '.join(map(str, ranks))}"
        )
    if a["alpha"] is not None:
        what += f", alpha {a['alpha']:g}"
        if a["scale"] is not None and len(a["ranks"]) == 1:
            what += f" (update scaled by alpha/rank = {a['scale']:g})"
    lines = [f"{a['path']}  ({human_size(a['file_size'])}, GGUF v{a['gguf_version']})"]
    if a.get("name"):
        lines.append(_row("name", _text(a["name"])))
    lines.append(_row("adapter", what))
    targets = (
        ", ".join(f"{_text(k.removesuffix('.weight'))} x{n}" for k, n in a["targets"].items())
        or "none"
    )
    where = f" ({plural(a['n_matrices'], 'matrix', 'matrices')}"
    where += f" in {plural(a['n_layers'], 'layer')})" if a["n_layers"] else ")"
    lines.append(_row("targets", targets + where))
    lines.append(_row("parameters", f"{a['n_params']:,} in {plural(a['n_tensors'], 'tensor')}"))
    lines.append(
        _row("tensor types", ", ".join(f"{k} x{v}" for k, v in a["tensor_types"].items()) or "none")
    )
    for note in a["notes"]:
        lines.append(_row("note", note))
    lines.append(
        _row(
            "use",
            f"on its {_text(a['arch'])} base in llama.cpp: "
            f"llama-cli -m BASE.gguf --lora {args.model}",
        )
    )
    print("\n".join(lines))
    return _adapter_verdict(a)


def _adapter_dir(args) -> int:
    """A PEFT (adapter_model.safetensors) or mlx-lm (adapters.safetensors) adapter directory:
    read and checked as infer and export read it, then described."""
    from collections import Counter

    from toy.formats import mlx_adapter, peft

    d = Path(args.model)
    if (d / mlx_adapter.WEIGHTS_NAME).is_file():
        first = _first_key(d / mlx_adapter.WEIGHTS_NAME)
        prefix = first[: first.find("layers.")] if "layers." in first else mlx_adapter.PREFIX
        sd, config = mlx_adapter.load_mlx_adapter(d, prefix)
        kind, base, use = "mlx-lm", None, f"mlx_lm.generate --model MLX_BASE --adapter-path {d}"
    else:
        sd, config = peft.load_peft_adapter(d)
        kind, base = "PEFT", config.get("base_model_name_or_path")
        use = f"toy infer --model {base or 'BASE'} --adapter {d}"
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    modules = sorted({k.rsplit(".", 1)[0] for k in sd})
    kinds = Counter(m.split(".", 2)[2] if m.startswith("layers.") else m for m in modules)
    layers = {m.split(".")[1] for m in modules if m.startswith("layers.")}
    a = {
        "path": str(d),
        "type": "adapter",
        "adapter_format": kind,
        "rank": rank,
        "alpha": alpha,
        "scale": alpha / rank,
        "base": base,
        "targets": dict(sorted(kinds.items())),
        "n_matrices": len(modules),
        "n_layers": len(layers),
        "n_params": sum(t.numel() for t in sd.values()),
    }
    if args.json:
        print(json.dumps({"format": "toy/describe-v1", **a}))
        return 0
    size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
    lines = [f"{d}  ({human_size(size)}, {kind} adapter directory)"]
    lines.append(
        _row("adapter", f"LoRA: rank {rank}, alpha {alpha:g} (update scaled by {alpha / rank:g})")
    )
    targets = ", ".join(f"{k} x{n}" for k, n in a["targets"].items())
    lines.append(
        _row(
            "targets",
            f"{targets} ({plural(len(modules), 'matrix', 'matrices')} in "
            f"{plural(len(layers), 'layer')})",
        )
    )
    lines.append(_row("parameters", f"{a['n_params']:,} in {plural(len(sd), 'tensor')}"))
    if base:
        lines.append(_row("base", _text(base)))
    lines.append(_row("use", use))
    print("\n".join(lines))
    return 0


def _first_key(path: Path) -> str:
    """The first tensor name of a safetensors file ("" when unreadable: the loader says why)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return next(iter(f.keys()), "")
    except (SafetensorError, OSError):
        return ""


def _adapter_verdict(a: dict) -> int:
    if a["problems"]:
        raise InputError(
            f"{a['path']}: {'; '.join(a['problems'][:3])}; llama.cpp cannot apply it as it is "
            "(re-export it with `toy export RUN --format gguf-lora`)"
        )
    return 0


def _verdict(d: dict) -> int:
    # What is in the file is shown either way; a file toy cannot load must not exit 0.
    if d["load_error"]:
        raise InputError(
            f"{d['load_error']} (toy infer and train refuse it; "
            "re-convert or re-download the model)"
        )
    return 0


def _run_dir(args) -> int:
    """A run directory: its recipe, shape, steps and status (`toy runs`' row), its base,
    what final/ holds and the files under export/, each export's step."""
    from toy.cli.cmd_runs import summarize
    from toy.formats.checkpoint import read_json

    d = Path(args.model)
    row = summarize(d)
    info = read_json(d / "run.json")
    job = info.get("job") if isinstance(info.get("job"), dict) else {}
    final = d / "final"
    if (final / "adapter_config.json").is_file():
        holds = "a LoRA adapter (PEFT)"
    elif (final / "config.json").is_file():
        holds = "a model (config.json, model.safetensors)"
    else:
        holds = None
    exports = sorted(p.name for p in (d / "export").iterdir()) if (d / "export").is_dir() else []
    out = {
        "path": str(d),
        "type": "run",
        "recipe": row["recipe"],
        "arch": row["arch"],
        "params": row["params"],
        "steps": row["steps"],
        "target_steps": row["target_steps"],
        "status": row["status"],
        "base": next(
            (job[k] for k in ("model", "teacher", "donor") if isinstance(job.get(k), str)), None
        ),
        "held_out": row["held_out"],
        "held_out_step": row["held_out_step"],
        "final": holds,
        "exports": exports,
    }
    if args.json:
        print(json.dumps({"format": "toy/describe-v1", **out}))
        return 0
    steps = f"{row['steps'] or 0} of {row['target_steps']}" if row["target_steps"] else "-"
    lines = [f"{d}  (a toy run)", _row("recipe", f"{row['recipe']}, {row['arch']}")]
    if row["params"]:
        lines.append(_row("parameters", f"{row['params']:,}"))
    lines.append(_row("steps", f"{steps}, {row['status']}"))
    if out["base"]:
        lines.append(_row("base", str(out["base"])))
    if row["held_out"]:
        ((k, v),) = row["held_out"].items()
        k = "val loss" if k == "val_loss" else k
        lines.append(_row("held-out", f"{k} {v:.4g} at step {row['held_out_step']}"))
    lines.append(_row("final/", holds or "none yet (resume the run to finish it)"))
    if exports:
        lines.append(_row("export/", ", ".join(exports)))
    print("\n".join(lines))
    return 0
