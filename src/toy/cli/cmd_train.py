"""`toy train`: build a recipe's job, make the run directory, run the shared loop. The
flags and their help come from their declarations (train_flags.py, train_help.py, each
recipe's Flags); the run is train/run.py's."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from toy.cli.train_flags import general_flags
from toy.cli.train_help import DOC, RecipeHelp, default_shown, recipe_groups
from toy.errors import UsageError
from toy.recipes import RECIPES, load_recipe, recipe_names
from toy.runs import find_project, json_safe
from toy.train import dist
from toy.train.config import RunConfig
from toy.train.progress import stdout_closed
from toy.train.run import new_run, resume_run, resumed_processes


def add_parser(sub, recipes: bool = True) -> None:
    names = recipe_names()
    p = sub.add_parser(
        "train", help=f"train a model ({', '.join(RECIPES)})", description=DOC, add_help=False
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
            args, kw = f.argparse(None if f.shown is not None else default_shown(f.key, every))
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


def run(args) -> int:
    nproc = args.nproc
    if nproc is None and args.resume and "WORLD_SIZE" not in os.environ:
        # a run `toy train --nproc N` started resumes on N processes unless told otherwise
        if nproc := resumed_processes(Path(args.resume)):
            print(
                f"toy train: resuming on {nproc} processes, as the run was trained "
                "(--nproc 1 resumes it on one: the same global batch, losses close, not equal)",
                file=sys.stderr,
            )
    if nproc and nproc > 1 and "WORLD_SIZE" not in os.environ:
        return dist.launch(nproc, args.argv)
    try:
        return _run(args)
    finally:
        dist.shutdown()


def _run(args) -> int:
    project = find_project()
    recipes = {name: load_recipe(name) for name in RECIPES}  # the recipe table's order
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
        outcome = new_run(
            cli, project, recipes, run_id=args.run_id, out=args.out, json_mode=args.json
        )
    if outcome.main:
        try:
            if args.json:
                print(json.dumps(json_safe(outcome.record()), allow_nan=False))
            else:
                print(outcome.done_line())
            sys.stdout.flush()
        except BrokenPipeError:
            stdout_closed()  # the run finished: a reader that went away does not change that
    return 0
