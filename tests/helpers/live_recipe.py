"""A recipe for the tests only (tests/train/test_live_batches.py): its batches are sampled from
the live model (Job.live), so they change as the model trains. It takes from-scratch's
job and replaces the batch: each row keeps the first 4 tokens of its corpus window and
samples the rest from the model as the step finds it (Live.model, Live.generator).

Registered in a test's own process by `register()` (one line, as a real recipe's)."""

from __future__ import annotations

import torch

from toy.recipes import RECIPES
from toy.recipes import from_scratch as scratch
from toy.train.recipe import Recipe

PROMPT = 4  # tokens of each corpus window kept as the prompt


def build(cfg, project):
    built = scratch.build(cfg, project)
    job, windows = built.job, built.job.micro_batch

    def live_batch(k: int, live) -> dict[str, torch.Tensor]:
        seq = windows(k)["ids"][:, :PROMPT].to(live.device)  # (B, 4)
        T = windows(k)["ids"].shape[1]
        while seq.shape[1] < T + 1:
            logits = live.model.lm_head(live.model.hidden(seq)[:, -1]).float()  # (B, V)
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=live.generator)
            seq = torch.cat([seq, nxt], 1)
        seq = seq.cpu()
        return {"ids": seq[:, :-1], "targets": seq[:, 1:]}

    job.micro_batch, job.live = live_batch, True
    return built


RECIPE = Recipe("live-test", build)


def register() -> None:
    RECIPES["live-test"] = __name__
