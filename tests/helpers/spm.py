"""SentencePiece-style GGUF tokenizer metadata made by hand (`spm_metadata`)."""

from __future__ import annotations

from helpers.gguf_fixtures import gemma3_gguf  # noqa: E402,F401

CONTROL, USER_DEFINED, BYTE, NORMAL, UNKNOWN = 3, 4, 6, 1, 2


# (token, type) of the synthetic vocabulary, in file order, after the special tokens each
# family starts with (transformers adds its default specials to a vocabulary lacking them).
# "ab" comes before "bc" but scores lower (SCORES below): Gemma ranks merges by position,
# the others by score, so "abc" splits differently under the two conventions and the test
# sees which was used.
_GEMMA_HEAD = [
    ("<pad>", CONTROL),
    ("<eos>", CONTROL),
    ("<bos>", CONTROL),
    ("<unk>", CONTROL),
    ("<mask>", CONTROL),
]


_LLAMA_HEAD = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL)]


_TURNS = [
    ("<start_of_turn>", CONTROL),
    ("<end_of_turn>", CONTROL),
    ("\n", USER_DEFINED),
    ("\n\n", USER_DEFINED),
    ("\t", USER_DEFINED),
    ("<b>", USER_DEFINED),
]


_PIECES = [
    "ab",
    "bc",
    "▁t",
    "he",
    "▁the",
    "ll",
    "llo",
    "▁he",
    "▁hello",
    "or",
    "▁w",
    "▁wor",
    "ld",
    "▁world",
    "12",
    "123",
    "é",
    "▁é",
    "▁",
    "a",
    "b",
    "c",
    "d",
    "e",
    "h",
    "l",
    "o",
    "r",
    "t",
    "w",
    "x",
    "1",
    "2",
    "3",
]


SCORES = {
    "ab": -5.0,
    "bc": -1.0,
    "▁the": -2.0,
    "▁t": -3.0,
    "he": -3.0,
    "llo": -4.0,
}  # others: -10 - position


def spm_metadata(arch: str) -> dict:
    """The synthetic vocabulary as a GGUF's `tokenizer.ggml.*` key/values. Gemma's ids:
    <pad> 0, <eos> 1, <bos> 2, <unk> 3, <start_of_turn> 5, "\n" 7, <b> 10; Llama's:
    <unk> 0, <s> 1, </s> 2."""
    gemma = arch.startswith("gemma")
    head = (_GEMMA_HEAD if gemma else _LLAMA_HEAD) + _TURNS
    if gemma:  # Gemma stores its runs of spaces as real spaces
        head += [("  ", USER_DEFINED), ("   ", USER_DEFINED)]
    tokens = [t for t, _ in head] + [f"<0x{b:02X}>" for b in range(256)] + _PIECES
    types = [ty for _, ty in head] + [BYTE] * 256 + [NORMAL] * len(_PIECES)
    scores = (
        [-1000.0] * len(head)
        + [0.0] * 256
        + [SCORES.get(t, -10.0 - i) for i, t in enumerate(_PIECES)]
    )
    special = dict(bos=2, eos=1, unknown=3, padding=0) if gemma else dict(bos=1, eos=2, unknown=0)
    return {
        "general.architecture": arch,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        **{f"tokenizer.ggml.{k}_token_id": v for k, v in special.items()},
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": not gemma,
    }
