"""A recipe's face: what `toy train`, a run's life (train/run.py) and the tools that show a
run (the progress line, --json, `toy plot`) may ask of a recipe.

Each module in recipes/ declares one `Recipe` as `RECIPE`; nothing probes a recipe's
module for optional attributes. A recipe's own flags are declared once, as `Flag`s: from
each come its argparse line (the default written into the help by code), its place in
the run's config (RunConfig.opts, recorded flat in run.json and checked on resume) and
its check. A recipe's own figures are declared once, as `Figure`s: the loop records
whatever a job's step_figures / eval_figures return, and the progress line, the done line,
--json and `toy plot` show what the recipe declares, naming no recipe's metric themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from toy.train.config import RunConfig
from toy.train.flags import Flag
from toy.train.job import Built

__all__ = ["Figure", "Flag", "Recipe"]


@dataclass(frozen=True)
class Figure:
    """A figure a recipe's job reports beside the loss: in step events and lines
    (step_figures) and in evaluations (eval_figures), under `key`.

    - `label`: its name in words ("held-out preference accuracy").
    - `final`: the done line ends with its last evaluated value, and --json carries its
      evaluation curve as `json_key`: [{"step", "accuracy"}] (the form the curves have),
      or, with `every`, [{"step", key: value, and every other figure of that evaluation}]
      (GRPO's val_rewards: the total reward and each reward function's).
    - `bar`: a short label for the progress bar, which shows the step's value.
    - `plot`: `toy plot` draws its evaluation curve on a right-hand axis in `span`.
    """

    key: str
    label: str
    final: bool = False
    json_key: str | None = None
    bar: str | None = None
    plot: bool = False
    span: tuple[float, float] | None = None
    every: bool = False

    @property
    def curve_key(self) -> str:
        """The key of this figure's value in its --json curve's entries."""
        return self.key if self.every else "accuracy"

    def point(self, evaluation: dict[str, Any]) -> dict[str, Any]:
        """One entry of its --json curve, from an evaluation's record {"step", figures}."""
        if self.every:
            return {"step": evaluation["step"]} | {
                k: v for k, v in evaluation.items() if k != "step"
            }
        return {"step": evaluation["step"], "accuracy": evaluation[self.key]}

    def curve(self, evaluations: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Its --json curve over a run's evaluations (those that hold it)."""
        return [self.point(m) for m in evaluations if self.key in m]


def _no_problems(cfg: RunConfig) -> list[str]:
    return []


def _rows(cfg: RunConfig) -> str:
    return "rows"


# The general flags that shape a fresh model.
SHAPE_KEYS = ("arch", "preset", "n_layer", "d_model", "n_head", "n_kv_head")


@dataclass(frozen=True)
class Recipe:
    name: str
    # build(cfg, project) -> Built: the job, from the resolved config (all input checks here).
    build: Callable[[RunConfig, Any], Built]
    # The recipe's defaults for the general flags it sets otherwise (lr, batch_size, ...).
    defaults: dict[str, Any] = field(default_factory=dict)
    # The recipe's own flags, each declared once.
    flags: tuple[Flag, ...] = ()
    # Every problem across its flags, by flag, before anything is read (each flag's own
    # check runs first, from its declaration).
    check: Callable[[RunConfig], list[str]] = _no_problems
    # What one global batch is made of: "rows" (token windows, images; split over
    # processes) or "batches" (whole length-grouped chat batches): how a resume on
    # another number of processes keeps the global batch.
    batch_unit: Callable[[RunConfig], str] = _rows
    # The figures its job reports beside the loss (what the tools show of them).
    figures: tuple[Figure, ...] = ()
    # Whether it builds a fresh model from the shape flags (SHAPE_KEYS); a recipe that
    # trains a given model's own shape (an adapter on --model) refuses them and its help
    # leaves them out.
    shape: bool = True

    def own(self) -> tuple[Flag, ...]:
        """The flags that are config keys of this recipe's (not aliases of general flags)."""
        general = set(RunConfig.keys())
        return tuple(f for f in self.flags if f.key not in general)

    def flag_defaults(self) -> dict[str, Any]:
        """Every default the recipe sets: its own flags' and the general flags' it changes."""
        return {**{f.key: f.default for f in self.own()}, **self.defaults}

    def config(self, **overrides: Any) -> RunConfig:
        """Defaults, then the recipe's, then overrides: how scripts and tests build one."""
        return self.typed(
            RunConfig.build({**self.flag_defaults(), **overrides, "recipe": self.name})
        )

    def typed(self, cfg: RunConfig) -> RunConfig:
        """`cfg` with each of the recipe's own values as its Flag's type says (toy.toml's
        `beta = 1` and run.json's numbers are read as given): a recipe reads cfg.beta as a
        float, never casting it."""
        typed = {}
        for f in self.own():
            v = cfg.opts.get(f.key)
            if v is None or f.type not in (float, bool):
                continue
            if f.type is float and isinstance(v, int) and not isinstance(v, bool):
                typed[f.key] = float(v)
            elif f.type is bool and isinstance(v, int):
                typed[f.key] = bool(v)
        return cfg.replace(**typed) if typed else cfg

    def problems(self, cfg: RunConfig) -> list[str]:
        """Every problem with the recipe's flags: each flag's check, then the recipe's."""
        p = [why for f in self.own() if (why := f.problem(cfg.opts.get(f.key)))]
        return p + self.check(cfg)
