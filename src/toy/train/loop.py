"""The one training loop. Every recipe hands it a Job (job.py); the loop owns
accumulation, loss normalisation, clipping, the LR schedule, AdamW, evaluation,
checkpoints, resume, events, signals and throughput figures.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from toy.errors import Interrupted, RunFailed
from toy.formats import checkpoint as ckpt
from toy.runs import EventLog
from toy.train import dist
from toy.train.device import autocast
from toy.train.job import Job
from toy.train.progress import Reporter
from toy.train.schedule import lr_at, make_adamw


@dataclass
class TrainConfig:
    steps: int = 5
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 10
    weight_decay: float = 0.1
    clip: float = 1.0
    eval_every: int = 0  # 0: only before the first step and at the end
    eval_batches: int = 8
    save_every: int = 0
    keep_last: int = 2
    seed: int = 0
    fused_adamw: bool = False
    fsdp: bool = False  # shard parameters, grads and AdamW state (FSDP2) instead of DDP
    compile: bool = False  # torch.compile each block (inductor); eager where it cannot

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainResult:
    losses: list[dict] = field(default_factory=list)
    val_losses: list[dict] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)
    items_per_s: float | None = None
    wall_s: float = 0.0
    final_step: int = 0


class _LossModule(torch.nn.Module):
    """The job's loss as a module, so DistributedDataParallel wraps one forward() that
    covers whatever the recipe's loss calls (model.hidden, the head, ...)."""

    def __init__(self, job: Job):
        super().__init__()
        self.job = job
        self.model = job.model

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.job.loss(self.model, batch)


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a model (llama `layers`, GPT-2 `h`, ViT `blocks`)."""
    for name in ("layers", "h", "blocks"):
        found = getattr(model, name, None)
        if isinstance(found, torch.nn.ModuleList):
            return list(found)
    return []


def compile_unavailable(device: torch.device) -> str | None:
    """Why torch.compile cannot run here, or None."""
    import shutil

    if device.type == "mps":
        return "torch.compile stays off on Apple MPS (inductor fails there)"
    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile does not support this Python/torch ({torch.__version__})"
    if device.type == "cpu" and not any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "c++", "clang++")):
        return "no C++ compiler (g++, c++ or clang++) on PATH for inductor's CPU kernels; install one (e.g. gcc)"
    return None


def compile_blocks(model: torch.nn.Module, device: torch.device) -> str:
    """Regional compilation: each block is compiled in place (names and state_dict keys
    unchanged), and as the blocks share their code, inductor builds one kernel set for
    all of them, so compile time does not grow with depth. The head, the loss and the
    optimizer stay eager. Returns a line for the log."""
    why = compile_unavailable(device)
    found = blocks(model)
    if why or not found:
        return f"--compile: {why or 'this model has no repeated blocks to compile'}; training eagerly"
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True  # a graph inductor cannot build runs eagerly
    for b in found:
        b.compile(dynamic=False)
    return f"--compile: {len(found)} blocks compiled with inductor (the first steps include compile time)"


def _no_buffer_sync() -> dict:
    """DDP kwargs that skip syncing buffers each forward (newer torch renamed the flag)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


class _Signals:
    """Turn SIGINT/SIGTERM into a flag checked between steps: the step in flight
    finishes, a checkpoint is written, then the run stops."""

    def __init__(self):
        self.signum: int | None = None
        self._old = {}

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        self.signum = signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        return False


def train(job: Job, cfg: TrainConfig, run_dir: Path | None, device: torch.device, events: EventLog,
          reporter: Reporter | None = None, resume: Path | None = None) -> TrainResult:
    reporter = reporter or Reporter()
    d = dist.info()
    model = job.model.to(device)
    if cfg.compile:
        reporter.message(compile_blocks(model, device))
    ddp = fsdp = None
    if d.enabled and cfg.fsdp:
        from torch.distributed.fsdp import fully_shard

        # One FSDP unit per block (its weights are gathered just for its forward and
        # backward), and the root for the rest (embedding, final norm, tied head).
        fsdp = _LossModule(job)
        for block in blocks(model):
            fully_shard(block)
        fully_shard(fsdp)
    elif d.enabled:
        from torch.nn.parallel import DistributedDataParallel

        # Buffers (rotary tables) are a function of the config: no need to broadcast them.
        ddp = DistributedDataParallel(_LossModule(job), device_ids=[d.local_rank] if device.type == "cuda" else None,
                                      **_no_buffer_sync())
    forward = ddp or fsdp  # None: call the job's loss directly
    named = job.trainable()  # after sharding: FSDP replaces parameters with DTensors
    names = {id(p): n for n, p in named}
    by_name = dict(named)
    opt = make_adamw(named, cfg.lr, cfg.weight_decay, job.params_decay, fused=cfg.fused_adamw)
    res = TrainResult()
    start_step = 0
    ckpt_root = run_dir / "checkpoints" if run_dir is not None else None
    if resume is not None:
        start_step = _restore(job, opt, resume, res, names)
    evals = job.eval_batches()

    def run_eval(step: int) -> None:
        if not evals:
            return
        metrics = evaluate(job, evals, device, fsdp)
        res.val_losses.append({"step": step, "loss": metrics["val_loss"]})
        extra = {k: v for k, v in metrics.items() if k != "val_loss"}
        if extra:
            res.metrics.append({"step": step, **extra})
        events.emit("eval", step=step, **metrics)
        reporter.eval(step, metrics)

    def save(step: int) -> None:
        if ckpt_root is None:
            return
        state = {"losses": res.losses, "val_losses": res.val_losses, "metrics": res.metrics,
                 "data_position": step * cfg.grad_accum, "config": job.config, "world_size": d.world}
        # Every rank's torch generator (dropout) goes into rank 0's checkpoint; sharded
        # tensors are gathered whole (collectives: every rank takes part).
        rank_rng = dist.gather_rng_states()
        model_state = {n: _full(t) for n, t in job.trainable_state().items()}
        opt_state = ckpt.optimizer_tensors(opt, names, _full)
        if not d.is_main:
            dist.barrier()
            return
        try:
            path = ckpt.save_checkpoint(ckpt_root, step, model_state, opt_state, state, rank_rng)
        except OSError as e:
            # The temp directory is gone (atomic_dir removed it): no partial checkpoint
            # can pass for a valid one, and the previous checkpoint is untouched.
            raise RunFailed(f"cannot write the step-{step} checkpoint under {ckpt_root}: {e.strerror or e}; "
                            "free disk space or train with another --out", step=step)
        ckpt.prune_checkpoints(ckpt_root, cfg.keep_last)
        events.emit("checkpoint", step=step, path=str(path.relative_to(run_dir)))
        dist.barrier()

    t_start = time.perf_counter()
    # Throughput skips the first 3 steps (allocator warm-up, lazy init) when the run is
    # longer than that; eval time is never counted.
    warm = 3 if cfg.steps - start_step > 3 else 0
    t_mark, items_since_mark, eval_time, eval_time_mark = None, 0, 0.0, 0.0
    reporter.start(cfg.steps, start_step)
    step = start_step
    with _Signals() as sig:
        if start_step == 0:
            t0 = time.perf_counter()
            run_eval(0)
            eval_time += time.perf_counter() - t0
        for step in range(start_step + 1, cfg.steps + 1):
            lr = lr_at(step - 1, cfg.steps, cfg.lr, cfg.min_lr, cfg.warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            if warm == 0 and t_mark is None:
                t_mark, eval_time_mark = time.perf_counter(), eval_time
            model.train()
            # Fetch the whole accumulation step first: its supervised-token count
            # normalises every micro-batch, so accumulation never changes the objective.
            micro = [job.micro_batch((step - 1) * cfg.grad_accum + m) for m in range(cfg.grad_accum)]
            n_sup = sum(job.count(b) for b in micro)
            if d.enabled:  # normalise by the supervised tokens of the whole global step
                n_sup = int(dist.all_sum(torch.tensor(float(n_sup), device=device)).item())
            if n_sup == 0:
                raise RunFailed(f"step {step}: the batch has no supervised tokens; check the data's loss mask", step=step)
            loss_sum = torch.zeros((), device=device)
            n_items = 0
            for i, b in enumerate(micro):
                b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
                # Gradients are all-reduced once per step, on the last micro-batch.
                last = i == len(micro) - 1
                sync = ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext()
                if fsdp is not None:
                    fsdp.set_requires_gradient_sync(last)
                with sync:
                    with autocast(device):
                        ls, _ = forward(b) if forward is not None else job.loss(model, b)
                    # DDP averages gradients over ranks; the objective is the sum over the
                    # global batch divided by its supervised tokens, hence * world.
                    (ls * (d.world / n_sup)).backward()
                loss_sum += ls.detach().float()
                n_items += job.n_items(b) * d.world
            if job.frozen is not None:  # after backward and the gradient all-reduce: AdamW skips None grads
                for n in job.frozen(step):
                    by_name[n].grad = None
            if cfg.clip > 0:
                torch.nn.utils.clip_grad_norm_([p for _, p in named], cfg.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss = dist.all_sum(loss_sum).item() / n_sup  # one host sync per step
            if not math.isfinite(loss):
                raise RunFailed(f"loss became {loss} at step {step}; lower --lr or check the data "
                                f"(the last good checkpoint, if any, stays under {ckpt_root})", step=step)
            now = time.perf_counter()
            if t_mark is not None:
                items_since_mark += n_items
            elif step - start_step == warm:
                t_mark, eval_time_mark = now, eval_time
            ips = None
            if t_mark is not None and items_since_mark:
                ips = items_since_mark / max(1e-9, now - t_mark - (eval_time - eval_time_mark))
                res.items_per_s = ips
            res.losses.append({"step": step, "loss": loss})
            events.emit("step", step=step, loss=loss, lr=lr, items=n_items,
                        **({f"{job.items_name}_per_s": round(ips, 2)} if ips else {}))
            reporter.step(step, loss, ips)
            if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps:
                t0 = time.perf_counter()
                run_eval(step)
                eval_time += time.perf_counter() - t0
            if cfg.save_every and step % cfg.save_every == 0:
                save(step)
            if dist.any_flag(sig.signum is not None, device):  # a signal on one rank stops all
                signum = sig.signum or signal.SIGTERM
                if not (cfg.save_every and step % cfg.save_every == 0):
                    save(step)
                events.emit("interrupted", step=step, signal=signal.Signals(signum).name)
                reporter.close()
                raise Interrupted(f"interrupted by {signal.Signals(signum).name} after step {step}; "
                                  f"resume with `toy train --resume {run_dir}`", signum)
        run_eval(cfg.steps)
    if fsdp is not None:
        fsdp.reshard()  # the root keeps its gathered weights after backward: shard them back first
        materialize(model)  # whole tensors on every rank, so rank 0 saves a plain model
    reporter.close()
    res.wall_s = time.perf_counter() - t_start
    res.final_step = cfg.steps
    return res


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind an FSDP shard (a collective); plain tensors as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _shard_like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A whole tensor laid out like parameter p (sharded when p is a DTensor)."""
    if hasattr(p, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(t.to(p.device), p.device_mesh, p.placements)
    return t.to(p.device)


def materialize(model: torch.nn.Module) -> None:
    """After FSDP training: replace every sharded parameter by the whole tensor, so the
    model saves (and runs) as a plain module. A collective: every rank calls it."""
    from torch.distributed.fsdp import FSDPModule

    whole = {}
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if hasattr(p, "full_tensor") and id(p) not in whole:
                whole[id(p)] = torch.nn.Parameter(p.full_tensor().detach().clone(), requires_grad=p.requires_grad)
    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            # Drop FSDP's class and hooks: they would swap the sharded parameters back in.
            mod.__class__ = next(c for c in mod.__class__.__mro__[1:]
                                 if issubclass(c, torch.nn.Module) and not issubclass(c, FSDPModule))
            for hooks in (mod._forward_pre_hooks, mod._forward_hooks, mod._state_dict_pre_hooks,
                          mod._state_dict_hooks, mod._load_state_dict_pre_hooks, mod._backward_pre_hooks):
                hooks.clear()
        for name, p in list(mod.named_parameters(recurse=False)):
            if id(p) in whole:
                setattr(mod, name, whole[id(p)])
    cfg = getattr(model, "cfg", None)
    if cfg is not None and getattr(cfg, "tie_embeddings", False) and hasattr(model, "lm_head"):
        model.lm_head.weight = model.embed_tokens.weight


@torch.no_grad()
def evaluate(job: Job, batches: list[dict[str, torch.Tensor]], device: torch.device,
             forward: torch.nn.Module | None = None) -> dict[str, float]:
    model = job.model
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for b in batches:
        b = {k: v.to(device) for k, v in b.items()}
        with autocast(device):
            ls, n = forward(b) if forward is not None else job.loss(model, b)
        total += float(ls)
        count += int(n)
    out = {"val_loss": total / max(1, count)}
    if job.eval_metrics is not None:
        out.update(job.eval_metrics(model, batches))
    model.train(was_training)
    return out


def _restore(job: Job, opt: torch.optim.Optimizer, ckpt_dir: Path, res: TrainResult, names: dict[int, str]) -> int:
    model_sd, opt_t, rng_t, state = ckpt.load_checkpoint(ckpt_dir)
    params = dict(job.trainable())
    missing = set(params) - set(model_sd)
    if missing:
        raise RunFailed(f"{ckpt_dir}: checkpoint lacks {sorted(missing)[0]}; it belongs to another run")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(_shard_like(model_sd[n].to(p.dtype), p))
    ckpt.load_optimizer(opt, opt_t, state["optimizer"], names, _shard_like)
    ckpt.set_rng_state(rng_t, state["rng"], rank=dist.info().rank)
    res.losses = state.get("losses", [])
    res.val_losses = state.get("val_losses", [])
    res.metrics = state.get("metrics", [])
    return int(state["step"])
