"""`toy infer` (--prompt, --chat, or an interactive chat) on a llama GGUF without torch.

A reply on a llama GGUF held packed steps every token in C (models/reply_c.py);
its first run, through torch, keeps the model as that loop reads it in toy's cache
(formats/reply_image.py). From then on the same command maps that file and replies with
numpy, `tokenizers`, jinja2 and the C library only: `import torch` was 1.0-1.4 s of a
2.7 s 100-token reply on a 2-core Zen 4 (docs/performance.md). The text is the same bytes
as the first run's: both go through the same loop on the same bytes.

Taken only where the torch path would hold the base packed and reply through that loop: a
GGUF file given as --model (no --run, no --adapter), --device cpu, --base-dtype auto or
quantized (auto's own weighing, choose_base_dtype, made with the sizes kept), --precision
auto or float32, a prompt of at most PREFILL_MAX tokens (an interactive chat: every turn
in C, where the kept tables cover the model's context), and a kept file that reads and
checks. Anything else, and every error a user can make, goes the torch path's way
(cmd_infer.run), which says what is wrong."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# A prompt is fed one token at a time through the C step; torch's batched prefill takes
# longer prompts sooner. SmolLM2 Q4_1 on a 2-core Zen 4, 2 threads: 64 tokens C 0.26-0.27 s
# against torch's 0.36-0.45, 256: 1.19-1.22 against 0.89-0.90, 512: 2.57-2.69 against
# 1.27-1.46 (docs/performance.md). Up to 256 a reply without torch's import (1.0-1.4 s)
# still ends sooner, and the first run, through torch, loses at most ~0.3 s.
PREFILL_MAX = 256


def takes(fed: int, new: int, positions: int, limit: int) -> bool:
    """Whether the C loop takes a reply of `fed` prompt ids and `new` new tokens (torch's
    path, cmd_infer.stream, asks the same of its loaded model: both paths give the same
    text): a prompt of at most PREFILL_MAX ids, and positions the model's tables cover
    (reply_c.Model.positions)."""
    return fed <= PREFILL_MAX and min(limit, fed + new) <= positions


def eligible(args) -> bool:
    """Whether the command is one this path may take (before anything is read)."""
    return bool(
        args.model
        and not args.run
        and not args.adapter
        and not getattr(args, "image", None)
        and not getattr(args, "build_steps", False)
        and args.device == "cpu"
        and getattr(args, "base_dtype", "auto") in ("auto", "quantized")
        and getattr(args, "precision", "auto") in ("auto", "float32")
        and os.environ.get("TOY_NATIVE", "1") != "0"
        and Path(args.model).is_file()
    )


def meta_of(lm, sizes: dict, template_note: str | None) -> dict:
    """What a later reply reads of the file's header, from a loaded LM (cmd_infer.LM):
    kept beside the model (formats/reply_image.py). A note that opens with the file's path
    keeps the rest, the path put back as the later command names the file."""
    if template_note and template_note.startswith(lm.source):
        template_note = "\0" + template_note[len(lm.source) :]
    return {
        "tokenizer": lm.tok.to_str(),
        "template": lm.template,
        "template_note": template_note,
        "no_template": lm.no_template,
        "bos": lm.bos,
        "eos": lm.eos,
        "stop": sorted(lm.stop),
        "limit": lm.limit,
        **sizes,
    }


def load(args):
    """An LM (cmd_infer.LM) whose model is a reply_c.Model read from toy's cache, ready for
    cmd_infer.run's replies; None where this path does not take the command."""
    if not eligible(args):
        return None
    from toy.formats import reply_image

    try:
        path = reply_image.path_for(Path(args.model))
    except OSError:
        return None
    if not path.is_file():
        return None
    got = reply_image.read(path)
    if got is None:
        args.reply_image_bad = True  # damaged or another layout: the torch path writes it
        return None
    from toy.errors import ToyError

    try:
        return _lm(args, *got)
    except ToyError:  # the user's to mend (a template that does not render): torch's path
        return None  # says it, as it always has
    except Exception:  # a kept file this toy cannot use: torch's path writes it again
        args.reply_image_bad = True
        return None


def _lm(args, plan: dict, arrays: dict, meta: dict):
    """load's LM from a kept model, or None where auto would not hold it packed or the
    reply is not one the loop takes (takes)."""
    from tokenizers import Tokenizer

    from toy.cli.cmd_infer import LM, _planned_cache, _prompt_len, _tokens, choose_base_dtype
    from toy.models import reply_c
    from toy.train.memory import available_memory

    source = str(Path(args.model))  # as torch's path names it (cmd_infer.load_base_lm)
    lm = LM(
        None,
        Tokenizer.from_str(meta["tokenizer"]),
        meta["template"],
        meta["bos"],
        meta["eos"],
        set(meta["stop"]),
        source,
        meta["no_template"],
        limit=meta["limit"],
    )
    most = reply_c.positions(plan, arrays)
    tokens = _tokens(args)  # None: an interactive chat
    if tokens is None:  # its steps in C where the tables cover the context (cmd_infer.new_cache)
        if most != lm.limit:
            return None
    elif not takes(_prompt_len(lm, args), args.max_new_tokens, most, lm.limit):
        return None
    positions = _planned_cache(args)(lm)
    kv = 2 * meta["n_layer"] * meta["n_kv"] * meta["head_dim"] * positions * 4
    want = [args.base_dtype, "cpu", meta["float32_bytes"], available_memory(), kv]
    dtype, note = choose_base_dtype(*want, meta["packed_bytes"], tokens, True)
    # the library last: loaded before torch, it brings the system's libgomp, which a torch
    # loaded after it would then share (a command this path does not take imports torch)
    if dtype != "quantized" or reply_c.library() is None:
        return None
    model = reply_c.Model(plan, arrays)
    template_note = meta["template_note"]
    if template_note:
        if template_note.startswith("\0"):
            template_note = source + template_note[1:]
        print(f"note: {template_note}", file=sys.stderr)
    if note:
        print(f"note: {note}", file=sys.stderr)
    lm.held, lm.why = "quantized (packed)", note
    if not note and args.base_dtype == "auto":
        lm.why = (
            "auto: packed, an interactive chat"
            if tokens is None
            else f"auto: packed, shorter expected wait for {tokens} new tokens"
        )
    lm.c = model
    return lm


def threads(args) -> int:
    """The C loop's thread count in a process without torch, as train/device.py's Threads
    starts torch's: --threads N; else OMP_NUM_THREADS (libgomp reads it); else the physical
    cores other programs leave free (cores.py)."""
    from toy import cores
    from toy.models import reply_c

    n = args.threads or 0
    if not n and "OMP_NUM_THREADS" not in os.environ:
        most = cores.physical_cores()
        n = (cores.watching.free(most) if cores.watching is not None else None) or most
    return reply_c.threads(n)
