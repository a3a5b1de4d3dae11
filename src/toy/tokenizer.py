"""Tokenizers, through HF `tokenizers`.

- `train_bpe`: a byte-level BPE trained on the user's text (GPT-2 style: bytes are
  mapped to printable characters, so any input round-trips).
- `load`: a `tokenizer.json`.
- `tokenizer_hash`: a stable fingerprint stored in token-file headers, so a token
  file is never silently paired with a different tokenizer.
- `from_gguf_metadata`: a byte-level BPE rebuilt from a GGUF's `tokenizer.ggml.*`
  fields (the GGUF reader in formats/ passes its metadata in); `gguf_special_ids`
  gives the bos/eos/pad/unk ids it declares.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

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


# ------------------------------------------------------------------ from GGUF metadata

# llama.cpp's token types (tokenizer.ggml.token_type), as in gguf.TokenType.
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# How each `tokenizer.ggml.pre` splits text before BPE. These regexes are the ones the
# models' own tokenizer.json files use; llama.cpp keys them by this name.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# "gpt-2" is llama.cpp's name for exactly GPT-2's regex (what toy's exports declare).
_GPT2_STYLE = ("default", "gpt2", "gpt-2")
# StarCoder-family vocabularies (SmolLM's included) put every digit on its own before
# the GPT-2 split: llama.cpp's "\p{N}" rule, HF's Digits(individual_digits=True).
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell")
_LLAMA3_STYLE = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx")
_QWEN2_STYLE = ("qwen2", "deepseek-r1-qwen")
GGUF_PRE_TOKENIZERS = _GPT2_STYLE + _DIGITS_THEN_GPT2 + _LLAMA3_STYLE + _QWEN2_STYLE

_OTHER_MODELS = {"llama": "sentencepiece", "t5": "unigram", "bert": "wordpiece", "gemma4": "sentencepiece",
                 "rwkv": "rwkv", "plamo2": "plamo2"}


@dataclass(frozen=True)
class GGUFSpecialIds:
    """Special token ids a GGUF declares (None when absent), and whether llama.cpp adds
    BOS/EOS around a prompt."""

    bos: int | None
    eos: int | None
    pad: int | None
    unk: int | None
    add_bos: bool
    add_eos: bool


def gguf_special_ids(meta: dict) -> GGUFSpecialIds:
    n = len(meta.get("tokenizer.ggml.tokens") or ())

    def get(key: str) -> int | None:
        v = meta.get(f"tokenizer.ggml.{key}_token_id")
        return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < max(n, 1) else None

    return GGUFSpecialIds(
        bos=get("bos"), eos=get("eos"), pad=get("padding"), unk=get("unknown"),
        add_bos=meta.get("tokenizer.ggml.add_bos_token") is True,
        add_eos=meta.get("tokenizer.ggml.add_eos_token") is True,
    )


@lru_cache(maxsize=1)
def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes map to
    themselves, the rest to code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _pre_tokenizer(pre: str):
    if pre in _GPT2_STYLE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    split = _LLAMA3_SPLIT if pre in _LLAMA3_STYLE else _QWEN2_SPLIT
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def from_gguf_metadata(meta: dict, source: str | None = None) -> Tokenizer:
    """An HF `tokenizers` Tokenizer from a GGUF's `tokenizer.ggml.*` fields (gpt2-style
    byte-level BPE). Control tokens become special added tokens, user-defined ones plain
    added tokens; ids are the file's. If the file asks for BOS/EOS (add_bos_token), a
    post-processor adds them when encoding with add_special_tokens=True.
    `gguf_special_ids(meta)` gives the bos/eos/pad/unk ids. `source` names the file in
    error messages."""
    where = f"{source}: " if source else ""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise InputError(f"{where}the GGUF has no tokenizer (no tokenizer.ggml.model key); pass a tokenizer.json")
    if kind != "gpt2":
        what = _OTHER_MODELS.get(kind, "unknown kind") if isinstance(kind, str) else "unknown kind"
        raise InputError(f"{where}tokenizer model {kind!r} ({what}) is not supported yet; supported: gpt2 (BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise InputError(f"{where}GGUF pre-tokenizer {pre!r} is not supported; supported: "
                         f"{', '.join(GGUF_PRE_TOKENIZERS)}")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise InputError(f"{where}GGUF key tokenizer.ggml.tokens is missing or not a list of strings")
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise InputError(f"{where}GGUF key tokenizer.ggml.merges is missing or not a list of strings; "
                         "a gpt2 (BPE) tokenizer needs its merges")
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None and (not isinstance(types, list) or len(types) != len(tokens)):
        n = len(types) if isinstance(types, list) else "?"
        raise InputError(f"{where}GGUF key tokenizer.ggml.token_type has {n} entries for {len(tokens)} tokens; "
                         "the file is damaged")

    # A byte-level vocabulary spells every token in GPT-2's byte alphabet. A few files
    # store some tokens as raw text (real spaces, newlines): respell those so BPE can
    # find them.
    chars = _byte_chars()
    alphabet = set(chars)
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if not set(t) <= alphabet:
            t = "".join(chars[b] for b in t.encode("utf-8"))
        vocab.setdefault(t, i)  # a duplicate keeps its first id
    pairs = []
    for j, m in enumerate(merges):
        parts = m.split(" ")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise InputError(f"{where}GGUF merge {j} ({m[:40]!r}) is not two tokens separated by one space; "
                             "the file is damaged")
        pairs.append((parts[0], parts[1]))
    try:
        # Llama 3's tokenizer takes a pre-token that is itself in the vocabulary as is,
        # before any merge (HF's ignore_merges; llama.cpp does the same for this pre type).
        bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in ("llama-bpe", "llama3", "llama-v3"))
    except Exception as e:  # tokenizers raises a bare Exception for a merge of unknown tokens
        raise InputError(f"{where}GGUF merges do not match its tokens ({str(e).splitlines()[0]}); the file is damaged")
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()

    # llama.cpp matches control and user-defined tokens whole, before BPE; added tokens do
    # the same here. Only tokens spelled as in the vocabulary are added, so no id is new.
    special, plain = [], []
    for i, (t, ty) in enumerate(zip(tokens, types or ())):
        if ty in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED) and vocab.get(t) == i:
            (special if ty == _TOKEN_CONTROL else plain).append(
                AddedToken(t, special=ty == _TOKEN_CONTROL, normalized=False))
    if special:
        tok.add_special_tokens(special)
    if plain:
        tok.add_tokens(plain)

    ids = gguf_special_ids(meta)
    single, marks = ["$A"], []  # a list, not a string: token names may hold spaces
    if ids.add_bos and ids.bos is not None:
        single.insert(0, tokens[ids.bos])
        marks.append((tokens[ids.bos], ids.bos))
    if ids.add_eos and ids.eos is not None:
        single.append(tokens[ids.eos])
        marks.append((tokens[ids.eos], ids.eos))
    if marks:
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=list(dict.fromkeys(marks)))
    return tok
