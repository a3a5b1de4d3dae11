"""Tokenizers, through HF `tokenizers`.

- `train_bpe`: a byte-level BPE trained on the user's text (GPT-2 style: bytes are
  mapped to printable characters, so any input round-trips).
- `load`: a `tokenizer.json`.
- `tokenizer_hash`: a stable fingerprint stored in token-file headers, so a token
  file is never silently paired with a different tokenizer.
- Building a tokenizer from GGUF metadata lives in `from_gguf_metadata` (the GGUF
  reader in formats/ passes the `tokenizer.ggml.*` fields in).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from toy.errors import InputError

EOS_TOKEN = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE of exactly `vocab_size` entries (256 bytes + merges + eos).

    The trainer is deterministic for the same texts and vocab size.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except FileNotFoundError:
        raise InputError(f"tokenizer {path} not found; pass --tokenizer FILE or train one with `toy prep --vocab-size N`")
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise InputError(f"{path}: not a valid tokenizer.json ({str(e).splitlines()[0]})")


def tokenizer_hash(tok: Tokenizer) -> bytes:
    """sha256 of the canonical JSON (sorted keys), 32 bytes."""
    canon = json.dumps(json.loads(tok.to_str()), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).digest()


def eos_id(tok: Tokenizer) -> int | None:
    return tok.token_to_id(EOS_TOKEN)


def encode_batches(tok: Tokenizer, texts: list[str], batch: int = 256) -> Iterator[list[int]]:
    """Encode many texts using the library's own thread pool."""
    for i in range(0, len(texts), batch):
        for enc in tok.encode_batch(texts[i : i + batch], add_special_tokens=False):
            yield enc.ids
