"""The token file (`.bin`) and the windows a language model trains on.

Layout (little-endian), a 64-byte header then the tokens:

    offset size  field
    0      8     magic b"TOYTOK\\x00\\x01"
    8      4     version (1)
    12     4     bytes per token: 2 (uint16) or 4 (uint32)
    16     4     vocab size
    20     4     reserved (0)
    24     8     token count
    32     32    sha256 of the tokenizer (toy.tokenizer.tokenizer_hash), zeros if unknown

The tokens are read with `numpy.memmap`, so a corpus larger than memory is fine.
The headerless packed-int32 form (the seed system's `ts_seqs.bin`) is read with
`read_tokens(path, raw_i32=True, vocab_size=...)`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from toy.errors import InputError
from toy.runs import write_file_atomic

if TYPE_CHECKING:
    import torch

MAGIC = b"TOYTOK\x00\x01"
VERSION = 1
HEADER = struct.Struct("<8sIIIIQ32s")
assert HEADER.size == 64


@dataclass
class TokenFile:
    path: Path
    tokens: np.ndarray  # memmap, uint16/uint32 (or int32 for the raw form)
    vocab_size: int
    tokenizer_hash: bytes  # 32 bytes, zeros when unknown

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def write_tokens(
    path: Path, tokens: np.ndarray, vocab_size: int, tok_hash: bytes = b"\0" * 32
) -> None:
    """Write atomically (temp file, fsync, rename)."""
    dtype = np.uint16 if vocab_size <= 65536 else np.uint32
    arr = np.asarray(tokens)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_size):
        raise InputError(
            f"{path}: token id {int(arr.max())} out of range for vocab size {vocab_size}"
        )
    arr = arr.astype(dtype, copy=False)

    def fill(tmp: Path) -> None:
        with open(tmp, "wb") as fh:
            fh.write(
                HEADER.pack(MAGIC, VERSION, arr.dtype.itemsize, vocab_size, 0, arr.size, tok_hash)
            )
            fh.write(arr.tobytes())

    write_file_atomic(path, fill)


def read_tokens(
    path: Path, raw_i32: bool = False, vocab_size: int | None = None, check_ids: bool = True
) -> TokenFile:
    """Open a token file; every problem is an InputError naming the file and the fix."""
    path = Path(path)
    if not path.is_file():
        raise InputError(
            f"corpus {path} not found; "
            f"make one with `toy prep TEXT --out {path.name}` or `toy new DIR`"
        )
    size = path.stat().st_size
    if raw_i32:
        if vocab_size is None:
            raise InputError(
                f"{path}: --raw-i32 needs the vocabulary size (pass --vocab-size or --tokenizer)"
            )
        if size % 4 or size == 0:
            raise InputError(f"{path}: {size} bytes is not a whole number of int32 tokens")
        toks = np.memmap(path, dtype=np.int32, mode="r")
        tf = TokenFile(path, toks, vocab_size, b"\0" * 32)
    else:
        if size < HEADER.size:
            raise InputError(
                f"{path}: {size} bytes, too short for a toy token file (64-byte header); "
                "re-run `toy prep`"
            )
        with open(path, "rb") as fh:
            magic, version, width, vocab, _, count, h = HEADER.unpack(fh.read(HEADER.size))
        if magic != MAGIC:
            raise InputError(
                f"{path}: not a toy token file (bad magic); make one with `toy prep`, "
                "or pass --raw-i32 for headerless int32 tokens"
            )
        if version != VERSION:
            raise InputError(
                f"{path}: token file version {version}, this toy reads version {VERSION}"
            )
        if width not in (2, 4):
            raise InputError(f"{path}: token width {width} bytes; expected 2 or 4")
        if vocab == 0 or (width == 2 and vocab > 65536):
            raise InputError(f"{path}: vocab size {vocab} does not fit {width}-byte tokens")
        if HEADER.size + count * width != size:
            raise InputError(
                f"{path}: header says {count} tokens ({HEADER.size + count * width} bytes) "
                f"but the file has {size} bytes; it is truncated or corrupt, re-run `toy prep`"
            )
        if count == 0:
            raise InputError(f"{path}: holds no tokens; prep a larger text")
        toks = np.memmap(
            path,
            dtype=np.uint16 if width == 2 else np.uint32,
            mode="r",
            offset=HEADER.size,
            shape=(count,),
        )
        tf = TokenFile(path, toks, vocab, h)
    if check_ids:
        _check_ids(tf)
    return tf


def _check_ids(tf: TokenFile) -> None:
    # One pass in chunks: bounded memory even for a corpus larger than RAM.
    chunk = 1 << 24
    for i in range(0, len(tf), chunk):
        part = tf.tokens[i : i + chunk]
        hi, lo = int(part.max()), int(part.min())
        if hi >= tf.vocab_size or lo < 0:
            bad = hi if hi >= tf.vocab_size else lo
            pos = i + int(np.argmax(part == bad))
            raise InputError(
                f"{tf.path}: token id {bad} at position {pos} is outside the vocabulary "
                f"(size {tf.vocab_size}); "
                "the file was made with another tokenizer, re-run `toy prep`"
            )


def tokenizer_path_for(path: Path) -> Path:
    """`mine.bin` -> `mine.tokenizer.json`: where `toy prep` puts the tokenizer it trains,
    so each prepared corpus owns its tokenizer and two corpora in one folder never
    overwrite each other's."""
    return path.with_name(path.stem + ".tokenizer.json")


def tokenizer_beside(path: Path) -> Path | None:
    """The tokenizer that made the corpus at `path`: `NAME.tokenizer.json`, else a plain
    `tokenizer.json` in the same folder (projects made before per-corpus tokenizers, and
    `toy new`'s data/), else None."""
    for p in (tokenizer_path_for(path), path.with_name("tokenizer.json")):
        if p.is_file():
            return p
    return None


def val_path_for(path: Path) -> Path:
    """`corpus.bin` -> `corpus.val.bin`: where `toy prep` puts the held-out split."""
    return path.with_name(path.stem + ".val" + path.suffix)


class Windows:
    """Random (input, target) windows of length T from a token stream, reproducible
    and resumable: batch k of a run is drawn from a generator seeded by (seed, k), so
    the data position is just the batch counter — no iterator state to save.

    Optimizer step s draws its whole global batch at once (accum * world * batch_size
    windows) and micro-batch m of rank r takes its own slice: so 2 processes of batch 2,
    or 1 process of batch 2 with 2 accumulation steps, see exactly the windows 1 process
    of batch 4 sees, and the objective does not depend on how the batch is split."""

    def __init__(
        self,
        tf: TokenFile,
        seq_len: int,
        batch_size: int,
        seed: int,
        world: int = 1,
        rank: int = 0,
        accum: int = 1,
    ):
        if len(tf) < seq_len + 1:
            raise InputError(
                f"{tf.path}: {len(tf)} tokens, fewer than --seq-len {seq_len} + 1; "
                "lower --seq-len or prep more text"
            )
        self.tf, self.T, self.B, self.seed = tf, seq_len, batch_size, seed
        self.world, self.rank, self.accum = world, rank, accum

    def batch(self, k: int) -> dict[str, torch.Tensor]:
        """Micro-batch k = step * accum + m (the loop's numbering)."""
        step, m = divmod(k, self.accum)
        rng = np.random.default_rng([self.seed, 0, step])
        starts = rng.integers(
            0, len(self.tf) - self.T - 1, size=self.B * self.world * self.accum, endpoint=True
        )
        first = (m * self.world + self.rank) * self.B
        return self._gather(starts[first : first + self.B])

    def _gather(self, starts: np.ndarray) -> dict[str, torch.Tensor]:
        rows = np.stack(
            [np.asarray(self.tf.tokens[s : s + self.T + 1], dtype=np.int64) for s in starts]
        )
        import torch  # here: `toy prep` writes token files without torch (~1 s to import)

        t = torch.from_numpy(rows)
        return {"ids": t[:, :-1], "targets": t[:, 1:]}

    def eval_batches(self, max_batches: int) -> list[dict[str, torch.Tensor]]:
        """Fixed, non-overlapping windows from the start of the stream: the same every eval."""
        n = min(max_batches * self.B, (len(self.tf) - 1) // self.T)
        starts = np.arange(n) * self.T
        return [self._gather(starts[i : i + self.B]) for i in range(0, n, self.B)]
