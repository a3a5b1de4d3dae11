"""Tokenizers, through HF `tokenizers`.

- `train_bpe`: a byte-level BPE trained on the user's text (GPT-2 style: bytes are
  mapped to printable characters, so any input round-trips).
- `load`: a `tokenizer.json`.
- `tokenizer_hash`: a fingerprint of what decides the ids (not of the JSON the
  `tokenizers` release writes), stored in token-file headers, so a token file is
  never silently paired with a different tokenizer.
- `from_gguf_metadata`: a byte-level BPE (gpt2) or SentencePiece-style BPE (llama,
  Gemma) rebuilt from a GGUF's `tokenizer.ggml.*` fields (the GGUF reader in formats/
  passes its metadata in); `gguf_special_ids` gives the bos/eos/pad/unk ids it declares.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

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
        raise InputError(
            f"tokenizer {path} not found; "
            "pass --tokenizer FILE or train one with `toy prep --vocab-size N`"
        )
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise InputError(f"{path}: not a valid tokenizer.json ({str(e).splitlines()[0]})")


# Bumped whenever the canonical form below changes: it is hashed along with it, and the
# bundled corpus cache (data/prep.py) is keyed by it, so a cache made under another
# scheme is never paired with this one.
TOKENIZER_HASH_SCHEME = "toy-tokenizer-hash/2"

# Model options that change ids, per model type, with the value a tokenizer.json that
# lacks the field means. Other fields of the model section, including ones a later
# `tokenizers` release may add, stay out of the hash.
_MODEL_OPTIONS: dict[str, dict] = {
    "BPE": {
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": False,
        "dropout": None,
    },
    "Unigram": {"unk_id": None, "byte_fallback": False},
    "WordPiece": {
        "unk_token": "[UNK]",
        "continuing_subword_prefix": "##",
        "max_input_chars_per_word": 100,
    },
    "WordLevel": {"unk_token": "<unk>"},
}
# Normalizer / pre-tokenizer fields that only move offsets (trim_offsets) or that older
# releases wrote and newer ones derive (Metaspace's str_rep, add_prefix_space) ...
_COMPONENT_DROP = {"ByteLevel": ("trim_offsets",), "Metaspace": ("str_rep", "add_prefix_space")}
# ... and fields newer releases added, with the behaviour a file without them had.
_COMPONENT_DEFAULTS = {
    "ByteLevel": {"add_prefix_space": True, "use_regex": True},
    "Metaspace": {"split": True},
    "Split": {"invert": False},
}


def hash_matches(tok: Tokenizer, h: bytes) -> bool:
    """Whether a token file's hash `h` says it was made with `tok`: the canonical hash,
    or the one toy wrote before it (sha256 of the library's JSON, computed only when the
    first does not match), so corpora prepared by earlier toy versions keep training as
    long as the library writes the same JSON."""
    if h == tokenizer_hash(tok):
        return True
    legacy = hashlib.sha256(
        json.dumps(json.loads(tok.to_str()), sort_keys=True, separators=(",", ":")).encode()
    ).digest()
    return h == legacy


def tokenizer_hash(tok: Tokenizer) -> bytes:
    """sha256 (32 bytes) of a canonical form of what decides the ids a tokenizer gives,
    stored in token-file headers so a token file is never paired with another tokenizer.

    Hashing `tok.to_str()` itself would tie every prepared .bin to one `tokenizers`
    release's way of writing JSON (merges went from "a b" strings to ["a", "b"] pairs,
    Metaspace's add_prefix_space became prepend_scheme, fields get added). So the fields
    are read from that JSON and rebuilt in a fixed form of toy's own:

    In: the model type; its vocabulary (token -> id; Unigram: [token, score] in id
    order); BPE merges as [left, right] pairs in rank order, whichever way they were
    written; the model options that change ids (`_MODEL_OPTIONS`: unk token,
    byte_fallback, fuse_unk, ignore_merges, subword prefix/suffix, dropout), with their
    defaults filled in; the normalizer and the pre-tokenizer with sorted keys, minus
    fields that only move offsets and with old/new spellings of the same option made one
    (`_COMPONENT_DROP`, `_COMPONENT_DEFAULTS`); the added tokens (id, content, special,
    single_word, lstrip, rstrip, normalized: all change which text they match), by id;
    and `TOKENIZER_HASH_SCHEME`.

    Out: the decoder (text from ids, not ids), padding and truncation (batching), the
    format version, and the post-processor (the BOS/EOS a GGUF asks for): it adds ids
    around each document, it does not change which ids a text gets, so a token file
    made with it (`toy prep`) matches the GGUF's own tokenizer whether or not the file
    asks for BOS."""
    j = json.loads(tok.to_str())
    canon = {
        "scheme": TOKENIZER_HASH_SCHEME,
        "model": _canonical_model(j.get("model") or {}),
        "normalizer": _canonical_component(j.get("normalizer")),
        "pre_tokenizer": _canonical_component(j.get("pre_tokenizer")),
        "added_tokens": sorted(
            [
                a["id"],
                a["content"],
                bool(a.get("special", False)),
                bool(a.get("single_word", False)),
                bool(a.get("lstrip", False)),
                bool(a.get("rstrip", False)),
                bool(a.get("normalized", not a.get("special", False))),
            ]
            for a in j.get("added_tokens") or ()
        ),
    }
    return hashlib.sha256(
        json.dumps(canon, sort_keys=True, separators=(",", ":")).encode()
    ).digest()


def _canonical_model(m: dict) -> dict:
    kind = m.get("type")
    if kind not in _MODEL_OPTIONS:  # a model toy does not know: every field as written
        return {k: _canonical_component(v) for k, v in m.items()}
    out = {"type": kind, **{k: m.get(k, default) for k, default in _MODEL_OPTIONS[kind].items()}}
    if kind == "Unigram":
        out["vocab"] = [[t, float(score)] for t, score in m.get("vocab") or ()]
    else:
        out["vocab"] = m.get("vocab") or {}
    if kind == "BPE":
        merges = m.get("merges") or []
        if merges and isinstance(
            merges[0], str
        ):  # the older "a b" layout: one release writes one layout
            merges = [x.split(" ", 1) for x in merges]
        out["merges"] = merges
    return out


def _canonical_component(c):
    """A normalizer / pre-tokenizer (nested through Sequence) in one spelling."""
    if isinstance(c, list):
        return [_canonical_component(x) for x in c]
    if not isinstance(c, dict):
        return c
    kind, c = c.get("type"), dict(c)
    if kind == "Metaspace" and "prepend_scheme" not in c:  # written before prepend_scheme existed
        c["prepend_scheme"] = "always" if c.get("add_prefix_space", True) else "never"
    for k in _COMPONENT_DROP.get(kind, ()):
        c.pop(k, None)
    for k, default in _COMPONENT_DEFAULTS.get(kind, {}).items():
        c.setdefault(k, default)
    return {k: _canonical_component(v) for k, v in c.items()}


def eos_id(tok: Tokenizer) -> int | None:
    return tok.token_to_id(EOS_TOKEN)


def encode_batches(
    tok: Tokenizer, texts: list[str], batch: int = 256, add_special_tokens: bool = False
) -> Iterator[list[int]]:
    """Encode many texts using the library's own thread pool (with the tokenizer's own
    BOS/EOS rules, its post-processor, when `add_special_tokens`)."""
    for i in range(0, len(texts), batch):
        for enc in tok.encode_batch(texts[i : i + batch], add_special_tokens=add_special_tokens):
            yield enc.ids


def special_affixes(tok: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids a tokenizer's rules put before and after every text it encodes: a GGUF's
    BOS when it sets tokenizer.ggml.add_bos_token, its EOS for add_eos_token (the
    post-processor `from_gguf_metadata` builds), a tokenizer.json's own template; ([], [])
    for toy's trained BPE. Found by encoding one probe text with and without them."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain) :]
    return [], []  # a post-processor that rewrites the text's own ids: none toy makes


def encode_prompt(tok: Tokenizer, text: str) -> list[int]:
    """Ids of text a model continues (`toy infer --prompt`, a rendered chat): the
    tokenizer's leading special ids (a GGUF's BOS when the file asks for it, as llama.cpp
    and transformers encode), unless the text already starts with them (a chat template
    that writes `{{ bos_token }}`: one BOS, never two); never its trailing ones (an EOS
    would end what is to be continued)."""
    ids = tok.encode(text, add_special_tokens=False).ids
    pre, _ = special_affixes(tok)
    return ids if ids[: len(pre)] == pre else pre + ids


# ------------------------------------------------------------------ from GGUF metadata

# llama.cpp's token types (tokenizer.ggml.token_type), as in gguf.TokenType.
_TOKEN_UNKNOWN = 2
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

_OTHER_MODELS = {
    "t5": "unigram",
    "bert": "wordpiece",
    "gemma4": "sentencepiece",
    "rwkv": "rwkv",
    "plamo2": "plamo2",
}


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
        bos=get("bos"),
        eos=get("eos"),
        pad=get("padding"),
        unk=get("unknown"),
        add_bos=meta.get("tokenizer.ggml.add_bos_token") is True,
        add_eos=meta.get("tokenizer.ggml.add_eos_token") is True,
    )


@lru_cache(maxsize=1)
def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes map to
    themselves, the rest to code points from 256 up, in byte order."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
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
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = _LLAMA3_SPLIT if pre in _LLAMA3_STYLE else _QWEN2_SPLIT
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def from_gguf_metadata(meta: dict, source: str | None = None) -> Tokenizer:
    """An HF `tokenizers` Tokenizer from a GGUF's `tokenizer.ggml.*` fields, with the
    file's own ids. Two kinds of vocabulary:

    - "gpt2": byte-level BPE with the file's merges and its `tokenizer.ggml.pre` split;
    - "llama": SentencePiece-style (Llama 1/2, Mistral, Gemma 1-3): "▁" for spaces,
      byte fallback, and merges rebuilt from the scores (see `_sentencepiece`).

    Both give the same ids as transformers' GGUF loader (`AutoTokenizer.from_pretrained(
    dir, gguf_file=...)`), which tests/formats/test_gguf.py and
    tests/data/test_tokenizer_spm.py check.
    Control and unknown tokens become special added tokens, user-defined ones plain added
    tokens, so all are matched whole in text, as llama.cpp does. If the file asks for BOS/EOS
    (add_bos_token), a post-processor adds them when encoding with add_special_tokens=True.
    `gguf_special_ids(meta)` gives the bos/eos/pad/unk ids. `source` names the file in
    error messages."""
    where = f"{source}: " if source else ""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise InputError(
            f"{where}the GGUF has no tokenizer (no tokenizer.ggml.model key); pass a tokenizer.json"
        )
    if kind not in ("gpt2", "llama"):
        what = _OTHER_MODELS.get(kind, "unknown kind") if isinstance(kind, str) else "unknown kind"
        raise InputError(
            f"{where}tokenizer model {kind!r} ({what}) is not supported yet; "
            "supported: gpt2 (BPE), llama (sentencepiece)"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise InputError(
            f"{where}GGUF key tokenizer.ggml.tokens is missing or not a list of strings"
        )
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None and (not isinstance(types, list) or len(types) != len(tokens)):
        n = len(types) if isinstance(types, list) else "?"
        raise InputError(
            f"{where}GGUF key tokenizer.ggml.token_type has {n} entries for {len(tokens)} tokens; "
            "the file is damaged"
        )
    if kind == "gpt2":
        tok, vocab = _byte_level_bpe(meta, tokens, where)
    else:
        tok, vocab = _sentencepiece(meta, tokens, where)

    # llama.cpp matches control, unknown and user-defined tokens whole, before BPE; added
    # tokens do the same here (the first two special, as transformers makes <unk> too).
    # Only tokens spelled as in the vocabulary are added, so no id is new.
    special, plain = [], []
    for i, (t, ty) in enumerate(zip(tokens, types or ())):
        if ty in (_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED) and vocab.get(t) == i:
            is_special = ty != _TOKEN_USER_DEFINED
            (special if is_special else plain).append(
                AddedToken(t, special=is_special, normalized=False)
            )
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
        tok.post_processor = processors.TemplateProcessing(
            single=single, special_tokens=list(dict.fromkeys(marks))
        )
    return tok


def _byte_level_bpe(meta: dict, tokens: list[str], where: str) -> tuple[Tokenizer, dict[str, int]]:
    """gpt2-style byte-level BPE: the file's merges, its pre-tokenizer by name."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise InputError(
            f"{where}GGUF pre-tokenizer {pre!r} is not supported; supported: "
            f"{', '.join(GGUF_PRE_TOKENIZERS)}"
        )
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise InputError(
            f"{where}GGUF key tokenizer.ggml.merges is missing or not a list of strings; "
            "a gpt2 (BPE) tokenizer needs its merges"
        )

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
    pairs = _split_merges(merges, where)
    try:
        # Llama 3's tokenizer takes a pre-token that is itself in the vocabulary as is,
        # before any merge (HF's ignore_merges; llama.cpp does the same for this pre type).
        bpe = models.BPE(
            vocab=vocab, merges=pairs, ignore_merges=pre in ("llama-bpe", "llama3", "llama-v3")
        )
    except Exception as e:  # tokenizers raises a bare Exception for a merge of unknown tokens
        raise InputError(
            f"{where}GGUF merges do not match its tokens ({str(e).splitlines()[0]}); "
            "the file is damaged"
        )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok, vocab


def _split_merges(merges: list[str], where: str) -> list[tuple[str, str]]:
    pairs = []
    for j, m in enumerate(merges):
        parts = m.split(" ")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise InputError(
                f"{where}GGUF merge {j} ({m[:40]!r}) is not two tokens separated by one space; "
                "the file is damaged"
            )
        pairs.append((parts[0], parts[1]))
    return pairs


# Architectures whose SentencePiece vocabulary transformers loads as GemmaTokenizer: no
# space prefix, and merges ranked by position in the file rather than by score.
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


def _sentencepiece(meta: dict, tokens: list[str], where: str) -> tuple[Tokenizer, dict[str, int]]:
    """A SentencePiece-BPE vocabulary (`tokenizer.ggml.model == "llama"`) as an HF BPE.

    SentencePiece and llama.cpp encode by repeatedly joining the adjacent pair of pieces
    whose join is in the vocabulary with the best score. An HF BPE does the same when its
    merges are every split (left, right) of every token, ranked by the token's score: the
    merge it applies first is always the one with the best-scoring result. This is how
    transformers converts these files too, and its choices are kept so the ids agree:

    - Gemma files rank by position (Gemma's scores do not follow its merge order: the
      single characters score below the pieces built from them), other files by score;
      equal ranks put the longer left piece first.
    - Gemma stores its runs of spaces as real spaces ("  "); they are respelled "▁▁" so
      the merges reach them. Text is normalized " " -> "▁" with no space prefix.
    - Others (Llama, Mistral) put "▁" before the text (`add_space_prefix`, true unless
      the file says false) with a Metaspace pre-tokenizer, which prefixes only the start
      of the text, not the text after a special token (llama.cpp prefixes both; transformers
      does not). Phi-3 prefixes every stretch of text between special tokens, as llama.cpp.
    - Characters outside the vocabulary become their UTF-8 bytes, <0x00>..<0xFF>
      (byte_fallback); the decoder turns those back into text.

    A duplicated token keeps its last id, as in llama.cpp and transformers."""
    arch = meta.get("general.architecture")
    gemma = arch in _GEMMA_ARCHS
    n = len(tokens)
    if gemma:
        tokens = ["▁" * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = dict(zip(tokens, range(n)))

    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None:  # rare; transformers then uses them as given
        if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
            raise InputError(
                f"{where}GGUF key tokenizer.ggml.merges is not a list of strings; "
                "the file is damaged"
            )
        pairs = _split_merges(merges, where)
    else:
        if gemma:
            rank = [float(-i) for i in range(n)]
        else:
            rank = meta.get("tokenizer.ggml.scores")
            if (
                not isinstance(rank, list)
                or len(rank) != n
                or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                    for x in rank
                )
            ):
                got = f"{len(rank)} entries" if isinstance(rank, list) else "missing"
                raise InputError(
                    f"{where}GGUF key tokenizer.ggml.scores is {got} or not finite numbers for {n} "
                    "tokens; a sentencepiece (llama) tokenizer needs one score per token"
                )
        pairs = _merges_from_ranks(vocab, rank)

    unk_id = gguf_special_ids(meta).unk
    unk = tokens[unk_id] if unk_id is not None else ("<unk>" if "<unk>" in vocab else None)
    try:
        bpe = models.BPE(
            vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True
        )
    except Exception as e:  # tokenizers raises a bare Exception for a merge of unknown tokens
        raise InputError(
            f"{where}GGUF merges do not match its tokens ({str(e).splitlines()[0]}); "
            "the file is damaged"
        )
    tok = Tokenizer(bpe)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    prefix = meta.get("tokenizer.ggml.add_space_prefix", not gemma) is True
    if gemma:
        tok.normalizer = normalizers.Replace(" ", "▁")
    elif arch == "phi3":
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if prefix else "never", split=False
        )
        if prefix:
            steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok, vocab


def _merges_from_ranks(vocab: dict[str, int], rank: list[float]) -> list[tuple[str, str]]:
    """Every split (left, right) of every token with both halves in the vocabulary, best
    rank first; equal ranks: longer left first, then longer right, then earlier token
    (transformers' `generate_merges` order). Gemma's 262,144 tokens give ~515k merges;
    one list comprehension (~1 s there) is the fastest plain-Python way found."""
    merges = [
        (t[:k], t[k:])
        for t in vocab
        for k in range(len(t) - 1, 0, -1)
        if t[:k] in vocab and t[k:] in vocab
    ]
    ranks = [rank[i] for i in vocab.values()]
    if any(a <= b for a, b in zip(ranks, ranks[1:])):  # tokens not in rank order: sort (stable)
        merges.sort(key=lambda m: (-rank[vocab[m[0] + m[1]]], -len(m[0]), -len(m[1])))
    return merges
