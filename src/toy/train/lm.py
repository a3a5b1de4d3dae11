"""What the decoder-LM recipes share: finding and opening the corpus, the model
config from flags, a cheap file fingerprint, and the Job that trains on token windows.

It lives here, below the recipes, because a recipe never imports another recipe:
from_scratch.py and warm_start.py both build on it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from tokenizers import Tokenizer

from toy import tokenizer as toktools
from toy.data.prep import bundled_corpus
from toy.data.tokens import TokenFile, Windows, read_tokens, val_path_for
from toy.errors import InputError, UsageError
from toy.formats.model_dir import save_model_dir
from toy.models import registry
from toy.runs import Project
from toy.train import dist
from toy.train.job import Job


def resolve_corpus(opts: dict, project: Project) -> tuple[Path, bool]:
    """--corpus, else the project's data/corpus.bin, else the bundled plays.
    The flag says whether the bundled corpus was chosen."""
    if opts.get("corpus"):
        return Path(opts["corpus"]), False
    if project.data_dir is not None and (project.data_dir / "corpus.bin").is_file():
        return project.data_dir / "corpus.bin", False
    return bundled_corpus(), True


def open_corpus(opts: dict, project: Project) -> tuple[TokenFile, TokenFile | None, Path | None]:
    """The training and validation token files, and the tokenizer.json that made them
    (--tokenizer, else the one beside the corpus), checked against each other."""
    path, _ = resolve_corpus(opts, project)
    tok_path = Path(opts["tokenizer"]) if opts.get("tokenizer") else path.parent / "tokenizer.json"
    tok = toktools.load(tok_path) if tok_path.is_file() else None
    if opts.get("tokenizer") and tok is None:
        raise InputError(f"--tokenizer {tok_path} not found")
    vocab = tok.get_vocab_size(with_added_tokens=True) if tok is not None else opts.get("vocab_size")
    train = read_tokens(path, raw_i32=bool(opts.get("raw_i32")), vocab_size=vocab)
    if tok is not None and train.tokenizer_hash != b"\0" * 32 and train.tokenizer_hash != toktools.tokenizer_hash(tok):
        raise InputError(f"{path} was tokenized with a different tokenizer than {tok_path}; "
                         "re-run `toy prep` or pass the matching --tokenizer")
    val = open_val_corpus(opts, train)
    return train, val, tok_path if tok is not None else None


def open_val_corpus(opts: dict, train: TokenFile) -> TokenFile | None:
    """--val-corpus, else CORPUS.val.bin beside the corpus when `toy prep` wrote one;
    it must come from the same tokenizer as `train`."""
    val_path = Path(opts["val_corpus"]) if opts.get("val_corpus") else val_path_for(train.path)
    if not (opts.get("val_corpus") or val_path.is_file()):
        return None
    val = read_tokens(val_path, raw_i32=bool(opts.get("raw_i32")), vocab_size=train.vocab_size)
    if val.vocab_size != train.vocab_size or val.tokenizer_hash != train.tokenizer_hash:
        raise InputError(f"{val_path} and {train.path} were made with different tokenizers; prep them together")
    return val


def fingerprint(path: Path, limit: int = 1 << 22) -> str:
    """sha256 of the file's size and first 4 MiB: cheap, and catches a swapped corpus on resume."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as fh:
        h.update(fh.read(limit))
    return h.hexdigest()[:16]


def lm_config(opts: dict, arch: str, train: TokenFile):
    """The model config from --preset and the shape flags, with vocab_size from the corpus.
    Sets opts["seq_len"] (default: the preset's context). Every shape problem is reported
    at once as a UsageError naming its flag."""
    if arch not in registry.LM_ARCHS:
        hint = "; train images with --recipe vit-tiny" if arch == "vit" else ""
        raise UsageError(f"--arch {arch!r} is not a language model; valid: {', '.join(registry.LM_ARCHS)}{hint}")
    if arch == "gpt2" and opts.get("n_kv_head"):
        raise UsageError("--n-kv-head applies to llama (grouped-query attention); gpt2 has one kv head per head")
    try:
        cfg = registry.build_config(arch, opts.get("preset"), train.vocab_size, n_layer=opts.get("n_layer"),
                                    d_model=opts.get("d_model"), n_head=opts.get("n_head"),
                                    **({"n_kv_head": opts.get("n_kv_head")} if arch == "llama" else {}))
    except KeyError as e:
        raise UsageError(str(e.args[0]))
    except TypeError as e:
        raise UsageError(f"--arch {arch}: {e}")
    seq_len = opts.get("seq_len") or cfg.max_seq_len
    opts["seq_len"] = seq_len
    cfg.max_seq_len = max(cfg.max_seq_len, seq_len)
    problems = registry.check_config(cfg)
    if len(train) < seq_len + 1:
        problems.append(f"--seq-len {seq_len} is longer than the corpus {train.path} ({len(train)} tokens); "
                        "lower it or prep more text")
    if problems:
        raise UsageError("; ".join(problems))
    return cfg


def lm_job(recipe: str, model: nn.Module, train: TokenFile, val: TokenFile | None, opts: dict,
           tokenizer: Tokenizer | Path | None, config: dict[str, Any],
           export: Callable[[], nn.Module] | None = None, **job_fields: Any) -> Job:
    """Next-token training on random windows of `train`, validation on fixed windows of
    `val`. `final/` gets `export()` (default: the model itself) as a plain model
    directory with the tokenizer; `job_fields` go to Job as they are."""
    seq_len = opts["seq_len"]
    d = dist.info()
    win = Windows(train, seq_len, opts["batch_size"], opts["seed"], world=d.world, rank=d.rank,
                  accum=int(opts.get("grad_accum") or 1))
    if val is not None and len(val) < seq_len + 1:
        raise InputError(f"{val.path}: {len(val)} validation tokens, fewer than --seq-len {seq_len} + 1; "
                         "raise --val-fraction in `toy prep` or lower --seq-len")
    # Every rank evaluates the same global set: eval_batches batches of the global batch size.
    val_win = Windows(val, seq_len, opts["batch_size"] * d.world, opts["seed"]) if val is not None else None

    def save_final(d: Path) -> None:
        with torch.no_grad():
            out = export() if export is not None else model
        save_model_dir(d, out, extra={"recipe": recipe, "train": config}, tokenizer=tokenizer)

    return Job(recipe=recipe, model=model, micro_batch=win.batch,
               eval_batches=(lambda: val_win.eval_batches(opts["eval_batches"])) if val_win else (lambda: []),
               save_final=save_final, config=config, **job_fields)
