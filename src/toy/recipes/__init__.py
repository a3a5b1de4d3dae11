"""Recipes declare a job (model, trainable parameters, batches, loss); the loop in
toy.train runs it. A recipe never imports another recipe."""

from __future__ import annotations

from importlib import import_module

# name -> module; each module declares its `RECIPE` (toy.train.recipe.Recipe). In the order
# `toy train --help` names them. One line a recipe: adding one touches nothing else here.
RECIPES = {
    "from-scratch": "toy.recipes.from_scratch",
    "warm-start": "toy.recipes.warm_start",
    "lora": "toy.recipes.lora",
    "dpo": "toy.recipes.dpo",
    "orpo": "toy.recipes.orpo",
    "simpo": "toy.recipes.simpo",
    "kto": "toy.recipes.kto",
    "grpo": "toy.recipes.grpo",
    "distill": "toy.recipes.distill",
    "vit-tiny": "toy.recipes.vit_tiny",
}


def recipe_names() -> list[str]:
    return sorted(RECIPES)


def load_recipe(name: str):
    """The Recipe named `name` (a KeyError for an unknown one: callers check the names)."""
    return import_module(RECIPES[name]).RECIPE
