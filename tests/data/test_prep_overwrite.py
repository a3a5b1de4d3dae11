"""`toy prep ... --out NAME.bin` never silently replaces a token file or its siblings
(NAME.val.bin, NAME.tokenizer.json): runs made on them would no longer resume (issue 23
item 14). It exits 2 naming the file and --force; with --force it overwrites."""

from __future__ import annotations

import json

import numpy as np

from toy.data.prep import bundled_text_paths
from toy.data.tokens import tokenizer_path_for, val_path_for, write_tokens


def _snapshot(*paths):
    return {p: p.read_bytes() for p in paths if p.exists()}


def test_prep_refuses_to_overwrite_a_token_file_and_force_overwrites(toy_cli, tmp_path):
    plays = bundled_text_paths()
    out = tmp_path / "corpus.bin"
    code, _, err = toy_cli("prep", plays[0], "--out", out, "--vocab-size", "300")
    assert code == 0, err
    files = (out, val_path_for(out), tokenizer_path_for(out))
    before = _snapshot(*files)
    assert len(before) == 3
    code, out_text, err = toy_cli("prep", plays[1], "--out", out, "--vocab-size", "260")
    assert code == 2 and str(out) in err and "--force" in err and "Traceback" not in err, err
    assert _snapshot(*files) == before  # nothing touched
    code, out_text, err = toy_cli(
        "prep", plays[1], "--out", out, "--vocab-size", "260", "--force", "--json"
    )
    assert code == 0, err
    assert json.loads(out_text)["vocab_size"] == 260
    assert _snapshot(out)[out] != before[out] and _snapshot(*files).keys() == before.keys()


def test_prep_refuses_when_only_a_sibling_exists(toy_cli, tmp_path):
    txt = bundled_text_paths()[0]
    for sibling in (val_path_for, tokenizer_path_for):
        out = tmp_path / f"{sibling.__name__}.bin"
        s = sibling(out)
        s.write_text("someone else's")
        code, _, err = toy_cli("prep", txt, "--out", out, "--vocab-size", "300")
        assert code == 2 and str(s) in err and "--force" in err, err
        assert s.read_text() == "someone else's" and not out.exists()


def test_prep_may_name_its_own_tokenizer_sibling_as_tokenizer(toy_cli, tmp_path):
    """--tokenizer NAME.tokenizer.json for a new NAME.bin reads that file and leaves it as it is."""
    plays = bundled_text_paths()
    code, _, err = toy_cli("prep", plays[0], "--out", tmp_path / "a.bin", "--vocab-size", "300")
    assert code == 0, err
    tok = tokenizer_path_for(tmp_path / "b.bin")
    tok.write_bytes(tokenizer_path_for(tmp_path / "a.bin").read_bytes())
    code, _, err = toy_cli("prep", plays[1], "--out", tmp_path / "b.bin", "--tokenizer", tok)
    assert code == 0, err


def test_raw_i32_conversion_refuses_to_overwrite(toy_cli, tmp_path):
    raw = tmp_path / "seqs.bin"
    np.arange(100, dtype=np.int32).tofile(raw)
    out = tmp_path / "t.bin"
    write_tokens(out, np.arange(10), 300)
    before = out.read_bytes()
    code, _, err = toy_cli("prep", raw, "--raw-i32", "--vocab-size", "300", "--out", out)
    assert code == 2 and str(out) in err and "--force" in err, err
    assert out.read_bytes() == before
    code, _, err = toy_cli("prep", raw, "--raw-i32", "--vocab-size", "300", "--out", out, "--force")
    assert code == 0, err


def test_a_new_projects_corpus_is_kept(toy_cli, tmp_path):
    """`toy new` writes data/corpus.bin itself; a later `toy prep --out data/corpus.bin` is
    refused."""
    proj = tmp_path / "p"
    code, _, err = toy_cli("new", proj)
    assert code == 0, err
    corpus = proj / "data" / "corpus.bin"
    before = _snapshot(corpus, tokenizer_path_for(corpus))
    code, _, err = toy_cli("prep", bundled_text_paths()[0], "--out", corpus, "--vocab-size", "300")
    assert code == 2 and str(corpus) in err, err
    assert _snapshot(corpus, tokenizer_path_for(corpus)) == before
