"""Text -> token files: read .txt / .jsonl, train or load a tokenizer, hold back a
validation split, write `NAME.bin` + `NAME.val.bin` + `NAME.tokenizer.json`.

Each prepared corpus owns its tokenizer (`NAME.tokenizer.json`, whether trained here,
copied from a tokenizer.json or taken out of a GGUF), so two corpora prepared into one
folder never overwrite each other's, and a corpus is always usable from scratch and
with `toy infer` (training finds it with `toy.data.tokens.tokenizer_beside`)."""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from toy import tokenizer as toktools
from toy.data.chat import json_lines
from toy.data.tokens import (
    MAGIC,
    tokenizer_beside,
    tokenizer_path_for,
    val_path_for,
    write_tokens,
)
from toy.errors import InputError, UsageError
from toy.runs import cache_dir, write_file_atomic

DEFAULT_VOCAB = 4096


def read_texts(paths: list[Path]) -> list[str]:
    """Each .txt file is one document; each .jsonl line with a `text` field is one. A bad
    line (not UTF-8, not JSON, a lone surrogate escape, no `text`) is an InputError naming
    its file and line: a corpus is made once, from the text as it was given."""
    docs: list[str] = []
    for p in paths:
        p = Path(p)
        if not p.is_file():
            raise InputError(
                f"{p}: no such file; pass .txt files or .jsonl files with a 'text' field"
            )
        with open(p, "rb") as fh:
            if fh.read(len(MAGIC)) == MAGIC:
                raise InputError(
                    f"{p} is a token file from `toy prep` already, not text: train on it with "
                    f"`toy train --corpus {p}` (prep takes .txt files, or .jsonl files with a "
                    "'text' field)"
                )
        if p.suffix == ".jsonl":
            docs.extend(_read_jsonl_texts(p))
        else:
            try:
                docs.append(p.read_text(encoding="utf-8"))
            except UnicodeDecodeError as e:
                raise InputError(f"{p}: not UTF-8 text (byte {e.start}); convert it to UTF-8 first")
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise InputError(f"no text found in {', '.join(map(str, paths))}")
    return docs


def _read_jsonl_texts(p: Path) -> list[str]:
    """The `text` of each line, read by the reader every JSONL file goes through
    (data.chat.json_lines: per-line UTF-8, lone surrogate escapes, blank and `#` lines);
    the first bad line stops prep, named."""
    hint = 'each line must be {"text": "..."}'
    out = []
    for i, obj, reason, detail in json_lines(p, hint):
        if obj is None:  # a lone surrogate's detail says its own fix
            raise InputError(f"{p}:{i}: {detail}" + ("" if "surrogate" in reason else f"; {hint}"))
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise InputError(f"{p}:{i}: no string 'text' field; {hint}")
        out.append(obj["text"])
    return out


@dataclass
class PrepResult:
    train_path: Path
    val_path: Path | None
    tokenizer_path: Path | None
    train_tokens: int
    val_tokens: int
    vocab_size: int
    documents: int


def check_overwrite(out: Path, tokenizer_src: Path | None = None) -> None:
    """UsageError naming the first of NAME.bin, NAME.val.bin, NAME.tokenizer.json that
    exists: a run made on a corpus records its tokenizer and fingerprint, and would no
    longer resume once they change. A tokenizer sibling that is --tokenizer itself is
    read, not replaced, so it does not count."""
    out = Path(out)
    for p in (out, val_path_for(out), tokenizer_path_for(out)):
        if not p.exists():
            continue
        if (
            tokenizer_src is not None
            and p == tokenizer_path_for(out)
            and p.resolve() == Path(tokenizer_src).resolve()
        ):
            continue
        raise UsageError(
            f"--out {out}: {p} already exists (runs made on it would no longer resume once it "
            "changes); choose another --out, or pass --force to overwrite it"
        )


def prep(
    paths: list[Path],
    out: Path,
    vocab_size: int | None = None,
    tokenizer: Tokenizer | None = None,
    tokenizer_src: Path | None = None,
    val_fraction: float = 0.05,
    force: bool = False,
) -> PrepResult:
    if (vocab_size is None) == (tokenizer is None):
        raise UsageError(
            "give exactly one of --vocab-size N (train a BPE) or --tokenizer FILE (reuse one)"
        )
    if not 0.0 <= val_fraction < 0.5:
        raise UsageError(f"--val-fraction must be in [0, 0.5), got {val_fraction}")
    if vocab_size is not None and not 257 <= vocab_size <= 1 << 20:
        raise UsageError(f"--vocab-size must be between 257 and 1048576, got {vocab_size}")
    out = Path(out)
    if out.suffix != ".bin":
        raise UsageError(f"--out {out}: the token file name must end in .bin")
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: directory {out.parent} does not exist")
    if not force:
        check_overwrite(out, tokenizer_src)
    docs = read_texts(paths)
    if tokenizer is None:
        tokenizer = toktools.train_bpe(docs, vocab_size)
    ids = encode_documents(tokenizer, docs)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    n_val = int(len(ids) * val_fraction)
    train, val = ids[: len(ids) - n_val], ids[len(ids) - n_val :]
    h = toktools.tokenizer_hash(tokenizer)
    tok_path = save_tokenizer_beside(
        out, tokenizer, tokenizer_src
    )  # first: no token file without its tokenizer
    write_tokens(out, train, vocab, h)
    val_path = None
    if n_val:
        val_path = val_path_for(out)
        write_tokens(val_path, val, vocab, h)
    return PrepResult(out, val_path, tok_path, len(train), len(val), vocab, len(docs))


def save_tokenizer_beside(out: Path, tokenizer: Tokenizer, src: Path | None = None) -> Path:
    """Write the tokenizer that made the token file `out` as `NAME.tokenizer.json` beside
    it: a copy of `src` when that is a tokenizer.json (its bytes as they are), else the
    tokenizer serialised (a trained one, or a GGUF's). Returns the path."""
    path = tokenizer_path_for(out)
    if src is not None and src.suffix == ".json":
        if path.exists() and path.resolve() == src.resolve():
            return path  # --tokenizer names this very file
        write_file_atomic(path, lambda tmp: shutil.copyfile(src, tmp))
    else:
        write_file_atomic(path, lambda tmp: tokenizer.save(str(tmp)))
    return path


def encode_documents(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    """Concatenate documents, each as the tokenizer's own rules mark one (a GGUF's BOS
    and EOS when the file asks for them: `<bos>` before each Gemma document, as the model
    saw text in training), then followed by the end-of-text token when the tokenizer has
    one and its rules put nothing after a document."""
    _, after = toktools.special_affixes(tok)
    eos = toktools.eos_id(tok) if not after else None
    parts = []
    for ids in toktools.encode_batches(tok, docs, add_special_tokens=True):
        parts.append(np.asarray(ids + ([eos] if eos is not None else []), dtype=np.int64))
    return np.concatenate(parts)


# ---------------------------------------------------------------- bundled corpus


def bundled_text_paths() -> list[Path]:
    root = resources.files("toy") / "data" / "assets" / "shakespeare"
    return sorted(Path(str(p)) for p in root.iterdir() if p.name.endswith(".txt"))


def bundled_corpus(vocab_size: int = DEFAULT_VOCAB) -> Path:
    """The bundled plays, tokenized once into the user cache (keyed by content, vocab
    and tokenizer-hash scheme)."""
    paths = bundled_text_paths()
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    # The hash scheme too: a cache from before a change of `tokenizer_hash` holds token
    # files whose header no longer matches their tokenizer.json; a new key re-tokenizes.
    h.update(f"bpe-{vocab_size}-{toktools.TOKENIZER_HASH_SCHEME}".encode())
    d = cache_dir() / "bundled" / h.hexdigest()[:16]
    out = d / "corpus.bin"
    # corpus.tokenizer.json, or the tokenizer.json of a cache made before per-corpus tokenizers.
    if out.is_file() and tokenizer_beside(out) is not None and val_path_for(out).is_file():
        return out
    d.mkdir(parents=True, exist_ok=True)
    prep(paths, out, vocab_size=vocab_size, force=True)  # toy's own cache: a partial one is remade
    return out
