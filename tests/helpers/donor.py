"""A tiny donor GGUF and a corpus in its tokenizer (`make_donor`, the `donor` fixture), and
the tiny preset's flags (TINY) the warm-start runs use."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.gguf_fixtures import tiny_model, write_llama_gguf  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402
from toy.tokenizer import train_bpe  # noqa: E402

TINY = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2"]


PAD_ROWS = 8  # the donor table has this many unused rows beyond its tokenizer, as padded GGUFs do


def make_donor(d: Path) -> dict:
    """A tiny llama GGUF (width 64) with its own byte-level BPE, and a corpus prepped with
    the donor's tokenizer (`toy prep TEXT --tokenizer donor.gguf`)."""
    from toy.cli.main import main

    text = bundled_text_paths()[0].read_text()[:50000]
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    model = tiny_model(seed=3, vocab_size=vocab + PAD_ROWS)
    donor = write_llama_gguf(d / "donor.gguf", model, tok)
    txt = d / "text.txt"
    txt.write_text(text)
    assert (
        main(
            [
                "prep",
                str(txt),
                "--out",
                str(d / "c.bin"),
                "--tokenizer",
                str(donor),
                "--val-fraction",
                "0.1",
            ]
        )
        == 0
    )
    table = model.embed_tokens.weight.detach().clone()  # (vocab + PAD_ROWS, 64)
    return {
        "dir": d,
        "gguf": donor,
        "corpus": d / "c.bin",
        "table": table,
        "vocab": vocab,
        "text": txt,
    }


@pytest.fixture(scope="module")
def donor(tmp_path_factory):
    return make_donor(tmp_path_factory.mktemp("warm"))
