"""A run's life, start to end: resolve and check the config, build the recipe's job, make
the run directory and run.json, run the loop, and close the run with one event whatever
happens. A resumed run is the same life continued: its recorded config, the global batch
kept on another number of processes, the LR schedule extended.

    outcome = new_run(cli_flags, project, RECIPES)            # `toy train ...`
    outcome = resume_run(run_dir, cli_flags, project, RECIPES)  # `toy train --resume RUN`

`toy train` (cli/cmd_train.py) parses flags into `cli_flags` (None = not given), calls
one of these and prints the outcome.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from toy import __version__
from toy.errors import Interrupted, RunFailed, ToyError, UsageError
from toy.formats.checkpoint import checkpoint_problem, list_checkpoints, read_json
from toy.formats.hf_dir import same_base
from toy.models import registry
from toy.runs import (
    RUNNING,
    EventLog,
    Project,
    check_run_id,
    create_run_dir,
    dir_status,
    make_run_id,
    plural,
    this_process,
    write_json_atomic,
)
from toy.train import dist
from toy.train.config import RESUME_MAY_CHANGE, RunConfig, problems, resolve
from toy.train.device import (
    Precision,
    apply_threads,
    device_info,
    resolve_device,
    resolve_precision,
)
from toy.train.job import Built
from toy.train.loop import TrainResult, evaluate, train
from toy.train.progress import Reporter, TextReporter
from toy.train.recipe import SHAPE_KEYS, Figure, Recipe
from toy.train.report import attach as attach_report
from toy.train.report import check_report_to
from toy.train.schedule import resolve_optimizer_state

WARMUP_SHARE = 0.1  # the warmup is at most this share of the run
SHORT_RUN = 20  # fewer optimizer steps than this rarely move a loss: say so


@dataclass
class Outcome:
    """A finished run, for the command line to print: `record()` with --json, else
    `done_line()`."""

    run_id: str
    run_dir: Path
    cfg: RunConfig
    built: Built
    device: torch.device
    precision: Precision
    res: TrainResult
    main: bool  # rank 0: the process that speaks
    figures: tuple[Figure, ...] = ()  # the recipe's

    def finals(self) -> list[tuple[Figure, list[dict]]]:
        """The recipe's figures that close a run, with their held-out curves."""
        return [(f, f.curve(self.res.metrics)) for f in self.figures if f.final]

    def record(self) -> dict[str, Any]:
        """--json's object ("format": "toy/train-v1")."""
        res, job = self.res, self.built.job
        out = {
            "format": "toy/train-v1",
            "run_id": self.run_id,
            "run_dir": str(self.run_dir),
            "recipe": self.cfg.recipe,
            "arch": self.built.arch,
            "device": self.device.type,
            "precision": self.precision.name,
            "precision_reason": self.precision.reason,
            "seed": self.cfg.seed,
            "steps": self.cfg.steps,
            "params": self.built.params,
            "losses": res.losses,
            "val_losses": res.val_losses,
            f"{job.items_name}_per_s": res.items_per_s,
            "wall_s": round(res.wall_s, 3),
            "peak_mem_bytes": res.peak_mem_bytes,
        }
        if res.metrics:
            out["metrics"] = res.metrics
        if res.test:
            out["test_loss"], out["test_ppl"] = res.test["loss"], res.test["ppl"]
        out.update({f.json_key: curve for f, curve in self.finals() if curve and f.json_key})
        return out

    def done_line(self) -> str:
        """The text mode's last line: losses, the final figures, speed, memory, where."""
        res, job = self.res, self.built.job
        last = res.losses[-1]["loss"] if res.losses else None
        val = f", val loss {res.val_losses[-1]['loss']:.4f}" if res.val_losses else ""
        val += "".join(f", {f.label} {c[-1][f.curve_key]:.4f}" for f, c in self.finals() if c)
        val += f", test loss {res.test['loss']:.4f}" if res.test else ""
        speed = f", {res.items_per_s:,.0f} {job.items_name}/s" if res.items_per_s else ""
        mem = f", peak memory {res.peak_mem_bytes / 1e9:.2f} GB" if res.peak_mem_bytes else ""
        return (
            f"done: loss {last:.4f}{val}{speed}{mem}, {res.wall_s:.1f}s; "
            f"model in {self.run_dir / 'final'}"
        )


# ------------------------------------------------------------------ the config


def unknown_recipe(name: str, recipes: dict[str, Recipe]) -> str:
    import difflib

    close = difflib.get_close_matches(str(name), sorted(recipes), n=1, cutoff=0.5)
    return f"--recipe {name!r} is unknown; valid: {', '.join(sorted(recipes))}" + (
        f"; did you mean {close[0]!r}?" if close else ""
    )


def check_recipe_flags(recipe: str, cli: dict, recipes: dict[str, Recipe]) -> None:
    """A flag of another recipe given on this one's run is a mistake, not a no-op: say
    which recipe takes it (the first in the recipe table's order that does)."""
    problems = []
    # recipe -> {config key: flag} of its own flags (less the general flags it merely
    # aliases, such as the adapter recipes' --max-seq-len)
    owned = {name: {f.key: f.option for f in r.own()} for name, r in recipes.items()}
    takers: dict[str, list[str]] = {}  # flag -> the recipes that take it
    for name, flags in owned.items():
        if name == recipe:
            continue
        for key, flag in flags.items():
            if cli.get(key) is not None and key not in owned.get(recipe, {}):
                takers.setdefault(flag, []).append(name)
    for flag, names in takers.items():
        also = f" (and {', '.join(names[1:])})" if len(names) > 1 else ""
        problems.append(
            f"{flag} is a {names[0]} recipe flag{also}; the {recipe} recipe does not take it "
            f"(drop it, or train with --recipe {names[0]})"
        )
    if problems:
        raise UsageError("; ".join(problems))


def resolve_config(cli: dict[str, Any], project: Project, recipes: dict[str, Recipe]) -> RunConfig:
    """The resolved config (flags > toy.toml [train.<recipe>] > [train] > the recipe's
    defaults > RunConfig's), checked: every problem at once, by flag."""
    name = cli.get("recipe") or project.train_defaults.get("recipe") or RunConfig.recipe
    if name not in recipes:
        raise UsageError(unknown_recipe(name, recipes))
    recipe = recipes[name]
    check_recipe_flags(name, cli, recipes)
    if not recipe.shape:  # a given model's own shape: a shape flag would be dropped in silence
        given = [k for k in SHAPE_KEYS if cli.get(k) is not None]
        if given:
            takers = ", ".join(n for n, r in recipes.items() if r.shape)
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            raise UsageError(
                f"{flags}: the {name} recipe trains --model's own shape, so it reads no shape "
                f"flag (those build a fresh model: {takers}); drop {flags}"
            )
    others = {f.key for r in recipes.values() for f in r.own()}
    many = {f.key for f in recipe.own() if f.many}
    cfg = recipe.typed(
        resolve(cli, project.train_defaults, name, recipe.flag_defaults(), others, many)
    )
    archs = registry.arch_names()
    found = problems(
        cfg, archs, registry.preset_names(cfg.arch) if cfg.arch in archs else None
    ) + recipe.problems(cfg)
    if found:
        raise UsageError("; ".join(found))
    return cfg


def _toml_keys(project: Project, recipe: str) -> set[str]:
    """The [train] (and [train.<recipe>]) keys toy.toml sets, with _ for -."""
    t = project.train_defaults
    own = t.get(recipe) if isinstance(t.get(recipe), dict) else {}
    return {k.replace("-", "_") for k in (*t, *own)}


def _stopped_at_once(run_dir: Path, in_flight: int | None) -> str:
    """What a second Ctrl-C left: the newest checkpoint and the steps after it, or that
    nothing is saved (no checkpoint yet: --save-every 0, or before the first one)."""
    head = "stopped at once by a second Ctrl-C" + (f" during step {in_flight}" if in_flight else "")
    done = f"step {in_flight - 1}" if in_flight else "the last step"
    kept = list_checkpoints(run_dir / "checkpoints")
    if not kept:
        return (
            f"{head}: nothing is saved, no checkpoint was written (--save-every 0, or none "
            f"due yet) and the steps up to {done} are lost; train again, and press Ctrl-C once "
            "to stop with a checkpoint"
        )
    step = int(kept[-1].name.removeprefix("step-"))
    lost = (
        f"; not saved: steps {step + 1} to {in_flight - 1}"
        if in_flight and in_flight - 1 > step
        else ""
    )
    return (
        f"{head}: saved: the checkpoint of step {step} ({kept[-1]}){lost}; resume from step "
        f"{step} with `toy train --resume {run_dir}`"
    )


def fit_schedule(
    cfg: RunConfig,
    notes: list[str],
    default_lr: float | None = None,
    warmup_given: bool = True,
    default_schedule: bool = False,
) -> RunConfig:
    """Keep the warmup within 10% of the run (a 2-step run spent entirely warming up
    learns nothing; said only of a --warmup the user gave, not of a default), and warn of a
    run too short to learn at the recipe's default LR (a short run with a raised --lr, as
    README's LoRA example, is a choice, not a mistake; `default_schedule`: the steps are the
    recipe's own default epochs, LR and epochs chosen together for small sets, as the
    preference recipes' are)."""
    cap = int(cfg.steps * WARMUP_SHARE)
    if cfg.warmup > cap and warmup_given:
        notes.append(
            f"--warmup {cfg.warmup} cut to {cap}: at most {WARMUP_SHARE:.0%} of the run's "
            f"{plural(cfg.steps, 'step')}"
        )
    if cfg.warmup > cap:
        cfg = cfg.replace(warmup=cap)
    if (
        cfg.steps < SHORT_RUN
        and not default_schedule
        and (default_lr is None or cfg.lr <= default_lr)
    ):
        notes.append(
            f"warning: {plural(cfg.steps, 'optimizer step')} is too short for the loss to move "
            "much; raise --steps or --epochs (or --lr) to see learning"
        )
    return cfg


def rescale_for_world(cfg: RunConfig, saved_world: int, world: int, unit: str) -> RunConfig:
    """The same global batch on another number of processes. Token windows and images
    are rows, split over processes (per-process batch rescaled); chat batches are whole
    length-grouped batches, so the micro-steps per process are rescaled instead."""
    if world == saved_world:
        return cfg
    if unit == "batches":
        units = cfg.grad_accum * saved_world
        if units % world:
            raise UsageError(
                f"--resume: each step of the run takes {units} chat batches, which do not split "
                f"over {world} processes; resume on a number of processes that divides {units}"
            )
        return cfg.replace(grad_accum=units // world)
    rows = cfg.batch_size * saved_world
    if rows % world:
        raise UsageError(
            f"--resume: the run's global batch of {rows} rows does not split over {world} "
            f"processes; resume with a world size that divides {rows}"
        )
    return cfg.replace(batch_size=rows // world)


# ------------------------------------------------------------------ a new run


def new_run(
    cli: dict[str, Any],
    project: Project,
    recipes: dict[str, Recipe],
    *,
    run_id: str | None = None,
    out: str | None = None,
    json_mode: bool = False,
) -> Outcome:
    """`toy train`: everything checked before the run directory exists."""
    cfg = resolve_config(cli, project, recipes)
    recipe = recipes[cfg.recipe]
    device = resolve_device(cfg.device)  # before any work: metal off macOS exits 2 here
    check_report_to(cfg.report_to)  # a missing package: exit 2 before any work
    apply_threads(cfg.threads)
    precision = resolve_precision(cfg.precision, device)  # bf16 on a cpu without units: exit 2
    cfg = cfg.replace(precision=precision.name)  # run.json records what auto resolved to
    d = dist.init(device.type)
    runs_dir = Path(out) if out else project.runs_dir
    if run_id and d.is_main:
        check_run_id(run_id)
        if (runs_dir / run_id).exists():
            raise UsageError(
                f"--run-id {run_id}: {runs_dir / run_id} already exists; pick another id"
            )
    built = recipe.build(cfg, project)  # every input check happens here, before the run dir exists
    cfg = cfg.with_derived(built.derived)
    default_lr = recipe.config().lr
    keys = _toml_keys(project, cfg.recipe)
    given = cli.get("warmup") is not None or "warmup" in keys
    schedule_given = any(cli.get(k) is not None or k in keys for k in ("steps", "epochs"))
    default_schedule = not schedule_given and recipe.defaults.get("epochs") is not None
    cfg = fit_schedule(cfg, built.notes, default_lr, given, default_schedule)
    cfg = with_optimizer_state(cfg, built, d.enabled)  # the resolved config, read-only from here on
    run_dir = None
    if d.is_main:  # rank 0 alone names and makes the run directory, then tells the others
        rid = run_id or make_run_id(
            project.run_id_template, runs_dir, recipe=cfg.recipe, arch=built.arch
        )
        run_dir = create_run_dir(runs_dir, rid)
    run_dir = Path(dist.broadcast_object(str(run_dir)))
    distributed = {
        "world_size": d.world,
        "backend": d.backend if d.enabled else "none",
        "global_batch": cfg.batch_size * cfg.grad_accum * d.world,
        "fsdp": bool(cfg.fsdp and d.enabled),
        "launcher": dist.launcher(d.enabled),
    }
    info = {
        "run_id": run_dir.name,
        "recipe": cfg.recipe,
        "arch": built.arch,
        "seed": cfg.seed,
        "params": built.params,
        "config": cfg.to_dict(),
        "job": built.job.config,
        "device": device_info(device),
        "precision": {"name": precision.name, "reason": precision.reason},
        "versions": {
            "toy": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "machine": {"platform": platform.platform(), "cpu_count": _cpu_count()},
        "command": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **this_process(),  # pid and host: `toy runs` says "running" while it lives
        "distributed": distributed,
        "segments": [
            {
                "from_step": 0,
                "steps": cfg.steps,
                "world_size": d.world,
                "started": time.time(),
                **this_process(),
            }
        ],
    }
    if d.is_main:
        write_json_atomic(run_dir / "run.json", info)
    events = EventLog(run_dir / "events.jsonl", enabled=d.is_main)
    attach_report(events, cfg.report_to, run_dir)
    events.emit(
        "run_started",
        run_id=run_dir.name,
        recipe=cfg.recipe,
        arch=built.arch,
        params=built.params,
        steps=cfg.steps,
        seed=cfg.seed,
        device=device.type,
        precision=precision.name,
        world_size=d.world,
        global_batch=distributed["global_batch"],
    )
    return _execute(cfg, built, run_dir, device, precision, events, None, json_mode, recipe.figures)


def with_optimizer_state(cfg: RunConfig, built, distributed: bool) -> RunConfig:
    """--optimizer-state resolved (train/schedule.py), with a note when auto halves it."""
    trained = sum(p.numel() for _, p in built.job.trainable())
    sharded = bool(cfg.fsdp and distributed)
    name = resolve_optimizer_state(cfg.optimizer_state, cfg.precision, trained, sharded)
    if cfg.optimizer_state == "auto" and name == "bfloat16":
        built.notes.append(
            f"AdamW's moments kept in bfloat16 ({trained / 1e6:.0f}M trained values: "
            f"{trained * 8 / 1e9:.2f} GB in float32, half that in bf16); "
            "--optimizer-state float32 keeps them in float32"
        )
    return cfg.replace(optimizer_state=name)


# ------------------------------------------------------------------ a resumed run


def _saved_config(info: dict, run_dir: Path, recipes: dict[str, Recipe]) -> RunConfig:
    """The resolved config run.json recorded (runs made before it was recorded kept their
    flags under "flags")."""
    record = info.get("config", info.get("flags", {}))
    name = record.get("recipe", RunConfig.recipe)
    if name not in recipes:
        raise UsageError(
            f"--resume {run_dir}: its recipe {name!r} is not one of this toy's; resume it "
            "with the toy version that made it"
        )
    own = {f.key for f in recipes[name].own()}
    if "config" in info:
        cfg = RunConfig.from_record(info["config"], own, source=str(run_dir / "run.json"))
        cfg = recipes[name].typed(cfg)
        if "optimizer_state" not in info["config"]:  # recorded before --optimizer-state
            cfg = cfg.replace(optimizer_state="float32")
        if "precision" in info["config"]:
            return cfg
    else:
        known = set(RunConfig.keys()) | own
        cfg = RunConfig.build({k: v for k, v in info["flags"].items() if k in known})
    # Recorded before --precision: such runs trained in float32 except on cuda (bf16 autocast).
    return cfg.replace(precision="auto" if cfg.device == "cuda" else "float32")


def _same_base(key: str, recorded, now) -> bool:
    """A LoRA run made before bases were recorded absolute kept --model as given
    (relative); resumed, the recipe records the absolute path of the same file. The
    file's content is compared separately (model_sha256)."""
    return (
        key == "model"
        and isinstance(recorded, str)
        and isinstance(now, str)
        and not Path(recorded).is_absolute()
        and Path(recorded).resolve() == Path(now)
    )


# A base's fingerprint key -> the job key holding its path. The fingerprint covers every
# byte (formats.hf_dir.base_fingerprint), so the base may be given again at another path
# (--model, --donor on resume: a copy, a moved file): its bytes are what is compared.
_FINGERPRINTED = {"model_sha256": "model", "donor_sha256": "donor"}


def _base_matches(key: str, recorded, config: dict) -> bool:
    """Whether the base at job key `config[_FINGERPRINTED[key]]` is the one the run
    recorded under `key`, in today's form or one runs recorded before (same_base)."""
    where = config.get(_FINGERPRINTED.get(key, ""))
    return isinstance(where, str) and Path(where).exists() and same_base(Path(where), recorded)


def _more_epochs(saved: RunConfig, cli: dict) -> dict[str, Any]:
    """--epochs E on a resumed run begun with --epochs: its steps for E epochs (an epoch's
    steps are the run's, fixed when it began: its steps / its epochs)."""
    e = cli["epochs"]
    if not saved.epochs:
        raise UsageError(
            f"--resume: --epochs {e}: the run counts steps ({saved.steps}), not epochs; "
            "raise --steps instead"
        )
    if cli.get("steps") is not None:
        raise UsageError("--resume: give --steps or --epochs, not both")
    if e < saved.epochs:
        raise UsageError(f"--epochs {e} is below the run's {saved.epochs}; it may only be raised")
    return {"steps": saved.steps // saved.epochs * e, "epochs": e}


def _run_of(path: Path) -> tuple[Path | None, Path]:
    """(the checkpoint chosen, the run directory) of a --resume PATH: RUN, or one of its
    RUN/checkpoints/step-N."""
    if path.parent.name == "checkpoints" and (path.parent.parent / "run.json").is_file():
        return path, path.parent.parent
    return None, path


def resumed_processes(path: Path) -> int | None:
    """How many processes `toy train --resume PATH` starts when --nproc is not given: the
    run's own count where `toy train --nproc N` started it (run.json's launcher "nproc",
    its latest segment's where a resume recorded one), so that a resume is the run it
    continues, to the byte; None (this process alone, or a torchrun's) otherwise, and where
    PATH is not a run resume_run can read (it says why)."""
    _, run_dir = _run_of(path)
    try:
        info = json.loads((run_dir / "run.json").read_text())
        last = info.get("distributed", {})
        later = [g for g in info.get("segments", []) if "launcher" in g]
        last = later[-1] if later else last  # the latest resume's, where one was recorded
        world = int(last.get("world_size", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return world if last.get("launcher") == "nproc" and world > 1 else None


def resume_run(
    run_dir: Path,
    cli: dict[str, Any],
    project: Project,
    recipes: dict[str, Recipe],
    *,
    json_mode: bool = False,
) -> Outcome:
    """`toy train --resume RUN`: its recorded config (only --steps may be raised, and the
    device and --compile changed), from its latest checkpoint, in place; or `--resume
    RUN/checkpoints/step-N`: from that one (the checkpoints after it are set aside)."""
    chosen, run_dir = _run_of(run_dir)
    if not (run_dir / "run.json").is_file():
        raise UsageError(
            f"--resume {run_dir}: no run.json there; give a run directory made by `toy train`"
        )
    if dist.info().is_main and dir_status(run_dir) == RUNNING:  # two writers of one run
        raise UsageError(
            f"--resume {run_dir}: the run is still training (its process lives); wait for it "
            "to end, or stop it (Ctrl-C checkpoints), then resume"
        )
    info = read_json(run_dir / "run.json")
    saved = _saved_config(info, run_dir, recipes)
    for k, v in cli.items():
        if v is None or k in RESUME_MAY_CHANGE or k in ("precision", "epochs"):
            continue
        if k == "optimizer_state" and v == "auto":  # the run's recorded choice stands
            continue
        flag = "--" + k.replace("_", "-")
        if k not in saved.to_dict():
            raise UsageError(
                f"--resume: {flag} is not a flag of the run's recipe ({saved.recipe}); drop it"
            )
        if k in _FINGERPRINTED.values():  # a base at another path: its bytes are compared below
            continue
        if getattr(saved, k) != v:
            raise UsageError(
                f"--resume: {flag} {v!r} differs from the run's {getattr(saved, k)!r}; "
                "a resumed run keeps its config (only --steps or --epochs may be raised)"
            )
    ckpts = list_checkpoints(run_dir / "checkpoints")
    if not ckpts:
        raise UsageError(
            f"--resume {run_dir}: no checkpoint to resume from; train with --save-every N"
        )
    last = _intact(run_dir, ckpts, chosen)
    done = int(read_json(last / "state.json")["step"])
    cfg = saved
    if cli.get("steps") is not None:
        if cli["steps"] < saved.steps:
            raise UsageError(
                f"--steps {cli['steps']} is below the run's {saved.steps}; it may only be raised"
            )
        cfg = cfg.replace(steps=cli["steps"])
    if cli.get("epochs") is not None and cli["epochs"] != saved.epochs:
        cfg = cfg.replace(**_more_epochs(saved, cli))
    for k in ("device", "compile", "threads", "report_to", *_FINGERPRINTED.values()):
        if cli.get(k) is not None:
            cfg = cfg.replace(**{k: cli[k]})
    if done >= cfg.steps:
        raise UsageError(
            f"--resume {run_dir}: its checkpoint is at step {done} of {cfg.steps}; "
            "raise --steps to train further"
        )
    device = resolve_device(cfg.device)
    check_report_to(cfg.report_to)
    apply_threads(cfg.threads)
    try:  # the run's precision, checked on this machine
        precision = resolve_precision(cfg.precision, device)
    except UsageError as e:
        why = e.message.split(": ", 1)[-1].split("; use ")[0]
        raise UsageError(
            f"--resume {run_dir}: the run trains in {cfg.precision} and a resumed run keeps its "
            f"precision, but {why}; resume it on a machine with bf16 units or cuda"
        )
    precision = Precision(
        precision.name,
        "the run's recorded precision"
        + (f" ({info['precision']['reason']})" if "precision" in info else ""),
    )
    if cli.get("precision") is not None:
        asked = resolve_precision(cli["precision"], device)
        if asked.name != precision.name:
            raise UsageError(
                f"--resume: --precision {cli['precision']} ({asked.name}) differs from the run's "
                f"{precision.name}; a resumed run keeps its precision (drop --precision)"
            )
    cfg = cfg.replace(precision=precision.name)
    d = dist.init(device.type)
    saved_world = int(info.get("distributed", {}).get("world_size", 1))
    recipe = recipes[cfg.recipe]
    run_cfg = rescale_for_world(cfg, saved_world, d.world, recipe.batch_unit(cfg))
    built = recipe.build(run_cfg, project)
    moved = {}  # a base's job key -> its path now, where it is given at another path
    info["job"], first_4mib = _one_digest(info["job"])
    changed = {}  # job key -> what changed in it, where the user's flag lets it
    for k in sorted(set(built.job.config) | set(info["job"])):
        a, b = info["job"].get(k), json.loads(json.dumps(built.job.config.get(k)))
        if a == b or _same_base(k, a, b):
            continue
        if k in built.may_change:  # e.g. a reward file's code: only when the user says so
            flag = built.may_change[k]
            if not cli.get(flag):
                raise UsageError(
                    f"--resume {run_dir}: {_what_changed(a, b)} changed since the run started "
                    f"(its sha256 differs); restore it, or pass --{flag.replace('_', '-')} to "
                    "go on with it as it is now (run.json records the change)"
                )
            changed[k] = {"was": a, "now": b}
            info["job"][k] = b
            continue
        if f"{k}_sha256" in info["job"] and k in _FINGERPRINTED.values():
            moved[k] = b  # its bytes are compared under its fingerprint key
            continue
        if k in _FINGERPRINTED and _base_matches(k, a, built.job.config):
            continue
        fingerprinted = k.endswith(("_sha256", "_sha256_full"))
        if a is None and fingerprinted:
            continue  # a run recorded before this fingerprint was: nothing to compare it to
        name = k.removesuffix("_full").removesuffix("_sha256")
        src = info["job"].get(name) if fingerprinted else None
        if _FINGERPRINTED.get(k) in moved:  # given at another path, and not a copy
            flag, now = "--" + _FINGERPRINTED[k], moved[_FINGERPRINTED[k]]
            raise UsageError(
                f"--resume {run_dir}: {flag} {now} is not the base the run started on ({src}): "
                "its bytes differ; pass that file or a copy of it, or start a new run"
            )
        if k in first_4mib and isinstance(src, str) and _first_4mib_matches(src, a):
            continue  # a run recorded before every byte was: checked on its first 4 MiB
        if isinstance(src, str):  # a fingerprint: name the file that changed
            raise UsageError(
                f"--resume {run_dir}: {src} (the run's {name}) changed "
                "since the run started (its sha256 differs); restore the original file or "
                "start a new run"
            )
        raise UsageError(
            f"--resume {run_dir}: {k} changed since the run started ({a!r} -> {b!r}); "
            "restore the original input or start a new run"
        )
    info["job"].update(moved)  # run.json names where the base is now
    run_cfg = run_cfg.with_derived(built.derived)
    if d.is_main and last != ckpts[-1]:
        _set_aside(ckpts, last)
    if d.is_main:  # run.json tells the truth about the run as it now stands
        info["config"] = cfg.to_dict()
        info["precision"] = {
            "name": precision.name,
            "reason": info.get("precision", {}).get("reason", "recorded before --precision"),
        }
        info.setdefault("segments", []).append(
            {
                "from_step": done,
                "steps": cfg.steps,
                "world_size": d.world,
                "launcher": dist.launcher(d.enabled),
                "started": time.time(),
                **this_process(),
                "device": device_info(device),  # this segment's (--device, --threads)
                **({"changed": changed} if changed else {}),
            }
        )
        write_json_atomic(run_dir / "run.json", info)
    events = EventLog(run_dir / "events.jsonl", enabled=d.is_main)
    attach_report(events, cfg.report_to, run_dir, resumed_from=done)
    events.emit(
        "run_resumed",
        from_step=done,
        steps=run_cfg.steps,
        checkpoint=str(last.relative_to(run_dir)),
        world_size=d.world,
    )
    return _execute(
        run_cfg, built, run_dir, device, precision, events, last, json_mode, recipe.figures
    )


def _intact(run_dir: Path, ckpts: list[Path], chosen: Path | None) -> Path:
    """The checkpoint to resume from (`chosen`, else the latest), checked against the
    digests it was written with: a damaged one is one line naming it and the newest intact
    one, which `--resume` then takes."""
    if chosen is not None and chosen not in ckpts:
        raise UsageError(
            f"--resume {chosen}: not a complete checkpoint of {run_dir} (they are: "
            f"{', '.join(c.name for c in ckpts) or 'none'})"
        )
    last = chosen or ckpts[-1]
    why = checkpoint_problem(last)
    if why is None:
        return last
    older = ckpts[: ckpts.index(last)]  # oldest first
    good = next((c for c in reversed(older) if checkpoint_problem(c) is None), None)
    then = (
        f"the newest intact one is {good.name}: resume from it with `toy train --resume {good}`"
        if good is not None
        else "no earlier checkpoint is intact: start the run again"
    )
    raise UsageError(f"--resume {run_dir}: checkpoint {last.name} is damaged ({why}); {then}")


def _set_aside(ckpts: list[Path], last: Path) -> None:
    """The checkpoints after the one resumed from, renamed out of the way (kept, not
    listed): the resumed run writes its own."""
    for c in ckpts[ckpts.index(last) + 1 :]:
        c.rename(c.with_name(f"{c.name}.set-aside-{int(time.time())}"))


_DATA_KEYS = ("corpus", "data", "val_data")  # the job keys of data files (data_fingerprints)


def _one_digest(job: dict) -> tuple[dict, set[str]]:
    """A run's job record with one digest a data file, and the keys still holding only a
    first-4-MiB digest. Runs recorded before kept that one as {key}_sha256, some beside
    every byte's as {key}_sha256_full; today's {key}_sha256 is every byte's, so an older
    run is compared on every byte where it has them, else on its first 4 MiB."""
    out = dict(job)
    for k in [k for k in job if k.endswith("_sha256_full")]:
        if job[k] is not None:
            out[k.removesuffix("_full")] = job[k]
        del out[k]
    older = {f"{k}_sha256" for k in _DATA_KEYS if f"{k}_sha256_full" not in job}
    return out, {k for k in older if out.get(k) is not None}


def _first_4mib_matches(path: str, recorded: str) -> bool:
    from toy.runs import fingerprint

    return Path(path).is_file() and fingerprint(Path(path)) == recorded


def _what_changed(was, now) -> str:
    """The entries of a recorded {file: digest} that differ now, named, or the record."""
    if isinstance(was, dict) and isinstance(now, dict):
        names = [k for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
        return ", ".join(names) or "it"
    return f"{was!r} -> {now!r}"


# ------------------------------------------------------------------ the loop, and closing the run


def _execute(
    cfg: RunConfig,
    built: Built,
    run_dir: Path,
    device: torch.device,
    precision: Precision,
    events: EventLog,
    resume: Path | None,
    json_mode: bool,
    figures: tuple[Figure, ...] = (),
) -> Outcome:
    """Run the loop and close the run with exactly one event: run_finished, run_failed
    (exit 1; an unexpected error also leaves its traceback in error.log) or interrupted."""
    main_rank = dist.info().is_main
    bar = {f.key: f.bar for f in figures if f.bar}  # the recipe's figures the bar shows
    reporter = (
        Reporter()
        if json_mode or not main_rank
        else TextReporter(items_name=built.job.items_name, bar=bar)
    )
    if not json_mode:
        what = f"resuming {run_dir.name} from {resume.name}" if resume else f"run {run_dir.name}"
        reporter.message(
            f"{what}: {cfg.recipe} {built.arch}, {plural(built.params, 'parameter')}, "
            f"{plural(cfg.steps, 'step')} on {device.type} "
            f"({plural(torch.get_num_threads(), 'thread')}, {precision.name})"
            + (f", {built.batch}" if built.batch else "")
            + f" -> {run_dir}"
        )
        reporter.message(f"  precision {precision.name}: {precision.reason}")
        for note in built.notes:
            reporter.message(f"  {note}")
    elif main_rank:  # --json: stdout is the one object; warnings still reach the user
        for note in built.notes:
            if note.startswith("warning:"):
                print(note, file=sys.stderr)

    def close(event: str, **fields: Any) -> None:
        reporter.close()
        if event:
            events.emit(event, **fields)
        events.close()

    try:
        res = train(
            built.job, cfg, run_dir, device, events, reporter, resume=resume, precision=precision
        )
        if main_rank:
            built.job.save_final(run_dir / "final")
            res.test = _test_pass(built.job, device, precision, events, reporter)
        dist.barrier()
    except Interrupted:
        close("")  # the loop recorded the interruption and its checkpoint
        raise
    except KeyboardInterrupt as e:  # a second Ctrl-C: stop now, the step in flight unsaved
        close("interrupted", signal="SIGINT", checkpoint=False)
        raise Interrupted(_stopped_at_once(run_dir, e.args[0] if e.args else None), 2)
    except ToyError as e:
        step = e.step  # a recipe's input error may say when it came
        close("run_failed", step=step, error=e.message)
        if not isinstance(e, RunFailed) and step is not None and step <= 1:
            raise e  # bad input met before the first step (a reward function): exit 2
        raise e if isinstance(e, RunFailed) else RunFailed(e.message, step=step)
    except SystemExit as e:  # a user's code (a reward file) that ends the process
        close("run_failed", error=f"SystemExit({e.code!r})")
        raise RunFailed(f"the run was ended by sys.exit({e.code!r}) in code it called")
    except Exception as e:
        log = run_dir / ("error.log" if main_rank else f"error-rank{dist.info().rank}.log")
        log.write_text(traceback.format_exc())
        close("run_failed", error=f"{type(e).__name__}: {e}")
        raise RunFailed(f"{type(e).__name__}: {e} (traceback in {log})")
    last = res.losses[-1]["loss"] if res.losses else None
    last_val = res.val_losses[-1]["loss"] if res.val_losses else None
    close(
        "run_finished",
        step=res.final_step,
        loss=last,
        val_loss=last_val,
        wall_s=round(res.wall_s, 3),
        peak_mem_bytes=res.peak_mem_bytes,
        **{f"{built.job.items_name}_per_s": res.items_per_s},
    )
    return Outcome(run_dir.name, run_dir, cfg, built, device, precision, res, main_rank, figures)


def _test_pass(job, device, precision, events, reporter) -> dict | None:
    """The final model's loss on the job's test batches (mlx_lm.lora's --test), once."""
    test = job.test_batches()
    if test is None:
        return None
    where, batches = test
    loss = evaluate(job, batches, device, precision=precision)["val_loss"]
    out = {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "batches": len(batches)}
    events.emit("test", **out, file=where)
    reporter.message(f"test loss {loss:.3f}, test ppl {out['ppl']:.3f} ({len(batches)} "
                     f"batches of {where})")  # fmt: skip
    return out


def _cpu_count() -> int:
    return (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
