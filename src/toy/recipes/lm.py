"""What the decoder-LM recipes share (not a recipe itself): the token data (corpus,
validation split and the tokenizer that made them, resolved and checked in one place),
the model config from flags, and the Job that trains on token windows (WindowJob). The
recipes that train on a corpus build on it; no recipe imports another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from tokenizers import Tokenizer

from toy import tokenizer as toktools
from toy.data.prep import bundled_corpus
from toy.data.tokens import TokenFile, Windows, read_tokens, tokenizer_beside, val_path_for
from toy.errors import InputError, UsageError
from toy.formats.model_dir import save_model_dir
from toy.models import registry
from toy.runs import Project
from toy.train import dist
from toy.train.config import RunConfig
from toy.train.job import Job

NO_HASH = b"\0" * 32


@dataclass
class TokenData:
    train: TokenFile
    val: TokenFile | None
    tokenizer: Tokenizer | None
    tokenizer_path: Path | None  # the tokenizer.json it came from, when it came from a file
    bundled: bool  # the bundled plays (no --corpus, no project corpus)


def open_token_data(
    cfg: RunConfig,
    project: Project,
    tokenizer: Tokenizer | None = None,
    tokenizer_source: str | None = None,
    bundled_ok: bool = True,
) -> TokenData:
    """The training corpus, its validation split and their tokenizer, checked together.

    Corpus: --corpus, else the project's data/corpus.bin, else (when `bundled_ok`) the
    bundled plays. Tokenizer: `tokenizer` when the recipe brings its own (a GGUF base's or
    a donor's: `tokenizer_source` names it in errors), else --tokenizer, else the one
    beside the corpus (`NAME.tokenizer.json`, or `tokenizer.json`). A corpus whose header
    records a tokenizer hash must match it; with a recipe's own tokenizer the hash is
    required (a headerless corpus cannot prove which tokenizer made it). Validation:
    --val-corpus, else NAME.val.bin beside the corpus when `toy prep` wrote one; it must
    come from the same tokenizer.
    """
    if cfg.corpus:
        path, bundled = Path(cfg.corpus), False
    elif project.data_dir is not None and (project.data_dir / "corpus.bin").is_file():
        path, bundled = project.data_dir / "corpus.bin", False
    elif bundled_ok:
        path, bundled = bundled_corpus(), True
    else:
        raise UsageError(
            f"{cfg.recipe} needs --corpus FILE.bin tokenized with {tokenizer_source}'s tokenizer; "
            f"make it with `toy prep TEXT --tokenizer {tokenizer_source} --out FILE.bin`"
        )
    tok_path: Path | None = None
    if tokenizer is None:
        tok_path = Path(cfg.tokenizer) if cfg.tokenizer else tokenizer_beside(path)
        if cfg.tokenizer and not tok_path.is_file():
            raise InputError(f"--tokenizer {tok_path} not found")
        tokenizer = toktools.load(tok_path) if tok_path is not None and tok_path.is_file() else None
        if tokenizer is None:
            tok_path = None
        tokenizer_source = str(tok_path)
    vocab = (
        tokenizer.get_vocab_size(with_added_tokens=True)
        if tokenizer is not None
        else cfg.vocab_size
    )
    train = read_tokens(path, raw_i32=bool(cfg.raw_i32), vocab_size=vocab)
    if tokenizer is not None:
        own = tok_path is None  # the recipe's tokenizer (a model's), not a file beside the corpus
        if (own or train.tokenizer_hash != NO_HASH) and not toktools.hash_matches(
            tokenizer, train.tokenizer_hash
        ):
            if cfg.raw_i32:
                raise InputError(
                    f"--raw-i32 {path}: a headerless corpus cannot prove it was tokenized with "
                    f"{tokenizer_source}'s tokenizer; convert it with `toy prep {path} --raw-i32 "
                    f"--tokenizer {tokenizer_source} --out FILE.bin`"
                )
            what = (
                "has no tokenizer hash"
                if train.tokenizer_hash == NO_HASH
                else f"was tokenized with another tokenizer (vocabulary {train.vocab_size})"
            )
            raise InputError(
                f"{path} {what} than {tokenizer_source} (vocabulary {vocab}); re-run "
                f"`toy prep TEXT --tokenizer {tokenizer_source} --out {path}`"
            )
    val_path = Path(cfg.val_corpus) if cfg.val_corpus else val_path_for(path)
    val = None
    if cfg.val_corpus or val_path.is_file():
        val = read_tokens(val_path, raw_i32=bool(cfg.raw_i32), vocab_size=train.vocab_size)
        if val.vocab_size != train.vocab_size or val.tokenizer_hash != train.tokenizer_hash:
            raise InputError(
                f"{val_path} and {path} were made with different tokenizers; prep them together"
            )
    return TokenData(train, val, tokenizer, tok_path, bundled)


def val_windows(val: TokenFile | None, seq_len: int, rows: int, seed: int) -> Windows | None:
    """Fixed validation windows; a validation file too short for one window is an error,
    never silently dropped."""
    if val is None:
        return None
    if len(val) < seq_len + 1:
        raise InputError(
            f"{val.path}: {len(val)} validation tokens, fewer than --seq-len {seq_len} + 1; "
            "raise --val-fraction in `toy prep`, give a longer --val-corpus or lower --seq-len"
        )
    return Windows(val, seq_len, rows, seed)


def lm_config(cfg: RunConfig, arch: str, train: TokenFile, notes: list[str] | None = None):
    """The model config from --preset and the shape flags, with vocab_size from the
    corpus, and the training sequence length (--seq-len, else the preset's context).
    Every shape problem is reported at once as a UsageError naming its flag."""
    mcfg, seq_len, problems = lm_shape(cfg, arch, train.vocab_size, notes)
    if len(train) < seq_len + 1:
        problems.append(
            f"--seq-len {seq_len} is longer than the corpus {train.path} ({len(train)} tokens); "
            "lower it or prep more text"
        )
    if problems:
        raise UsageError("; ".join(problems))
    return mcfg, seq_len


def lm_shape(cfg: RunConfig, arch: str, vocab: int, notes: list[str] | None = None):
    """(the model config from --preset and the shape flags over `vocab` tokens, the training
    sequence length, the shape's problems, each naming its flag)."""
    if arch not in registry.lm_archs():
        hint = "; train images with --recipe vit-tiny" if arch == "vit" else ""
        raise UsageError(
            f"--arch {arch!r} is not a language model; "
            f"valid: {', '.join(registry.lm_archs())}{hint}"
        )
    if arch == "gpt2" and cfg.n_kv_head:
        raise UsageError(
            "--n-kv-head applies to llama (grouped-query attention); gpt2 has one kv head per head"
        )
    try:
        mcfg = registry.build_config(
            arch,
            cfg.preset,
            vocab,
            n_layer=cfg.n_layer,
            d_model=cfg.d_model,
            n_head=cfg.n_head,
            **({"n_kv_head": cfg.n_kv_head} if arch == "llama" else {}),
        )
    except KeyError as e:
        raise UsageError(str(e.args[0]))
    except TypeError as e:
        raise UsageError(f"--arch {arch}: {e}")
    seq_len = cfg.seq_len or mcfg.max_seq_len
    if notes is not None and seq_len > mcfg.max_seq_len:
        notes.append(
            f"warning: --seq-len {seq_len} is beyond the preset's context {mcfg.max_seq_len}: "
            "attention costs grow with its square "
            f"({(seq_len / mcfg.max_seq_len) ** 2:,.0f}x the preset's per sequence), "
            "expect slow steps; "
            "a preset with a longer context (--preset) is the usual choice"
        )
    mcfg.max_seq_len = max(mcfg.max_seq_len, seq_len)
    return mcfg, seq_len, registry.check_config(mcfg)


def lm_derived(cfg: RunConfig, train: TokenFile, seq_len: int, notes: list[str]) -> dict[str, Any]:
    """What an LM recipe works out from the data: the sequence length, and the steps of
    --epochs (one epoch: every non-overlapping window of the corpus once, in rows)."""
    windows = max(1, (len(train) - 1) // seq_len)
    epochs, note = cfg.epoch_steps(
        windows, cfg.batch_size * cfg.grad_accum * dist.info().world, "token windows"
    )
    notes += [note] if note else []
    return {"seq_len": seq_len, **epochs}


def token_windows(data: TokenData, cfg: RunConfig, seq_len: int) -> tuple[Windows, Windows | None]:
    """(random training windows of this process's share, fixed validation windows): every
    rank evaluates the same global set, eval_batches batches of the global batch size."""
    d = dist.info()
    train = Windows(
        data.train,
        seq_len,
        cfg.batch_size,
        cfg.seed,
        world=d.world,
        rank=d.rank,
        accum=cfg.grad_accum,
    )
    return train, val_windows(data.val, seq_len, cfg.batch_size * d.world, cfg.seed)


class WindowJob(Job):
    """Next-token training on random windows of the corpus, validation on fixed windows
    of its validation split; its loss is Job's, the next-token cross-entropy at every
    position (lm_loss). `final/` gets `export()` (default: the model itself) as a plain
    model directory with the tokenizer."""

    def __init__(
        self,
        recipe: str,
        model: nn.Module,
        data: TokenData,
        cfg: RunConfig,
        seq_len: int,
        config: dict[str, Any],
        export: Callable[[], nn.Module] | None = None,
    ):
        super().__init__(recipe, model, config)
        self.windows, self.val = token_windows(data, cfg, seq_len)
        self.n_eval = cfg.eval_batches
        self.tokenizer = data.tokenizer_path or data.tokenizer
        self.export = export

    def micro_batch(self, k: int, live=None) -> dict[str, torch.Tensor]:
        return self.windows.batch(k)

    def eval_batches(self) -> list[dict[str, torch.Tensor]]:
        return self.val.eval_batches(self.n_eval) if self.val is not None else []

    def save_final(self, out: Path) -> None:
        with torch.no_grad():
            m = self.export() if self.export is not None else self.model
        extra = {"recipe": self.recipe, "train": self.config}
        save_model_dir(out, m, extra=extra, tokenizer=self.tokenizer)
