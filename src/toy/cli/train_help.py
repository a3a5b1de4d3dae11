"""`toy train --help`: the general flags with each recipe's defaults, and the recipes' own
flags in groups named after the recipes that take them; after --recipe NAME, that recipe's
flags alone. Written from the declarations (train_flags.py, each recipe's Flags)."""

from __future__ import annotations

import argparse
import dataclasses

from toy.cli.train_flags import general_flags
from toy.recipes import RECIPES, load_recipe, recipe_names
from toy.train.config import RunConfig
from toy.train.flags import Flag
from toy.train.recipe import SHAPE_KEYS

DOC = "`toy train`: build a recipe's job, make the run directory, run the shared loop."


def default_shown(key: str, recipes: dict) -> str | None:
    """A general flag's default: RunConfig's, with each recipe's that differs ('1e-3; lora
    2e-4, ...'); None for a key that is not a config key."""
    base = RunConfig.defaults()
    if key not in base:
        return None
    others = [
        f"{name} {r.defaults[key]}"
        for name, r in recipes.items()
        if r.defaults.get(key) is not None and r.defaults[key] != base[key]
    ]
    shown = "the preset context" if key == "seq_len" else str(base[key])
    return shown + (f"; {', '.join(others)}" if others else "")


class RecipeHelp(argparse._HelpAction):
    """-h/--help. After --recipe NAME (argparse reads the flags in order): that recipe's
    help alone, its own --data forms and defaults; else every recipe's."""

    def __call__(self, parser, namespace, values, option_string=None):
        name = getattr(namespace, "recipe", None)
        if name is not None and name not in RECIPES:  # one line, as a run would say it
            from toy.train.run import unknown_recipe

            parser.exit(2, f"{parser.prog}: error: {unknown_recipe(name, RECIPES)}\n")
        if name in RECIPES:
            parser = recipe_parser(parser.prog, name)
        parser.print_help()
        parser.exit()


def recipe_parser(prog: str, name: str) -> argparse.ArgumentParser:
    """The parser `toy train --recipe NAME --help` prints: the general flags with the
    recipe's defaults, then its own flags with its own help (used for the help only)."""
    recipe = load_recipe(name)
    base = RunConfig.defaults()
    p = argparse.ArgumentParser(
        prog=prog,
        description=f"{DOC} The {name} recipe's flags; `toy train --help` shows every recipe's.",
    )
    for title, flags in general_flags(recipe_names()):
        g = p.add_argument_group(title)
        for f in flags:
            if f.key in SHAPE_KEYS and not recipe.shape:  # it trains a given model's shape
                continue
            value = recipe.defaults.get(f.key, base.get(f.key))
            shown = None if f.shown is not None or value is None else str(value)
            if f.shown is None and f.key == "seq_len" and value is None:
                shown = "the preset context"
            epochs = recipe.defaults.get("epochs")
            if epochs is not None and f.key in ("steps", "epochs"):  # a recipe's own passes
                shown = (
                    f"those of --epochs {epochs}"
                    if f.key == "steps"
                    else f"{epochs}; a --steps given replaces it"
                )
            args, kw = f.argparse(shown)
            g.add_argument(*args, **kw)
    if recipe.flags:
        g = p.add_argument_group(f"{name} recipe")
        for f in recipe.flags:
            g.add_argument(*f.argparse()[0], **f.argparse()[1])
    return p


def recipe_groups() -> list[tuple[str, list[Flag]]]:
    """(group title, flags) for the recipes' flags, each flag once, under the recipes that
    take it, in the recipe table's order (recipes/__init__.py: the recipe most of a shared
    flag's users know it from comes first). A flag that recipes declare each their own way
    (their --data forms, --beta) says each one's help and default."""
    owners: dict[str, list[str]] = {}
    for name in RECIPES:  # the recipe table's order: lora before the others it shares with
        for f in load_recipe(name).flags:
            owners.setdefault(f.option, []).append(name)
    groups: dict[str, list[Flag]] = {}
    for option, names in owners.items():
        by_help: dict[str, list[str]] = {}
        for n in names:
            by_help.setdefault(load_flag(n, option).help_text(), []).append(n)
        f = load_flag(names[0], option)
        if len(by_help) > 1:
            said = "; ".join(f"{', '.join(ns)}: {h}" for h, ns in by_help.items())
            f = dataclasses.replace(f, help=said.replace("%%", "%"), shown="")
        title = f"{', '.join(names)} recipe" + ("s" if len(names) > 1 else "")
        groups.setdefault(title, []).append(f)
    return list(groups.items())


def load_flag(recipe: str, option: str) -> Flag:
    return next(f for f in load_recipe(recipe).flags if f.option == option)
