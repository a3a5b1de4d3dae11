"""A recipe's face: what `toy train` and a run's life (train/run.py) may ask of a recipe.

Each module in recipes/ declares one `Recipe` as `RECIPE`; nothing probes a recipe's
module for optional attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from toy.train.config import RunConfig
from toy.train.job import Built


def _no_flags(group) -> None:
    pass


def _no_problems(cfg: RunConfig) -> list[str]:
    return []


def _rows(cfg: RunConfig) -> str:
    return "rows"


@dataclass(frozen=True)
class Recipe:
    name: str
    # build(cfg, project) -> Built: the job, from the resolved config (all input checks here).
    build: Callable[[RunConfig, Any], Built]
    # The recipe's defaults for its own flags and for general flags it sets otherwise.
    defaults: dict[str, Any] = field(default_factory=dict)
    # Adds the recipe's own flags to an argparse group.
    add_arguments: Callable[[Any], None] = _no_flags
    # Every problem with its flags, by flag, before anything is read.
    check: Callable[[RunConfig], list[str]] = _no_problems
    # What one global batch is made of: "rows" (token windows, images; split over
    # processes) or "batches" (whole length-grouped chat batches): how a resume on
    # another number of processes keeps the global batch.
    batch_unit: Callable[[RunConfig], str] = _rows
