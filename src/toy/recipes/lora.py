"""LoRA fine-tune of a frozen GGUF base: chat JSONL (loss on every assistant turn) or a
token stream. Only the adapters train; the output is a PEFT adapter directory."""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from toy import tokenizer as toktools
from toy.data.chat import (GIVE_UP_AFTER, SHOW_SKIPPED, ConversationError, count_reasons, encode_chat,
                            length_batches, pad_batch, read_chat_jsonl, resolve_chat_template)
from toy.data.tokens import Windows
from toy.errors import InputError
from toy.formats.gguf import read_gguf
from toy.formats.peft import save_peft_adapter
from toy.lora import VALID_TARGETS, apply_lora, lora_state_dict
from toy.models.quant import count_params, resident_bytes
from toy.runs import Project, plural
from toy.train import dist
from toy.train.config import RunConfig
from toy.train.job import IGNORE, Built, Job
from toy.train.lm import fingerprint, open_token_data, val_windows

DEFAULT_MODEL = "data/smollm2-135m.gguf"
GET_MODEL = "get it with `toy fetch smollm2`, or pass --model FILE.gguf"

# Recipe flags and the general flags whose default differs for LoRA. targets None: the
# family's default (q_proj,v_proj; Phi-3's fused qkv_proj); base_dtype None: the device's
# (quantized on cpu and mps, bfloat16 on cuda).
FLAGS = dict(model=None, data=None, val_data=None, rank=8, alpha=16.0, dropout=0.0, targets=None,
             epochs=None, output=None, strict=False, base_dtype=None, chat_template=None,
             lr=2e-4, min_lr=2e-5, seq_len=512, batch_size=4, warmup=10, weight_decay=0.0)
BASE_DTYPES = ("quantized", "bfloat16", "float32")
CHAT_BUCKET = 64  # --compile: chat batch lengths are padded up to a multiple of this


def add_arguments(g) -> None:
    g.add_argument("--model", help=f"base model GGUF (default {DEFAULT_MODEL} in the project)")
    g.add_argument("--data", help="chat JSONL: one {\"messages\": [{\"role\", \"content\"}, ...]} per line "
                   "(no default: give --data, or --corpus for a token stream)")
    g.add_argument("--val-data", help="validation chat JSONL (default: 5%% of --data held out)")
    g.add_argument("--rank", type=int, help="LoRA rank r (default 8)")
    g.add_argument("--alpha", type=float, help="LoRA alpha; the update is scaled by alpha / r (default 16)")
    g.add_argument("--dropout", type=float, help="dropout on the LoRA input (default 0)")
    g.add_argument("--targets", help="comma-separated projections to adapt, from "
                   f"{','.join(VALID_TARGETS)} (default q_proj,v_proj; qkv_proj for phi3)")
    g.add_argument("--base-dtype", choices=BASE_DTYPES,
                   help="how the frozen base is held: quantized (the GGUF's own blocks, memory-mapped, dequantized "
                        "per layer in forward and backward: the least memory), bfloat16 or float32 (dequantized "
                        "once at load) (default quantized on cpu and metal, bfloat16 on cuda)")
    g.add_argument("--chat-template", metavar="FILE.jinja", help="chat template for --data (default: the GGUF's "
                   "own; for a file without one, toy's built-in template of its family: Gemma turns, ChatML)")
    g.add_argument("--epochs", type=int,
                   help="passes over the data; sets --steps (conflicts with --steps) (default: none, --steps counts)")
    g.add_argument("--output", help="also copy the final adapter directory to PATH (default: only RUN_DIR/final)")
    g.add_argument("--strict", action="store_true", default=None, help="an invalid chat line is fatal (default: warn, skip, count)")
    g.add_argument("--max-seq-len", dest="seq_len", type=int, help="alias of --seq-len (default 512 for LoRA)")


def resolve_model(cfg: RunConfig, project: Project) -> Path:
    if cfg.model:
        p = Path(cfg.model)
        if not p.is_file():
            raise InputError(f"--model {p} not found; {GET_MODEL}")
        return p
    root = project.root or Path.cwd()
    p = root / DEFAULT_MODEL
    if not p.is_file():
        raise InputError(f"no --model given and {p} is missing; {GET_MODEL}")
    return p


def batch_unit(cfg: RunConfig) -> str:
    """What a step's global batch is made of: whole length-grouped chat batches, or rows
    of token windows (how a resume on another number of processes splits it)."""
    return "batches" if cfg.data else "rows"


def base_dtype(cfg: RunConfig) -> str:
    if cfg.base_dtype:
        return cfg.base_dtype
    return "bfloat16" if cfg.device == "cuda" else "quantized"


def check_opts(cfg: RunConfig) -> list[str]:
    p = []
    if cfg.base_dtype is not None and cfg.base_dtype not in BASE_DTYPES:
        p.append(f"--base-dtype {cfg.base_dtype!r} is unknown; valid: {', '.join(BASE_DTYPES)}")
    if cfg.data and cfg.corpus:
        p.append("--data and --corpus conflict: train on chat JSONL or on a token file, not both")
    if not cfg.data and not cfg.corpus:
        p.append("give --data chat.jsonl or --corpus tokens.bin")
    if cfg.val_data and not cfg.data:
        p.append("--val-data needs --data (use --val-corpus with --corpus)")
    if cfg.seq_len is None or cfg.seq_len < 2:
        p.append(f"--seq-len must be >= 2, got {cfg.seq_len}")
    if cfg.model and not Path(cfg.model).is_file():
        p.append(f"--model {cfg.model} not found; {GET_MODEL}")
    for flag in ("data", "val_data"):
        if getattr(cfg, flag) and not Path(getattr(cfg, flag)).is_file():
            p.append(f"--{flag.replace('_', '-')} {getattr(cfg, flag)} not found; give a chat JSONL file")
    return p


def build(cfg: RunConfig, project: Project) -> Built:
    # Absolute: run.json, adapter_config.json and `toy infer --run` / `toy export` find the
    # base from any folder (model_sha256 below notices a file changed since).
    model_path = resolve_model(cfg, project).resolve()
    dtype = base_dtype(cfg)
    base = read_gguf(model_path, dtype)
    targets = cfg.target_list or base.family.default_targets.split(",")
    tok = toktools.from_gguf_metadata(base.metadata, source=str(model_path))
    # The adapters' dropout draws from torch's generator: seeded here so --seed decides it
    # (the loop then gives each process its own stream from (seed, rank)).
    torch.manual_seed(cfg.seed)
    model = base.build_model()
    del base.state_dict  # the model holds the only copy of the base
    # Validation of rank/alpha/targets happens here, before any data work.
    wrapped = apply_lora(model, targets, int(cfg.rank), float(cfg.alpha), float(cfg.dropout), int(cfg.seed))
    seq_len = int(cfg.seq_len)
    notes: list[str] = list(base.notes)
    resident = resident_bytes(model)
    notes.append(f"base {model_path.name}: {base.arch}, held {dtype} ({resident / 1e9:.2f} GB resident"
                 + (", memory-mapped blocks)" if dtype == "quantized" else ")"))
    if seq_len > base.config.max_seq_len:
        notes.append(f"--seq-len {seq_len} lowered to the model's context {base.config.max_seq_len}")
        seq_len = base.config.max_seq_len
    config = {"recipe": "lora", "arch": base.arch, "model": str(model_path), "model_sha256": fingerprint(model_path),
              "rank": int(cfg.rank), "alpha": float(cfg.alpha), "targets": targets, "seq_len": seq_len,
              "base_dtype": dtype, "base_resident_bytes": resident}
    d = dist.info()
    if cfg.data:
        micro, evals, n_units, info = chat_stream(cfg, tok, base, seq_len, notes)
        unit, per_step = "batches", d.world * cfg.grad_accum
    else:
        micro, evals, n_units, info = token_stream(cfg, project, tok, model_path, seq_len)
        unit, per_step = "rows", cfg.batch_size * d.world * cfg.grad_accum
    config.update(info)
    derived: dict = {"seq_len": seq_len, "targets": ",".join(targets), "base_dtype": dtype}
    if cfg.steps is None:  # --epochs: the step count follows from the data (a resumed run keeps its own)
        derived["steps"] = cfg.epochs * math.ceil(n_units / per_step)
        notes.append(f"{plural(cfg.epochs, 'epoch')} of {n_units} {unit}, {per_step} a step = "
                     f"{plural(derived['steps'], 'step')}")

    def save_final(out: Path) -> None:
        save_peft_adapter(out, lora_state_dict(model), rank=int(cfg.rank), alpha=float(cfg.alpha),
                          dropout=float(cfg.dropout), targets=targets, base_model_name_or_path=str(model_path))
        tok.save(str(out / "tokenizer.json"))
        if cfg.output:
            dest = Path(cfg.output)
            if dest.exists():
                shutil.rmtree(dest)
            shutil.copytree(out, dest)

    job = Job(recipe="lora", model=model, micro_batch=micro, eval_batches=lambda: evals, save_final=save_final,
              config=config)
    n_params = count_params(model)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    notes.append(f"adapters on {plural(len(wrapped), 'module')}: {n_train:,} trainable of "
                 f"{plural(n_params, 'parameter')}")
    return Built(job=job, arch=base.arch, params=n_params, notes=notes, derived=derived)


# ---------------------------------------------------------------- chat JSONL

def _encode_all(items, path, model, encode, strict, warn) -> tuple[list, int, int]:
    """Encode the (line, messages) items read from `path`; returns (samples, the number
    dropped because their prompt fills --seq-len, the number the template cannot render).

    A conversation the template cannot render (ConversationError: it calls
    raise_exception, fails on it, or is not prefix-stable for it) is skipped, counted and
    warned with its line, as an invalid line is; with --strict it is fatal. If none
    renders, the template is the problem, not the data: one error, no warnings. A fault
    of the template itself (syntax, sandbox) stops at once."""
    samples, dropped, failed = [], 0, []
    for line, messages in items:
        try:
            ids, mask = encode(messages)
        except ConversationError as e:
            if strict:
                raise InputError(f"{path}:{line}: {e.message} (--strict stops at the first conversation the "
                                 "chat template cannot render)")
            failed.append((line, e.message))
            if len(failed) == GIVE_UP_AFTER and not samples and not dropped:
                break  # the template rejects everything: the first reason says why
            continue
        except InputError as e:  # the template's own fault: every conversation would fail
            raise InputError(f"{model}: {e.message}")
        if sum(mask) == 0:
            dropped += 1  # the prompt alone fills --seq-len: nothing left to supervise
            continue
        samples.append((ids, mask))
    if failed and not samples and not dropped:
        line, why = failed[0]
        tried = f"the first {len(failed)}" if len(failed) < len(items) else f"all {len(failed)}"
        raise InputError(f"{model}: its chat template renders none of {tried} conversations in {path} "
                         f"(line {line}: {why}); use a model whose template fits this data, or fix the data")
    for line, why in failed[:SHOW_SKIPPED]:
        warn(f"{path}:{line}: {why}; conversation skipped")
    if len(failed) > SHOW_SKIPPED:
        warn(f"{path}: ... and {len(failed) - SHOW_SKIPPED} more conversations the chat template cannot render; "
             "skipped")
    return samples, dropped, len(failed)


def _to_batch(samples: list[tuple[list[int], list[int]]], pad: int, bucket: int = 1,
              seq_len: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad samples to their longest; shift: position t predicts token t+1, a
    target where mask[t+1] says so. Padding comes after every real token, so plain
    causal attention keeps each conversation to itself.

    `bucket` > 1 (under --compile) pads the length up to a multiple of it (at most
    seq_len), so the compiled blocks meet a handful of shapes instead of one per batch:
    each new shape is a recompile, and past dynamo's limit it silently runs eagerly."""
    longest = max(len(ids) for ids, _ in samples)
    width = None
    if bucket > 1:
        width = -(-(longest - 1) // bucket) * bucket + 1  # inputs are width - 1 long
        if seq_len is not None:
            width = min(width, max(longest, seq_len + 1))
    b = pad_batch(samples, pad, width)  # ids, mask: (n, L)
    ids, mask = b["ids"], b["mask"]
    targets = torch.where(mask[:, 1:] > 0, ids[:, 1:], torch.full_like(ids[:, 1:], IGNORE))
    return {"ids": ids[:, :-1], "targets": targets}


def chat_stream(cfg: RunConfig, tok, base, seq_len, notes):
    model = base.path or cfg.model or DEFAULT_MODEL
    template, note = resolve_chat_template(base.chat_template, base.metadata.get("tokenizer.ggml.tokens") or [],
                                           base.family.chat_format, cfg.chat_template, str(model))
    if note:
        notes.append(note)
    special = toktools.gguf_special_ids(base.metadata)
    bos = tok.id_to_token(special.bos) if special.bos is not None else ""
    eos = tok.id_to_token(special.eos) if special.eos is not None else ""
    pad = special.pad if special.pad is not None else (special.eos or 0)
    strict = bool(cfg.strict)

    def warn(msg: str) -> None:
        print(f"warning: {msg}", file=sys.stderr)

    def encode(messages):
        return encode_chat(tok, template, messages, seq_len + 1, bos, eos)

    def read(path) -> list:
        chat = read_chat_jsonl(path, strict=strict, warn=warn)
        if chat.skipped:
            notes.append(f"{path}: skipped {plural(chat.n_skipped, 'invalid line')} ({count_reasons(chat.skipped)})")
        return list(zip(chat.lines, chat.conversations))

    samples, dropped, failed = _encode_all(read(cfg.data), cfg.data, model, encode, strict, warn)
    if failed:
        notes.append(f"{cfg.data}: skipped {plural(failed, 'conversation')} the chat template cannot render")
    if dropped:
        notes.append(f"skipped {plural(dropped, 'conversation')} whose prompt fills --seq-len {seq_len}")
    if not samples:
        raise InputError(f"{cfg.data}: no conversation has a supervised token within --seq-len {seq_len}")
    if cfg.val_data:
        val_samples, _, _ = _encode_all(read(cfg.val_data), cfg.val_data, model, encode, strict, warn)
    else:
        # Hold out a deterministic 5% (at least one) when there is enough data.
        n_val = max(1, len(samples) // 20) if len(samples) >= 20 else 0
        perm = np.random.default_rng([cfg.seed, 7]).permutation(len(samples))
        val_idx = set(perm[:n_val].tolist())
        val_samples = [x for i, x in enumerate(samples) if i in val_idx]
        samples = [x for i, x in enumerate(samples) if i not in val_idx]
        if n_val:
            notes.append(f"validation: {plural(n_val, 'conversation')} held out of --data (give --val-data to choose)")
    # A step holds about what --batch-size packed rows of --seq-len would: conversations
    # of similar length, right-padded to the longest of their batch (length_batches).
    budget = int(cfg.batch_size) * (seq_len + 1)
    seed = int(cfg.seed)
    lengths = [len(ids) for ids, _ in samples]
    epochs = {0: length_batches(lengths, budget, seed, 0)}
    n = len(epochs[0])  # the same count every epoch
    d = dist.info()
    bucket = CHAT_BUCKET if cfg.compile else 1

    def micro(k: int) -> dict[str, torch.Tensor]:
        # Global micro-batch k is `world` batches; this rank takes its own. Batch j of the
        # run is batch j % n of epoch j // n: a pure function of k.
        epoch, i = divmod(k * d.world + d.rank, n)
        if epoch not in epochs:
            epochs.clear()
            epochs[epoch] = length_batches(lengths, budget, seed, epoch)
        return _to_batch([samples[j] for j in epochs[epoch][i]], pad, bucket, seq_len)

    val_lengths = [len(ids) for ids, _ in val_samples]
    evals = [_to_batch([val_samples[j] for j in batch], pad, bucket, seq_len)
             for batch in length_batches(val_lengths, budget, seed, 0)] if val_samples else []
    sup = sum(int(sum(m)) for _, m in samples)
    info = {"data": str(cfg.data), "data_sha256": fingerprint(Path(cfg.data)),
            "conversations": len(samples), "batches": n, "supervised_tokens": sup}
    notes.append(f"{plural(len(samples), 'conversation')} in {plural(n, 'length-grouped batch', 'length-grouped batches')} of up to {budget:,} tokens; "
                 f"{sup:,} supervised tokens")
    return micro, evals, n, info


# ---------------------------------------------------------------- token stream

def token_stream(cfg: RunConfig, project: Project, tok, model_path: Path, seq_len: int):
    """Random windows of a token file made with the base's tokenizer (checked by its hash),
    and fixed windows of its validation split."""
    data = open_token_data(cfg, project, tokenizer=tok, tokenizer_source=str(model_path))
    d = dist.info()
    win = Windows(data.train, seq_len, cfg.batch_size, cfg.seed, world=d.world, rank=d.rank, accum=cfg.grad_accum)
    val = val_windows(data.val, seq_len, cfg.batch_size * d.world, cfg.seed)
    evals = val.eval_batches(cfg.eval_batches) if val is not None else []
    n_rows = max(1, len(data.train) // seq_len)
    info = {"corpus": str(data.train.path), "corpus_tokens": len(data.train)}
    return win.batch, evals, n_rows, info
