"""Recipes declare a job (model, trainable parameters, batches, loss); the loop in
toy.train runs it. A recipe never imports another recipe."""

from __future__ import annotations

from importlib import import_module

# name -> module under toy.recipes; each module declares its `RECIPE` (toy.train.recipe.Recipe).
RECIPES = {
    "from-scratch": "from_scratch",
    "vit-tiny": "vit_tiny",
    "lora": "lora",
    "dpo": "dpo",
    "orpo": "orpo",
    "warm-start": "warm_start",
}


def recipe_names() -> list[str]:
    return sorted(RECIPES)


def load_recipe(name: str):
    """The Recipe named `name` (a KeyError for an unknown one: callers check the names)."""
    return import_module(f"toy.recipes.{RECIPES[name]}").RECIPE
