"""What a recipe declares, as a class the loop calls by name (Job): the model, which
parameters train, the batch stream, the loss, the figures and what a resume needs; the
loop (loop.py) owns everything else."""

from __future__ import annotations

import hashlib
from collections.abc import Collection
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
    and a generator seeded by (seed, global micro-batch index). The same seed, data, machine
    and weights give the same batch; a resumed run restores the weights exactly, so it
    makes the batches its unbroken twin made, with no sampling state to keep."""

    model: nn.Module
    generator: torch.Generator
    device: torch.device


def live_seed(seed: int, g: int) -> int:
    """The sampling generator's seed for global micro-batch `g` (k * world + rank for
    process rank's micro-batch k: the same batch whatever the process count)."""
    digest = hashlib.sha256(f"toy-live/{seed}/{g}/0".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class Job:
    """A recipe's run as the loop (loop.py) calls it, by name: its model and which of its
    parameters train, its batches, its loss, its figures, what a checkpoint keeps and
    what the run leaves in final/. A recipe subclasses it and overrides what differs; the
    defaults are a decoder LM's (next-token cross-entropy over the supervised tokens), so
    a recipe that trains on token windows or chat data writes only its batches and its
    final/. The loop owns everything else: accumulation, clipping, the LR schedule, AdamW,
    evaluation, checkpoints, resume, processes, events.

    The loop hands the job its device and precision (`bind`) before any batch or loss:
    a job never resolves them again."""

    units = "supervised tokens"  # what count() counts, as an error names it
    items_name = "tokens"  # what n_items() counts, for throughput ("images", ...)
    # Batches made from the live model (micro_batch(k, Live)): made when their step
    # starts, never ahead of it (the step before changes the weights they are sampled
    # from). GRPO's; a teacher's samples and online DPO would be too.
    live = False
    # False: the held-out batches have no loss, only eval_figures (GRPO's rewards of
    # greedy completions): no val_loss is recorded.
    eval_loss = True

    def __init__(self, recipe: str, model: nn.Module, config: dict[str, Any] | None = None):
        self.recipe = recipe
        self.model = model
        # Flags/choices that identify the run (recorded in run.json, checked on resume).
        self.config: dict[str, Any] = dict(config or {})
        self.device = torch.device("cpu")
        self.precision: Any = None  # train.device.Precision (None: float32)
        # The run's runs.EventLog, set by the loop before bind (None outside a run): for
        # records only --report-to's sinks take (EventLog.aside).
        self.events: Any = None

    def bind(self, device: torch.device, precision: Any, run_dir: Path | None = None) -> None:
        """The run's device and precision and its directory (None: a run kept nowhere),
        from the loop, before any batch."""
        self.device, self.precision = device, precision

    # ------------------------------------------------------------ batches

    def micro_batch(self, k: int, live: Live | None = None) -> dict[str, torch.Tensor]:
        """Global micro-batch k (0-based; step s's are (s-1) * grad_accum + m) as CPU
        tensors: a pure function of k and the seed, which makes resume exact. A live job's
        is made from `live.model` as it stands before its step, sampled with
        `live.generator`: a pure function of k, the seed and the weights."""
        raise NotImplementedError

    def eval_batches(self) -> list[dict[str, torch.Tensor]]:
        """Held-out batches, the same list at every evaluation (empty: no validation)."""
        return []

    def test_batches(self) -> tuple[str, list[dict[str, torch.Tensor]]] | None:
        """(where from, batches) evaluated once after training (mlx_lm.lora's --test), or
        None: no test pass."""
        return None

    def prepare(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host-side work on a batch before its copy to the device (the LM loss: the
        indices of its supervised positions, so the device is never asked for a count)."""
        return lm_prepare(batch)

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """The units of a batch its loss is normalised by (supervised tokens, pairs), known
        on the host before its forward: the loop divides every micro-batch's loss sum by
        the total over the whole accumulation step (and every process)."""
        return lm_count(batch)

    def n_items(self, batch: dict[str, torch.Tensor]) -> int:
        """Tokens (or images) a batch feeds through the model, for throughput."""
        return int(batch["ids"].numel())

    def whole_step(self, batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """A live step's micro-batches once all are made, called on every process together
        (a collective): what needs the whole step's batches, every process's, before its
        loss (GRPO's --scale-rewards batch: the step's reward spread)."""
        return batches

    # ------------------------------------------------------------ loss and figures

    def loss(
        self, model: nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the per-unit losses, units) over one micro-batch: by default the next-
        token cross-entropy summed over the supervised targets (lm_loss)."""
        return lm_loss(model, batch)

    def step_figures(self) -> dict[str, float]:
        """The figures of the step just taken, beside its loss (rewards, margins): read
        once after each step on every process, recorded with the loss, shown on its line.
        The recipe declares them (train/recipe.py Figure)."""
        return {}

    def eval_figures(
        self, model: nn.Module, batches: list[dict[str, torch.Tensor]]
    ) -> dict[str, float]:
        """Held-out figures beside the validation loss (accuracy, mean reward)."""
        return {}

    # ------------------------------------------------------------ the optimizer

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def decays(self, name: str, p: torch.Tensor) -> bool:
        """Whether AdamW decays this parameter: every trainable tensor of 2+ dims."""
        return p.dim() >= 2

    def lr_scale(self, name: str) -> float:
        """This parameter's LR as a multiple of the schedule's."""
        return 1.0

    def frozen(self, step: int) -> Collection[str]:
        """Names of parameters held still during step `step` (1-based): the loop drops their
        gradients after backward and the reduction, so clipping ignores them and AdamW
        skips them (no moment update, no decay). A pure function of the step, so a resumed
        run freezes the same steps."""
        return ()

    # ------------------------------------------------------------ checkpoints and the end

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint must hold to resume: every trainable parameter (tied
        tensors once, by their first name). No buffer: toy's never change in training (rotary
        tables, a frozen base's quantized blocks, a donor's embedding table), so the resumed
        run's rebuilt model already has them."""
        return {n: p.detach() for n, p in self.trainable()}

    def state(self) -> dict[str, torch.Tensor]:
        """What the job keeps between steps that a resume needs besides the weights (GRPO:
        the generation it reuses --num-iterations times), as tensors: saved in each
        checkpoint, every process's own."""
        return {}

    def load_state(self, states: list[dict[str, torch.Tensor]]) -> None:
        """Every saved process's state(), in rank order (the run may resume on another
        number of processes: each rank takes what its micro-batches need)."""

    def save_final(self, out: Path) -> None:
        """Write the ready-to-use model (or adapter) into directory `out`."""
        raise NotImplementedError


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
    # Job config keys that a resume may find changed when the user says so (key -> the
    # flag that says it: GRPO's reward_files -> reward_changed); run.json records the change.
    may_change: dict[str, str] = field(default_factory=dict)
