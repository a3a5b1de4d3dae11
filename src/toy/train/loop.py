"""The one training loop. Every recipe hands it a Job (job.py); the loop owns
accumulation, loss normalisation, clipping, the LR schedule, AdamW, evaluation,
checkpoints, resume, events, signals and throughput figures.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from toy.errors import Interrupted, RunFailed, SecondInterrupt
from toy.formats import checkpoint as ckpt
from toy.models.decode import compile_unavailable
from toy.models.sample import seeded
from toy.runs import MMAP_THRESHOLD_LOW_MEMORY, EventLog, plural, tune_malloc
from toy.train import dist
from toy.train.config import RunConfig
from toy.train.device import (
    Precision,
    autocast,
    check_threads,
    peak_memory,
    resolve_precision,
)
from toy.train.job import Job, Live, live_seed
from toy.train.progress import Reporter
from toy.train.schedule import Schedule, make_adamw


@dataclass
class TrainResult:
    losses: list[dict] = field(default_factory=list)
    val_losses: list[dict] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)
    items_per_s: float | None = None
    wall_s: float = 0.0
    final_step: int = 0
    peak_mem_bytes: int | None = None
    test: dict | None = None  # the test pass after training (Job.test_batches): loss, ppl


class _LossModule(torch.nn.Module):
    """The job's loss as a module, so DistributedDataParallel wraps one forward() that
    covers whatever the recipe's loss calls (model.hidden, the head, ...)."""

    def __init__(self, job: Job):
        super().__init__()
        self.job = job
        self.model = job.model

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.job.loss(self.model, batch)


def compile_blocks(model: torch.nn.Module, device: torch.device, live: bool = False) -> str:
    """Regional compilation: each block is compiled in place (names and state_dict keys
    unchanged), and as the blocks share their code, inductor builds one kernel set for
    all of them, so compile time does not grow with depth. The head, the loss and the
    optimizer stay eager. Returns a line for the log.

    `live`: a job whose batches are sampled (GRPO). Its decode changes shape every token
    and its batches every step, so a shape-specialised build would be rebuilt until
    dynamo's recompile limit (3 tiny GRPO steps: 52 s against 0.6 s eager): the blocks are
    built once for any batch and length, and the sampling runs eagerly (_live_batches)."""
    why = compile_unavailable(device)
    found = list(model.blocks)
    if why or not found:
        return (
            f"--compile: {why or 'this model has no repeated blocks to compile'}; training eagerly"
        )
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True  # a graph inductor cannot build runs eagerly
    for b in found:
        b.compile(dynamic=live)
    return (
        f"--compile: {plural(len(found), 'block')} compiled with inductor "
        + ("for any batch and length; the sampling runs eagerly" if live else "")
        + "(the first steps include compile time)"
    )


# From this many base weights a live job's sampling on a cpu under bf16 compiles its decode
# steps (sample_steps); TOY_DECODE_STEPS=0 never, =1 at any size.
SAMPLE_STEPS_MIN = 30_000_000


def sample_steps(model: torch.nn.Module, device: torch.device, precision: Precision) -> str:
    """A live job's sampling (GRPO) on compiled batched decode steps (models/decode.py
    compile_steps(rows=True): each block one call a token, its small ops fused) where they
    pay: a cpu, bf16 (float32 stays eager, to the bit), a model of SAMPLE_STEPS_MIN base
    weights or more (a SmolLM2-135M step's sampling 1.5-2.4x faster, docs/performance.md, for a
    build of 1-2 min once a machine; a tiny model's build would cost more than its run), and
    a C++ compiler; not under --fsdp (its parameters become DTensors after this). Returns a
    line for the log ("" where nothing is said)."""
    from toy.models import decode, quant

    env = os.environ.get("TOY_DECODE_STEPS", "")
    if env == "0" or device.type != "cpu" or precision.name != "bf16":
        return ""
    if env != "1" and quant.count_params(model) < SAMPLE_STEPS_MIN:
        return ""
    why = compile_unavailable(device)
    if why:
        return f"sampling eagerly: {why}"
    decode.compile_steps(model, check=False, rows=True)
    return (
        "sampling on compiled decode steps (built on first use, once on this machine: "
        "one to two minutes; TOY_DECODE_STEPS=0 samples eagerly)"
    )


def _eager():
    """Compiled blocks run eagerly inside (a live job's sampling: compile_blocks). Where
    torch._dynamo was never imported nothing in this process is torch.compile'd (the decode
    steps are AOT libraries, which no stance touches), and set_stance would import it: 1.0-1.2
    s of a GRPO process's start, for nothing."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def _no_buffer_sync() -> dict:
    """DDP kwargs that skip syncing buffers each forward (newer torch renamed the flag)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in params
        else {"broadcast_buffers": False}
    )


def _ddp_ignore_frozen(module: torch.nn.Module) -> list[str]:
    """Leave every frozen parameter and every buffer out of DDP: its start-up broadcast
    (which torch 2.13 does even with forward_sync_buffers=False) copies rank 0's tensors
    into every rank's, and a quantized base's blocks are views of the GGUF's copy-on-write
    map, so that write gives each rank a private copy of the whole base. Every rank reads
    the same file, the buffers (rotary tables, quantized blocks, a donor's table) are a
    function of the config and the files, and a frozen parameter gets no gradient to
    reduce: nothing of them needs syncing. Returns the names left out."""
    from torch.nn.parallel import DistributedDataParallel

    names = [n for n, p in module.named_parameters() if not p.requires_grad]
    names += [n for n, _ in module.named_buffers()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
    return names


class _Signals:
    """Turn SIGINT/SIGTERM into a flag checked between steps: the step in flight
    finishes, a checkpoint is written, then the run stops. The first signal says so at
    once (a slow step can take a while); a second SIGINT stops at once, without a
    checkpoint for the step in flight."""

    def __init__(self, announce: bool):
        self.signum: int | None = None
        self.step = 0  # the step in flight, for the message
        self._announce = announce
        self._old = {}

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise SecondInterrupt(self.step)  # the second Ctrl-C: stop now (the step in flight)
        self.signum = signum
        if self._announce:
            print(
                f"{signal.Signals(signum).name}: finishing step {self.step}, then checkpointing... "
                "(Ctrl-C again stops at once, without it: the steps since the last checkpoint "
                "are lost)",
                file=sys.stderr,
                flush=True,
            )

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        return False


JOB_STATE = "job_state."  # the checkpoint's names of a job's own state (Job.state)


def rank_seed(seed: int, rank: int) -> int:
    """The torch generator seed of one process: each rank draws its own dropout stream,
    and the same (seed, rank) always draws the same one."""
    digest = hashlib.sha256(f"toy-train/{seed}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class _Throughput:
    """Items per second of training, skipping the first steps (allocator warm-up, lazy
    init) when the run is long enough, and never counting evaluation time."""

    def __init__(self, steps_to_run: int):
        self.warm = 3 if steps_to_run > 3 else 0
        self.t_mark: float | None = None
        self.items = 0
        self.eval_time = 0.0
        self.eval_mark = 0.0
        self.done = 0

    def begin_step(self) -> None:
        if self.warm == 0 and self.t_mark is None:
            self.t_mark, self.eval_mark = time.perf_counter(), self.eval_time

    def end_step(self, n_items: int) -> float | None:
        self.done += 1
        now = time.perf_counter()
        if self.t_mark is not None:
            self.items += n_items
        elif self.done == self.warm:
            self.t_mark, self.eval_mark = now, self.eval_time
        if self.t_mark is None or not self.items:
            return None
        return self.items / max(1e-9, now - self.t_mark - (self.eval_time - self.eval_mark))


class Trainer:
    """One run of the loop over a Job. `run()` is the whole of it; each method below is
    one part, in the order a step meets them."""

    def __init__(
        self,
        job: Job,
        cfg: RunConfig,
        run_dir: Path | None,
        device: torch.device,
        events: EventLog,
        reporter: Reporter,
        precision: Precision | None = None,
    ):
        self.job, self.cfg, self.run_dir, self.device = job, cfg, run_dir, device
        self.precision = precision or resolve_precision(cfg.precision, device)
        self.events, self.reporter = events, reporter
        self.d = dist.info()
        self.ckpt_root = run_dir / "checkpoints" if run_dir is not None else None
        self.model = job.model.to(device)
        job.events = events
        job.bind(device, self.precision, run_dir)
        if cfg.checkpointing:
            self.model.checkpointing = True
            # the low-memory mode: freed blocks go back at once
            tune_malloc(MMAP_THRESHOLD_LOW_MEMORY, MMAP_THRESHOLD_LOW_MEMORY)
        if cfg.compile:
            reporter.message(compile_blocks(self.model, device, job.live))
        elif (
            job.live and not cfg.fsdp and (line := sample_steps(self.model, device, self.precision))
        ):
            reporter.message(line)
        self.ddp, self.fsdp = self._wrap()
        self.named = job.trainable()  # after sharding: FSDP replaces parameters with DTensors
        self.names = {id(p): n for n, p in self.named}
        self.by_name = dict(self.named)
        self.opt = make_adamw(
            self.named,
            cfg.lr,
            cfg.weight_decay,
            job.decays,
            lr_scale=job.lr_scale,
            # bf16 runs take the fused kernel (float32 keeps foreach's bits); FSDP's
            # DTensor shards stay on foreach
            fused=self.precision.name == "bf16"
            and self.fsdp is None
            and self.device.type in ("cpu", "cuda"),
            # resolved by train/run.py; "auto" only where train() is called directly
            state_dtype=torch.bfloat16 if cfg.optimizer_state == "bfloat16" else torch.float32,
        )
        self.schedule = Schedule(cfg.lr, cfg.min_lr, cfg.warmup, cfg.steps)
        self.res = TrainResult()
        self.saved_step = -1
        self.evals: list = []
        self._next: tuple[int, list] | None = (
            None  # (step, its batches), made during the step before
        )

    # ---------------------------------------------------------------- setup

    def _wrap(self):
        """DDP (default) or FSDP2 over several processes; nothing with one."""
        if not self.d.enabled:
            return None, None
        if self.cfg.fsdp:
            from torch.distributed.fsdp import fully_shard

            # One FSDP unit per block (its weights are gathered just for its forward and
            # backward), and the root for the rest (embedding, final norm, tied head).
            root = _LossModule(self.job)
            for block in self.model.blocks:
                fully_shard(block)
            fully_shard(root)
            return None, root
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.d.local_rank] if self.device.type == "cuda" else None
        root = _LossModule(self.job)
        _ddp_ignore_frozen(root)  # only the trainable parameters are broadcast and reduced
        return DistributedDataParallel(root, device_ids=ids, **_no_buffer_sync()), None

    def _start(self, resume: Path | None) -> int:
        """The step to continue from: 0, or the checkpoint's (everything restored)."""
        if resume is None:
            torch.manual_seed(rank_seed(self.cfg.seed, self.d.rank))
            return 0
        done, schedule = _restore(self.job, self.opt, resume, self.res, self.names, self.cfg.seed)
        self.saved_step = done
        base = schedule or Schedule(self.cfg.lr, self.cfg.min_lr, self.cfg.warmup, self.cfg.steps)
        self.schedule = base.extended(done, self.cfg.steps)
        if self.schedule != base:
            self.reporter.message(
                f"  LR schedule {self.schedule.describe()} (docs/reliability.md: resume)"
            )
        return done

    # ---------------------------------------------------------------- one step

    def _fetch(self, step: int) -> list[dict[str, torch.Tensor]]:
        """Step `step`'s micro-batches, prepared on the host (job.prepare) and, for CUDA,
        in pinned memory so the copies with non_blocking=True really are asynchronous."""
        cfg, job = self.cfg, self.job
        ks = [(step - 1) * cfg.grad_accum + m for m in range(cfg.grad_accum)]
        if job.live:
            # every process's micro-batches seen together (a collective)
            micro = [job.prepare(b) for b in job.whole_step(self._live_batches(ks))]
        else:
            micro = [job.prepare(job.micro_batch(k)) for k in ks]
        if self.device.type == "cuda":
            micro = [{k: v.pin_memory() for k, v in b.items()} for b in micro]
        return micro

    def _live_batches(self, ks: list[int]) -> list[dict[str, torch.Tensor]]:
        """Batches made from the model as it stands (job.live): in eval mode (no dropout),
        without gradients, under the run's autocast, each sampled with a generator of its own
        seeded by (seed, global micro-batch index), so they depend on nothing but those and
        the weights. The global index of process `rank`'s micro-batch k is k * world + rank,
        the index a recipe's batch stream gives it too (GRPO's prompts_of): one process
        accumulating two micro-batches makes the batches that two processes make with one
        each, so the process count never changes what is sampled."""
        model, was = self.model, self.model.training
        model.eval()
        try:
            out = []
            for k in ks:
                # the one sampler's generator (models/sample.py: a cpu one on mps)
                gen = seeded(self.device, live_seed(self.cfg.seed, k * self.d.world + self.d.rank))
                with torch.no_grad(), autocast(self.device, self.precision), _eager():
                    out.append(self.job.micro_batch(k, Live(model, gen, self.device)))
            return out
        finally:
            model.train(was)

    def _take_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """The batches prefetched for `step` by the step before, or fetched now. Batches
        are a pure function of the step, so prefetching never changes them."""
        nxt, self._next = self._next, None
        if nxt is not None and nxt[0] == step:
            return nxt[1]
        return self._fetch(step)

    def step(self, step: int) -> tuple[float, int, float, float]:
        """Optimizer step `step` (1-based): the loss over its whole global batch, the
        items (tokens, images) it fed, its LR and its gradient norm (before clipping)."""
        cfg, job, d = self.cfg, self.job, self.d
        lr = self.schedule.at(step - 1)
        for g in self.opt.param_groups:
            g["lr"] = lr * g["lr_scale"]
        self.model.train()
        # Fetch the whole accumulation step first: its count (supervised tokens, pairs)
        # normalises every micro-batch, so accumulation never changes the objective.
        micro = self._take_batches(step)
        n_sup = sum(job.count(b) for b in micro)  # on the host, before any copy
        if d.enabled:
            # Normalise by the units (job.count) of the whole global step: summed on the
            # device and used there (no host read); checked with the loss at the end.
            n_global = dist.all_sum(torch.tensor(float(n_sup), device=self.device))
            scale = d.world / n_global.clamp_min(1.0)
        elif n_sup == 0:
            raise RunFailed(
                f"step {step}: the batch has no {job.units}; check the data's loss mask",
                step=step,
            )
        else:
            n_global, scale = None, 1.0 / n_sup
        loss_sum = torch.zeros((), device=self.device)
        n_items = 0
        forward = self.ddp or self.fsdp
        for i, b in enumerate(micro):
            n_items += job.n_items(b) * d.world
            b = {k: v.to(self.device, non_blocking=True) for k, v in b.items()}
            # Gradients are all-reduced once per step, on the last micro-batch.
            last = i == len(micro) - 1
            sync = (
                self.ddp.no_sync()
                if self.ddp is not None and not last
                else contextlib.nullcontext()
            )
            if self.fsdp is not None:
                self.fsdp.set_requires_gradient_sync(last)
            with sync:
                with autocast(self.device, self.precision):
                    ls, _ = forward(b) if forward is not None else job.loss(self.model, b)
                # DDP averages gradients over ranks; the objective is the sum over the
                # global batch divided by its units (job.count), hence * world.
                (ls * scale).backward()
            loss_sum += ls.detach().float()
        for n in job.frozen(step):  # after backward and the all-reduce: AdamW skips None
            self.by_name[n].grad = None
        # The gradient's norm, logged every step (before clipping, as the other trainers
        # log it): the first sign of a run going wrong, and what --clip acts on.
        grads = [p for _, p in self.named]
        if cfg.clip > 0:
            gnorm = torch.nn.utils.clip_grad_norm_(grads, cfg.clip)
        else:
            gnorm = torch.nn.utils.get_total_norm([p.grad for p in grads if p.grad is not None])
        if self.fsdp is not None:  # FSDP2's norm is a DTensor over the shards
            gnorm = gnorm.full_tensor()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if step < cfg.steps and not job.live:
            # The next step's batches are made (and pinned) now, on the host, while the
            # device still works through this step's queue: the read below waits for it.
            # (A live job's are made from the weights this step leaves: when its step starts.)
            self._next = (step + 1, self._fetch(step + 1))
        if d.enabled:
            total, n_sup, grad_norm = torch.stack(
                [dist.all_sum(loss_sum), n_global, gnorm.float().to(self.device)]
            ).tolist()  # one host sync per step
            if n_sup == 0:
                raise RunFailed(
                    f"step {step}: the batch has no {job.units}; check the data's loss mask",
                    step=step,
                )
            loss = total / n_sup
        else:
            total, grad_norm = torch.stack([loss_sum, gnorm.float().to(loss_sum.device)]).tolist()
            loss = total / n_sup  # one host sync per step
        if not math.isfinite(loss):
            raise RunFailed(
                f"loss became {loss} at step {step}; lower --lr or check the data "
                f"(the last good checkpoint, if any, stays under {self.ckpt_root})",
                step=step,
            )
        return loss, n_items, lr, grad_norm

    # ---------------------------------------------------------------- eval, save

    def evaluate(self, step: int, timer: _Throughput) -> None:
        if not self.evals:
            return
        t0 = time.perf_counter()
        with _eager() if self.job.live else contextlib.nullcontext():
            metrics = evaluate(
                self.job,
                self.evals,
                self.device,
                self.fsdp,
                precision=self.precision,
                progress=lambda i, n: self.reporter.eval_progress(
                    step, i, n, time.perf_counter() - t0
                ),
            )
        timer.eval_time += time.perf_counter() - t0
        if "val_loss" in metrics:
            self.res.val_losses.append({"step": step, "loss": metrics["val_loss"]})
        extra = {k: v for k, v in metrics.items() if k != "val_loss"}
        if extra:
            self.res.metrics.append({"step": step, **extra})
        self.events.emit("eval", step=step, **metrics)
        self.reporter.eval(step, metrics)

    def save(self, step: int) -> None:
        """Checkpoint `step`: a collective (every rank takes part), rank 0 writes."""
        if self.ckpt_root is None or step == self.saved_step:
            return
        self.saved_step = step
        state = {
            "losses": self.res.losses,
            "val_losses": self.res.val_losses,
            "metrics": self.res.metrics,
            "data_position": step * self.cfg.grad_accum,
            "config": self.job.config,
            "world_size": self.d.world,
            "schedule": self.schedule.to_dict(),
        }
        rank_rng = dist.gather_rng_states(self.device)  # every rank's generators
        model_state = {n: _full(t) for n, t in self.job.trainable_state().items()}
        # what the job keeps between steps (Job.state), every rank's own
        for r, kept in enumerate(dist.all_gather(self.job.state())):
            model_state.update({f"{JOB_STATE}r{r}.{k}": v for k, v in kept.items()})
        opt_state = ckpt.optimizer_tensors(self.opt, self.names, _full)
        if not self.d.is_main:
            dist.barrier()
            return
        try:
            path = ckpt.save_checkpoint(
                self.ckpt_root, step, model_state, opt_state, state, rank_rng
            )
        except OSError as e:
            # The temp directory is gone (atomic_dir removed it): no partial checkpoint
            # can pass for a valid one, and the previous checkpoint is untouched.
            raise RunFailed(
                f"cannot write the step-{step} checkpoint under {self.ckpt_root}: "
                f"{e.strerror or e}; free disk space or train with another --out",
                step=step,
            )
        ckpt.prune_checkpoints(self.ckpt_root, self.cfg.keep_last)
        self.events.emit("checkpoint", step=step, path=str(path.relative_to(self.run_dir)))
        dist.barrier()

    # ---------------------------------------------------------------- the run

    def run(self, resume: Path | None = None) -> TrainResult:
        cfg = self.cfg
        start = self._start(resume)
        self.evals = self.job.eval_batches()
        t_start = time.perf_counter()
        timer = _Throughput(cfg.steps - start)
        self.reporter.start(cfg.steps, start)
        with _Signals(announce=self.d.is_main) as sig:
            if start == 0:
                self.evaluate(0, timer)
            for step in range(start + 1, cfg.steps + 1):
                sig.step = step
                n = check_threads()  # fewer threads while other programs take cores
                if n is not None:
                    self.events.emit("threads", step=step, threads=n)
                timer.begin_step()
                loss, n_items, lr, grad_norm = self.step(step)
                ips = timer.end_step(n_items)
                if ips:
                    self.res.items_per_s = ips
                extra = self.job.step_figures()
                self.res.losses.append(
                    {"step": step, "loss": loss, "grad_norm": round(grad_norm, 6), **extra}
                )
                peak = self.res.peak_mem_bytes = peak_memory(self.device)
                self.events.emit(
                    "step",
                    step=step,
                    loss=loss,
                    lr=lr,
                    grad_norm=round(grad_norm, 6),
                    items=n_items,
                    peak_mem_bytes=peak,
                    **({f"{self.job.items_name}_per_s": round(ips, 2)} if ips else {}),
                    **extra,
                )
                self.reporter.step(step, loss, ips, peak, **({"extra": extra} if extra else {}))
                if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps:
                    self.evaluate(step, timer)
                if cfg.save_every and step % cfg.save_every == 0:
                    self.save(step)
                if dist.any_flag(
                    sig.signum is not None, self.device
                ):  # a signal on one rank stops all
                    self._interrupted(step, sig.signum or signal.SIGTERM)
            self.evaluate(cfg.steps, timer)
            # The last step is always checkpointed: a finished run can be extended with
            # `--resume RUN --steps N`, and a resumed one keeps its newest state.
            self.save(cfg.steps)
        if self.fsdp is not None:
            # the root keeps its gathered weights after backward: shard them back first
            self.fsdp.reshard()
            materialize(self.model)  # whole tensors on every rank, so rank 0 saves a plain model
        self.reporter.close()
        self.res.wall_s = time.perf_counter() - t_start
        self.res.final_step = cfg.steps
        return self.res

    def _interrupted(self, step: int, signum: int) -> None:
        self.save(step)
        name = signal.Signals(signum).name
        self.events.emit("interrupted", step=step, signal=name)
        self.reporter.close()
        where = self.ckpt_root / ckpt.STEP_FMT.format(step) if self.ckpt_root is not None else None
        raise Interrupted(
            f"interrupted by {name} after step {step}; checkpoint saved in {where}; "
            f"resume with `toy train --resume {self.run_dir}`",
            signum,
        )


def train(
    job: Job,
    cfg: RunConfig,
    run_dir: Path | None,
    device: torch.device,
    events: EventLog,
    reporter: Reporter | None = None,
    resume: Path | None = None,
    precision: Precision | None = None,
) -> TrainResult:
    """Run the loop: `resume` is a checkpoint directory to continue from; `precision`
    by default what cfg.precision resolves to on `device`."""
    trainer = Trainer(job, cfg, run_dir, device, events, reporter or Reporter(), precision)
    return trainer.run(resume)


def _is_dtensor(t) -> bool:
    """Whether t is an FSDP shard (a DTensor). torch.distributed.tensor is imported only
    by --fsdp (0.5 s of every process's start on a 2-core Zen 4 where the loop imported
    it): a module never imported made no DTensor."""
    m = sys.modules.get("torch.distributed.tensor")
    return m is not None and isinstance(t, m.DTensor)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind an FSDP shard (a collective); plain tensors as they are."""
    return t.full_tensor() if _is_dtensor(t) else t


def _shard_like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A whole tensor laid out like parameter p (sharded when p is a DTensor)."""
    if _is_dtensor(p):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(t.to(p.device), p.device_mesh, p.placements)
    return t.to(p.device)


def materialize(model: torch.nn.Module) -> None:
    """After FSDP training: replace every sharded parameter by the whole tensor, so the
    model saves (and runs) as a plain module. A collective: every rank calls it."""
    from torch.distributed.fsdp import FSDPModule

    whole = {}
    for mod in model.modules():
        for _name, p in list(mod.named_parameters(recurse=False)):
            if _is_dtensor(p) and id(p) not in whole:
                whole[id(p)] = torch.nn.Parameter(
                    p.full_tensor().detach().clone(), requires_grad=p.requires_grad
                )
    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            # Drop FSDP's class and hooks: they would swap the sharded parameters back in.
            mod.__class__ = next(
                c
                for c in mod.__class__.__mro__[1:]
                if issubclass(c, torch.nn.Module) and not issubclass(c, FSDPModule)
            )
            for hooks in (
                mod._forward_pre_hooks,
                mod._forward_hooks,
                mod._state_dict_pre_hooks,
                mod._state_dict_hooks,
                mod._load_state_dict_pre_hooks,
                mod._backward_pre_hooks,
            ):
                hooks.clear()
        for name, p in list(mod.named_parameters(recurse=False)):
            if id(p) in whole:
                setattr(mod, name, whole[id(p)])
    # Whole tensors were made per parameter object, so a tied head now holds its own
    # copy: tie it again, the model's own way (llama's embed_tokens, GPT-2's wte).
    model.tie_weights()


@torch.no_grad()
def evaluate(
    job: Job,
    batches: list[dict[str, torch.Tensor]],
    device: torch.device,
    forward: torch.nn.Module | None = None,
    progress=None,
    precision: Precision | None = None,
) -> dict[str, float]:
    """Validation loss (and the job's metrics) over `batches`; `progress(i, n)` after each."""
    model = job.model
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    for i, b in enumerate(batches if job.eval_loss else []):
        if progress is not None and i:
            progress(i, len(batches))
        count += job.count(b)  # on the host
        b = {k: v.to(device, non_blocking=True) for k, v in job.prepare(b).items()}
        with autocast(device, precision):
            ls, _ = forward(b) if forward is not None else job.loss(model, b)
        total += ls.detach().double()
    out = {"val_loss": float(total) / max(1, count)} if job.eval_loss else {}
    out.update(job.eval_figures(model, batches))
    model.train(was_training)
    return out


def _restore(
    job: Job,
    opt: torch.optim.Optimizer,
    ckpt_dir: Path,
    res: TrainResult,
    names: dict[int, str],
    seed: int,
) -> tuple[int, Schedule | None]:
    """Load a checkpoint into the job and optimizer; (its step, its LR schedule)."""
    model_sd, opt_t, rng_t, state = ckpt.load_checkpoint(ckpt_dir)
    params = dict(job.trainable())
    missing = set(params) - set(model_sd)
    if missing:
        raise RunFailed(
            f"{ckpt_dir}: checkpoint lacks {sorted(missing)[0]}; it belongs to another run"
        )
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(_shard_like(model_sd[n].to(p.dtype), p))
    ckpt.load_optimizer(opt, opt_t, state["optimizer"], names, _shard_like)
    step = int(state["step"])
    rank = dist.info().rank
    if not ckpt.set_rng_state(rng_t, state["rng"], rank=rank):
        # A rank the run did not have (resumed on more processes): a stream of its own,
        # still a pure function of (seed, rank, step).
        torch.manual_seed(rank_seed(seed, rank) ^ step)
    job.load_state(_job_states(model_sd))
    res.losses = state.get("losses", [])
    res.val_losses = state.get("val_losses", [])
    res.metrics = state.get("metrics", [])
    sched = state.get("schedule")
    return step, Schedule.from_dict(sched) if sched else None


def _job_states(model_sd: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Every saved process's job state in a checkpoint (job_state.r<rank>.*), in rank
    order. Checkpoints written before each rank kept its own hold one, rank 0's,
    unprefixed."""
    by_rank: dict[int, dict[str, torch.Tensor]] = {}
    legacy = {}
    for k, v in model_sd.items():
        if not k.startswith(JOB_STATE):
            continue
        m = re.match(r"r(\d+)\.(.+)", k[len(JOB_STATE) :])
        if m:
            by_rank.setdefault(int(m[1]), {})[m[2]] = v
        else:
            legacy[k[len(JOB_STATE) :]] = v
    if not by_rank:
        return [legacy]
    return [by_rank.get(r, {}) for r in range(max(by_rank) + 1)]
