"""`toy infer`: sample from a trained model (KV cache, streaming)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from toy.cli.args import finite_float, nonneg_int, positive_int
from toy.errors import InputError, UsageError
from toy.formats.model_dir import load_model_dir
from toy.models.generate import generate
from toy.tokenizer import eos_id


def add_parser(sub) -> None:
    p = sub.add_parser("infer", help="generate text from a trained model", description=__doc__)
    p.add_argument("--run", help="run directory (or its final/) of a trained model")
    p.add_argument("--prompt", help="text to continue")
    p.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=100,
                   help="tokens to generate at most (default 100)")
    p.add_argument("--temperature", type=finite_float, default=0.8, help="0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=nonneg_int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=finite_float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--device", choices=("cpu", "cuda", "metal"), default="cpu")
    p.set_defaults(func=run)


def run(args) -> int:
    from toy.train.device import resolve_device

    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not args.run:
        raise UsageError("give --run RUN_DIR (a trained run)")
    if args.prompt is None:
        raise UsageError("give --prompt TEXT")
    device = resolve_device(args.device)
    d = Path(args.run)
    if not d.exists():
        raise InputError(f"--run {d}: no such directory")
    if (d / "final").is_dir():
        d = d / "final"
    model, meta, tok = load_model_dir(d, device)
    if tok is None:
        raise InputError(f"{d}: has no tokenizer.json; the run's corpus had no tokenizer beside it")
    ids = tok.encode(args.prompt, add_special_tokens=False).ids
    if not ids:
        eid = eos_id(tok)
        if eid is None:
            raise UsageError("--prompt is empty and the tokenizer has no end-of-text token to start from")
        ids = [eid]
    stop = {eos_id(tok)} - {None}
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    new: list[int] = []
    text_so_far = ""
    for t in generate(model, ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, stop):
        new.append(t)
        # Decode the whole continuation each time: a byte-level token may be half a
        # UTF-8 character, so print only the settled text.
        text = tok.decode(new)
        if not text.endswith("\ufffd"):
            out.write(text[len(text_so_far):])
            out.flush()
            text_so_far = text
    out.write("\n")
    return 0
