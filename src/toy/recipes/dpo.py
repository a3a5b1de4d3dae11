"""DPO: a LoRA adapter on a frozen base, trained on preference pairs with the sigmoid
loss -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))) over the answers' summed
log-probs. The reference is the same base with the adapter switched off (no second copy
of the weights), its log-probs computed once per pair (recipes/pairs.py)."""

from __future__ import annotations

from toy.models.losses import dpo_loss
from toy.recipes.pairs import (
    PAIR_FLAGS,
    add_pair_arguments,
    answer_logps,
    batches_unit,
    build_pairs,
    check_pair_opts,
)
from toy.runs import Project
from toy.train.config import RunConfig
from toy.train.job import Built
from toy.train.recipe import Recipe

FLAGS = {**PAIR_FLAGS, "beta": 0.1, "label_smoothing": 0.0}


def add_arguments(g) -> None:
    add_pair_arguments(g)
    g.add_argument(
        "--beta",
        type=float,
        help="DPO's beta: how far from the reference the adapter may move (default 0.1)",
    )
    g.add_argument(
        "--label-smoothing",
        type=float,
        help="conservative DPO: the share of pairs taken as mislabelled, in [0, 0.5) (default 0)",
    )


def check(cfg: RunConfig) -> list[str]:
    p = check_pair_opts(cfg)
    if not (isinstance(cfg.beta, (int, float)) and cfg.beta > 0):
        p.append(f"--beta must be > 0, got {cfg.beta!r}")
    if not (isinstance(cfg.label_smoothing, (int, float)) and 0 <= cfg.label_smoothing < 0.5):
        p.append(f"--label-smoothing must be in [0, 0.5), got {cfg.label_smoothing!r}")
    return p


def build(cfg: RunConfig, project: Project) -> Built:
    beta, smooth = float(cfg.beta), float(cfg.label_smoothing)

    def loss(model, b, figs):
        s, _ = answer_logps(model, b)  # (2B,): chosen rows, then rejected
        n = s.shape[0] // 2
        ref = b["ref"]  # (B, 2)
        losses, rc, rr = dpo_loss(s[:n], s[n:], ref[:, 0], ref[:, 1], beta, smooth)
        figs.add(model.training, rc, rr)
        return losses.sum(), n

    own = {"beta": beta, "label_smoothing": smooth}
    return build_pairs(cfg, project, "dpo", loss, own, reference=True)


RECIPE = Recipe("dpo", build, FLAGS, add_arguments, check, batches_unit)
