"""ORPO: a LoRA adapter on a frozen base, trained on preference pairs with the chosen
answer's NLL plus --orpo-lambda times the log odds-ratio term, as TRL's ORPOTrainer: the
NLL over the whole chosen sequence (prompt included), the odds on each answer's mean token
log-probability. No reference pass."""

from __future__ import annotations

from toy.models.losses import orpo_loss, sequence_logprobs
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

FLAGS = {**PAIR_FLAGS, "orpo_lambda": 0.1}


def add_arguments(g) -> None:
    add_pair_arguments(g)
    g.add_argument(
        "--orpo-lambda",
        type=float,
        help="weight of ORPO's odds-ratio term beside the chosen answer's NLL (default 0.1)",
    )


def check(cfg: RunConfig) -> list[str]:
    p = check_pair_opts(cfg)
    if not (isinstance(cfg.orpo_lambda, (int, float)) and cfg.orpo_lambda >= 0):
        p.append(f"--orpo-lambda must be >= 0, got {cfg.orpo_lambda!r}")
    return p


def build(cfg: RunConfig, project: Project) -> Built:
    lam = float(cfg.orpo_lambda)

    def loss(model, b, figs):
        s, h = answer_logps(model, b)  # (2B,): chosen rows, then rejected
        n = s.shape[0] // 2
        mean = s / b["n_ans"]
        nll = -sequence_logprobs(h[:n], model.lm_head, b["full"][:n], model.final_softcap)
        losses, rc, rr = orpo_loss(mean[:n], mean[n:], nll / b["n_full"][:n], lam)
        figs.add(model.training, rc, rr)
        return losses.sum(), n

    return build_pairs(cfg, project, "orpo", loss, {"orpo_lambda": lam}, reference=False)


RECIPE = Recipe("orpo", build, FLAGS, add_arguments, check, batches_unit)
