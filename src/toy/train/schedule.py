"""Learning-rate schedule and optimizer construction.

The schedule, and what a resume does to it, are defined here and nowhere else:

- A run of `total` steps: linear warmup over `warmup` steps, then a cosine from `lr` to
  `min_lr`, reached at the last step.
- Resumed with the same `--steps`: the same schedule, so the same losses as an
  unbroken run.
- Extended (`--resume RUN --steps N` with N above the run's total), resumed at step d:
  - if d is still inside the warmup, the warmup finishes as planned and the cosine runs
    to the new total: every step already taken had the LR it would have had in an
    unbroken N-step run, so the result equals one;
  - otherwise the new steps train: a warmup of a tenth of them (at least one step) from
    the LR of step d (the one restored with the optimizer) back to the run's peak `lr`,
    then a cosine to `min_lr` at step N, the shape of the run's own schedule. (Continuing
    from step d's LR instead left a finished run, whose last LR was min_lr, flat at
    min_lr: a tenth or less of its LR, for every new step.) Checkpoints written before
    the warmup existed (no `rewarm`) keep their curve: a cosine from step d's LR.
  The extension is stored in each checkpoint, so resuming an extension again continues
  the same curve, and extending it again starts a new segment from where it is.
"""

from __future__ import annotations

import ctypes
import inspect
import math
from dataclasses import asdict, dataclass

import torch

from toy.errors import UsageError
from toy.train import native
from toy.train.config import OPTIMIZER_STATES


@dataclass(frozen=True)
class Schedule:
    lr: float
    min_lr: float
    warmup: int
    total: int
    # An extension: from `start` (steps already taken) the LR goes from start_lr to
    # min_lr at `total`; the steps before it followed `previous`. None: the plain
    # warmup + cosine schedule.
    start: int | None = None
    start_lr: float | None = None
    previous: Schedule | None = None
    rewarm: int = 0  # an extension's warmup from start_lr back to lr (0: none, as before)

    def at(self, step: int) -> float:
        """The LR of step `step` (counting from 0: the step about to be taken)."""
        if self.start is not None:
            if step < self.start:
                return self.previous.at(step)
            i, n = step - self.start, self.total - self.start
            if i < self.rewarm:
                return self.start_lr + (self.lr - self.start_lr) * (i + 1) / self.rewarm
            if self.rewarm:
                return _cosine(i - self.rewarm, n - self.rewarm, self.lr, self.min_lr)
            return _cosine(i, n, self.start_lr, self.min_lr)
        if self.warmup > 0 and step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        return _cosine(step - self.warmup, self.total - self.warmup, self.lr, self.min_lr)

    def extended(self, done: int, total: int) -> Schedule:
        """This schedule resumed after `done` steps with a new, larger `total` (see the
        module docstring). The same total gives the same schedule."""
        if total == self.total:
            return self
        if self.start is None and done < self.warmup:
            return Schedule(self.lr, self.min_lr, self.warmup, total)
        last = self.at(done - 1) if done > 0 else self.lr
        rewarm = max(1, (total - done) // 10)
        return Schedule(
            self.lr,
            self.min_lr,
            self.warmup,
            total,
            start=done,
            start_lr=last,
            previous=self,
            rewarm=rewarm,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Schedule:
        prev = d.get("previous")
        return cls(**{**d, "previous": cls.from_dict(prev) if prev else None})

    def describe(self) -> str:
        if self.start is None:
            return (
                f"warmup {self.warmup}, cosine {self.lr:g} -> {self.min_lr:g} at step {self.total}"
            )
        if not self.rewarm:
            return (
                f"extended at step {self.start}: cosine from its LR {self.start_lr:.3g} to "
                f"--min-lr {self.min_lr:g} at step {self.total}"
            )
        return (
            f"extended at step {self.start}: warmup {self.rewarm} from its LR "
            f"{self.start_lr:.3g} back to the run's peak {self.lr:g}, then cosine to --min-lr "
            f"{self.min_lr:g} at step {self.total}"
        )


def _cosine(i: int, n: int, hi: float, lo: float) -> float:
    """Step i of a cosine from hi (i = 0) to lo (i = n - 1)."""
    progress = min(1.0, max(0, i) / max(1, n - 1))
    return lo + 0.5 * (hi - lo) * (1.0 + math.cos(math.pi * progress))


HALF_STATE_FROM = 16_000_000  # trained values from which auto keeps the moments in bf16


def resolve_optimizer_state(asked: str, precision: str, n_values: int, sharded: bool) -> str:
    """--optimizer-state: auto is bfloat16 under bf16 precision for a run that trains
    HALF_STATE_FROM values or more (a whole model: its AdamW state is then the largest
    thing a step keeps, twice the weights), float32 otherwise (an adapter's state is
    small; a float32 run keeps float32 throughout). FSDP's sharded state stays float32."""
    if asked not in OPTIMIZER_STATES:
        raise UsageError(
            f"--optimizer-state {asked!r} is unknown; valid: {', '.join(OPTIMIZER_STATES)}"
        )
    if asked == "bfloat16" and sharded:
        raise UsageError(
            "--optimizer-state bfloat16 does not take --fsdp (its sharded state stays "
            "float32); drop one of them"
        )
    if asked != "auto":
        return asked
    if precision == "bf16" and n_values >= HALF_STATE_FROM and not sharded:
        return "bfloat16"
    return "float32"


def make_adamw(
    named_params,
    lr: float,
    weight_decay: float,
    decay_rule,
    betas=(0.9, 0.95),
    eps=1e-8,
    lr_scale=None,
    fused: bool = False,
    state_dtype: torch.dtype = torch.float32,
) -> AdamW:
    """AdamW with a group for weights that decay (matrices, embeddings) and one for those
    that don't (biases, norm gains), as in GPT-2/nanoGPT; `lr_scale(name)` (default 1)
    splits further: each group's "lr_scale" multiplies the schedule's LR (a resume keeps
    it: checkpoint.load_optimizer checks the saved groups hold the same parameters).
    `fused`: torch's fused kernel, one pass a parameter (a bf16 run's: on a CPU 4 ms
    against foreach's 34 for the 14M-parameter gpt2 bench model, a Zen 4, torch 2.13);
    foreach otherwise, as float32 runs always had it: fused rounds its update a little
    differently, and a float32 run's losses stay the bits they were
    (docs/performance.md, "The non-matmul half"). `state_dtype` bfloat16: the moments
    are kept in bf16 (HalfStateAdamW), half their memory."""
    groups: dict[tuple[bool, float], list] = {}
    for name, p in named_params:
        key = (bool(decay_rule(name, p)), float(lr_scale(name)) if lr_scale is not None else 1.0)
        groups.setdefault(key, []).append(p)
    order = sorted(
        groups, key=lambda k: (not k[0], k[1])
    )  # decaying first, as before; a fixed order for resume
    param_groups = [
        {"params": groups[k], "weight_decay": weight_decay if k[0] else 0.0, "lr_scale": k[1]}
        for k in order
    ]
    if state_dtype == torch.bfloat16:
        return HalfStateAdamW(param_groups, lr=lr, betas=betas, eps=eps)
    return AdamW(
        param_groups,
        lr=lr,
        betas=betas,
        eps=eps,
        foreach=None if fused else True,
        fused=True if fused else None,
    )


# Adam's step without its wrappers (functools.wraps' __wrapped__, as inspect.unwrap follows)
_ADAM_STEP = inspect.unwrap(torch.optim.Adam.step)


class AdamW(torch.optim.AdamW):
    """torch's AdamW, the same arithmetic and state, whose methods run without the wrappers
    that keep torch.compile out of an optimizer (torch._disable_dynamo,
    _use_grad_for_differentiable): each imports torch._dynamo on its first call (1.0-1.2 s
    on a Zen 4, the first add_param_group of every training process, which waited for it
    before its first step). toy compiles models, never an optimizer, so the wrappers guard
    nothing here; the step runs under no_grad, as `_use_grad` sets it for a
    non-differentiable optimizer (its graph breaks do nothing outside a compile)."""

    add_param_group = inspect.unwrap(torch.optim.Optimizer.add_param_group)
    zero_grad = inspect.unwrap(torch.optim.Optimizer.zero_grad)
    state_dict = inspect.unwrap(torch.optim.Optimizer.state_dict)
    load_state_dict = inspect.unwrap(torch.optim.Optimizer.load_state_dict)

    def step(self, closure=None):  # noqa: D102 (torch's)
        with torch.no_grad():
            return _ADAM_STEP(self, closure)


class HalfStateAdamW(AdamW):
    """AdamW whose two moments are stored in bfloat16: 4 bytes a trained value instead
    of 8 (a whole SmolLM2-135M's state 0.54 GB instead of 1.08). The update itself is
    torch's fused AdamW's arithmetic in float32, in one pass over memory: toy's C kernel
    (adamw_bf16.c, built for this machine by train/native.py) reads each moment as bf16,
    updates it with the weight and the gradient (both float32) and writes it back rounded
    to nearest, one thread per core on its own range of values. The distill student's
    81M values on an AMX Xeon, 2 threads: 48-62 ms a step, against 60-68 ms for torch's
    fused AdamW on float32 moments (which moves 28 bytes a value to this kernel's 20).

    Where the kernel cannot run (no C compiler, a GPU, a weight or gradient that is not
    float32 and contiguous) the update is torch's fused AdamW on pieces of at most CHUNK
    values: each piece's moments widened to float32 into a kept buffer, updated, rounded
    back (108-172 ms for the same student: widening and rounding are memory traffic).
    Pieces start at multiples of CHUNK, a whole number of any vector width: the kernel's
    vector and tail paths round alike and the weights get the bits one call on the whole
    tensor gives. The C kernel does torch's arithmetic in torch's order, so on x86 (torch's
    Linux wheel) both paths give the same bits (tests/train/test_optimizer_state.py).

    Rounding the moments to bf16's 8-bit mantissa each step is safe at toy's betas (0.9,
    0.95): a step moves the second moment by 5% of the new square, more than bf16's
    0.4% resolution, so small updates are not rounded away (at beta2 0.999 they would
    be: the reason for stochastic rounding elsewhere). docs/performance.md
    ("Distillation") has the learning check against float32 state."""

    # The torch path's values a fused call takes at once (512 KiB of each float32 moment,
    # widened into one buffer kept between calls, so a piece stays in cache from widening
    # to rounding): 108-114 ms a step for the student above, against 120-128 ms in pieces
    # of 2M through torch's functional adamw with fresh copies.
    CHUNK = 1 << 17
    state_dtype = torch.bfloat16

    def __init__(self, params, lr: float, betas, eps: float, native: bool = True):
        super().__init__(params, lr=lr, betas=betas, eps=eps, foreach=False)
        self._wide: torch.Tensor | None = None  # the float32 moments of the pending pieces
        self.native = native  # False: always the torch path (tests compare the two)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 (torch's)
        if closure is not None:
            raise ValueError("HalfStateAdamW takes no closure")
        kernel = native.adamw_bf16() if self.native else None
        for group in self.param_groups:
            pending: list[tuple] = []  # (weights, gradient, m, v, step) pieces for one call
            size = 0  # their values
            whole: list[tuple] = []  # (weights, gradient, m, v, step) for the C kernel
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
                for key in ("exp_avg", "exp_avg_sq"):  # a float32 state (torch's own load)
                    if state[key].dtype != self.state_dtype:
                        state[key] = state[key].to(self.state_dtype)
                step = state["step"] + 1  # the update is the step-th (read, not written)
                state["step"] += 1
                tensors = (p, p.grad, state["exp_avg"], state["exp_avg_sq"])
                if kernel is not None and _kernel_takes(p, state):
                    whole.append((*tensors, step))
                    continue
                pieces = [tensors]
                if p.numel() > self.CHUNK and p.is_contiguous() and p.grad.is_contiguous():
                    flat = [t.view(-1) for t in tensors]
                    pieces = [
                        tuple(t[i : i + self.CHUNK] for t in flat)
                        for i in range(0, p.numel(), self.CHUNK)
                    ]
                for piece in pieces:
                    pending.append((*piece, step))
                    size += piece[0].numel()
                    if size >= self.CHUNK:
                        self._update(group, pending)
                        size = 0
            self._update(group, pending)
            if whole:
                _kernel_update(kernel, group, whole)

    def _update(self, group: dict, pending: list[tuple]) -> None:
        """One fused call on the pending pieces, their moments widened into float32 and
        rounded back to bf16 after (torch's fused AdamW kernel, the one AdamW(fused=True)
        runs, given each piece's step count)."""
        if not pending:
            return
        ps, gs, ms, vs, steps = (list(x) for x in zip(*pending))
        n = sum(m.numel() for m in ms)
        wide = self._wide
        if wide is None or wide.numel() < 2 * n or wide.device != ps[0].device:
            wide = self._wide = torch.empty(2 * max(n, self.CHUNK), device=ps[0].device)
        m32, v32, at = [], [], 0
        for m, v in zip(ms, vs):
            k = m.numel()
            m32.append(wide[at : at + k].view(m.shape).copy_(m))
            v32.append(wide[at + k : at + 2 * k].view(v.shape).copy_(v))
            at += 2 * k
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(
            ps,
            gs,
            m32,
            v32,
            [],
            steps,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            amsgrad=False,
            maximize=False,
        )
        for m, a in zip(ms, m32):
            m.copy_(a)
        for v, a in zip(vs, v32):
            v.copy_(a)
        pending.clear()


def _kernel_takes(p: torch.Tensor, state: dict) -> bool:
    """Whether adamw_bf16.c can update p: float32 weight and gradient, bf16 moments, all
    contiguous on the CPU."""
    g = p.grad
    return (
        p.device.type == "cpu"
        and p.dtype == torch.float32
        and g.dtype == torch.float32
        and not g.is_sparse
        and p.is_contiguous()
        and g.is_contiguous()
        and state["exp_avg"].is_contiguous()
        and state["exp_avg_sq"].is_contiguous()
    )


def _kernel_update(kernel, group: dict, whole: list[tuple]) -> None:
    """One AdamW step of a group's tensors in adamw_bf16.c: the tensors laid end to end,
    cut into one range of values a thread. Each tensor's scalars from its own step count,
    computed in double as torch's kernel does and handed over as float32."""
    k = len(whole)
    ptrs = [(ctypes.c_void_p * k)(*[w[i].data_ptr() for w in whole]) for i in range(4)]
    lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    steps = [float(w[4]) for w in whole]
    decay = (ctypes.c_float * k)(*[1.0 - lr * wd] * k)
    step_size = (ctypes.c_float * k)(*[lr / (1.0 - beta1**t) for t in steps])
    bc2_sqrt = (ctypes.c_float * k)(*[math.sqrt(1.0 - beta2**t) for t in steps])
    sizes = [w[0].numel() for w in whole]
    n = (ctypes.c_int64 * k)(*sizes)
    total = sum(sizes)
    parts = native.threads() if total >= 1 << 16 else 1  # a thread's start costs ~50 us

    def work(i: int) -> None:
        lo, hi = total * i // parts, total * (i + 1) // parts
        kernel(
            k, *ptrs, n, lo, hi, decay, step_size, bc2_sqrt, 1.0 - beta1, beta2, 1.0 - beta2, eps
        )

    native.parallel(parts, work)
