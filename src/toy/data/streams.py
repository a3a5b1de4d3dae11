"""The adapter recipes' data side, from plain values (no run config, no base model): where
--data and --val-data point (`data_files`), the held-out share (`hold_out`), what a base's
tokenizer gives a stream to encode with (`TextSide`), and the chat stream of conversations,
prompt/completion pairs or text lines as length-grouped batches (`chat_stream`, returning a
`Stream`). The preference pairs' reader is data/preference.py; a recipe (recipes/)
turns its flags and its base into these arguments.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from toy.data.chat import (
    FORMATS,
    ChatBatches,
    ConversationError,
    count_reasons,
    encode_all,
    encode_example,
    read_chat_jsonl,
)
from toy.errors import InputError
from toy.runs import data_fingerprints, plural

CHAT_BUCKET = 64  # --compile: batch lengths are padded up to a multiple of this


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def data_files(data: str, val_data: str | None) -> tuple[Path, Path | None]:
    """--data (a file, or a directory holding train.jsonl and, as the held-out set,
    valid.jsonl: mlx-lm's layout) and --val-data."""
    path = Path(data)
    val = Path(val_data) if val_data else None
    if path.is_dir():
        if not (path / "train.jsonl").is_file():
            raise InputError(
                f"--data {path}: a data directory holds train.jsonl (and valid.jsonl for "
                "validation); it has no train.jsonl"
            )
        if val is None and (path / "valid.jsonl").is_file():
            val = path / "valid.jsonl"
        path = path / "train.jsonl"
    return path, val


def hold_out(
    samples: list, seed: int, notes: list[str], what: str, flag: str = "--data"
) -> tuple[list, list]:
    """(train, validation): a deterministic 5% (at least one) held out of `flag`'s file
    when it has 20 or more samples; none otherwise."""
    n_val = max(1, len(samples) // 20) if len(samples) >= 20 else 0
    perm = np.random.default_rng([seed, 7]).permutation(len(samples))
    val_idx = set(perm[:n_val].tolist())
    val = [x for i, x in enumerate(samples) if i in val_idx]
    train = [x for i, x in enumerate(samples) if i not in val_idx]
    if n_val:
        notes.append(
            f"validation: {plural(n_val, what)} held out of {flag}"
            + (
                " (give --val-data or a data directory's valid.jsonl to choose)"
                if flag == "--data"
                else ""
            )
        )
    return train, val


@dataclass(frozen=True)
class TextSide:
    """What a base's tokenizer gives a data stream: the tokenizer, the chat template the
    data goes through (None: plain text), where it came from (for messages), the BOS and
    EOS strings and EOS id, the padding id and the model's embedding rows."""

    tok: Any
    template: str | None
    source: str
    bos: str | None
    eos: str | None
    eos_id: int | None
    pad: int
    rows: int

    def check_vocab(self, ids: list[int]) -> None:
        """A token the tokenizer makes beyond the model's embedding rows (an added token the
        file's tensors lack) cannot be trained on: that one example is skipped."""
        if ids and max(ids) >= self.rows:
            bad = max(ids)
            raise ConversationError(
                f"token {self.tok.id_to_token(bad)!r} (id {bad}) is beyond the model's "
                f"{self.rows} embedding rows"
            )


@dataclass
class Stream:
    """A data stream's batches: micro_batch(k), the held-out batches, how many units (chat
    batches, token rows) an epoch has, and what run.json records of the data."""

    micro_batch: Callable[[int], dict[str, torch.Tensor]]
    evals: list[dict[str, torch.Tensor]]
    n_batches: int
    info: dict[str, Any] = field(default_factory=dict)
    chat: Any = None  # chat data's ChatBatches: which samples each batch holds


@dataclass(frozen=True)
class StreamOpts:
    """The run's flags a stream reads (from the recipe's config)."""

    data: str
    val_data: str | None
    strict: bool
    seed: int
    batch_size: int
    eval_batches: int
    compile: bool
    world: int = 1
    rank: int = 0


def read_chat_files(data_path: Path, val_path: Path | None, strict: bool, notes: list[str]):
    """(train, validation or None): the two chat files, read and checked to share a form."""

    def read(path):
        chat = read_chat_jsonl(path, strict=strict, warn=warn)
        if chat.skipped:
            notes.append(
                f"{path}: skipped {plural(chat.n_skipped, 'invalid line')} "
                f"({count_reasons(chat.skipped)})"
            )
        return chat

    train = read(data_path)
    val = read(val_path) if val_path is not None else None
    if val is not None and val.kind != train.kind:
        raise InputError(
            f"{val_path}: {FORMATS[val.kind]}s, but {data_path} holds {FORMATS[train.kind]}s; "
            "give both in one format"
        )
    return train, val


def chat_stream(
    o: StreamOpts,
    files: tuple[Path, Path | None],
    chat: tuple[Any, Any],
    side: TextSide,
    seq_len: int,
    notes: list[str],
) -> Stream:
    """The chat data stream of `files` (read as `chat`, read_chat_files) encoded with `side`:
    length-grouped batches of about --batch-size rows of --seq-len tokens each."""
    (data_path, val_path), (train, val_file) = files, chat
    cut: list[tuple[int, int]] = []  # (strings cut to what a window can use, chars kept) a line

    def encode(ex):
        ids, mask = encode_example(
            side.tok, side.template, ex, seq_len + 1, side.bos, side.eos, side.eos_id, cut
        )
        side.check_vocab(ids)
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
        list(zip(train.lines, train.examples)), data_path, side.source, encode, o.strict, warn
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
            list(zip(val_file.lines, val_file.examples)), val_path, side.source, encode, o.strict,
            warn,
        )  # fmt: skip
    else:
        samples, val_samples = hold_out(samples, o.seed, notes, "example")
    # A step holds about what --batch-size packed rows of --seq-len would: conversations
    # of similar length, right-padded to the longest of their batch (length_batches).
    bucket = CHAT_BUCKET if o.compile else 1
    budget = int(o.batch_size) * (seq_len + 1)
    batches = ChatBatches(
        samples, budget, int(o.seed), side.pad, seq_len, bucket, world=o.world, rank=o.rank
    )
    val = (
        ChatBatches(val_samples, batches.budget, int(o.seed), side.pad, seq_len, bucket)
        if val_samples
        else None
    )
    evals = val.eval_batches(o.eval_batches) if val is not None else []
    if val is not None and len(val) > o.eval_batches:
        notes.append(
            f"validation: {o.eval_batches} of {len(val)} held-out batches per evaluation, "
            "spread over their lengths (--eval-batches)"
        )
    n, budget = len(batches), batches.budget
    sup = sum(int(sum(m)) for _, m in samples)
    info = {
        "data": str(o.data),
        **data_fingerprints("data", data_path),
        "conversations": len(samples),
        "batches": n,
        "supervised_tokens": sup,
    }
    if train.kind != "messages":
        info["data_format"] = train.kind
    if val_path is not None:  # a file given or found in a --data directory: checked alike
        info["val_data"] = str(val_path)
        info.update(data_fingerprints("val_data", val_path))
    notes.append(
        f"{plural(len(samples), 'example')} in "
        f"{plural(n, 'length-grouped batch', 'length-grouped batches')} "
        f"of up to {budget:,} tokens; {sup:,} supervised tokens"
    )
    return Stream(batches.batch, evals, n, info, chat=batches)
