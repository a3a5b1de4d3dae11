"""Learning-rate schedule and optimizer construction.

The schedule, and what a resume does to it, are defined here and nowhere else:

- A run of `total` steps: linear warmup over `warmup` steps, then a cosine from `lr` to
  `min_lr`, reached at the last step.
- Resumed with the same `--steps`: the same schedule, so the same losses as an
  unbroken run.
- Extended (`--resume RUN --steps N` with N above the run's total), resumed at step d:
  - if d is still inside the warmup, the warmup finishes as planned and the cosine runs
    to the new total: every step already taken had the LR it would have had in an
    unbroken N-step run, so the result equals one;
  - otherwise the LR continues from the LR of step d (the one restored with the
    optimizer) and decays by a cosine to `min_lr` at step N. Re-warming a trained model
    would throw away what the decay bought; a finished run, whose last LR was min_lr,
    therefore continues at min_lr.
  The extension is stored in each checkpoint, so resuming an extension again continues
  the same curve, and extending it again starts a new segment from where it is.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Schedule:
    lr: float
    min_lr: float
    warmup: int
    total: int
    # An extension: from `start` (steps already taken) the LR goes from start_lr to
    # min_lr at `total`; the steps before it followed `previous`. None: the plain
    # warmup + cosine schedule.
    start: int | None = None
    start_lr: float | None = None
    previous: Schedule | None = None

    def at(self, step: int) -> float:
        """The LR of step `step` (counting from 0: the step about to be taken)."""
        if self.start is not None:
            if step < self.start:
                return self.previous.at(step)
            return _cosine(step - self.start, self.total - self.start, self.start_lr, self.min_lr)
        if self.warmup > 0 and step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        return _cosine(step - self.warmup, self.total - self.warmup, self.lr, self.min_lr)

    def extended(self, done: int, total: int) -> Schedule:
        """This schedule resumed after `done` steps with a new, larger `total` (see the
        module docstring). The same total gives the same schedule."""
        if total == self.total:
            return self
        if self.start is None and done < self.warmup:
            return Schedule(self.lr, self.min_lr, self.warmup, total)
        last = self.at(done - 1) if done > 0 else self.lr
        return Schedule(
            self.lr, self.min_lr, self.warmup, total, start=done, start_lr=last, previous=self
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Schedule:
        prev = d.get("previous")
        return cls(**{**d, "previous": cls.from_dict(prev) if prev else None})

    def describe(self) -> str:
        if self.start is None:
            return (
                f"warmup {self.warmup}, cosine {self.lr:g} -> {self.min_lr:g} at step {self.total}"
            )
        return (
            f"extended at step {self.start}: cosine from its LR {self.start_lr:.3g} to --min-lr "
            f"{self.min_lr:g} at step {self.total}"
        )


def _cosine(i: int, n: int, hi: float, lo: float) -> float:
    """Step i of a cosine from hi (i = 0) to lo (i = n - 1)."""
    progress = min(1.0, max(0, i) / max(1, n - 1))
    return lo + 0.5 * (hi - lo) * (1.0 + math.cos(math.pi * progress))


def lr_at(step: int, total: int, lr: float, min_lr: float, warmup: int) -> float:
    """The plain schedule's LR at `step` (0-based): Schedule(...).at(step)."""
    return Schedule(lr, min_lr, warmup, total).at(step)


def make_adamw(
    named_params,
    lr: float,
    weight_decay: float,
    decay_rule,
    betas=(0.9, 0.95),
    eps=1e-8,
    lr_scale=None,
) -> torch.optim.AdamW:
    """AdamW with a group for weights that decay (matrices, embeddings) and one for those
    that don't (biases, norm gains), as in GPT-2/nanoGPT; `lr_scale(name)` (default 1)
    splits further: each group's "lr_scale" multiplies the schedule's LR (a resume keeps
    it: checkpoint.load_optimizer checks the saved groups hold the same parameters).
    foreach: measured as fast as fused on CPU (docs/performance.md)."""
    groups: dict[tuple[bool, float], list] = {}
    for name, p in named_params:
        key = (bool(decay_rule(name, p)), float(lr_scale(name)) if lr_scale is not None else 1.0)
        groups.setdefault(key, []).append(p)
    order = sorted(
        groups, key=lambda k: (not k[0], k[1])
    )  # decaying first, as before; a fixed order for resume
    return torch.optim.AdamW(
        [
            {"params": groups[k], "weight_decay": weight_decay if k[0] else 0.0, "lr_scale": k[1]}
            for k in order
        ],
        lr=lr,
        betas=betas,
        eps=eps,
        foreach=True,
    )
