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
(cmd_infer.run), which says what is wrong.

Here: what decides whether a command may take this path (eligible, takes) and what is kept
beside the model (meta_of). cmd_infer.load_kept reads the kept file and builds the reply's
LM from them: this module imports nothing of cmd_infer."""

from __future__ import annotations

import os
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
