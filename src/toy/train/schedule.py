"""Learning-rate schedule and optimizer construction."""

from __future__ import annotations

import math

import torch


def lr_at(step: int, total: int, lr: float, min_lr: float, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to `min_lr` at the last step.
    `step` counts from 0 (the step about to be taken)."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, total - warmup - 1)
    progress = min(1.0, (step - warmup) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def make_adamw(named_params, lr: float, weight_decay: float, decay_rule, betas=(0.9, 0.95), eps=1e-8,
               fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW with two groups: weights that decay (matrices, embeddings) and those that
    don't (biases, norm gains), as in GPT-2/nanoGPT."""
    decay, no_decay = [], []
    for name, p in named_params:
        (decay if decay_rule(name, p) else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    kw = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **kw)
