"""ORPO: a LoRA adapter on a frozen base, trained on preference pairs with the chosen
answer's NLL plus --orpo-lambda times the log odds-ratio term, as TRL's ORPOTrainer: the
NLL over the whole chosen sequence (prompt included), the odds on each answer's mean token
log-probability. No reference pass."""

from __future__ import annotations

from toy.models.losses import orpo_loss, sequence_logprobs
from toy.recipes.pairs import (
    PAIR_DEFAULTS,
    PAIR_FIGURES,
    PAIR_FLAGS,
    SMALL_SET_EPOCHS,
    answer_logps,
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
        "orpo_lambda",
        0.1,
        "weight of ORPO's odds-ratio term beside the chosen answer's NLL",
        float,
        check=lambda v: v >= 0,
        must="be >= 0",
    ),
)
DEFAULTS = {**PAIR_DEFAULTS, "lr": 2e-3, "min_lr": 2e-4, "epochs": SMALL_SET_EPOCHS}


def build(cfg: RunConfig, project: Project) -> Built:
    lam = cfg.orpo_lambda

    def loss(model, b, figs):
        s, h = answer_logps(model, b)  # (2B,): chosen rows, then rejected
        n = s.shape[0] // 2
        mean = s / b["n_ans"]
        nll = -sequence_logprobs(h[:n], model.lm_head, b["full"][:n], model.final_softcap)
        losses, rc, rr = orpo_loss(mean[:n], mean[n:], nll / b["n_full"][:n], lam)
        figs.add(model.training, rc, rr)
        return losses.sum(), n

    return build_pairs(cfg, project, "orpo", loss, {"orpo_lambda": lam}, reference=False)


RECIPE = Recipe(
    "orpo",
    build,
    defaults=DEFAULTS,
    flags=FLAGS,
    check=check_pair_opts,
    batch_unit=batches_unit,
    figures=PAIR_FIGURES,
    shape=False,
)
