"""SimPO: a LoRA adapter on a frozen base, trained on preference pairs without a
reference: -log sigmoid(beta * (mean_c - mean_r) - gamma), where mean_c and mean_r are the
answers' mean token log-probabilities (SimPO, Meng et al. 2024), as TRL's
CPOTrainer(loss_type="simpo", cpo_alpha=0). The rewards shown are beta times the means.

Reference-free losses can degenerate a small model (torchtune #2470): watch the held-out
preference accuracy with a sample of replies, and lower --lr or --beta if replies repeat.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toy.recipes.pairs import (
    PAIR_DEFAULTS,
    PAIR_FIGURES,
    PAIR_FLAGS,
    SMALL_SET_EPOCHS,
    answer_sums,
    batches_unit,
    build_pairs,
    check_pair_opts,
)
from toy.runs import Project
from toy.train.config import RunConfig
from toy.train.job import Built
from toy.train.recipe import Flag, Recipe

# The SimPO paper's region for 7-8B instruct models: beta 2-2.5, gamma / beta about 0.5.
# The LR and epochs as DPO's and ORPO's, for a user's small set: three passes at 7e-4
# moved SmolLM2-135M's held-out accuracy 0 -> 1.0 on the "captain" set and 0.7 -> 1.0 on
# the "brief" one with no collapsed reply; 1e-3 and 2e-3 collapsed captain's replies, 5e-4
# reached 0.625 there (docs/results.md, "Preference defaults for small sets").
DEFAULTS = {**PAIR_DEFAULTS, "lr": 7e-4, "min_lr": 7e-5, "epochs": SMALL_SET_EPOCHS}
FLAGS = (
    *PAIR_FLAGS,
    Flag(
        "beta",
        2.0,
        "SimPO's beta: the scale of the answers' mean log-prob difference",
        float,
        check=lambda v: v > 0,
        must="be > 0",
    ),
    Flag(
        "gamma",
        1.0,
        "SimPO's target margin: how far the chosen answer's scaled mean log-prob must lead",
        float,
        check=lambda v: v >= 0,
        must="be >= 0",
    ),
)


def simpo_loss(
    mean_c: torch.Tensor, mean_r: torch.Tensor, beta: float, gamma: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair SimPO losses (B,) and the rewards (beta x mean log-prob, detached) of the
    chosen and rejected answers, from their mean token log-probs (B,)."""
    mean_c, mean_r = mean_c.float(), mean_r.float()
    losses = -F.logsigmoid(beta * (mean_c - mean_r) - gamma)
    return losses, (beta * mean_c).detach(), (beta * mean_r).detach()


def build(cfg: RunConfig, project: Project) -> Built:
    beta, gamma = cfg.beta, cfg.gamma

    def loss(model, b, figs):
        s = answer_sums(model, b)  # (2B,): chosen rows, then rejected
        n = s.shape[0] // 2
        mean = s / b["n_ans"]  # each answer's mean token log-prob
        losses, rc, rr = simpo_loss(mean[:n], mean[n:], beta, gamma)
        figs.add(model.training, rc, rr)
        return losses.sum(), n

    own = {"beta": beta, "gamma": gamma}
    return build_pairs(cfg, project, "simpo", loss, own, reference=False)


RECIPE = Recipe(
    "simpo",
    build,
    defaults=DEFAULTS,
    flags=FLAGS,
    check=check_pair_opts,
    batch_unit=batches_unit,
    figures=PAIR_FIGURES,
    shape=False,
)
