"""SentencePiece-style GGUF tokenizers (`tokenizer.ggml.model == "llama"`): toy's
`from_gguf_metadata` gives the same ids and the same decoded text as transformers' GGUF
loader.

- A tiny synthetic vocabulary (control, user-defined and byte tokens, scores) written
  with gguf.GGUFWriter under three architectures, each read back by toy's own header
  parser and by transformers: covers the Gemma, Llama and Phi-3 conventions in CI.
- The real Gemma-3-270M vocabulary (262,144 tokens) when scripts/get-gemma3.sh can fetch
  it (slow).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers.gguf_fixtures import gemma3_gguf, hf_gguf_tokenizer  # noqa: E402,F401
from helpers.spm import spm_metadata  # noqa: F401

from toy.errors import InputError  # noqa: E402
from toy.formats.gguf import read_gguf_tokenizer  # noqa: E402
from toy.formats.gguf_header import read_gguf_header  # noqa: E402
from toy.tokenizer import from_gguf_metadata  # noqa: E402


def write_spm_gguf(path: Path, meta: dict) -> Path:
    """A GGUF holding only hyper-parameters and the tokenizer: enough for transformers'
    AutoTokenizer, which reads the architecture's config before the vocabulary."""
    import gguf

    arch = meta["general.architecture"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(4)
    w.add_value_length(4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_scores(meta["tokenizer.ggml.scores"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_unk_token_id(meta["tokenizer.ggml.unknown_token_id"])
    if "tokenizer.ggml.padding_token_id" in meta:
        w.add_pad_token_id(meta["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])
    w.add_add_eos_token(meta["tokenizer.ggml.add_eos_token"])
    w.add_add_space_prefix(meta["tokenizer.ggml.add_space_prefix"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_tokenizer(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def assert_same_as_transformers(tok, hf, texts: list[str]) -> None:
    """Same ids (BOS included), and the same decoded text with and without specials."""
    for text in texts:
        ids = tok.encode(text).ids
        want = hf(text)["input_ids"]
        assert ids == want, (
            text,
            [tok.id_to_token(i) for i in ids],
            [tok.id_to_token(i) for i in want],
        )
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(want), text
        assert tok.decode(ids) == hf.decode(want, skip_special_tokens=True), text


# ------------------------------------------------------------------ synthetic vocabulary

TINY_TEXTS = [
    "",
    "hello world",
    " hello",
    "  hello",
    "the  world   the",
    "abc",
    "abcabc bc",
    "hello\n\nworld\n",
    "\tx\t\t",
    "é é",
    "日本🙂 x",
    "<start_of_turn>hello<end_of_turn>\n",
    "<bos>the<eos>",
    "a<b>b</b>",
    "123123 12 1",
    "   ",
    " ",
    "trailing ",
    "<unk>",
    "<s>x</s>",
    "x▁y",
]


@pytest.mark.parametrize("arch", ["gemma3", "llama", "phi3"])
def test_synthetic_matches_transformers(tmp_path, arch):
    path = write_spm_gguf(tmp_path / f"tiny-{arch}.gguf", spm_metadata(arch))
    tok = read_gguf_tokenizer(path)
    hf = hf_tokenizer(path)
    assert tok.get_vocab_size() == len(spm_metadata(arch)["tokenizer.ggml.tokens"]) == len(hf)
    assert_same_as_transformers(tok, hf, TINY_TEXTS)
    # Gemma ranks merges by position ("ab" first), the others by score ("bc" first).
    pieces = [tok.id_to_token(i) for i in tok.encode("abc", add_special_tokens=False).ids]
    lead = [] if arch == "gemma3" else ["▁"]
    assert pieces == lead + (["ab", "c"] if arch == "gemma3" else ["a", "bc"]), pieces


def test_synthetic_roundtrip_and_specials():
    """Plain text decodes back to itself (bytes outside the vocabulary included);
    control and user-defined tokens are single ids; BOS comes from add_bos_token."""
    tok = from_gguf_metadata(spm_metadata("gemma3"))
    for text in ["hello world", "  the\t\tworld\n\n", "日本🙂 é", "123 abc"]:
        ids = tok.encode(text).ids
        assert ids[0] == 2 and tok.decode(ids) == text
    ids = tok.encode("<start_of_turn>x<b>\n", add_special_tokens=False).ids
    assert ids[0] == 5 and 10 in ids and ids[-1] == 7
    assert tok.encode("hi").ids[0] == 2 and tok.encode("hi", add_special_tokens=False).ids[0] != 2
    # byte fallback: 日 is E6 97 A5
    assert [tok.id_to_token(i) for i in tok.encode("日", add_special_tokens=False).ids] == [
        "<0xE6>",
        "<0x97>",
        "<0xA5>",
    ]
    no_bos = from_gguf_metadata({**spm_metadata("gemma3"), "tokenizer.ggml.add_bos_token": False})
    assert no_bos.encode("hi").ids == no_bos.encode("hi", add_special_tokens=False).ids


def test_space_prefix_flag():
    """Llama-style vocabularies put "▁" before the text unless the file says not to."""
    meta = spm_metadata("llama")
    with_prefix = from_gguf_metadata(meta)
    assert with_prefix.encode("hello", add_special_tokens=False).ids == [
        with_prefix.token_to_id("▁hello")
    ]
    without = from_gguf_metadata({**meta, "tokenizer.ggml.add_space_prefix": False})
    assert (
        without.token_to_id("▁hello") not in without.encode("hello", add_special_tokens=False).ids
    )
    assert without.decode(without.encode(" hello").ids) == " hello"


def test_merges_from_the_file():
    """A file that lists merges gets them as given (as transformers does), not rebuilt."""
    meta = {**spm_metadata("gemma3"), "tokenizer.ggml.merges": ["b c", "a b"]}
    tok = from_gguf_metadata(meta)
    assert [tok.id_to_token(i) for i in tok.encode("abc", add_special_tokens=False).ids] == [
        "a",
        "bc",
    ]
    with pytest.raises(InputError, match="merge 0 .* is not two tokens"):
        from_gguf_metadata({**meta, "tokenizer.ggml.merges": ["abc"]})


def test_bad_sentencepiece_metadata():
    meta = spm_metadata("llama")
    with pytest.raises(InputError, match=r"^x\.gguf: GGUF key tokenizer\.ggml\.scores is missing"):
        from_gguf_metadata(
            {k: v for k, v in meta.items() if k != "tokenizer.ggml.scores"}, source="x.gguf"
        )
    with pytest.raises(InputError, match="scores is 3 entries"):
        from_gguf_metadata({**meta, "tokenizer.ggml.scores": [0.0, 1.0, 2.0]})
    with pytest.raises(InputError, match="not finite numbers"):
        from_gguf_metadata(
            {**meta, "tokenizer.ggml.scores": [float("nan")] * len(meta["tokenizer.ggml.tokens"])}
        )
    with pytest.raises(InputError, match="token_type has 1 entries"):
        from_gguf_metadata({**meta, "tokenizer.ggml.token_type": [1]})
    with pytest.raises(InputError, match=r"tokenizer model 't5' \(unigram\) is not supported yet"):
        from_gguf_metadata({**meta, "tokenizer.ggml.model": "t5"})


# ------------------------------------------------------------------ real Gemma-3-270M

GEMMA_TEXTS = [
    "",
    " ",
    "   ",
    "Hello world",
    " leading space",
    "  two leading",
    "trailing  ",
    "a  b   c    d",
    "\n",
    "\n\nx\n\n\ny\n",
    "\r\nwindows\r\n",
    "tab\there\t\tand\t\t\t",
    "    indented\n        code",
    "héllo wörld — ünïcödé café naïve",
    "日本語のテキスト 世界 中文字符",
    "Привет мир",
    "مرحبا بالعالم",
    "emoji 🙂🚀👩‍👩‍👧 done",
    "🙂",
    "𝔹𝕆𝕃𝔻 ǅ ﬁ Ω",
    "\u00a0nbsp\u3000ideographic",
    "ZWJ\u200dtest\u200b",
    "numbers 12345 3.14159 1,000,000 99999999999999",
    "1234567890" * 5,
    "x" * 50,
    "def f(x):\n    return x**2  # sq\n",
    "for (int i = 0; i < n; ++i) { s += a[i]; }",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
    "<bos>text<eos>",
    "a<start_of_turn>b",
    "<unk> and <pad>",
    "<table><tr><td>x</td></tr></table>",
    "<0x41> is not a byte",
    "▁already▁escaped",
]


@pytest.fixture(scope="module")
def gemma_tokenizers(gemma3_gguf):
    meta = read_gguf_header(gemma3_gguf).metadata
    t0 = time.perf_counter()
    tok = from_gguf_metadata(meta, source=str(gemma3_gguf))
    seconds = time.perf_counter() - t0
    return tok, hf_gguf_tokenizer(gemma3_gguf), seconds


@pytest.mark.slow
def test_gemma3_matches_transformers(gemma_tokenizers, record_property):
    tok, hf, seconds = gemma_tokenizers
    record_property("gemma3_tokenizer_load_s", round(seconds, 3))
    print(f"Gemma-3 tokenizer (262,144 tokens) built in {seconds:.2f} s")
    assert tok.get_vocab_size() == 262144
    assert seconds < 10, f"building Gemma's tokenizer took {seconds:.1f} s"  # transformers: ~13 s
    assert_same_as_transformers(tok, hf, GEMMA_TEXTS)


@pytest.mark.slow
def test_gemma3_roundtrip_and_chat_tokens(gemma_tokenizers):
    tok, _, _ = gemma_tokenizers
    for text in GEMMA_TEXTS:
        if "<" not in text and "▁" not in text:
            assert tok.decode(tok.encode(text).ids) == text, text
    ids = tok.encode("<start_of_turn>user\nhi<end_of_turn>\n", add_special_tokens=False).ids
    assert ids[0] == 105 and 106 in ids and ids[-1] == 107  # <start_of_turn>, <end_of_turn>, "\n"
    assert tok.encode("hi").ids[0] == 2  # the file says add_bos_token
