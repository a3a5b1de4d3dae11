"""`toy train`: build a recipe's job, make the run directory, run the shared loop."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from toy import __version__
from toy.cli.args import finite_float, nonneg_int, plural, positive_int, resolve
from toy.errors import Interrupted, RunFailed, ToyError, UsageError
from toy.models import registry
from toy.recipes import load_recipe, recipe_names
from toy.runs import EventLog, check_run_id, create_run_dir, find_project, make_run_id, write_json_atomic
from toy.train import dist
from toy.train.device import DEVICES, device_info, resolve_device
from toy.train.config import RunConfig
from toy.train.loop import TrainConfig, train
from toy.train.progress import Reporter, TextReporter

# Built-in defaults: RunConfig's (toy.toml [train] and then flags override them).
DEFAULTS = RunConfig.defaults()


def dflt(key: str, base: str | None = None) -> str:
    """'(default X)', with each recipe whose default differs: '(default 1e-3; lora 1e-4, ...)'."""
    shown = base if base is not None else str(DEFAULTS[key])
    others = []
    for name in recipe_names():
        flags = getattr(load_recipe(name), "FLAGS", {})
        if key in flags and flags[key] != DEFAULTS[key] and flags[key] is not None:
            others.append(f"{name} {flags[key]}")
    return f"(default {shown}" + (f"; {', '.join(others)})" if others else ")")


def _presets() -> str:
    out = []
    for arch in registry.arch_names():
        for name in registry.preset_names(arch):
            f = registry.PRESETS[arch][name]
            shape = (f"{f['image_size']}px/{f['patch_size']}, " if "image_size" in f else "") + \
                f"{f['n_layer']}x{f['d_model']}, {f['n_head']} heads" + \
                (f", context {f['max_seq_len']}" if "max_seq_len" in f else "")
            out.append(f"{arch} {name} ({shape})")
    return "; ".join(out)


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model (from-scratch, warm-start, lora, vit-tiny)", description=__doc__)
    g = p.add_argument_group("run")
    g.add_argument("--recipe", help=f"what to train: {', '.join(recipe_names())} (default from-scratch)")
    g.add_argument("--arch", help=f"architecture: {', '.join(registry.arch_names())} {dflt('arch')}")
    g.add_argument("--steps", type=positive_int("--steps"), help=f"optimizer steps {dflt('steps')}")
    g.add_argument("--seed", type=int, help="seed for init, data order and sampling (default 0)")
    g.add_argument("--out", help="directory that holds run directories (default: the project's runs/)")
    g.add_argument("--run-id", help="run directory name (default from toy.toml's template "
                   "'{date}-{recipe}-{arch}-{n}')")
    g.add_argument("--json", action="store_true", help="print one JSON object (format toy/train-v1) "
                   "instead of step lines")
    g.add_argument("--device", choices=DEVICES, help="cpu (default), cuda (bf16 autocast) or metal (macOS)")
    g.add_argument("--nproc", type=positive_int("--nproc"), metavar="N",
                   help="launch N local processes through torch.distributed.run (DDP; gloo on cpu, nccl on "
                        "cuda); --batch-size is per process. For multi-node use torchrun, see README (default: "
                        "one process)")
    g.add_argument("--fsdp", action="store_true", default=None,
                   help="with several processes: shard parameters, gradients and AdamW state (FSDP2) "
                        "instead of replicating them (DDP)")
    g.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile each transformer block (inductor; needs a C++ compiler on cpu). Faster "
                        "steps after a one-off compile of tens of seconds; falls back to eager where it cannot")
    g.add_argument("--checkpointing", action="store_true", default=None,
                   help="activation checkpointing, the low-memory mode: keep only each block's input and recompute "
                        "the block in backward, and give freed memory back to the OS at once. Measured on SmolLM2 "
                        "LoRA (docs/performance.md): peak memory 0.59 GB instead of 2.1 GB, steps about 2.3x slower. "
                        "Every recipe")
    g.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint, in place "
                   "(same config; --steps may be raised: docs/reliability.md says what the LR then does) "
                   "(default: a new run)")
    d = p.add_argument_group("data")
    d.add_argument("--corpus", help="token file from `toy prep` (default: the project's data/corpus.bin, "
                   "else the bundled Shakespeare plays)")
    d.add_argument("--val-corpus", help="validation token file (default: CORPUS.val.bin beside --corpus)")
    d.add_argument("--tokenizer", help="tokenizer.json for the corpus (default: CORPUS.tokenizer.json, else "
                   "tokenizer.json, beside the corpus)")
    d.add_argument("--raw-i32", action="store_true", help="--corpus is headerless packed int32 tokens")
    d.add_argument("--vocab-size", type=positive_int("--vocab-size"),
                   help="vocabulary size of a --raw-i32 corpus without --tokenizer (default: the tokenizer's)")
    m = p.add_argument_group("model")
    vit = load_recipe("vit-tiny")
    m.add_argument("--preset", help=f"named model shape: {_presets()} (default: llama small, gpt2 small; vit "
                   f"{vit.SMALL_PRESET} under {vit.SMALL_SET:,} training images, else vit-tiny)")
    m.add_argument("--n-layer", type=positive_int("--n-layer"), help="transformer blocks (default: the preset's)")
    m.add_argument("--d-model", type=positive_int("--d-model"), help="model width (default: the preset's)")
    m.add_argument("--n-head", type=positive_int("--n-head"), help="attention (query) heads (default: the preset's)")
    m.add_argument("--n-kv-head", type=positive_int("--n-kv-head"),
                   help="key/value heads, grouped-query attention, llama only (default: the preset's)")
    m.add_argument("--seq-len", type=positive_int("--seq-len"),
                   help=f"training sequence length {dflt('seq_len', 'the preset context')}")
    o = p.add_argument_group("optimiser")
    o.add_argument("--batch-size", type=positive_int("--batch-size"),
                   help=f"sequences per micro-batch {dflt('batch_size')}; with chat --data, a budget of "
                   "batch-size x (seq-len + 1) tokens filled with conversations of similar length")
    o.add_argument("--grad-accum", type=positive_int("--grad-accum"),
                   help="micro-batches per optimizer step; the loss is normalised over all of them "
                        f"{dflt('grad_accum')}")
    o.add_argument("--lr", type=finite_float, help=f"peak learning rate {dflt('lr')}")
    o.add_argument("--min-lr", type=finite_float, help=f"final learning rate of the cosine decay {dflt('min_lr')}")
    o.add_argument("--warmup", type=nonneg_int, help="linear warmup steps, at most 10%% of the run (a longer one is "
                   f"cut, with a note) {dflt('warmup')}")
    o.add_argument("--weight-decay", type=finite_float,
                   help=f"AdamW decay on matrices and embeddings {dflt('weight_decay')}")
    o.add_argument("--clip", type=finite_float, help=f"gradient norm clip, 0 disables {dflt('clip')}")
    o.add_argument("--eval-every", type=nonneg_int,
                   help="validation every N steps; it also runs before step 1 and at the end (default 0: only those)")
    o.add_argument("--eval-batches", type=positive_int("--eval-batches"),
                   help=f"validation batches per eval {dflt('eval_batches')}")
    o.add_argument("--save-every", type=nonneg_int, help="checkpoint every N steps; the last step is always "
                   "checkpointed (default 0: only the last)")
    o.add_argument("--keep-last", type=nonneg_int, help="checkpoints to keep, 0 keeps all (default 2)")
    # Each recipe adds its own flags in a group of its own (recipe modules own them).
    for name in recipe_names():
        mod = load_recipe(name)
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(p.add_argument_group(f"{name} recipe"))
    p.set_defaults(func=run)


def flag_keys() -> list[str]:
    return RunConfig.keys()


def validate(c: RunConfig) -> None:
    """Every problem with the resolved config at once, each naming its flag."""
    problems = []
    if c.recipe not in recipe_names():
        problems.append(f"--recipe {c.recipe!r} is unknown; valid: {', '.join(recipe_names())}")
    if c.arch not in registry.arch_names():
        problems.append(f"--arch {c.arch!r} is unknown; valid: {', '.join(registry.LM_ARCHS)} "
                        "(vit via --recipe vit-tiny)")
    elif c.preset is not None and c.preset not in registry.preset_names(c.arch):
        problems.append(f"--preset {c.preset!r} is unknown for {c.arch}; "
                        f"valid: {', '.join(registry.preset_names(c.arch))}")
    for k in ("batch_size", "grad_accum", "eval_batches") + (("steps",) if c.steps is not None else ()):
        v = getattr(c, k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            problems.append(f"--{k.replace('_', '-')} must be an integer >= 1, got {v!r}")
    if c.epochs is not None and (not isinstance(c.epochs, int) or c.epochs < 1):
        problems.append(f"--epochs must be an integer >= 1, got {c.epochs!r}")
    if not (isinstance(c.lr, (int, float)) and c.lr > 0):
        problems.append(f"--lr must be > 0, got {c.lr!r}")
    elif not (isinstance(c.min_lr, (int, float)) and 0 <= c.min_lr <= c.lr):
        problems.append(f"--min-lr must be between 0 and --lr ({c.lr}), got {c.min_lr!r}")
    if not isinstance(c.weight_decay, (int, float)) or c.weight_decay < 0:
        problems.append(f"--weight-decay must be >= 0, got {c.weight_decay!r}")
    if not isinstance(c.clip, (int, float)) or c.clip < 0:
        problems.append(f"--clip must be >= 0 (0 disables), got {c.clip!r}")
    for k in ("warmup", "eval_every", "save_every", "keep_last"):
        v = getattr(c, k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            problems.append(f"--{k.replace('_', '-')} must be an integer >= 0, got {v!r}")
    if c.corpus and not Path(c.corpus).is_file():
        problems.append(f"--corpus {c.corpus} not found; make one with `toy prep TEXT --out FILE.bin` "
                        "or start a project with `toy new DIR`")
    if c.recipe in recipe_names():
        check = getattr(load_recipe(c.recipe), "check_opts", None)
        if check is not None:
            problems += check(c)
    if problems:
        raise UsageError("; ".join(problems))


# What `--resume` may change; everything else must match the run's recorded config.
RESUME_MAY_CHANGE = ("steps", "device", "compile")


def _launch(args) -> int:
    """`toy train --nproc N ...` = `python -m torch.distributed.run --standalone
    --nproc-per-node N -m toy train ...` (the same flags minus --nproc)."""
    import subprocess

    argv, skip = [], False
    for a in args.argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        argv.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           "-m", "toy", *argv]
    return subprocess.call(cmd)


def run(args) -> int:
    if args.nproc and args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _launch(args)
    try:
        return _run(args)
    finally:
        dist.shutdown()


def resolve_config(cli: dict, project) -> RunConfig:
    """Flags > toy.toml [train.<recipe>] > toy.toml [train] > the recipe's FLAGS > RunConfig's
    defaults, checked (every problem at once, by flag)."""
    recipe_name = cli.get("recipe") or project.train_defaults.get("recipe") or DEFAULTS["recipe"]
    if recipe_name not in recipe_names():
        raise UsageError(f"--recipe {recipe_name!r} is unknown; valid: {', '.join(recipe_names())}")
    if cli.get("epochs") is not None and cli.get("steps") is not None:
        raise UsageError("--epochs and --steps conflict: give one (--epochs sets the step count)")
    recipe = load_recipe(recipe_name)
    builtin = {**DEFAULTS, **getattr(recipe, "FLAGS", {})}
    toml = {k: v for k, v in project.train_defaults.items() if not isinstance(v, dict)}
    toml.update(project.train_defaults.get(recipe_name, {}))
    opts = resolve(cli, toml, builtin, None)
    opts["recipe"] = recipe_name
    if opts.get("epochs") is not None and cli.get("steps") is None:
        opts["steps"] = None  # the recipe counts the steps of --epochs from the data
    cfg = RunConfig(**opts)
    validate(cfg)
    return cfg


def _run(args) -> int:
    project = find_project()
    cli = {k: getattr(args, k, None) for k in flag_keys()}
    cli["raw_i32"] = args.raw_i32 or None
    if args.resume:
        return _resume(args, cli, project)
    cfg = resolve_config(cli, project)
    device = resolve_device(cfg.device)  # before any work: metal off macOS exits 2 here
    d = dist.init(device.type)
    runs_dir = Path(args.out) if args.out else project.runs_dir
    if args.run_id and d.is_main:
        check_run_id(args.run_id)
        if (runs_dir / args.run_id).exists():
            raise UsageError(f"--run-id {args.run_id}: {runs_dir / args.run_id} already exists; pick another id")
    built = load_recipe(cfg.recipe).build(cfg, project)  # all input checks happen here, before the run dir exists
    cfg = cfg.with_derived(built.derived)
    default_lr = RunConfig.for_recipe(cfg.recipe, getattr(load_recipe(cfg.recipe), "FLAGS", None)).lr
    cfg = fit_schedule(cfg, built.notes, default_lr)  # the resolved config, read-only from here on
    run_dir = None
    if d.is_main:  # rank 0 alone names and makes the run directory, then tells the others
        run_id = args.run_id or make_run_id(project.run_id_template, runs_dir, recipe=cfg.recipe, arch=built.arch)
        run_dir = create_run_dir(runs_dir, run_id)
    run_dir = Path(dist.broadcast_object(str(run_dir)))
    run_id = run_dir.name
    tcfg = TrainConfig.from_run(cfg)
    distributed = {"world_size": d.world, "backend": d.backend if d.enabled else "none",
                   "global_batch": tcfg.batch_size * tcfg.grad_accum * d.world, "fsdp": bool(tcfg.fsdp and d.enabled)}
    run_info = {
        "run_id": run_id, "recipe": cfg.recipe, "arch": built.arch, "seed": cfg.seed,
        "params": built.params, "config": cfg.to_dict(), "job": built.job.config,
        "device": device_info(device),
        "versions": {"toy": __version__, "torch": torch.__version__, "python": platform.python_version()},
        "machine": {"platform": platform.platform(), "cpu_count": _cpu_count()},
        "command": sys.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "distributed": distributed,
        "segments": [{"from_step": 0, "steps": tcfg.steps, "world_size": d.world, "started": time.time()}],
    }
    if d.is_main:
        write_json_atomic(run_dir / "run.json", run_info)
    events = EventLog(run_dir / "events.jsonl", enabled=d.is_main)
    events.emit("run_started", run_id=run_id, recipe=cfg.recipe, arch=built.arch, params=built.params,
                steps=tcfg.steps, seed=cfg.seed, device=device.type, world_size=d.world,
                global_batch=distributed["global_batch"])
    return _execute(args, cfg, built, tcfg, run_dir, run_id, device, events, None)


WARMUP_SHARE = 0.1  # the warmup is at most this share of the run
SHORT_RUN = 20  # fewer optimizer steps than this rarely move a loss: say so


def fit_schedule(cfg: RunConfig, notes: list[str], default_lr: float | None = None) -> RunConfig:
    """Keep the warmup within 10% of the run (a 2-step run spent entirely warming up
    learns nothing), and warn about runs too short to learn at the recipe's default
    learning rate (a short run with a raised --lr, as README's LoRA example, is a
    choice, not a mistake). Notes say what changed."""
    cap = int(cfg.steps * WARMUP_SHARE)
    if cfg.warmup > cap:
        notes.append(f"--warmup {cfg.warmup} cut to {cap}: at most {WARMUP_SHARE:.0%} of the run's "
                     f"{plural(cfg.steps, 'step')}")
        cfg = cfg.replace(warmup=cap)
    if cfg.steps < SHORT_RUN and (default_lr is None or cfg.lr <= default_lr):
        notes.append(f"warning: {plural(cfg.steps, 'optimizer step')} is too short for the loss to move much; "
                     f"raise --steps{' or --epochs' if cfg.recipe == 'lora' else ''} (or --lr) to see learning")
    return cfg


def train_config(cfg: RunConfig) -> TrainConfig:
    return TrainConfig.from_run(cfg)


def _saved_config(info: dict, run_dir: Path) -> RunConfig:
    """The resolved config run.json recorded (runs made before it was recorded kept their
    flags under "flags")."""
    if "config" in info:
        return RunConfig.from_record(info["config"], source=str(run_dir / "run.json"))
    known = set(RunConfig.keys())
    return RunConfig(**{k: v for k, v in info["flags"].items() if k in known})


def rescale_for_world(cfg: RunConfig, saved_world: int, world: int, unit: str) -> RunConfig:
    """The same global batch on another number of processes. Token windows and images
    are rows, split over processes (per-process batch rescaled); chat batches are whole
    length-grouped batches, so the micro-steps per process are rescaled instead."""
    if world == saved_world:
        return cfg
    if unit == "batches":
        units = cfg.grad_accum * saved_world
        if units % world:
            raise UsageError(f"--resume: each step of the run takes {units} chat batches, which do not split over "
                             f"{world} processes; resume on a number of processes that divides {units}")
        return cfg.replace(grad_accum=units // world)
    rows = cfg.batch_size * saved_world
    if rows % world:
        raise UsageError(f"--resume: the run's global batch of {rows} rows does not split over {world} "
                         f"processes; resume with a world size that divides {rows}")
    return cfg.replace(batch_size=rows // world)


def _same_base(key: str, recorded, now) -> bool:
    """A LoRA run made before bases were recorded absolute kept --model as given
    (relative); resumed, the recipe records the absolute path of the same file. The
    file's content is compared separately (model_sha256)."""
    return (key == "model" and isinstance(recorded, str) and isinstance(now, str)
            and not Path(recorded).is_absolute() and Path(recorded).resolve() == Path(now))


def _resume(args, cli: dict, project) -> int:
    from toy.formats.checkpoint import list_checkpoints, read_json

    run_dir = Path(args.resume)
    if not (run_dir / "run.json").is_file():
        raise UsageError(f"--resume {run_dir}: no run.json there; give a run directory made by `toy train`")
    if args.run_id or args.out:
        raise UsageError("--resume continues a run in place; --run-id and --out conflict with it")
    info = read_json(run_dir / "run.json")
    saved = _saved_config(info, run_dir)
    for k, v in cli.items():
        if v is None or k in RESUME_MAY_CHANGE:
            continue
        if getattr(saved, k) != v:
            flag = "--" + k.replace("_", "-")
            raise UsageError(f"--resume: {flag} {v!r} differs from the run's {getattr(saved, k)!r}; "
                             "a resumed run keeps its config (only --steps may be raised)")
    ckpts = list_checkpoints(run_dir / "checkpoints")
    if not ckpts:
        raise UsageError(f"--resume {run_dir}: no checkpoint to resume from; train with --save-every N")
    last = ckpts[-1]
    done = int(read_json(last / "state.json")["step"])
    cfg = saved
    if cli["steps"] is not None:
        if cli["steps"] < saved.steps:
            raise UsageError(f"--steps {cli['steps']} is below the run's {saved.steps}; it may only be raised")
        cfg = cfg.replace(steps=cli["steps"])
    for k in ("device", "compile"):
        if cli.get(k) is not None:
            cfg = cfg.replace(**{k: cli[k]})
    if done >= cfg.steps:
        raise UsageError(f"--resume {run_dir}: its checkpoint is at step {done} of {cfg.steps}; "
                         "raise --steps to train further")
    device = resolve_device(cfg.device)
    d = dist.init(device.type)
    saved_world = int(info.get("distributed", {}).get("world_size", 1))
    recipe = load_recipe(cfg.recipe)
    unit = recipe.batch_unit(cfg) if hasattr(recipe, "batch_unit") else "rows"
    run_cfg = rescale_for_world(cfg, saved_world, d.world, unit)
    built = recipe.build(run_cfg, project)
    for k in sorted(set(built.job.config) | set(info["job"])):
        a, b = info["job"].get(k), json.loads(json.dumps(built.job.config.get(k)))
        if a != b and not _same_base(k, a, b):
            raise UsageError(f"--resume {run_dir}: {k} changed since the run started ({a!r} -> {b!r}); "
                             "restore the original input or start a new run")
    tcfg = TrainConfig.from_run(run_cfg.with_derived(built.derived))
    if d.is_main:  # run.json tells the truth about the run as it now stands
        info["config"] = cfg.to_dict()
        info.setdefault("segments", []).append({"from_step": done, "steps": cfg.steps, "world_size": d.world,
                                                "started": time.time()})
        write_json_atomic(run_dir / "run.json", info)
    events = EventLog(run_dir / "events.jsonl", enabled=d.is_main)
    events.emit("run_resumed", from_step=done, steps=tcfg.steps, checkpoint=str(last.relative_to(run_dir)),
                world_size=d.world)
    return _execute(args, run_cfg, built, tcfg, run_dir, run_dir.name, device, events, last)


def _execute(args, run_cfg: RunConfig, built, cfg: TrainConfig, run_dir, run_id, device, events, resume) -> int:
    main_rank = dist.info().is_main
    reporter = Reporter() if args.json or not main_rank else TextReporter(items_name=built.job.items_name)
    if not args.json:
        what = f"resuming {run_id} from {resume.name}" if resume else f"run {run_id}"
        reporter.message(f"{what}: {run_cfg.recipe} {built.arch}, {plural(built.params, 'parameter')}, "
                         f"{plural(cfg.steps, 'step')} on {device.type} "
                         f"({plural(torch.get_num_threads(), 'thread')}) -> {run_dir}")
        for note in built.notes:
            reporter.message(f"  {note}")
    elif main_rank:  # --json: stdout is the one object; warnings still reach the user
        for note in built.notes:
            if note.startswith("warning:"):
                print(note, file=sys.stderr)
    try:
        res = train(built.job, cfg, run_dir, device, events, reporter, resume=resume)
        if main_rank:
            built.job.save_final(run_dir / "final")
        dist.barrier()
    except Interrupted:
        reporter.close()
        events.close()
        raise
    except KeyboardInterrupt:  # a second Ctrl-C: stop now, no checkpoint for the step in flight
        reporter.close()
        events.emit("interrupted", signal="SIGINT", checkpoint=False)
        events.close()
        raise Interrupted(f"stopped at once by a second Ctrl-C; no checkpoint for the step in flight; resume "
                          f"from the last checkpoint with `toy train --resume {run_dir}`", 2)
    except ToyError as e:
        reporter.close()
        events.emit("run_failed", step=getattr(e, "step", None), error=e.message)
        events.close()
        raise e if isinstance(e, RunFailed) else RunFailed(e.message)
    except Exception as e:
        reporter.close()
        log = run_dir / ("error.log" if main_rank else f"error-rank{dist.info().rank}.log")
        log.write_text(traceback.format_exc())
        events.emit("run_failed", error=f"{type(e).__name__}: {e}")
        events.close()
        raise RunFailed(f"{type(e).__name__}: {e} (traceback in {log})")
    last_loss = res.losses[-1]["loss"] if res.losses else None
    last_val = res.val_losses[-1]["loss"] if res.val_losses else None
    ips_key = f"{built.job.items_name}_per_s"
    acc = [{"step": m["step"], "accuracy": m["accuracy"]} for m in res.metrics if "accuracy" in m]
    events.emit("run_finished", step=res.final_step, loss=last_loss, val_loss=last_val,
                wall_s=round(res.wall_s, 3), peak_mem_bytes=res.peak_mem_bytes, **{ips_key: res.items_per_s})
    events.close()
    if not main_rank:
        return 0
    if args.json:
        out = {"format": "toy/train-v1", "run_id": run_id, "run_dir": str(run_dir), "recipe": run_cfg.recipe,
               "arch": built.arch, "device": device.type, "seed": cfg.seed, "steps": cfg.steps,
               "params": built.params, "losses": res.losses, "val_losses": res.val_losses,
               ips_key: res.items_per_s, "wall_s": round(res.wall_s, 3), "peak_mem_bytes": res.peak_mem_bytes}
        if res.metrics:
            out["metrics"] = res.metrics
        if acc:  # classifiers: the accuracy curve under its own key
            out["val_accuracy"] = acc
        print(json.dumps(out))
    else:
        val = f", val loss {last_val:.4f}" if last_val is not None else ""
        speed = f", {res.items_per_s:,.0f} {built.job.items_name}/s" if res.items_per_s else ""
        val += f", val accuracy {acc[-1]['accuracy']:.4f}" if acc else ""
        mem = f", peak memory {res.peak_mem_bytes / 1e9:.2f} GB" if res.peak_mem_bytes else ""
        print(f"done: loss {last_loss:.4f}{val}{speed}{mem}, {res.wall_s:.1f}s; model in {run_dir / 'final'}")
    return 0


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
