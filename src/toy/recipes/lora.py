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
from toy.data.chat import encode_chat, length_batches, pad_batch, read_chat_jsonl
from toy.data.tokens import Windows, read_tokens, val_path_for
from toy.errors import InputError
from toy.formats.gguf import read_gguf
from toy.formats.peft import save_peft_adapter
from toy.lora import VALID_TARGETS, apply_lora, lora_state_dict
from toy.runs import Project
from toy.train import dist
from toy.train.job import IGNORE, Built, Job
from toy.train.lm import fingerprint

DEFAULT_MODEL = "data/smollm2-135m.gguf"
GET_MODEL = "get it with `make smollm2` (or scripts/get-smollm2.sh DIR), or pass --model FILE.gguf"

# Recipe flags and the general flags whose default differs for LoRA.
FLAGS = dict(model=None, data=None, val_data=None, rank=8, alpha=16.0, dropout=0.0, targets="q_proj,v_proj",
             epochs=None, output=None, strict=False,
             lr=1e-4, min_lr=1e-5, seq_len=512, batch_size=4, warmup=10, weight_decay=0.0)


def add_arguments(g) -> None:
    g.add_argument("--model", help=f"base model GGUF (default {DEFAULT_MODEL} in the project)")
    g.add_argument("--data", help="chat JSONL: one {\"messages\": [{\"role\", \"content\"}, ...]} per line")
    g.add_argument("--val-data", help="validation chat JSONL (default: 5%% of --data held out)")
    g.add_argument("--rank", type=int, help="LoRA rank r (default 8)")
    g.add_argument("--alpha", type=float, help="LoRA alpha; the update is scaled by alpha / r (default 16)")
    g.add_argument("--dropout", type=float, help="dropout on the LoRA input (default 0)")
    g.add_argument("--targets", help="comma-separated projections to adapt, from "
                   f"{','.join(VALID_TARGETS)} (default q_proj,v_proj)")
    g.add_argument("--epochs", type=int, help="passes over the data; sets --steps (conflicts with --steps)")
    g.add_argument("--output", help="also copy the final adapter directory to PATH")
    g.add_argument("--strict", action="store_true", help="an invalid chat line is fatal (default: warn, skip, count)")
    g.add_argument("--max-seq-len", dest="seq_len", type=int, help="alias of --seq-len (default 512 for LoRA)")


def resolve_model(opts: dict, project: Project) -> Path:
    if opts.get("model"):
        p = Path(opts["model"])
        if not p.is_file():
            raise InputError(f"--model {p} not found; {GET_MODEL}")
        return p
    root = project.root or Path.cwd()
    p = root / DEFAULT_MODEL
    if not p.is_file():
        raise InputError(f"no --model given and {p} is missing; {GET_MODEL}")
    return p


def check_opts(opts: dict) -> list[str]:
    p = []
    if opts.get("data") and opts.get("corpus"):
        p.append("--data and --corpus conflict: train on chat JSONL or on a token file, not both")
    if not opts.get("data") and not opts.get("corpus"):
        p.append("give --data chat.jsonl or --corpus tokens.bin")
    if opts.get("val_data") and not opts.get("data"):
        p.append("--val-data needs --data (use --val-corpus with --corpus)")
    if opts.get("epochs") is not None and opts["epochs"] < 1:
        p.append(f"--epochs must be >= 1, got {opts['epochs']}")
    if opts["seq_len"] is None or opts["seq_len"] < 2:
        p.append(f"--seq-len must be >= 2, got {opts['seq_len']}")
    if opts.get("model") and not Path(opts["model"]).is_file():
        p.append(f"--model {opts['model']} not found; {GET_MODEL}")
    for flag in ("data", "val_data"):
        if opts.get(flag) and not Path(opts[flag]).is_file():
            p.append(f"--{flag.replace('_', '-')} {opts[flag]} not found; give a chat JSONL file")
    return p


def build(opts: dict, project: Project) -> Built:
    targets = [t.strip() for t in str(opts["targets"]).split(",") if t.strip()]
    model_path = resolve_model(opts, project)
    base = read_gguf(model_path)
    tok = toktools.from_gguf_metadata(base.metadata, source=str(model_path))
    model = base.build_model()
    del base.state_dict  # the model holds the only float32 copy of the base
    # Validation of rank/alpha/targets happens here, before any data work.
    wrapped = apply_lora(model, targets, int(opts["rank"]), float(opts["alpha"]), float(opts["dropout"]),
                         int(opts["seed"]))
    seq_len = int(opts["seq_len"])
    notes: list[str] = []
    if seq_len > base.config.max_seq_len:
        notes.append(f"--seq-len {seq_len} lowered to the model's context {base.config.max_seq_len}")
        seq_len = opts["seq_len"] = base.config.max_seq_len
    vocab = tok.get_vocab_size(with_added_tokens=True)
    config = {"recipe": "lora", "arch": "llama", "model": str(model_path), "model_sha256": fingerprint(model_path),
              "rank": int(opts["rank"]), "alpha": float(opts["alpha"]), "targets": targets, "seq_len": seq_len}
    if opts.get("data"):
        micro, evals, n_units, info = chat_stream(opts, tok, base, seq_len, notes)
        unit, per_micro = "batches", dist.info().world
        config.update(info)
    else:
        micro, evals, n_units, info = token_stream(opts, tok, seq_len, vocab)
        unit, per_micro = "rows", int(opts["batch_size"]) * dist.info().world
        config.update(info)
    if opts.get("epochs"):
        opts["steps"] = int(opts["epochs"]) * math.ceil(n_units / (per_micro * int(opts["grad_accum"])))
        notes.append(f"{opts['epochs']} epoch(s) of {n_units} {unit} = {opts['steps']} steps")

    def save_final(d: Path) -> None:
        save_peft_adapter(d, lora_state_dict(model), rank=int(opts["rank"]), alpha=float(opts["alpha"]),
                          dropout=float(opts["dropout"]), targets=targets, base_model_name_or_path=str(model_path))
        tok.save(str(d / "tokenizer.json"))
        if opts.get("output"):
            out = Path(opts["output"])
            if out.exists():
                shutil.rmtree(out)
            shutil.copytree(d, out)

    job = Job(recipe="lora", model=model, micro_batch=micro, eval_batches=lambda: evals, save_final=save_final,
              config=config)
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    notes.append(f"adapters on {len(wrapped)} modules: {n_train:,} trainable of {n_params:,} parameters")
    return Built(job=job, arch="llama", params=n_params, notes=notes)


# ---------------------------------------------------------------- chat JSONL

def _encode_all(convs, tok, template, seq_len, bos, eos) -> tuple[list, int]:
    samples, dropped = [], 0
    for messages in convs:
        ids, mask = encode_chat(tok, template, messages, seq_len + 1, bos, eos)
        if sum(mask) == 0:
            dropped += 1  # the prompt alone fills --seq-len: nothing left to supervise
            continue
        samples.append((ids, mask))
    return samples, dropped


def _to_batch(samples: list[tuple[list[int], list[int]]], pad: int) -> dict[str, torch.Tensor]:
    """Right-pad samples to their longest; shift: position t predicts token t+1, a
    target where mask[t+1] says so. Padding comes after every real token, so plain
    causal attention keeps each conversation to itself."""
    b = pad_batch(samples, pad)  # ids, mask: (n, L)
    ids, mask = b["ids"], b["mask"]
    targets = torch.where(mask[:, 1:] > 0, ids[:, 1:], torch.full_like(ids[:, 1:], IGNORE))
    return {"ids": ids[:, :-1], "targets": targets}


def chat_stream(opts, tok, base, seq_len, notes):
    template = base.chat_template
    if not template:
        raise InputError(f"{opts.get('model') or DEFAULT_MODEL}: has no chat template (tokenizer.chat_template); "
                         "train on a token file with --corpus instead")
    special = toktools.gguf_special_ids(base.metadata)
    bos = tok.id_to_token(special.bos) if special.bos is not None else ""
    eos = tok.id_to_token(special.eos) if special.eos is not None else ""
    pad = special.pad if special.pad is not None else (special.eos or 0)

    def warn(msg: str) -> None:
        print(f"warning: {msg}", file=sys.stderr)

    convs, n_bad = read_chat_jsonl(opts["data"], strict=bool(opts.get("strict")), warn=warn)
    if n_bad:
        notes.append(f"{opts['data']}: skipped {n_bad} invalid line(s)")
    if opts.get("val_data"):
        val_convs, n_bad_val = read_chat_jsonl(opts["val_data"], strict=bool(opts.get("strict")), warn=warn)
        if n_bad_val:
            notes.append(f"{opts['val_data']}: skipped {n_bad_val} invalid line(s)")
    else:
        # Hold out a deterministic 5% (at least one) when there is enough data.
        n_val = max(1, len(convs) // 20) if len(convs) >= 20 else 0
        perm = np.random.default_rng([opts["seed"], 7]).permutation(len(convs))
        val_idx = set(perm[:n_val].tolist())
        val_convs = [c for i, c in enumerate(convs) if i in val_idx]
        convs = [c for i, c in enumerate(convs) if i not in val_idx]
        if n_val:
            notes.append(f"validation: {n_val} conversations held out of --data (give --val-data to choose)")
    samples, dropped = _encode_all(convs, tok, template, seq_len, bos, eos)
    if dropped:
        notes.append(f"skipped {dropped} conversation(s) whose prompt fills --seq-len {seq_len}")
    if not samples:
        raise InputError(f"{opts['data']}: no conversation has a supervised token within --seq-len {seq_len}")
    val_samples, _ = _encode_all(val_convs, tok, template, seq_len, bos, eos)
    # A step holds about what --batch-size packed rows of --seq-len would: conversations
    # of similar length, right-padded to the longest of their batch (length_batches).
    budget = int(opts["batch_size"]) * (seq_len + 1)
    seed = int(opts["seed"])
    lengths = [len(ids) for ids, _ in samples]
    epochs = {0: length_batches(lengths, budget, seed, 0)}
    n = len(epochs[0])  # the same count every epoch
    d = dist.info()

    def micro(k: int) -> dict[str, torch.Tensor]:
        # Global micro-batch k is `world` batches; this rank takes its own. Batch j of the
        # run is batch j % n of epoch j // n: a pure function of k.
        epoch, i = divmod(k * d.world + d.rank, n)
        if epoch not in epochs:
            epochs.clear()
            epochs[epoch] = length_batches(lengths, budget, seed, epoch)
        return _to_batch([samples[j] for j in epochs[epoch][i]], pad)

    val_lengths = [len(ids) for ids, _ in val_samples]
    evals = [_to_batch([val_samples[j] for j in batch], pad)
             for batch in length_batches(val_lengths, budget, seed, 0)] if val_samples else []
    sup = sum(int(sum(m)) for _, m in samples)
    info = {"data": str(opts["data"]), "data_sha256": fingerprint(Path(opts["data"])),
            "conversations": len(samples), "batches": n, "supervised_tokens": sup}
    notes.append(f"{len(samples)} conversations in {n} length-grouped batches of up to {budget:,} tokens; "
                 f"{sup:,} supervised tokens")
    return micro, evals, n, info


# ---------------------------------------------------------------- token stream

def token_stream(opts, tok, seq_len, vocab):
    path = Path(opts["corpus"])
    tf = read_tokens(path, raw_i32=bool(opts.get("raw_i32")), vocab_size=vocab)
    want = toktools.tokenizer_hash(tok)
    if tf.tokenizer_hash not in (b"\0" * 32, want) or tf.vocab_size != vocab:
        raise InputError(f"{path} was tokenized with another tokenizer (vocab {tf.vocab_size}) than the model's "
                         f"(vocab {vocab}); re-run `toy prep TEXT --tokenizer {opts.get('model') or DEFAULT_MODEL}`")
    if len(tf) < seq_len + 1:
        raise InputError(f"{path}: {len(tf)} tokens, fewer than --seq-len {seq_len} + 1; lower --seq-len")
    win = Windows(tf, seq_len, int(opts["batch_size"]), int(opts["seed"]), world=dist.info().world,
                  rank=dist.info().rank, accum=int(opts.get("grad_accum") or 1))
    val_path = Path(opts["val_corpus"]) if opts.get("val_corpus") else val_path_for(path)
    evals: list = []
    if opts.get("val_corpus") or val_path.is_file():
        vf = read_tokens(val_path, raw_i32=bool(opts.get("raw_i32")), vocab_size=vocab)
        if len(vf) >= seq_len + 1:
            evals = Windows(vf, seq_len, int(opts["batch_size"]) * dist.info().world, int(opts["seed"])).eval_batches(
                int(opts["eval_batches"]))
    n_rows = max(1, len(tf) // seq_len)
    info = {"corpus": str(path), "corpus_tokens": len(tf)}
    return win.batch, evals, n_rows, info
