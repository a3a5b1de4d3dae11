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
from toy.cli.args import finite_float, nonneg_int, positive_int, resolve
from toy.errors import Interrupted, RunFailed, ToyError, UsageError
from toy.models import registry
from toy.recipes import load_recipe, recipe_names
from toy.runs import EventLog, check_run_id, create_run_dir, find_project, make_run_id, write_json_atomic
from toy.train import dist
from toy.train.device import DEVICES, device_info, resolve_device
from toy.train.loop import TrainConfig, train
from toy.train.progress import Reporter, TextReporter

# Built-in defaults (toy.toml [train] and then flags override them).
DEFAULTS = dict(
    recipe="from-scratch", arch="llama", preset=None, steps=5, seed=0, device="cpu",
    n_layer=None, d_model=None, n_head=None, n_kv_head=None, seq_len=None,
    batch_size=16, grad_accum=1, lr=1e-3, min_lr=1e-4, warmup=10, weight_decay=0.1, clip=1.0,
    eval_every=0, eval_batches=8, save_every=0, keep_last=2,
    fsdp=False, compile=False, corpus=None, val_corpus=None, tokenizer=None, raw_i32=False, vocab_size=None,
)


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model (from-scratch, ...)", description=__doc__)
    g = p.add_argument_group("run")
    g.add_argument("--recipe", help=f"what to train: {', '.join(recipe_names())} (default from-scratch)")
    g.add_argument("--arch", help=f"architecture: {', '.join(registry.arch_names())} (default llama)")
    g.add_argument("--steps", type=positive_int("--steps"), help="optimizer steps (default 5)")
    g.add_argument("--seed", type=int, help="seed for init, data order and sampling (default 0)")
    g.add_argument("--out", help="directory that holds run directories (default: the project's runs/)")
    g.add_argument("--run-id", help="run directory name (default from toy.toml's template "
                   "'{date}-{recipe}-{arch}-{n}')")
    g.add_argument("--json", action="store_true", help="print one JSON object (format toy/train-v1) "
                   "instead of step lines")
    g.add_argument("--device", choices=DEVICES, help="cpu (default), cuda (bf16 autocast) or metal (macOS)")
    g.add_argument("--nproc", type=positive_int("--nproc"), metavar="N",
                   help="launch N local processes through torch.distributed.run (DDP; gloo on cpu, nccl on "
                        "cuda); --batch-size is per process. For multi-node use torchrun, see README")
    g.add_argument("--fsdp", action="store_true", default=None,
                   help="with several processes: shard parameters, gradients and AdamW state (FSDP2) "
                        "instead of replicating them (DDP)")
    g.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile each transformer block (inductor; needs a C++ compiler on cpu). Faster "
                        "steps after a one-off compile of tens of seconds; falls back to eager where it cannot")
    g.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint, in place "
                   "(same config; --steps may be raised)")
    d = p.add_argument_group("data")
    d.add_argument("--corpus", help="token file from `toy prep` (default: the project's data/corpus.bin, "
                   "else the bundled Shakespeare plays)")
    d.add_argument("--val-corpus", help="validation token file (default: CORPUS.val.bin beside --corpus)")
    d.add_argument("--tokenizer", help="tokenizer.json for the corpus (default: beside the corpus)")
    d.add_argument("--raw-i32", action="store_true", help="--corpus is headerless packed int32 tokens")
    d.add_argument("--vocab-size", type=positive_int("--vocab-size"),
                   help="vocabulary size of a --raw-i32 corpus without --tokenizer")
    m = p.add_argument_group("model")
    m.add_argument("--preset", help="named model shape; " + "; ".join(f"{a}: {', '.join(registry.preset_names(a))}"
                                                                for a in registry.arch_names()))
    m.add_argument("--n-layer", type=positive_int("--n-layer"), help="transformer blocks")
    m.add_argument("--d-model", type=positive_int("--d-model"), help="model width")
    m.add_argument("--n-head", type=positive_int("--n-head"), help="attention (query) heads")
    m.add_argument("--n-kv-head", type=positive_int("--n-kv-head"), help="key/value heads (grouped-query attention)")
    m.add_argument("--seq-len", type=positive_int("--seq-len"), help="training sequence length (default: the preset's)")
    o = p.add_argument_group("optimiser")
    o.add_argument("--batch-size", type=positive_int("--batch-size"), help="sequences per micro-batch (default 16); with chat --data, a budget of "
                   "batch-size x (seq-len + 1) tokens filled with conversations of similar length")
    o.add_argument("--grad-accum", type=positive_int("--grad-accum"),
                   help="micro-batches per optimizer step; the loss is normalised over all of them (default 1)")
    o.add_argument("--lr", type=finite_float, help="peak learning rate (default 1e-3)")
    o.add_argument("--min-lr", type=finite_float, help="final learning rate of the cosine decay (default 1e-4)")
    o.add_argument("--warmup", type=nonneg_int, help="linear warmup steps (default 10)")
    o.add_argument("--weight-decay", type=finite_float, help="AdamW decay on matrices and embeddings (default 0.1)")
    o.add_argument("--clip", type=finite_float, help="gradient norm clip, 0 disables (default 1.0)")
    o.add_argument("--eval-every", type=nonneg_int,
                   help="validation every N steps; it also runs before step 1 and at the end (default 0: only those)")
    o.add_argument("--eval-batches", type=positive_int("--eval-batches"), help="validation batches per eval (default 8)")
    o.add_argument("--save-every", type=nonneg_int, help="checkpoint every N steps (default 0: none)")
    o.add_argument("--keep-last", type=nonneg_int, help="checkpoints to keep, 0 keeps all (default 2)")
    # Each recipe adds its own flags in a group of its own (recipe modules own them).
    for name in recipe_names():
        mod = load_recipe(name)
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(p.add_argument_group(f"{name} recipe"))
    p.set_defaults(func=run)


def flag_keys() -> list[str]:
    keys = list(DEFAULTS)
    for name in recipe_names():
        keys += [k for k in getattr(load_recipe(name), "FLAGS", {}) if k not in keys]
    return keys


def validate(o: dict) -> None:
    problems = []
    if o["recipe"] not in recipe_names():
        problems.append(f"--recipe {o['recipe']!r} is unknown; valid: {', '.join(recipe_names())}")
    if o["arch"] not in registry.arch_names():
        problems.append(f"--arch {o['arch']!r} is unknown; valid: {', '.join(registry.LM_ARCHS)} "
                        "(vit via --recipe vit-tiny)")
    elif o["preset"] is not None and o["preset"] not in registry.preset_names(o["arch"]):
        problems.append(f"--preset {o['preset']!r} is unknown for {o['arch']}; "
                        f"valid: {', '.join(registry.preset_names(o['arch']))}")
    for k in ("steps", "batch_size", "grad_accum", "eval_batches"):
        if not isinstance(o[k], int) or o[k] < 1:
            problems.append(f"--{k.replace('_', '-')} must be an integer >= 1, got {o[k]!r}")
    if not (isinstance(o["lr"], (int, float)) and o["lr"] > 0):
        problems.append(f"--lr must be > 0, got {o['lr']!r}")
    if not (0 <= o["min_lr"] <= o["lr"]):
        problems.append(f"--min-lr must be between 0 and --lr ({o['lr']}), got {o['min_lr']!r}")
    if o["weight_decay"] < 0:
        problems.append(f"--weight-decay must be >= 0, got {o['weight_decay']}")
    if o["clip"] < 0:
        problems.append(f"--clip must be >= 0 (0 disables), got {o['clip']}")
    if o["corpus"] and not Path(o["corpus"]).is_file():
        problems.append(f"--corpus {o['corpus']} not found; make one with `toy prep TEXT --out FILE.bin` "
                        "or start a project with `toy new DIR`")
    if o["recipe"] in recipe_names():
        check = getattr(load_recipe(o["recipe"]), "check_opts", None)
        if check is not None:
            problems += check(o)
    if problems:
        raise UsageError("; ".join(problems))


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


def _run(args) -> int:
    project = find_project()
    cli = {k: getattr(args, k, None) for k in flag_keys()}
    cli["raw_i32"] = args.raw_i32 or None
    if args.resume:
        return _resume(args, cli, project)
    recipe_name = cli["recipe"] or project.train_defaults.get("recipe") or DEFAULTS["recipe"]
    if recipe_name not in recipe_names():
        raise UsageError(f"--recipe {recipe_name!r} is unknown; valid: {', '.join(recipe_names())}")
    recipe = load_recipe(recipe_name)
    # Precedence: flag > toy.toml [train.<recipe>] > toy.toml [train] > the recipe's defaults > toy's.
    builtin = {**DEFAULTS, **{k: v for k, v in getattr(recipe, "FLAGS", {}).items()}}
    toml = {k: v for k, v in project.train_defaults.items() if not isinstance(v, dict)}
    toml.update(project.train_defaults.get(recipe_name, {}))
    opts = resolve(cli, toml, builtin, None)
    validate(opts)
    device = resolve_device(opts["device"])  # before any work: metal off macOS exits 2 here
    d = dist.init(device.type)
    runs_dir = Path(args.out) if args.out else project.runs_dir
    if args.run_id and d.is_main:
        check_run_id(args.run_id)
        if (runs_dir / args.run_id).exists():
            raise UsageError(f"--run-id {args.run_id}: {runs_dir / args.run_id} already exists; pick another id")

    if cli.get("epochs") is not None and cli.get("steps") is not None:
        raise UsageError("--epochs and --steps conflict: give one (--epochs sets the step count)")
    built = recipe.build(opts, project)  # all input checks happen here, before the run dir exists
    run_dir = None
    if d.is_main:  # rank 0 alone names and makes the run directory, then tells the others
        run_id = args.run_id or make_run_id(project.run_id_template, runs_dir, recipe=opts["recipe"],
                                            arch=built.arch)
        run_dir = create_run_dir(runs_dir, run_id)
    run_dir = Path(dist.broadcast_object(str(run_dir)))
    run_id = run_dir.name
    cfg = train_config(opts)
    distributed = {"world_size": d.world, "backend": d.backend if d.enabled else "none",
                   "global_batch": cfg.batch_size * cfg.grad_accum * d.world, "fsdp": bool(cfg.fsdp and d.enabled)}
    run_info = {
        "run_id": run_id, "recipe": opts["recipe"], "arch": built.arch, "seed": opts["seed"],
        "params": built.params, "train": cfg.to_dict(), "job": built.job.config,
        "flags": {k: v for k, v in opts.items()},
        "device": device_info(device),
        "versions": {"toy": __version__, "torch": torch.__version__, "python": platform.python_version()},
        "machine": {"platform": platform.platform(), "cpu_count": _cpu_count()},
        "command": sys.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "distributed": distributed,
    }
    if d.is_main:
        write_json_atomic(run_dir / "run.json", run_info)
    events = EventLog(run_dir / "events.jsonl", enabled=d.is_main)
    events.emit("run_started", run_id=run_id, recipe=opts["recipe"], arch=built.arch, params=built.params,
                steps=cfg.steps, seed=cfg.seed, device=device.type, world_size=d.world,
                global_batch=distributed["global_batch"])
    return _execute(args, opts, built, cfg, run_dir, run_id, device, events, None)


def train_config(opts: dict) -> TrainConfig:
    return TrainConfig(**{k: opts.get(k, DEFAULTS.get(k)) for k in ("steps", "batch_size", "grad_accum", "lr", "min_lr", "warmup",
                                               "weight_decay", "clip", "eval_every", "eval_batches",
                                               "save_every", "keep_last", "seed", "fsdp", "compile")})


def _resume(args, cli: dict, project) -> int:
    from toy.formats.checkpoint import list_checkpoints, read_json

    run_dir = Path(args.resume)
    if not (run_dir / "run.json").is_file():
        raise UsageError(f"--resume {run_dir}: no run.json there; give a run directory made by `toy train`")
    if args.run_id or args.out:
        raise UsageError("--resume continues a run in place; --run-id and --out conflict with it")
    info = read_json(run_dir / "run.json")
    saved = info["flags"]
    for k, v in cli.items():
        if v is None or k in RESUME_MAY_CHANGE:
            continue
        if saved.get(k) != v:
            flag = "--" + k.replace("_", "-")
            raise UsageError(f"--resume: {flag} {v!r} differs from the run's {saved.get(k)!r}; "
                             "a resumed run keeps its config (only --steps may be raised)")
    ckpts = list_checkpoints(run_dir / "checkpoints")
    if not ckpts:
        raise UsageError(f"--resume {run_dir}: no checkpoint to resume from; train with --save-every N")
    last = ckpts[-1]
    done = int(read_json(last / "state.json")["step"])
    opts = dict(saved)
    if cli["steps"] is not None:
        if cli["steps"] < saved["steps"]:
            raise UsageError(f"--steps {cli['steps']} is below the run's {saved['steps']}; it may only be raised")
        opts["steps"] = cli["steps"]
    for k in ("device", "compile"):
        if cli.get(k) is not None:
            opts[k] = cli[k]
    if done >= opts["steps"]:
        raise UsageError(f"--resume {run_dir}: its checkpoint is at step {done} of {opts['steps']}; "
                         "raise --steps to train further")
    device = resolve_device(opts["device"])
    d = dist.init(device.type)
    # Resuming on another number of processes keeps the global batch: the per-process
    # batch is rescaled (the data draw is per global step, so the batches are the same).
    saved_world = int(info.get("distributed", {}).get("world_size", 1))
    if d.world != saved_world:
        rows = int(saved["batch_size"]) * saved_world
        if rows % d.world:
            raise UsageError(f"--resume: the run's global batch of {rows} rows does not split over {d.world} "
                             f"processes; resume with a world size that divides {rows}")
        opts["batch_size"] = rows // d.world
    recipe = load_recipe(opts["recipe"])
    built = recipe.build(opts, project)
    for k in sorted(set(built.job.config) | set(info["job"])):
        a, b = info["job"].get(k), json.loads(json.dumps(built.job.config.get(k)))
        if a != b:
            raise UsageError(f"--resume {run_dir}: {k} changed since the run started ({a!r} -> {b!r}); "
                             "restore the original input or start a new run")
    cfg = train_config(opts)
    events = EventLog(run_dir / "events.jsonl", enabled=dist.info().is_main)
    events.emit("run_resumed", from_step=done, steps=cfg.steps, checkpoint=str(last.relative_to(run_dir)))
    return _execute(args, opts, built, cfg, run_dir, run_dir.name, device, events, last)


def _execute(args, opts, built, cfg, run_dir, run_id, device, events, resume) -> int:
    main_rank = dist.info().is_main
    reporter = Reporter() if args.json or not main_rank else TextReporter(items_name=built.job.items_name)
    if not args.json:
        what = f"resuming {run_id} from {resume.name}" if resume else f"run {run_id}"
        reporter.message(f"{what}: {opts['recipe']} {built.arch}, {built.params:,} parameters, "
                         f"{cfg.steps} steps on {device.type} ({torch.get_num_threads()} threads) -> {run_dir}")
        for note in built.notes:
            reporter.message(f"  {note}")
    try:
        res = train(built.job, cfg, run_dir, device, events, reporter, resume=resume)
        if main_rank:
            built.job.save_final(run_dir / "final")
        dist.barrier()
    except Interrupted:
        reporter.close()
        events.close()
        raise
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
                wall_s=round(res.wall_s, 3), **{ips_key: res.items_per_s})
    events.close()
    if not main_rank:
        return 0
    if args.json:
        out = {"format": "toy/train-v1", "run_id": run_id, "run_dir": str(run_dir), "recipe": opts["recipe"],
               "arch": built.arch, "device": device.type, "seed": cfg.seed, "steps": cfg.steps,
               "params": built.params, "losses": res.losses, "val_losses": res.val_losses,
               ips_key: res.items_per_s, "wall_s": round(res.wall_s, 3)}
        if res.metrics:
            out["metrics"] = res.metrics
        if acc:  # classifiers: the accuracy curve under its own key
            out["val_accuracy"] = acc
        print(json.dumps(out))
    else:
        val = f", val loss {last_val:.4f}" if last_val is not None else ""
        speed = f", {res.items_per_s:,.0f} {built.job.items_name}/s" if res.items_per_s else ""
        val += f", val accuracy {acc[-1]['accuracy']:.4f}" if acc else ""
        print(f"done: loss {last_loss:.4f}{val}{speed}, {res.wall_s:.1f}s; model in {run_dir / 'final'}")
    return 0


def _cpu_count() -> int:
    import os
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
