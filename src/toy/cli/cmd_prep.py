"""`toy prep TEXT... --out NAME.bin`: text to a token file, with a validation split
(NAME.val.bin) and the tokenizer that made them (NAME.tokenizer.json) beside it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from toy import tokenizer as toktools
from toy.cli.args import finite_float, plural, positive_int
from toy.data.prep import check_overwrite, prep, save_tokenizer_beside
from toy.data.tokens import read_tokens, write_tokens
from toy.errors import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("prep", help="tokenize text into a token file", description=__doc__)
    p.add_argument(
        "texts", nargs="+", metavar="TEXT", help=".txt files, or .jsonl files with a 'text' field"
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="NAME.bin",
        help="output token file; NAME.val.bin (validation split) and NAME.tokenizer.json (its "
        "tokenizer) go beside it",
    )
    p.add_argument(
        "--vocab-size",
        type=positive_int("--vocab-size"),
        metavar="N",
        help="train a byte-level BPE with N tokens (no default: give this or --tokenizer)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="FILE",
        help="reuse a tokenizer: a tokenizer.json, a GGUF model's, or a "
        "transformers or MLX model directory's (no default: give this or --vocab-size); copied "
        "beside --out as NAME.tokenizer.json",
    )
    p.add_argument(
        "--val-fraction",
        type=finite_float,
        default=0.05,
        metavar="F",
        help="fraction of tokens held back for validation, 0 for none (default 0.05)",
    )
    p.add_argument(
        "--raw-i32",
        action="store_true",
        help="TEXT is a headerless packed-int32 token file to convert (needs --tokenizer "
        "or --vocab-size for the vocabulary size)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="overwrite an existing NAME.bin, NAME.val.bin or NAME.tokenizer.json "
        "(default: refuse, exit 2: runs made on them would no longer resume)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def tokenizer_source(path: Path) -> Path:
    """A model directory's tokenizer is its tokenizer.json."""
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise UsageError(
                f"--tokenizer {path}: a directory, but no tokenizer.json in it; give a "
                "tokenizer.json, a GGUF model, or a transformers or MLX model directory"
            )
        return path / "tokenizer.json"
    return path


def load_any_tokenizer(path: Path):
    path = tokenizer_source(path)
    if path.suffix == ".gguf":
        from toy.formats.gguf import read_gguf_tokenizer

        return read_gguf_tokenizer(path)
    return toktools.load(path)


def run(args) -> int:
    out = Path(args.out)
    if args.raw_i32:
        if len(args.texts) != 1:
            raise UsageError("--raw-i32 converts exactly one token file")
        vocab = args.vocab_size
        h = b"\0" * 32
        if args.tokenizer:
            tok = load_any_tokenizer(Path(args.tokenizer))
            vocab, h = tok.get_vocab_size(with_added_tokens=True), toktools.tokenizer_hash(tok)
        if vocab is None:
            raise UsageError("--raw-i32 needs --tokenizer FILE or --vocab-size N")
        if out.suffix != ".bin":
            raise UsageError(f"--out {out}: the token file name must end in .bin")
        if not args.force:
            check_overwrite(out, Path(args.tokenizer) if args.tokenizer else None)
        tf = read_tokens(Path(args.texts[0]), raw_i32=True, vocab_size=vocab)
        tok_path = save_tokenizer_beside(out, tok, Path(args.tokenizer)) if args.tokenizer else None
        write_tokens(out, tf.tokens, vocab, h)
        if args.json:
            print(
                json.dumps(
                    {
                        "out": str(out),
                        "tokens": len(tf),
                        "tokenizer": str(tok_path) if tok_path else None,
                    }
                )
            )
        else:
            print(f"wrote {out}: {plural(len(tf), 'token')}")
            if tok_path:
                print(f"tokenizer -> {tok_path}")
        return 0
    if args.tokenizer and args.vocab_size:
        raise UsageError(
            "--tokenizer and --vocab-size conflict: reuse a tokenizer or train one, not both"
        )
    if not args.tokenizer and not args.vocab_size:
        raise UsageError(
            "give --vocab-size N to train a tokenizer, or --tokenizer FILE to reuse one"
        )
    tok = load_any_tokenizer(Path(args.tokenizer)) if args.tokenizer else None
    r = prep(
        [Path(t) for t in args.texts],
        out,
        vocab_size=args.vocab_size,
        tokenizer=tok,
        tokenizer_src=tokenizer_source(Path(args.tokenizer)) if args.tokenizer else None,
        val_fraction=args.val_fraction,
        force=args.force,
    )
    short = bool(args.vocab_size) and r.vocab_size < args.vocab_size
    if short:  # BPE stops when no pair is left to merge: a small text has few
        print(
            f"note: --vocab-size {args.vocab_size:,} asked, but the text gave a vocabulary of "
            f"only {r.vocab_size:,} (BPE ran out of pairs to merge); more text gives more",
            file=sys.stderr if args.json else sys.stdout,
        )
    if args.json:
        print(
            json.dumps(
                {
                    "format": "toy/prep-v1",
                    "out": str(r.train_path),
                    "val": str(r.val_path) if r.val_path else None,
                    "tokenizer": str(r.tokenizer_path) if r.tokenizer_path else None,
                    "train_tokens": r.train_tokens,
                    "val_tokens": r.val_tokens,
                    "vocab_size": r.vocab_size,
                    "documents": r.documents,
                    **({"vocab_size_asked": args.vocab_size} if short else {}),
                }
            )
        )
    else:
        print(f"{plural(r.documents, 'document')}, vocabulary {r.vocab_size:,}")
        print(f"train     {plural(r.train_tokens, 'token')} -> {r.train_path}")
        if r.val_path:
            print(f"val       {plural(r.val_tokens, 'token')} -> {r.val_path}")
        print(
            f"tokenizer {'trained' if args.vocab_size else 'from ' + args.tokenizer} -> "
            f"{r.tokenizer_path}"
        )
    return 0
