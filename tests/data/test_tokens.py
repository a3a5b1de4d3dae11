"""The token file: header, round trip, and every way it can be broken."""

import numpy as np
import pytest

from toy.data.tokens import HEADER, Windows, read_tokens, val_path_for, write_tokens
from toy.errors import InputError


def test_round_trip_u16_and_u32(tmp_path):
    for vocab, dtype in ((1000, np.uint16), (70000, np.uint32)):
        toks = np.arange(500) % vocab
        p = tmp_path / f"t{vocab}.bin"
        write_tokens(p, toks, vocab, b"h" * 32)
        tf = read_tokens(p)
        assert (
            tf.tokens.dtype == dtype and tf.vocab_size == vocab and tf.tokenizer_hash == b"h" * 32
        )
        assert np.array_equal(np.asarray(tf.tokens), toks)
        assert p.stat().st_size == HEADER.size + 500 * np.dtype(dtype).itemsize


def test_raw_int32(tmp_path):
    p = tmp_path / "ts_seqs.bin"
    np.arange(100, dtype=np.int32).tofile(p)
    tf = read_tokens(p, raw_i32=True, vocab_size=100)
    assert len(tf) == 100 and int(tf.tokens[99]) == 99
    with pytest.raises(InputError, match="vocabulary size"):
        read_tokens(p, raw_i32=True)
    with pytest.raises(InputError, match="outside the vocabulary"):
        read_tokens(p, raw_i32=True, vocab_size=50)


@pytest.mark.parametrize(
    "case", ["missing", "bad_magic", "truncated", "too_short", "id_too_big", "empty"]
)
def test_broken_token_files(tmp_path, case):
    p = tmp_path / "c.bin"
    if case != "missing":
        write_tokens(p, np.arange(64), 64)
    data = p.read_bytes() if p.exists() else b""
    expect = {
        "missing": "not found",
        "bad_magic": "bad magic",
        "truncated": "truncated",
        "too_short": "too short",
        "id_too_big": "outside the vocabulary",
        "empty": "too short",
    }[case]
    if case == "bad_magic":
        p.write_bytes(b"NOTTOKEN" + data[8:])
    elif case == "truncated":
        p.write_bytes(data[:-3])
    elif case == "too_short":
        p.write_bytes(data[:20])
    elif case == "id_too_big":
        arr = np.frombuffer(data[64:], dtype=np.uint16).copy()
        arr[10] = 64  # == vocab size
        p.write_bytes(data[:64] + arr.tobytes())
    elif case == "empty":
        p.write_bytes(b"")
    with pytest.raises(InputError, match=expect) as e:
        read_tokens(p)
    assert "\n" not in str(e.value) and str(p.name) in str(e.value)


def test_windows_are_a_pure_function_of_the_batch_index(tmp_path):
    p = tmp_path / "c.bin"
    write_tokens(p, np.arange(1000) % 50, 50)
    w = Windows(read_tokens(p), seq_len=16, batch_size=4, seed=3)
    a, b = w.batch(7), w.batch(7)
    assert np.array_equal(a["ids"], b["ids"])
    assert not np.array_equal(w.batch(7)["ids"], w.batch(8)["ids"])
    assert np.array_equal(
        a["ids"][:, 1:], a["targets"][:, :-1]
    )  # targets are inputs shifted by one
    assert not np.array_equal(Windows(read_tokens(p), 16, 4, seed=4).batch(7)["ids"], a["ids"])
    ev = w.eval_batches(2)
    assert len(ev) == 2 and ev[0]["ids"].shape == (4, 16)


def test_val_path_for(tmp_path):
    assert val_path_for(tmp_path / "corpus.bin").name == "corpus.val.bin"
