"""What the adapter recipes (lora, dpo, orpo) share; not a recipe itself. Each trains a
LoRA adapter on a frozen base read as the user has it (a GGUF file, a transformers or MLX
directory): the base resolved and loaded, the adapters applied, the flags they all take
(with their checks), the --output policy, the final adapter saved (PEFT in final/, and
--output's copy), the data files (--data FILE|DIR, --val-data), the chat template for the
data, and the chat data stream. No recipe imports another; they import this.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from toy.data.chat import (
    FORMATS,
    ChatBatches,
    ConversationError,
    count_reasons,
    encode_all,
    encode_example,
    read_chat_jsonl,
    resolve_chat_template,
)
from toy.errors import InputError, UsageError
from toy.formats.base import Base
from toy.formats.base_readers import held_as, read_base
from toy.formats.checkpoint import atomic_dir
from toy.formats.hf_dir import base_fingerprint
from toy.formats.mlx_adapter import save_mlx_adapter
from toy.formats.peft import save_peft_adapter
from toy.lora import VALID_TARGETS, apply_lora, lora_state_dict
from toy.models.quant import count_params, resident_bytes
from toy.models.quant_types import BASE_DTYPES
from toy.recipes.lm import fingerprint
from toy.runs import Project, plural
from toy.train import dist
from toy.train.config import RunConfig
from toy.train.memory import available_memory

DEFAULT_MODEL = "data/smollm2-135m.gguf"
GET_MODEL = (
    "get it with `toy fetch smollm2`, or pass --model FILE.gguf or a transformers or MLX "
    "model directory"
)
CHAT_BUCKET = 64  # --compile: chat batch lengths are padded up to a multiple of this

# The adapter recipes' defaults for their own flags and the general flags whose default
# differs for them. targets None: the family's default (q_proj,v_proj; Phi-3's fused
# qkv_proj); base_dtype None: auto (base_dtype() below).
ADAPTER_FLAGS = dict(
    model=None,
    data=None,
    val_data=None,
    rank=8,
    alpha=16.0,
    dropout=0.0,
    targets=None,
    epochs=None,
    output=None,
    strict=False,
    base_dtype=None,
    chat_template=None,
    lr=2e-4,
    min_lr=2e-5,
    seq_len=512,
    batch_size=4,
    warmup=10,
    weight_decay=0.0,
)


def add_adapter_arguments(g, data_help: str) -> None:
    """The flags every adapter recipe takes (the base, the adapter's shape, --output, the
    data files); `data_help`: what its --data holds."""
    g.add_argument(
        "--model",
        "--model-path",
        dest="model",
        help="base model: a GGUF file, or a transformers or MLX "
        f"model directory (--model-path: mlx-lm's name) (default {DEFAULT_MODEL} in the project)",
    )
    g.add_argument("--data", help=data_help)
    g.add_argument(
        "--val-data", help="validation JSONL, in --data's format (default: 5%% of --data held out)"
    )
    g.add_argument("--rank", type=int, help="LoRA rank r (default 8)")
    g.add_argument(
        "--alpha", type=float, help="LoRA alpha; the update is scaled by alpha / r (default 16)"
    )
    g.add_argument("--dropout", type=float, help="dropout on the LoRA input (default 0)")
    g.add_argument(
        "--targets",
        help="comma-separated projections to adapt, from "
        f"{','.join(VALID_TARGETS)} (default q_proj,v_proj; qkv_proj for phi3)",
    )
    g.add_argument(
        "--base-dtype",
        choices=BASE_DTYPES,
        help="how the frozen base is held: quantized (the GGUF's own blocks, memory-mapped, "
        "dequantized per layer in forward and backward: the least memory), bfloat16 or float32 "
        "(dequantized once at load) (default bfloat16 on cuda, and on a cpu training in bf16 "
        "where the copy takes at most 1 GB and a quarter of the free memory; quantized elsewhere)",
    )
    g.add_argument(
        "--chat-template",
        metavar="FILE.jinja",
        help="chat template for --data (default: the GGUF's "
        "own; for a file without one, toy's built-in template of its family: Gemma turns, ChatML)",
    )
    g.add_argument(
        "--output",
        help="also copy the final adapter directory (PEFT) to PATH, which must be new or a "
        "directory of toy's adapter files (it is replaced whole; anything else exits 2 before "
        "training); "
        "PATH ending in .safetensors: the adapter for mlx-lm there, its adapter_config.json beside "
        "it, "
        "as mlx-lm's trainer writes them (default: only RUN_DIR/final)",
    )
    g.add_argument(
        "--strict",
        action="store_true",
        default=None,
        help="an invalid data line is fatal (default: warn, skip, count)",
    )
    g.add_argument(
        "--max-seq-len",
        dest="seq_len",
        type=int,
        help="alias of --seq-len (default 512 for the adapter recipes)",
    )


def resolve_model(cfg: RunConfig, project: Project) -> Path:
    if cfg.model:
        p = Path(cfg.model)
        if not p.exists():
            raise InputError(f"--model {p} not found; {GET_MODEL}")
        return p
    root = project.root or Path.cwd()
    p = root / DEFAULT_MODEL
    if not p.is_file():
        raise InputError(f"no --model given and {p} is missing; {GET_MODEL}")
    return p


# Under bf16 autocast on a cpu with bf16 units, a base held as bfloat16 skips dequantizing
# its blocks at every use (forward and backward) for the same losses: the blocks are
# dequantized straight to bf16 either way (docs/performance.md). It costs the copy's memory
# (SmolLM2-135M: 0.27 GB against 0.10 GB of Q4_1 blocks), so auto takes it for a base whose
# copy is at most BF16_BASE_MAX and BF16_FIT of the available memory; larger bases keep
# their blocks, the least memory (a 1B Q4_0 base trains in ~1.6 GB that way).
BF16_BASE_MAX = 10**9
BF16_FIT = 0.25


def base_dtype(cfg: RunConfig, bf16_bytes: int | None = None) -> tuple[str, str]:
    """How the frozen base is held, and why where auto chose: --base-dtype as given;
    bfloat16 on cuda; on a cpu under bf16 autocast (cfg.precision, resolved), bfloat16
    where the copy (`bf16_bytes`) is small enough (above), else the quantized blocks."""
    if cfg.base_dtype:
        return cfg.base_dtype, ""
    if cfg.device == "cuda":
        return "bfloat16", ""
    if cfg.device != "cpu" or cfg.precision != "bf16" or bf16_bytes is None:
        return "quantized", ""
    avail = available_memory()
    size = f"{bf16_bytes / 1e9:.2f} GB"
    if bf16_bytes > BF16_BASE_MAX:
        return "quantized", (
            f"--base-dtype auto: quantized, the least memory (a bfloat16 copy would take {size}; "
            "--base-dtype bfloat16 trains faster under bf16 where memory allows)"
        )
    if avail is not None and bf16_bytes > BF16_FIT * avail:
        return "quantized", (
            f"--base-dtype auto: quantized, a bfloat16 copy ({size}) would take over "
            f"{BF16_FIT:.0%} of the available memory ({avail / 1e9:.1f} GB)"
        )
    return "bfloat16", (
        f"--base-dtype auto: bfloat16 under bf16 autocast, faster than dequantizing the blocks "
        f"at every use (the copy takes {size}; --base-dtype quantized holds the least memory)"
    )


def check_adapter_opts(cfg: RunConfig) -> list[str]:
    """Every problem with the flags all adapter recipes share (the base, --seq-len,
    --base-dtype, --output, --val-data, --data's path when given)."""
    p = []
    if cfg.base_dtype is not None and cfg.base_dtype not in BASE_DTYPES:
        p.append(f"--base-dtype {cfg.base_dtype!r} is unknown; valid: {', '.join(BASE_DTYPES)}")
    if cfg.val_data and not cfg.data:
        p.append("--val-data needs --data (use --val-corpus with --corpus)")
    if cfg.seq_len is None or cfg.seq_len < 2:
        p.append(f"--seq-len must be >= 2, got {cfg.seq_len}")
    if cfg.model and not Path(cfg.model).exists():
        p.append(f"--model {cfg.model} not found; {GET_MODEL}")
    if cfg.data and not Path(cfg.data).exists():
        p.append(
            f"--data {cfg.data} not found; give a JSONL file (conversations, prompt/completion "
            "pairs or text) "
            "or a directory holding train.jsonl"
        )
    if cfg.val_data and not Path(cfg.val_data).is_file():
        p.append(f"--val-data {cfg.val_data} not found; give a JSONL file")
    if cfg.output:
        p += [why] if (why := output_problem(cfg.output)) else []
    return p


# What toy writes into --output: a directory holding only these may be replaced.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "README.md")


def mlx_output_problem(output: str) -> str | None:
    """--output FILE.safetensors (mlx-lm's trainer's own flag): the mlx-lm adapter goes
    there with adapter_config.json beside it. Neither may overwrite anything but an
    earlier mlx-lm adapter's files."""
    path = Path(output)
    cfg = path.parent / "adapter_config.json"
    fix = "give a new path, or the adapters.safetensors of an earlier mlx-lm adapter"
    if path.is_symlink() or (path.exists() and not path.is_file()):
        return f"--output {output} is not a plain file; {fix}"
    if cfg.exists():
        try:
            ok = "lora_parameters" in json.loads(cfg.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError):
            ok = False
        if not ok:
            return (
                f"--output {output}: {cfg} exists and is not an mlx-lm adapter config, which this "
                f"would replace; {fix}"
            )
    elif path.exists():
        return f"--output {output} exists beside no mlx-lm adapter_config.json; {fix}"
    return None


def output_problem(output: str) -> str | None:
    """Why --output PATH may not be written, or None. The copy replaces PATH whole, so
    PATH must be new, or a directory of toy's own adapter files (as `toy export --format
    peft` requires of its --out); never the working directory or one that holds it. A
    PATH ending in .safetensors is mlx-lm's form (mlx_output_problem)."""
    if output.endswith(".safetensors"):
        return mlx_output_problem(output)
    path = Path(output)
    fix = "give a new path, or a directory holding only a toy adapter"
    where, cwd = path.resolve(), Path.cwd().resolve()
    if where == cwd or where in cwd.parents:
        return (
            f"--output {output} is the working directory or holds it, and the copy replaces its "
            f"path whole; {fix}"
        )
    if path.is_symlink():
        return f"--output {output} is a symbolic link; {fix}"
    if not path.exists():
        return None
    if not path.is_dir():
        return f"--output {output} exists and is not a directory; {fix}"
    names = sorted(p.name for p in path.iterdir())
    others = [n for n in names if n not in ADAPTER_FILES]
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        return f"--output {output} holds files that are not a toy adapter's ({shown}); {fix}"
    if names and "adapter_config.json" not in names:
        return (
            f"--output {output} holds no adapter_config.json, so it is not a toy adapter "
            f"directory; {fix}"
        )
    return None


@dataclass
class Adapted:
    """A frozen base with LoRA adapters applied: what an adapter recipe builds its job on.
    `config` is the run.json "job" part every adapter recipe records (the recipe adds its
    data's); `notes` the lines the run prints before its first step."""

    model_path: Path  # absolute: run.json and `toy infer --run` find it from any folder
    base: Base  # its state_dict dropped: the model holds the only copy
    model: nn.Module
    targets: list[str]
    dtype: str
    seq_len: int
    wrapped: list[str]
    config: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def derived(self) -> dict:
        return {
            "seq_len": self.seq_len,
            "targets": ",".join(self.targets),
            "base_dtype": self.dtype,
        }

    def sizes(self) -> tuple[int, str]:
        """(the model's parameter count, the line saying how many of them train)."""
        n_params = count_params(self.model)
        n_train = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return n_params, (
            f"adapters on {plural(len(self.wrapped), 'module')}: {n_train:,} trainable of "
            f"{plural(n_params, 'parameter')}"
        )


def load_adapted(cfg: RunConfig, project: Project, recipe: str) -> Adapted:
    """The base --model names (or the project's default), held as --base-dtype asks, with
    adapters on --targets; --seq-len lowered to the base's context."""
    if cfg.output and (why := output_problem(cfg.output)):  # a resumed run skips the checks
        raise UsageError(why)
    # Absolute: run.json, adapter_config.json and `toy infer --run` / `toy export` find the
    # base from any folder (model_sha256 below notices a file changed since).
    model_path = resolve_model(cfg, project).resolve()
    dtype, why = base_dtype(cfg)
    base = read_base(model_path, dtype)
    blocks = any(t not in ("F32", "F16", "BF16") for t in base.tensor_types)
    if blocks and cfg.base_dtype is None and dtype == "quantized":  # auto may hold it in bf16
        dtype, why = base_dtype(cfg, base.float32_bytes() // 2)
        base = held_as(base, model_path, dtype)  # dequantized from what was read, not re-read
    targets = cfg.target_list or base.default_targets.split(",")
    # The adapters' dropout draws from torch's generator: seeded here so --seed decides it
    # (the loop then gives each process its own stream from (seed, rank)).
    torch.manual_seed(cfg.seed)
    model = base.build_model()
    del base.state_dict  # the model holds the only copy of the base
    # Validation of rank/alpha/targets happens here, before any data work.
    wrapped = apply_lora(
        model, targets, int(cfg.rank), float(cfg.alpha), float(cfg.dropout), int(cfg.seed)
    )
    seq_len = int(cfg.seq_len)
    notes: list[str] = list(base.notes) + ([why] if why else [])
    resident = resident_bytes(model)
    held = f"held {dtype}"
    if dtype == "quantized" and not blocks:
        # --base-dtype quantized on a float base keeps its own dtype: nothing is quantized.
        own = [t.lower() for t in base.tensor_types if t in ("F16", "BF16")] or ["float32"]
        held = f"kept in {', '.join(own)} (its own dtype)"
    notes.append(
        f"base {model_path.name}: {base.arch}, {held} ({resident / 1e9:.2f} GB resident"
        + (", memory-mapped blocks)" if dtype == "quantized" else ")")
    )
    if seq_len > base.config.max_seq_len:
        notes.append(
            f"--seq-len {seq_len} lowered to the model's context {base.config.max_seq_len}"
        )
        seq_len = base.config.max_seq_len
    config = {
        "recipe": recipe,
        "arch": base.arch,
        "model": str(model_path),
        "model_sha256": base_fingerprint(model_path),
        "rank": int(cfg.rank),
        "alpha": float(cfg.alpha),
        "targets": targets,
        "seq_len": seq_len,
        "base_dtype": dtype,
        "base_resident_bytes": resident,
    }
    return Adapted(model_path, base, model, targets, dtype, seq_len, wrapped, config, notes)


def adapter_saver(cfg: RunConfig, a: Adapted) -> Callable[[Path], None]:
    """The job's save_final: the PEFT adapter and the tokenizer in final/ (what `toy infer
    --run` and `toy export` read), then --output's copy."""
    model, tok = a.model, a.base.tokenizer
    n_layers, mlx_prefix = a.base.config.n_layer, a.base.mlx_prefix

    def save_final(out: Path) -> None:
        save_peft_adapter(
            out,
            lora_state_dict(model),
            rank=int(cfg.rank),
            alpha=float(cfg.alpha),
            dropout=float(cfg.dropout),
            targets=a.targets,
            base_model_name_or_path=str(a.model_path),
        )
        tok.save(str(out / "tokenizer.json"))
        if cfg.output:
            # Checked again now: PATH may have changed since the start, or be this very
            # run's directory (its name was not known then). final/ is written already.
            why = output_problem(cfg.output)
            if why:
                raise InputError(f"{why}; the adapter is in {out}, not copied")
            dest = Path(os.path.abspath(cfg.output))
            if cfg.output.endswith(
                ".safetensors"
            ):  # mlx-lm's trainer's --output: its adapter, there
                save_mlx_adapter(
                    dest.parent,
                    lora_state_dict(model),
                    int(cfg.rank),
                    float(cfg.alpha),
                    float(cfg.dropout),
                    n_layers=n_layers,
                    weights_name=dest.name,
                    prefix=mlx_prefix,
                )
            elif dest != out.resolve():
                with atomic_dir(dest) as tmp:
                    for name in ADAPTER_FILES:
                        if (out / name).is_file():
                            shutil.copyfile(out / name, tmp / name)

    return save_final


# ---------------------------------------------------------------- data files


def data_files(cfg: RunConfig) -> tuple[Path, Path | None]:
    """--data (a file, or a directory holding train.jsonl and, as the held-out set,
    valid.jsonl: mlx-lm's layout) and --val-data."""
    data = Path(cfg.data)
    val = Path(cfg.val_data) if cfg.val_data else None
    if data.is_dir():
        if not (data / "train.jsonl").is_file():
            raise InputError(
                f"--data {data}: a data directory holds train.jsonl (and valid.jsonl for "
                "validation); "
                "it has no train.jsonl"
            )
        if val is None and (data / "valid.jsonl").is_file():
            val = data / "valid.jsonl"
        data = data / "train.jsonl"
    return data, val


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def data_template(cfg: RunConfig, base: Base, kind: str, notes: list[str]) -> str | None:
    """The chat template the data goes through: a conversation ("messages") needs one
    (--chat-template, the base's own, or toy's built-in of its family); a prompt with its
    answers ("prompt") uses it where the model has one, else the texts are joined (a note
    says so); plain text needs none."""
    model = base.path or cfg.model or DEFAULT_MODEL
    if kind == "messages" or cfg.chat_template:
        template, note = resolve_chat_template(
            base.chat_template, base.vocab_tokens, base.chat_format, cfg.chat_template, str(model)
        )
        notes += [note] if note else []
        return template
    if kind == "prompt":
        try:
            template, note = resolve_chat_template(
                base.chat_template, base.vocab_tokens, base.chat_format, None, str(model)
            )
            notes += [note] if note else []
            return template
        except InputError:
            notes.append(
                f"{model} has no chat template: each prompt and completion are joined as plain text"
            )
    return None


def template_source(cfg: RunConfig, base: Base) -> str:
    """Where the chat template came from, for the messages about it."""
    if cfg.chat_template:
        return f"--chat-template {cfg.chat_template}"
    return str(base.path or cfg.model or DEFAULT_MODEL)


def pad_id(base: Base) -> int:
    special = base.special
    return special.pad if special.pad is not None else (special.eos or 0)


def check_vocab(ids: list[int], tok, base: Base) -> None:
    """A token the tokenizer makes beyond the model's embedding rows (an added token the
    file's tensors lack) cannot be trained on: that one example is skipped."""
    vocab = base.config.vocab_size
    if ids and max(ids) >= vocab:
        bad = max(ids)
        raise ConversationError(
            f"token {tok.id_to_token(bad)!r} (id {bad}) is beyond the model's {vocab} "
            "embedding rows"
        )


def hold_out(samples: list, seed: int, notes: list[str], what: str) -> tuple[list, list]:
    """(train, validation): a deterministic 5% (at least one) held out of --data when it
    has 20 or more samples; none otherwise."""
    n_val = max(1, len(samples) // 20) if len(samples) >= 20 else 0
    perm = np.random.default_rng([seed, 7]).permutation(len(samples))
    val_idx = set(perm[:n_val].tolist())
    val = [x for i, x in enumerate(samples) if i in val_idx]
    train = [x for i, x in enumerate(samples) if i not in val_idx]
    if n_val:
        notes.append(
            f"validation: {plural(n_val, what)} held out of --data (give --val-data or a data "
            "directory's valid.jsonl to choose)"
        )
    return train, val


def chat_stream(cfg: RunConfig, tok, base, seq_len, notes):
    """The chat data stream (--data FILE|DIR of conversations, prompt/completion pairs or
    text): (micro_batch, eval batches, number of batches, run.json info)."""
    data_path, val_path = data_files(cfg)
    strict = bool(cfg.strict)

    def read(path) -> list:
        chat = read_chat_jsonl(path, strict=strict, warn=warn)
        if chat.skipped:
            notes.append(
                f"{path}: skipped {plural(chat.n_skipped, 'invalid line')} "
                f"({count_reasons(chat.skipped)})"
            )
        return chat

    train = read(data_path)
    val_file = read(val_path) if val_path is not None else None
    if val_file is not None and val_file.kind != train.kind:
        raise InputError(
            f"{val_path}: {FORMATS[val_file.kind]}s, but {data_path} holds {FORMATS[train.kind]}s; "
            "give both in one format"
        )
    template = data_template(cfg, base, train.kind, notes)
    source = template_source(cfg, base)
    special = base.special
    bos, eos = base.token(special.bos), base.token(special.eos)
    pad = pad_id(base)
    cut: list[tuple[int, int]] = []  # (strings cut to what a window can use, chars kept) a line

    def encode(ex):
        ids, mask = encode_example(tok, template, ex, seq_len + 1, bos, eos, special.eos, cut)
        check_vocab(ids, tok, base)
        return ids, mask

    notes.append(
        f"{data_path}: {FORMATS[train.kind]} a line"
        + (
            ""
            if train.kind == "messages"
            else "; loss on the completion"
            if train.kind == "prompt"
            else "; loss on every token"
        )
    )
    samples, dropped, failed = encode_all(
        list(zip(train.lines, train.examples)), data_path, source, encode, strict, warn
    )
    if failed:
        notes.append(
            f"{data_path}: skipped {plural(failed, 'conversation')} the chat template cannot render"
        )
    if dropped:
        notes.append(f"skipped {plural(dropped, 'example')} whose prompt fills --seq-len {seq_len}")
    if cut:
        notes.append(
            f"{data_path}: cut {plural(sum(n for n, _ in cut), 'string')} in "
            f"{plural(len(cut), 'line')} to their first {cut[0][1]:,} characters before "
            f"tokenizing (no more can reach --seq-len {seq_len})"
        )
    if not samples:
        raise InputError(
            f"{data_path}: no example has a supervised token within --seq-len {seq_len}"
        )
    if val_file is not None:
        val_samples, _, _ = encode_all(
            list(zip(val_file.lines, val_file.examples)), val_path, source, encode, strict, warn
        )
    else:
        samples, val_samples = hold_out(samples, cfg.seed, notes, "example")
    # A step holds about what --batch-size packed rows of --seq-len would: conversations
    # of similar length, right-padded to the longest of their batch (length_batches).
    d = dist.info()
    bucket = CHAT_BUCKET if cfg.compile else 1
    batches = ChatBatches(
        samples,
        int(cfg.batch_size) * (seq_len + 1),
        int(cfg.seed),
        pad,
        seq_len,
        bucket,
        world=d.world,
        rank=d.rank,
    )
    val = (
        ChatBatches(val_samples, batches.budget, int(cfg.seed), pad, seq_len, bucket)
        if val_samples
        else None
    )
    evals = val.eval_batches(cfg.eval_batches) if val is not None else []
    if val is not None and len(val) > cfg.eval_batches:
        notes.append(
            f"validation: {cfg.eval_batches} of {len(val)} held-out batches per evaluation, "
            "spread over their lengths (--eval-batches)"
        )
    n, budget = len(batches), batches.budget
    sup = sum(int(sum(m)) for _, m in samples)
    info = {
        "data": str(cfg.data),
        "data_sha256": fingerprint(data_path),
        "conversations": len(samples),
        "batches": n,
        "supervised_tokens": sup,
    }
    if train.kind != "messages":
        info["data_format"] = train.kind
    if val_path is not None and not cfg.val_data:
        info["val_data"], info["val_data_sha256"] = str(val_path), fingerprint(val_path)
    notes.append(
        f"{plural(len(samples), 'example')} in "
        f"{plural(n, 'length-grouped batch', 'length-grouped batches')} "
        f"of up to {budget:,} tokens; {sup:,} supervised tokens"
    )
    return batches.batch, evals, n, info
