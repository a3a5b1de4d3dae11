"""What a recipe declares: the model, which parameters train, the batch stream and the
loss. The loop (loop.py) owns everything else."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from toy.models.losses import IGNORE, head_cross_entropy


@dataclass
class Live:
    """What a batch made from the live model is made with (Job.live): the model as the
    step finds it (eval mode, no gradients, under the run's autocast), on the run's device,
    and a generator seeded by (seed, micro-batch index, rank). The same seed, data, machine
    and weights give the same batch; a resumed run restores the weights exactly, so it
    makes the batches its unbroken twin made, with no sampling state to keep."""

    model: nn.Module
    generator: torch.Generator
    device: torch.device


def live_seed(seed: int, k: int, rank: int) -> int:
    """The sampling generator's seed for micro-batch `k` of process `rank`."""
    digest = hashlib.sha256(f"toy-live/{seed}/{k}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass
class Job:
    recipe: str
    model: nn.Module
    # micro_batch(k) -> dict of CPU tensors for global micro-batch index k. It must be a
    # pure function of k (and the seed): that is what makes resume exact. With `live`,
    # micro_batch(k, Live) -> the batch made from the model as it stands before its step
    # (sampled with Live.generator): a pure function of k, the seed and the weights.
    micro_batch: Callable[..., dict[str, torch.Tensor]]
    # Held-out batches, the same list at every eval (empty: no validation).
    eval_batches: Callable[[], list[dict[str, torch.Tensor]]]
    # Writes the ready-to-use model (or adapter) into a directory.
    save_final: Callable[[Path], None]
    # Flags/choices that identify the run (recorded in run.json, checked on resume).
    config: dict[str, Any] = field(default_factory=dict)
    # Loss over one micro-batch: (sum of the per-unit losses, number of units), a unit being
    # what `count` counts (supervised tokens; the pairs of a preference batch).
    loss: (
        Callable[[nn.Module, dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]] | None
    ) = None
    # The units of a batch that its loss is normalised by (supervised tokens, pairs), known
    # once the batch is made and before its forward pass: the loop divides every
    # micro-batch's loss sum by the total over the whole accumulation step.
    count: Callable[[dict[str, torch.Tensor]], int] | None = None
    units: str = "supervised tokens"  # what count counts, as an error names it
    # Tokens (or images) a batch feeds through the model, for throughput.
    n_items: Callable[[dict[str, torch.Tensor]], int] | None = None
    items_name: str = "tokens"
    # Optional extra eval metrics (e.g. accuracy): model -> {"name": value}
    eval_metrics: Callable[[nn.Module, list[dict[str, torch.Tensor]]], dict[str, float]] | None = (
        None
    )
    # Modules whose weights decay; default: every trainable tensor with 2+ dims.
    params_decay: Callable[[str, torch.Tensor], bool] | None = None
    # LR multiplier by parameter name (as in trainable()); default 1 for every parameter.
    lr_scale: Callable[[str], float] | None = None
    # Names (as in trainable()) of parameters to hold still during step s (1-based). The
    # loop drops their gradients (sets them to None) after backward and after the DDP/FSDP
    # reduction, so clipping ignores them and AdamW skips them: no moment update and no
    # decoupled weight decay (a zero gradient would still decay them). It must be a pure
    # function of the step, so a resumed run freezes the same steps.
    frozen: Callable[[int], Collection[str]] | None = None
    # Host-side work on a batch before it is copied to the device (the LM loss: the
    # indices of the supervised positions, so the device is never asked for a count).
    prepare: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    # Figures of the step just taken, beside its loss (preference recipes: rewards, margin,
    # accuracy): read once after each step, recorded with the loss, printed on its line.
    step_metrics: Callable[[], dict[str, float]] | None = None
    # Batches made from the live model (micro_batch(k, Live)): made when their step starts,
    # never ahead of it (the step before changes the weights they are sampled from).
    live: bool = False
    # What the job keeps between steps that a resume needs besides the weights (GRPO: the
    # generation batch it reuses --num-iterations times): saved in each checkpoint as
    # tensors, given back by load_state on resume (rank 0's).
    state: Callable[[], dict[str, torch.Tensor]] | None = None
    load_state: Callable[[dict[str, torch.Tensor]], None] | None = None
    # False: the held-out batches have no loss, only eval_metrics (GRPO's rewards of
    # greedy completions): no val_loss is recorded.
    eval_loss: bool = True

    def __post_init__(self) -> None:
        if self.prepare is None:
            self.prepare = lm_prepare if self.loss in (None, lm_loss) else (lambda b: b)
        self.loss = self.loss or lm_loss
        self.count = self.count or lm_count
        self.n_items = self.n_items or (lambda b: int(b["ids"].numel()))
        self.params_decay = self.params_decay or (lambda name, p: p.dim() >= 2)

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint must hold to resume: every trainable parameter (tied
        tensors once, by their first name). No buffer: toy's never change in training (rotary
        tables, a frozen base's quantized blocks, a donor's embedding table), so the resumed
        run's rebuilt model already has them."""
        return {n: p.detach() for n, p in self.trainable()}


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy summed over supervised targets (targets == -100 are not),
    for a decoder (models/family.py's contract: hidden, lm_head, final_softcap).

    The (tokens, vocab) logits are the biggest tensors of a step, so they never exist
    whole: the head runs only on supervised positions (with chat data most positions are
    prompt), chunk by chunk inside `head_cross_entropy`.
    """
    targets = batch["targets"]
    sup = targets != IGNORE
    h = model.hidden(batch["ids"])  # (B, T, C)
    idx = batch.get("sup_idx")
    if idx is not None:  # lm_prepare's indices: a gather of known size, no host sync
        h, tgt = h.flatten(0, 1).index_select(0, idx), targets.flatten().index_select(0, idx)
    elif bool(sup.all()):  # a batch that did not go through lm_prepare (direct callers)
        h, tgt = h.flatten(0, 1), targets.flatten()
    else:
        h, tgt = h[sup], targets[sup]  # (N, C) for the N supervised tokens
    return head_cross_entropy(h, model.lm_head, tgt, model.final_softcap), sup.sum()


def lm_count(batch: dict[str, torch.Tensor]) -> int:
    """Supervised positions of a batch still on the host (numpy: no device, no sync)."""
    t = batch["targets"]
    if t.device.type == "cpu":
        return int(np.count_nonzero(t.numpy() != IGNORE))
    return int((t != IGNORE).sum())


def lm_prepare(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """On the host, before the copy to the device: `sup_idx`, the flat indices of the
    supervised positions. The loss gathers them with index_select, whose size the host
    already knows, instead of a boolean mask, whose size the device must be asked for
    (one host sync per micro-step on CUDA). Gathering every row when all are supervised
    copies them in order: the same values, the same loss."""
    t = batch["targets"]
    if "sup_idx" in batch or t.device.type != "cpu":
        return batch
    idx = np.flatnonzero(t.numpy().reshape(-1) != IGNORE)
    return {**batch, "sup_idx": torch.from_numpy(idx)}


@dataclass
class Built:
    """What a recipe's `build(cfg, project)` returns to train/run.py. `derived` holds what
    the recipe worked out from the data (RunConfig field -> value: the step count of
    --epochs, the sequence length a preset or a GGUF's context gives); run.py folds it into
    the resolved config with `RunConfig.with_derived` (new_run, and resume_run for the
    rebuilt job); the recipe never writes the config."""

    job: Job
    arch: str
    params: int
    notes: list[str] = field(default_factory=list)
    derived: dict[str, Any] = field(default_factory=dict)
    # What a step's micro-batch is, in words, where it is not --batch-size rows (chat data's
    # token budget): the run's first line says it.
    batch: str = ""
