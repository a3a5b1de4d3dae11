"""`toy train`: build a recipe's job, make the run directory, run the shared loop."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from toy.cli.train_flags import general_flags
from toy.errors import UsageError
from toy.recipes import RECIPES, load_recipe, recipe_names
from toy.runs import find_project
from toy.train import dist
from toy.train.config import RunConfig
from toy.train.flags import Flag
from toy.train.progress import stdout_closed
from toy.train.run import Outcome, new_run, resume_run


def _default(key: str, recipes: dict) -> str | None:
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


def add_parser(sub, recipes: bool = True) -> None:
    names = recipe_names()
    p = sub.add_parser(
        "train", help=f"train a model ({', '.join(RECIPES)})", description=__doc__, add_help=False
    )
    p.add_argument(
        "-h",
        "--help",
        action=RecipeHelp,
        help="show this help and exit; after --recipe NAME, only that recipe's flags",
    )
    every = {name: load_recipe(name) for name in names}
    for title, flags in general_flags(names):
        g = p.add_argument_group(title)
        for f in flags:
            args, kw = f.argparse(None if f.shown is not None else _default(f.key, every))
            g.add_argument(*args, **kw)
    # Each recipe's own flags (declared in its file) in a group of its own; a flag several
    # recipes take (the adapter recipes' --model, --rank, ...) is added once, in a group
    # named after all of them.
    if recipes:
        for title, flags in recipe_groups():
            g = p.add_argument_group(title)
            for f in flags:
                g.add_argument(*f.argparse()[0], **f.argparse()[1])
    p.set_defaults(func=run)


class RecipeHelp(argparse._HelpAction):
    """-h/--help. After --recipe NAME (argparse reads the flags in order): that recipe's
    help alone, its own --data forms and defaults; else every recipe's."""

    def __call__(self, parser, namespace, values, option_string=None):
        name = getattr(namespace, "recipe", None)
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
        description=f"{__doc__.splitlines()[0]} The {name} recipe's flags; `toy train --help` "
        "shows every recipe's.",
    )
    for title, flags in general_flags(recipe_names()):
        g = p.add_argument_group(title)
        for f in flags:
            value = recipe.defaults.get(f.key, base.get(f.key))
            shown = None if f.shown is not None or value is None else str(value)
            if f.shown is None and f.key == "seq_len" and value is None:
                shown = "the preset context"
            epochs = recipe.defaults.get("epochs")
            if epochs is not None and f.key in ("steps", "epochs"):  # dpo, orpo: 3 passes
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
    take it ('lora recipe', 'dpo, lora, orpo recipes'). A flag that recipes declare each
    their own way (their --data forms; dpo's and simpo's --beta) says each one's help and
    default, lora's first: the recipe most of these flags are known from."""
    owners: dict[str, list[str]] = {}
    for name in recipe_names():
        for f in load_recipe(name).flags:
            owners.setdefault(f.option, []).append(name)
    groups: dict[str, list[Flag]] = {}
    for option, names in owners.items():
        by_help: dict[str, list[str]] = {}
        for n in sorted(names, key=lambda n: (n != "lora", n)):
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


def own_flags() -> dict[str, dict[str, str]]:
    """recipe -> {config key: flag} of its own flags (less the general flags it merely
    aliases, such as the adapter recipes' --max-seq-len)."""
    return {name: {f.key: f.option for f in load_recipe(name).own()} for name in recipe_names()}


def check_recipe_flags(recipe: str, cli: dict) -> None:
    """A flag of another recipe given on this one's run is a mistake, not a no-op: say
    which recipe takes it."""
    problems = []
    owned = own_flags()
    takers: dict[str, list[str]] = {}  # flag -> the recipes that take it
    for name, flags in owned.items():
        if name == recipe:
            continue
        for key, flag in flags.items():
            if cli.get(key) is not None and key not in owned.get(recipe, {}):
                takers.setdefault(flag, []).append(name)
    for flag, names in takers.items():
        # lora first: the recipe most flags of the adapter recipes are known from
        names.sort(key=lambda n: (n != "lora", n))
        also = f" (and {', '.join(names[1:])})" if len(names) > 1 else ""
        problems.append(
            f"{flag} is a {names[0]} recipe flag{also}; the {recipe} recipe does not take it "
            f"(drop it, or train with --recipe {names[0]})"
        )
    if problems:
        raise UsageError("; ".join(problems))


def run(args) -> int:
    if args.nproc and args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return dist.launch(args.nproc, args.argv)
    try:
        return _run(args)
    finally:
        dist.shutdown()


def _run(args) -> int:
    project = find_project()
    recipes = {name: load_recipe(name) for name in recipe_names()}
    keys = RunConfig.keys() + [f.key for r in recipes.values() for f in r.own()]
    cli = {k: getattr(args, k, None) for k in keys}
    if args.resume:
        if args.run_id or args.out:
            raise UsageError(
                f"--resume {args.resume} continues that run in place; --run-id and --out conflict "
                "with it"
            )
        outcome = resume_run(Path(args.resume), cli, project, recipes, json_mode=args.json)
    else:
        name = cli.get("recipe") or project.train_defaults.get("recipe") or RunConfig.recipe
        if name in recipes:
            check_recipe_flags(name, cli)
        outcome = new_run(
            cli, project, recipes, run_id=args.run_id, out=args.out, json_mode=args.json
        )
    if outcome.main:
        try:
            _print(outcome, args.json)
        except BrokenPipeError:
            stdout_closed()  # the run finished: a reader that went away does not change that
    return 0


def _print(o: Outcome, json_mode: bool) -> None:
    res, job = o.res, o.built.job
    last = res.losses[-1]["loss"] if res.losses else None
    last_val = res.val_losses[-1]["loss"] if res.val_losses else None
    # The recipe's figures that close a run: their held-out curves (the recipe names them).
    finals = [
        (f, [_point(f, m) for m in res.metrics if f.key in m])
        for f in load_recipe(o.cfg.recipe).figures
        if f.final
    ]
    if json_mode:
        out = {
            "format": "toy/train-v1",
            "run_id": o.run_id,
            "run_dir": str(o.run_dir),
            "recipe": o.cfg.recipe,
            "arch": o.built.arch,
            "device": o.device.type,
            "precision": o.precision.name,
            "precision_reason": o.precision.reason,
            "seed": o.cfg.seed,
            "steps": o.cfg.steps,
            "params": o.built.params,
            "losses": res.losses,
            "val_losses": res.val_losses,
            f"{job.items_name}_per_s": res.items_per_s,
            "wall_s": round(res.wall_s, 3),
            "peak_mem_bytes": res.peak_mem_bytes,
        }
        if res.metrics:
            out["metrics"] = res.metrics
        out.update({f.json_key: curve for f, curve in finals if curve and f.json_key})
        print(json.dumps(out))
    else:
        val = f", val loss {last_val:.4f}" if last_val is not None else ""
        speed = f", {res.items_per_s:,.0f} {job.items_name}/s" if res.items_per_s else ""
        val += "".join(f", {f.label} {c[-1][_at(f)]:.4f}" for f, c in finals if c)
        mem = f", peak memory {res.peak_mem_bytes / 1e9:.2f} GB" if res.peak_mem_bytes else ""
        print(
            f"done: loss {last:.4f}{val}{speed}{mem}, {res.wall_s:.1f}s; "
            f"model in {o.run_dir / 'final'}"
        )
    sys.stdout.flush()


def _at(f) -> str:
    """The key of a final figure's value in its curve's entries."""
    return f.key if f.every else "accuracy"


def _point(f, m: dict) -> dict:
    """One entry of a final figure's curve (train/recipe.py: Figure)."""
    if f.every:
        return {"step": m["step"], **{k: v for k, v in m.items() if k != "step"}}
    return {"step": m["step"], "accuracy": m[f.key]}
