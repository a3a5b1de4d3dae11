"""`toy train`: build a recipe's job, make the run directory, run the shared loop."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from toy.cli.args import finite_float, nonneg_int, positive_int
from toy.errors import UsageError
from toy.models import registry
from toy.recipes import load_recipe, recipe_names
from toy.runs import find_project
from toy.train import dist
from toy.train.config import RunConfig
from toy.train.device import DEVICES, PRECISIONS
from toy.train.progress import stdout_closed
from toy.train.run import Outcome, new_run, resume_run

# Built-in defaults: RunConfig's (toy.toml [train] and then flags override them).
DEFAULTS = RunConfig.defaults()


def dflt(key: str, base: str | None = None) -> str:
    """'(default X)', with each recipe whose default differs: '(default 1e-3; lora 1e-4, ...)'."""
    shown = base if base is not None else str(DEFAULTS[key])
    others = []
    for name in recipe_names():
        flags = load_recipe(name).defaults
        if key in flags and flags[key] != DEFAULTS[key] and flags[key] is not None:
            others.append(f"{name} {flags[key]}")
    return f"(default {shown}" + (f"; {', '.join(others)})" if others else ")")


def _presets() -> str:
    out = []
    for arch in registry.arch_names():
        for name in registry.preset_names(arch):
            f = registry.preset(arch, name)
            shape = (
                (f"{f['image_size']}px/{f['patch_size']}, " if "image_size" in f else "")
                + f"{f['n_layer']}x{f['d_model']}, {f['n_head']} heads"
                + (f", context {f['max_seq_len']}" if "max_seq_len" in f else "")
            )
            out.append(f"{arch} {name} ({shape})")
    return "; ".join(out)


def add_parser(sub, recipes: bool = True) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (from-scratch, warm-start, lora, dpo, orpo, vit-tiny)",
        description=__doc__,
    )
    g = p.add_argument_group("run")
    g.add_argument(
        "--recipe", help=f"what to train: {', '.join(recipe_names())} (default from-scratch)"
    )
    g.add_argument(
        "--arch", help=f"architecture: {', '.join(registry.arch_names())} {dflt('arch')}"
    )
    g.add_argument("--steps", type=positive_int("--steps"), help=f"optimizer steps {dflt('steps')}")
    g.add_argument(
        "--epochs",
        type=positive_int("--epochs"),
        help="passes over the training data (token windows, images or chat batches); sets --steps "
        "from the data, conflicts with --steps (default: none, --steps counts)",
    )
    g.add_argument("--seed", type=int, help="seed for init, data order and sampling (default 0)")
    g.add_argument(
        "--out", help="directory that holds run directories (default: the project's runs/)"
    )
    g.add_argument(
        "--run-id",
        help="run directory name (default from toy.toml's template '{date}-{recipe}-{arch}-{n}')",
    )
    g.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (format toy/train-v1) instead of step lines",
    )
    g.add_argument("--device", choices=DEVICES, help="cpu (default), cuda or metal (macOS)")
    g.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="what the matmuls compute in: auto (default: bf16 autocast on cuda and on a cpu "
        "with bf16 units (avx512_bf16, amx_bf16), float32 elsewhere), float32, or bf16 (refused "
        "on a cpu without the units). Norms, softmax, the loss, the weights and AdamW's state "
        "stay float32; run.json records the choice and why",
    )
    g.add_argument(
        "--nproc",
        type=positive_int("--nproc"),
        metavar="N",
        help="launch N local processes through torch.distributed.run (DDP; gloo on cpu, nccl on "
        "cuda); --batch-size is per process. For multi-node use torchrun, see README (default: "
        "one process)",
    )
    g.add_argument(
        "--fsdp",
        action="store_true",
        default=None,
        help="with several processes: shard parameters, gradients and AdamW state (FSDP2) "
        "instead of replicating them (DDP)",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="torch.compile each transformer block (inductor; needs a C++ compiler on cpu). Faster "
        "steps after a one-off compile of tens of seconds; falls back to eager where it cannot",
    )
    g.add_argument(
        "--checkpointing",
        action="store_true",
        default=None,
        help="activation checkpointing, the low-memory mode: keep only each block's input and "
        "recompute the block in backward, and give freed memory back to the OS at once. Measured "
        "on SmolLM2 LoRA (docs/performance.md): peak memory 0.59 GB instead of 2.1 GB, steps about "
        "2.3x slower. Every recipe",
    )
    g.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue RUN_DIR from its latest checkpoint, in place "
        "(same config; --steps may be raised: docs/reliability.md says what the LR then does) "
        "(default: a new run)",
    )
    d = p.add_argument_group("data")
    d.add_argument(
        "--corpus",
        help="token file from `toy prep` (default: the project's data/corpus.bin, "
        "else the bundled Shakespeare plays)",
    )
    d.add_argument(
        "--val-corpus", help="validation token file (default: CORPUS.val.bin beside --corpus)"
    )
    d.add_argument(
        "--tokenizer",
        help="tokenizer.json for the corpus (default: CORPUS.tokenizer.json, else "
        "tokenizer.json, beside the corpus)",
    )
    d.add_argument(
        "--raw-i32", action="store_true", help="--corpus is headerless packed int32 tokens"
    )
    d.add_argument(
        "--vocab-size",
        type=positive_int("--vocab-size"),
        help="vocabulary size of a --raw-i32 corpus without --tokenizer (default: the tokenizer's)",
    )
    m = p.add_argument_group("model")
    from toy.recipes import vit_tiny as vit

    m.add_argument(
        "--preset",
        help=f"named model shape: {_presets()} (default: llama small, gpt2 small; vit "
        f"{vit.SMALL_PRESET} under {vit.SMALL_SET:,} training images, else vit-tiny)",
    )
    m.add_argument(
        "--n-layer",
        type=positive_int("--n-layer"),
        help="transformer blocks (default: the preset's)",
    )
    m.add_argument(
        "--d-model", type=positive_int("--d-model"), help="model width (default: the preset's)"
    )
    m.add_argument(
        "--n-head",
        type=positive_int("--n-head"),
        help="attention (query) heads (default: the preset's)",
    )
    m.add_argument(
        "--n-kv-head",
        type=positive_int("--n-kv-head"),
        help="key/value heads, grouped-query attention, llama only (default: the preset's)",
    )
    m.add_argument(
        "--seq-len",
        type=positive_int("--seq-len"),
        help=f"training sequence length {dflt('seq_len', 'the preset context')}",
    )
    o = p.add_argument_group("optimiser")
    o.add_argument(
        "--batch-size",
        type=positive_int("--batch-size"),
        help=f"sequences per micro-batch {dflt('batch_size')}; with chat --data, a token budget: "
        "a micro-batch holds up to batch-size x (seq-len + 1) tokens, filled with conversations "
        "of similar length (more short conversations, fewer long ones)",
    )
    o.add_argument(
        "--grad-accum",
        type=positive_int("--grad-accum"),
        help="micro-batches per optimizer step; the loss is normalised over all of them "
        f"{dflt('grad_accum')}",
    )
    o.add_argument("--lr", type=finite_float, help=f"peak learning rate {dflt('lr')}")
    o.add_argument(
        "--min-lr",
        type=finite_float,
        help=f"final learning rate of the cosine decay {dflt('min_lr')}",
    )
    o.add_argument(
        "--warmup",
        type=nonneg_int,
        help="linear warmup steps, at most 10%% of the run (a longer one is "
        f"cut, with a note) {dflt('warmup')}",
    )
    o.add_argument(
        "--weight-decay",
        type=finite_float,
        help=f"AdamW decay on matrices and embeddings {dflt('weight_decay')}",
    )
    o.add_argument(
        "--clip", type=finite_float, help=f"gradient norm clip, 0 disables {dflt('clip')}"
    )
    o.add_argument(
        "--eval-every",
        type=nonneg_int,
        help="validation every N steps; it also runs before step 1 and at the end "
        "(default 0: only those)",
    )
    o.add_argument(
        "--eval-batches",
        type=positive_int("--eval-batches"),
        help=f"validation batches per eval {dflt('eval_batches')}",
    )
    o.add_argument(
        "--save-every",
        type=nonneg_int,
        help="checkpoint every N steps; the last step is always "
        "checkpointed (default 0: only the last)",
    )
    o.add_argument(
        "--keep-last", type=nonneg_int, help="checkpoints to keep, 0 keeps all (default 2)"
    )
    # Each recipe adds its own flags (recipe modules own them) in a group of its own; a
    # flag several recipes take (the adapter recipes' --model, --rank, ...) is added once,
    # in a group named after all of them.
    if recipes:
        for title, calls in recipe_groups():
            g = p.add_argument_group(title)
            for args, kwargs in calls:
                g.add_argument(*args, **kwargs)
    p.set_defaults(func=run)


class _Recorder:
    """Stands for an argparse group: keeps a recipe's add_argument calls."""

    def __init__(self):
        self.calls: list[tuple[tuple, dict]] = []

    def add_argument(self, *args, **kwargs) -> None:
        self.calls.append((args, kwargs))


def recipe_groups() -> list[tuple[str, list[tuple[tuple, dict]]]]:
    """(group title, add_argument calls) for the recipes' flags, each flag once, under
    the recipes that take it ('lora recipe', 'dpo, lora, orpo recipes')."""
    owners: dict[str, list[str]] = {}
    call: dict[str, tuple[tuple, dict]] = {}
    for name in recipe_names():
        rec = _Recorder()
        load_recipe(name).add_arguments(rec)
        for args, kwargs in rec.calls:
            owners.setdefault(args[0], []).append(name)
            call.setdefault(args[0], (args, kwargs))
    groups: dict[str, list] = {}
    for flag, names in owners.items():
        title = f"{', '.join(names)} recipe" + ("s" if len(names) > 1 else "")
        groups.setdefault(title, []).append(call[flag])
    return list(groups.items())


def own_flags() -> dict[str, dict[str, str]]:
    """recipe -> {config key: flag} of the flags only that recipe takes (its own group,
    less the general flags it merely aliases, such as LoRA's --max-seq-len)."""
    import argparse

    general = {a.dest for a in build_general_parser()._actions}
    owned = {}
    for name in recipe_names():
        scratch = argparse.ArgumentParser(add_help=False)
        load_recipe(name).add_arguments(scratch.add_argument_group(name))
        owned[name] = {
            a.dest: a.option_strings[0] for a in scratch._actions if a.dest not in general
        }
    return owned


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


def build_general_parser():
    """A parser with `toy train`'s general flags only (no recipe groups)."""
    from toy.cli.args import Parser

    p = Parser(prog="toy train", add_help=False)
    sub = p.add_subparsers()
    add_parser(sub, recipes=False)
    return sub.choices["train"]


def run(args) -> int:
    if args.nproc and args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return dist.launch(args.nproc, args.argv)
    try:
        return _run(args)
    finally:
        dist.shutdown()


def _run(args) -> int:
    project = find_project()
    cli = {k: getattr(args, k, None) for k in RunConfig.keys()}
    cli["raw_i32"] = args.raw_i32 or None
    recipes = {name: load_recipe(name) for name in recipe_names()}
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
    acc = [{"step": m["step"], "accuracy": m["accuracy"]} for m in res.metrics if "accuracy" in m]
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
        if acc:  # classifiers: the accuracy curve under its own key
            out["val_accuracy"] = acc
        pref = [
            {"step": m["step"], "accuracy": m["pref_accuracy"]}
            for m in res.metrics
            if "pref_accuracy" in m
        ]
        if pref:  # preference recipes: the held-out preference accuracy
            out["val_pref_accuracies"] = pref
        print(json.dumps(out))
    else:
        val = f", val loss {last_val:.4f}" if last_val is not None else ""
        speed = f", {res.items_per_s:,.0f} {job.items_name}/s" if res.items_per_s else ""
        val += f", val accuracy {acc[-1]['accuracy']:.4f}" if acc else ""
        prefs = [m for m in res.metrics if "pref_accuracy" in m]
        if prefs:
            val += f", held-out preference accuracy {prefs[-1]['pref_accuracy']:.4f}"
        mem = f", peak memory {res.peak_mem_bytes / 1e9:.2f} GB" if res.peak_mem_bytes else ""
        print(
            f"done: loss {last:.4f}{val}{speed}{mem}, {res.wall_s:.1f}s; "
            f"model in {o.run_dir / 'final'}"
        )
    sys.stdout.flush()
