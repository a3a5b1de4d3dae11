"""DPO: a LoRA adapter on a frozen base, trained on preference pairs with the sigmoid
loss -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))) over the answers' summed
log-probs, plus --sft-weight times the chosen answers' mean token NLL (RPO). The reference
is the same base with the adapter switched off (no second copy of the weights), its
log-probs computed once per pair (recipes/pairs.py)."""

from __future__ import annotations

from toy.models.losses import dpo_loss
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

FLAGS = (
    *PAIR_FLAGS,
    Flag(
        "beta",
        0.1,
        "DPO's beta: how far from the reference the adapter may move",
        float,
        check=lambda v: v > 0,
        must="be > 0",
    ),
    Flag(
        "label_smoothing",
        0.0,
        "conservative DPO: the share of pairs taken as mislabelled, in [0, 0.5)",
        float,
        shown="0",
        check=lambda v: 0 <= v < 0.5,
        must="be in [0, 0.5)",
    ),
    Flag(
        "sft_weight",
        1.0,
        "the weight of each chosen answer's NLL (its mean over the answer's tokens) added to "
        "DPO's loss (RPO; TRL's loss_type ['sigmoid', 'sft'] with loss_weights [1, W], whose "
        "sft term takes the mean over a batch's tokens instead: the same on one pair). It keeps "
        "the chosen answers likely while the margin grows, where DPO alone on a small set "
        "pushed both answers down and degenerated",
        float,
        check=lambda v: v >= 0,
        must="be >= 0 (0: DPO alone)",
    ),
)
# On 24 "Aye, captain!" pairs DPO alone degenerated at every LR that moved the replies
# ("Aye, captain! Aye, captain!"); with the chosen NLL beside it (sft_weight 1) it did not.
DEFAULTS = {**PAIR_DEFAULTS, "lr": 1e-3, "min_lr": 1e-4, "epochs": SMALL_SET_EPOCHS}


def build(cfg: RunConfig, project: Project) -> Built:
    beta, smooth, sft = cfg.beta, cfg.label_smoothing, cfg.sft_weight

    def loss(model, b, figs):
        s = answer_sums(model, b)  # (2B,): chosen rows, then rejected
        n = s.shape[0] // 2
        ref = b["ref"]  # (B, 2)
        losses, rc, rr = dpo_loss(s[:n], s[n:], ref[:, 0], ref[:, 1], beta, smooth)
        figs.add(model.training, rc, rr)
        total = losses.sum()
        if sft:  # each chosen answer's mean token NLL: a sum over pairs, as DPO's term is
            total = total - sft * (s[:n] / b["n_ans"][:n]).sum()
        return total, n

    own = {"beta": beta, "label_smoothing": smooth, "sft_weight": sft}
    return build_pairs(cfg, project, "dpo", loss, own, reference=True)


RECIPE = Recipe(
    "dpo",
    build,
    defaults=DEFAULTS,
    flags=FLAGS,
    check=check_pair_opts,
    batch_unit=batches_unit,
    figures=PAIR_FIGURES,
    shape=False,
)
