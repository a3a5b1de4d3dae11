"""KTO: a LoRA adapter on a frozen base, trained on completions labelled good or bad, no
pairs needed (Ethayarajh et al. 2024, as TRL's KTOTrainer with loss_type "kto"):

    r = log pi(y|x) - log ref(y|x)              the completion's implied reward / beta
    z = max(0, mean over the batch of r(x, y'))  the KL estimate, detached, from each
                                                 prompt with another example's completion
    desirable:   lambda_D (1 - sigmoid(beta (r - z)))
    undesirable: lambda_U (1 - sigmoid(beta (z - r)))

averaged over the batch's examples. The mismatched completions y' are TRL's: the file's
examples in runs of --batch-size, each run's completions turned by one
(data/preference.py read_unpaired); the reference is the base with the adapter off, its
log-probs of both sequences computed once an example (recipes/pairs.py References, each
example held as a "pair" of its own sequence and its KL one). The policy's KL sequence runs
without a gradient, as TRL's.

Data: {"prompt", "completion", "label": true|false} lines (strings, or lists of messages),
or preference pairs, each taken as a desirable and an undesirable example (TRL's
unpair_preference_dataset).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toy.data.preference import UNPAIRED_SCHEMA, encode_unpaired, read_unpaired
from toy.recipes.adapter import adapter_flags, check_adapter_opts
from toy.recipes.pairs import (
    PAIR_DEFAULTS,
    SMALL_SET_EPOCHS,
    PairData,
    PairJob,
    accuracy_figure,
    answer_logps,
    batches_unit,
    build_pairs,
)
from toy.runs import Project
from toy.train import dist
from toy.train.config import RunConfig
from toy.train.job import Built
from toy.train.recipe import Flag, Recipe

DATA_HELP = (
    'labelled completions, one JSON object a line (TRL\'s unpaired form): {"prompt", '
    '"completion", "label": true|false} with strings or lists of {"role", "content"} '
    "messages; preference pairs are taken too (chosen: true, rejected: false); or a "
    "directory holding train.jsonl and valid.jsonl (no default). --batch-size counts "
    "examples, and is the run each KL completion is drawn from (at least 2)"
)
FLAGS = (
    *adapter_flags(DATA_HELP),
    Flag(
        "beta",
        0.1,
        "KTO's beta: how far from the reference the adapter may move (TRL's default)",
        float,
        check=lambda v: v > 0,
        must="be > 0",
    ),
    Flag(
        "desirable_weight",
        1.0,
        "the weight of a desirable example's loss (lambda_D); with fewer desirable than "
        "undesirable examples, the KTO paper keeps lambda_D n_D / (lambda_U n_U) in [1, 4/3]",
        float,
        check=lambda v: v > 0,
        must="be > 0",
    ),
    Flag(
        "undesirable_weight",
        1.0,
        "the weight of an undesirable example's loss (lambda_U)",
        float,
        check=lambda v: v > 0,
        must="be > 0",
    ),
)
DEFAULTS = {**PAIR_DEFAULTS, "lr": 1e-3, "min_lr": 1e-4, "epochs": SMALL_SET_EPOCHS}
FIGURES = (accuracy_figure("label_accuracy", "held-out label accuracy", "val_label_accuracies"),)
UNPAIRED = PairData(
    lambda path, cfg: read_unpaired(path, int(cfg.batch_size)),
    encode_unpaired,
    "labelled completion",
    UNPAIRED_SCHEMA,
)


def kto_loss(
    pol: torch.Tensor,
    ref: torch.Tensor,
    pol_kl: torch.Tensor,
    ref_kl: torch.Tensor,
    label: torch.Tensor,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-example KTO losses (B,), the rewards beta (pi - ref) (detached) and the KL
    estimate z, from the completions' summed log-probs (B,) under the policy and the
    reference, the KL sequences' (B,), and the labels (B,) bool. z is the batch's mean
    over every process (TRL's gather), clamped at 0, no gradient."""
    z = (pol_kl.detach().float() - ref_kl.float()).mean()
    d = dist.info()
    if d.enabled:
        z = dist.all_sum(z) / d.world
    z = z.clamp(min=0)
    ratio = pol.float() - ref.float()
    good = desirable_weight * (1 - F.sigmoid(beta * (ratio - z)))
    bad = undesirable_weight * (1 - F.sigmoid(beta * (z - ratio)))
    return torch.where(label, good, bad), (beta * ratio).detach(), z


def kto_figures(rewards: torch.Tensor, label: torch.Tensor, z: torch.Tensor, across=False):
    """The mean reward of the desirable and the undesirable examples seen, their margin,
    the KL estimate, and the label accuracy: the share of examples the adapter judges as
    their label (reward above beta z for a desirable one, below for an undesirable)."""
    rewards, label = rewards.double(), label.bool()
    right = torch.where(label, rewards > 0, rewards < 0).double()
    sums = torch.stack(
        [
            (rewards * label).sum(),
            label.double().sum(),
            (rewards * ~label).sum(),
            (~label).double().sum(),
            right.sum(),
            torch.tensor(float(rewards.numel()), dtype=torch.float64),
            z.double().sum(),
            torch.tensor(float(z.numel()), dtype=torch.float64),
        ]
    )
    if across and dist.info().enabled:
        sums = dist.all_sum(sums)
    s = sums.tolist()
    good, bad = s[0] / max(s[1], 1.0), s[2] / max(s[3], 1.0)
    return {
        "reward_desirable": good,
        "reward_undesirable": bad,
        "margin": good - bad,
        "kl": s[6] / max(s[7], 1.0),
        "label_accuracy": s[4] / max(s[5], 1.0),
    }


class KTOTally:
    """The rewards, labels and KL estimates gathered as the loss runs: a step's figures
    (over every process's examples) and an evaluation's."""

    def __init__(self):
        self.seen = {True: [], False: []}

    def add(self, training: bool, rewards, label, z) -> None:
        self.seen[training].append((rewards, label, z.reshape(1)))

    def take(self, training: bool) -> dict[str, float]:
        got, self.seen[training] = self.seen[training], []
        if not got:
            return {}
        r, lab, z = (torch.cat(x) for x in zip(*got))
        return kto_figures(r, lab, z, across=training)


class KTOJob(PairJob):
    """PairJob's batches (each example's own sequence, then its KL sequence) with KTO's
    figures."""

    units = "examples"
    halves = True  # the own and KL sequences run apart (the KL ones without a gradient)
    tally_class = KTOTally


def rows(b: dict[str, torch.Tensor], part: slice) -> dict[str, torch.Tensor]:
    return {k: b[k][part] for k in ("ids", "ans_pos", "ans_tgt")}


def batch_loss(model, b, figs, beta: float, wd: float, wu: float) -> tuple[torch.Tensor, int]:
    """(the sum of a batch's KTO losses, its examples), its figures added to `figs`."""
    n = b["pair"].numel()
    pol, _ = answer_logps(model, rows(b, slice(0, n)))
    with torch.no_grad():  # the KL sequences: a sample for z, no gradient (TRL's)
        pol_kl, _ = answer_logps(model, rows(b, slice(n, 2 * n)))
    ref = b["ref"].to(pol.device)  # (B, 2): the example's sequence, its KL sequence
    label = b["label"].to(pol.device)
    losses, rewards, z = kto_loss(pol, ref[:, 0], pol_kl, ref[:, 1], label, beta, wd, wu)
    figs.add(model.training, rewards, label, z)
    return losses.sum(), n


def build(cfg: RunConfig, project: Project) -> Built:
    beta, wd, wu = cfg.beta, cfg.desirable_weight, cfg.undesirable_weight

    def loss(model, b, figs):
        return batch_loss(model, b, figs, beta, wd, wu)

    own = {"beta": beta, "desirable_weight": wd, "undesirable_weight": wu}
    return build_pairs(cfg, project, "kto", loss, own, True, UNPAIRED, KTOJob)


def check(cfg: RunConfig) -> list[str]:
    p = [] if cfg.data else ["give --data examples.jsonl (labelled completions)"]
    if cfg.corpus:
        p.append("--corpus is a token file; kto trains on --data examples.jsonl")
    p += check_adapter_opts(cfg)
    if cfg.batch_size < 2:
        p.append(
            f"--batch-size {cfg.batch_size}: KTO estimates its KL term from each batch's "
            "other completions; give --batch-size 2 or more"
        )
    return p


RECIPE = Recipe(
    "kto",
    build,
    defaults=DEFAULTS,
    flags=FLAGS,
    check=check,
    batch_unit=batches_unit,
    figures=FIGURES,
    shape=False,
)
