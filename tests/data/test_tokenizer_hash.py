"""`tokenizer_hash`: follows what decides the ids, not how `tokenizers` writes its JSON.

Token files store this hash, so a change of JSON layout in a `tokenizers` release must not
change it (or every prepared .bin would stop matching its tokenizer.json), while any
change that can move an id must.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors

from toy.tokenizer import (
    _canonical_component,
    _canonical_model,
    from_gguf_metadata,
    load,
    tokenizer_hash,
    train_bpe,
)

TEXT = [
    "To be, or not to be: that is the question. 12345 héllo wörld",
    "def f(x):\n    return x**2\n",
] * 20


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_bpe(TEXT, 300)


def rewrite(tok: Tokenizer, edit) -> Tokenizer:
    """The tokenizer with its JSON edited by `edit(dict)`, reloaded."""
    j = json.loads(tok.to_str())
    edit(j)
    return Tokenizer.from_str(json.dumps(j))


def test_stable(tok, tmp_path):
    h = tokenizer_hash(tok)
    assert len(h) == 32 and tokenizer_hash(tok) == h
    assert tokenizer_hash(Tokenizer.from_str(tok.to_str())) == h
    tok.save(str(tmp_path / "tokenizer.json"))
    assert tokenizer_hash(load(tmp_path / "tokenizer.json")) == h
    assert tokenizer_hash(train_bpe(TEXT, 300)) == h  # training is deterministic


def test_merges_layout_does_not_count(tok):
    """Merges written as "a b" strings (older releases) or ["a", "b"] pairs (newer) hash alike."""
    j = json.loads(tok.to_str())
    as_pairs = isinstance(j["model"]["merges"][0], list)

    def flip(j):
        j["model"]["merges"] = [
            " ".join(m) if as_pairs else m.split(" ") for m in j["model"]["merges"]
        ]

    flipped = rewrite(tok, flip)
    assert tokenizer_hash(flipped) == tokenizer_hash(tok)
    assert flipped.encode(TEXT[0]).ids == tok.encode(TEXT[0]).ids  # and the ids are indeed the same
    # Hashed straight from the flipped JSON too (the reload above may rewrite it as it likes).
    j = json.loads(tok.to_str())
    flip(j)
    assert _canonical_model(j["model"]) == _canonical_model(json.loads(tok.to_str())["model"])


def test_what_does_not_move_ids_does_not_count(tok):
    h = tokenizer_hash(tok)
    other = Tokenizer.from_str(tok.to_str())
    other.decoder = decoders.Metaspace()
    other.post_processor = processors.TemplateProcessing(
        single=["<|endoftext|>", "$A"], special_tokens=[("<|endoftext|>", 0)]
    )
    other.enable_padding(pad_id=0)
    other.enable_truncation(max_length=16)
    assert tokenizer_hash(other) == h
    # trim_offsets moves offsets only
    assert (
        tokenizer_hash(rewrite(tok, lambda j: j["pre_tokenizer"].update(trim_offsets=False))) == h
    )


def test_legacy_spellings_are_one():
    """Fields older releases wrote (Metaspace's add_prefix_space and str_rep before
    prepend_scheme and split; ByteLevel without use_regex) read as what they meant."""
    old = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Metaspace", "replacement": "▁", "str_rep": "▁", "add_prefix_space": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True},
        ],
    }
    new = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True},
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": False,
                "use_regex": True,
            },
        ],
    }
    assert _canonical_component(old) == _canonical_component(new)
    off = {"type": "Metaspace", "replacement": "▁", "str_rep": "▁", "add_prefix_space": False}
    assert _canonical_component(off)["prepend_scheme"] == "never"


@pytest.mark.parametrize(
    "change",
    [
        "merge_order",
        "merge_dropped",
        "vocab_token",
        "pre_tokenizer",
        "normalizer",
        "added_token",
        "added_special_flag",
        "byte_fallback",
        "unk_token",
    ],
)
def test_what_moves_ids_counts(tok, change):
    h = tokenizer_hash(tok)
    if change == "merge_order":
        other = rewrite(tok, lambda j: j["model"]["merges"].insert(0, j["model"]["merges"].pop(5)))
    elif change == "merge_dropped":
        other = rewrite(tok, lambda j: j["model"]["merges"].pop())
    elif change == "vocab_token":

        def rename(j):  # swap the ids of two byte tokens
            v = j["model"]["vocab"]
            v["a"], v["b"] = v["b"], v["a"]

        other = rewrite(tok, rename)
    elif change == "pre_tokenizer":
        other = Tokenizer.from_str(tok.to_str())
        other.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False),
            ]
        )
    elif change == "normalizer":
        other = Tokenizer.from_str(tok.to_str())
        other.normalizer = normalizers.NFKC()
    elif change == "added_token":
        other = Tokenizer.from_str(tok.to_str())
        other.add_tokens([AddedToken("<tool>", normalized=False)])
    elif change == "added_special_flag":
        other = rewrite(tok, lambda j: j["added_tokens"][0].update(special=False))
    elif change == "byte_fallback":
        other = rewrite(tok, lambda j: j["model"].update(byte_fallback=True))
    else:
        other = rewrite(tok, lambda j: j["model"].update(unk_token="<|endoftext|>"))
    assert tokenizer_hash(other) != h, change


def test_sentencepiece_gguf_tokenizer_hash_is_stable():
    """A tokenizer rebuilt from the same GGUF metadata always hashes the same (warm-start
    and LoRA compare a corpus's header against it)."""
    from helpers.spm import spm_metadata

    a, b = from_gguf_metadata(spm_metadata("gemma3")), from_gguf_metadata(spm_metadata("gemma3"))
    assert tokenizer_hash(a) == tokenizer_hash(b)
    assert tokenizer_hash(a) != tokenizer_hash(from_gguf_metadata(spm_metadata("llama")))


def test_a_corpus_prepared_before_the_canonical_hash_still_trains(tmp_path, toy_cli):
    """Token files written by earlier toy versions carry sha256 of the library's JSON:
    still accepted (as long as the library writes the same JSON), not a forced re-prep."""
    import hashlib
    import json as _json

    from toy.data.prep import bundled_text_paths
    from toy.data.tokens import HEADER, read_tokens, tokenizer_beside
    from toy.tokenizer import load

    code, _, err = toy_cli(
        "prep", bundled_text_paths()[0], "--out", tmp_path / "c.bin", "--vocab-size", "300"
    )
    assert code == 0, err
    tok = load(tokenizer_beside(tmp_path / "c.bin"))
    legacy = hashlib.sha256(
        _json.dumps(_json.loads(tok.to_str()), sort_keys=True, separators=(",", ":")).encode()
    ).digest()
    for name in ("c.bin", "c.val.bin"):
        raw = bytearray((tmp_path / name).read_bytes())
        raw[HEADER.size - 32 : HEADER.size] = legacy
        (tmp_path / name).write_bytes(bytes(raw))
    assert read_tokens(tmp_path / "c.bin").tokenizer_hash == legacy
    code, _, err = toy_cli(
        "train",
        "--corpus",
        tmp_path / "c.bin",
        "--preset",
        "tiny",
        "--steps",
        "1",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--out",
        tmp_path / "runs",
    )
    assert code == 0, err
