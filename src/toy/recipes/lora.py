"""LoRA fine-tune of a frozen base (GGUF file, transformers or MLX directory): chat JSONL
(loss on every assistant turn), prompt/completion pairs, text, or a token stream. Only
the adapters train; the output is a PEFT adapter directory. What it shares with the other
adapter recipes is in adapter.py."""

from __future__ import annotations

from pathlib import Path

import torch

from toy.data.streams import Stream
from toy.recipes.adapter import (
    ADAPTER_DEFAULTS,
    Adapted,
    AdapterJob,
    adapter_flags,
    chat_data,
    check_adapter_opts,
    load_adapted,
    token_stream,
)
from toy.runs import Project
from toy.train import dist
from toy.train.config import RunConfig
from toy.train.flags import Flag
from toy.train.job import Built, lm_loss
from toy.train.recipe import Recipe

DATA_HELP = (
    'training JSONL, one example a line, one format a file: chat {"messages": [{"role", '
    '"content"}, ...], "tools": [...]} (loss on every assistant turn), {"prompt", "completion"} '
    '(loss on the completion) or {"text"} (loss on every token); or a directory holding '
    "train.jsonl and valid.jsonl (no default: give --data, or --corpus for a token file, what "
    "from-scratch and warm-start train on instead of --data)"
)


def batch_unit(cfg: RunConfig) -> str:
    """What a step's global batch is made of: whole length-grouped chat batches, or rows
    of token windows (how a resume on another number of processes splits it)."""
    return "batches" if cfg.data else "rows"


# mlx_lm.lora's --test: after training, the loss on --data DIR's test.jsonl
FLAGS = (
    *adapter_flags(DATA_HELP),
    Flag(
        "test",
        help="mlx_lm.lora's: after training, the loss and perplexity of the final adapter on "
        "--data DIR's test.jsonl (the done line, events.jsonl's test event, --json's test_loss)",
        type=bool,
        shown="",
    ),
    Flag(
        "test_batches",
        type=int,
        help="mlx_lm.lora's: how many batches of test.jsonl --test reads (-1: all)",
        shown=": all",
        check=lambda v: v == -1 or v > 0,
        must="be -1 (all) or > 0",
    ),
)


def test_file(cfg: RunConfig) -> Path | None:
    """--test's file: test.jsonl in --data's directory."""
    return Path(cfg.data) / "test.jsonl" if cfg.test and cfg.data else None


def check_opts(cfg: RunConfig) -> list[str]:
    p = []
    if cfg.test and not ((test := test_file(cfg)) and test.is_file()):
        p.append(
            "--test reads test.jsonl in --data's directory, as mlx_lm.lora does: give --data "
            "DIR holding train.jsonl, valid.jsonl and test.jsonl"
        )
    if cfg.data and cfg.corpus:
        p.append("--data and --corpus conflict: train on chat JSONL or on a token file, not both")
    if not cfg.data and not cfg.corpus:
        p.append("give --data chat.jsonl or --corpus tokens.bin")
    return p + check_adapter_opts(cfg)


class LoraJob(AdapterJob):
    """Supervised fine-tuning of the adapters: the next-token cross-entropy over the
    supervised tokens (every assistant turn and its end-of-turn token of a chat, a
    completion, every token of text or of a token window), normalised by their count over
    the whole step."""

    def __init__(self, a: Adapted, cfg: RunConfig, config: dict, stream: Stream):
        super().__init__("lora", a, cfg, config)
        self.stream = stream

    def test_batches(self) -> tuple[str, list[dict[str, torch.Tensor]]] | None:
        """--test's batches: test.jsonl read as the held-out file is (the same tokenizing,
        template and batching), all of it or --test-batches of it."""
        path = test_file(self.cfg)
        if path is None:
            return None
        n = self.cfg.test_batches if self.cfg.test_batches not in (None, -1) else 1 << 30
        a = self.adapted
        stream = chat_data(self.cfg.replace(val_data=str(path), eval_batches=n), a.base,
                           a.seq_len, [])  # fmt: skip
        return str(path), stream.evals

    def micro_batch(self, k: int, live=None) -> dict[str, torch.Tensor]:
        return self.stream.micro_batch(k)

    def eval_batches(self) -> list[dict[str, torch.Tensor]]:
        return self.stream.evals

    def loss(self, model, batch):
        return lm_loss(model, batch)


def build(cfg: RunConfig, project: Project) -> Built:
    a: Adapted = load_adapted(cfg, project, "lora")
    tok, notes = a.base.tokenizer, a.notes
    d = dist.info()
    if cfg.data:
        stream = chat_data(cfg, a.base, a.seq_len, notes)
        unit, per_step = "batches", d.world * cfg.grad_accum
    else:
        stream = token_stream(cfg, project, tok, a.model_path, a.seq_len)
        unit, per_step = "rows", cfg.batch_size * d.world * cfg.grad_accum
    config = {**a.config, **stream.info}
    derived = a.derived()
    epochs, note = cfg.epoch_steps(stream.n_batches, per_step, unit)
    derived.update(epochs)
    notes += [note] if note else []
    job = LoraJob(a, cfg, config, stream)
    n_params, note = a.sizes()
    notes.append(note)
    # Every --data form (chat, prompt/completion, text) is batched the same way, by length
    # under a token budget: the line names no form.
    batch = (
        f"micro-batches of up to {int(cfg.batch_size) * (a.seq_len + 1):,} tokens (with --data, "
        f"--batch-size is a token budget: {cfg.batch_size} x (--seq-len {a.seq_len} + 1))"
        if cfg.data
        else ""
    )
    return Built(
        job=job, arch=a.base.arch, params=n_params, notes=notes, derived=derived, batch=batch
    )


RECIPE = Recipe(
    "lora",
    build,
    defaults=ADAPTER_DEFAULTS,
    flags=FLAGS,
    check=check_opts,
    batch_unit=batch_unit,
    shape=False,
)
