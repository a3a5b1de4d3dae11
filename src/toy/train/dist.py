"""torch.distributed, as the loop uses it: process group from torchrun's environment,
rank-0-only side effects, collectives with a timeout, and the global batch.

One process (no WORLD_SIZE in the environment) is the plain case: every helper here
is then a no-op, so single-process runs pay nothing.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from toy.errors import UsageError
from toy.formats.checkpoint import local_rng_state


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    backend: str = "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


_INFO = DistInfo()


def info() -> DistInfo:
    return _INFO


def init(device_type: str) -> DistInfo:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR...).
    NCCL on CUDA, gloo on CPU. A rank that fails makes the others fail at their next
    collective within TOY_DIST_TIMEOUT seconds (default 300) instead of hanging."""
    global _INFO
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        _INFO = DistInfo()
        return _INFO
    if device_type == "mps":
        raise UsageError("--device metal: distributed training needs cpu (gloo) or cuda (nccl)")
    backend = "nccl" if device_type == "cuda" else "gloo"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=float(os.environ.get("TOY_DIST_TIMEOUT", "300")))
        dist.init_process_group(backend=backend, timeout=timeout)
    _INFO = DistInfo(
        rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local, backend=backend
    )
    return _INFO


def shutdown() -> None:
    global _INFO
    if dist.is_initialized():
        dist.destroy_process_group()
    _INFO = DistInfo()


def all_sum(x: torch.Tensor) -> torch.Tensor:
    if _INFO.enabled:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def any_flag(flag: bool, device: torch.device) -> bool:
    """True on every rank if it is true on any (a signal seen by one rank stops all)."""
    if not _INFO.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def broadcast_object(obj):
    """Rank 0's value on every rank (run ids, run directories)."""
    if not _INFO.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_rng_states(device: torch.device | None = None) -> list[dict[str, torch.Tensor]]:
    """Every rank's generators (CPU, and its own CUDA device's), in rank order, on
    every rank: a checkpoint restores each rank's own stream."""
    mine = local_rng_state(device)
    if not _INFO.enabled:
        return [mine]
    out: list = [None] * _INFO.world
    dist.all_gather_object(out, {k: v.cpu() for k, v in mine.items()})
    return out


def all_gather(obj) -> list:
    """Every rank's `obj` (picklable: CPU tensors, lists, dicts), in rank order, on every
    rank: [obj] with one process."""
    if not _INFO.enabled:
        return [obj]
    out: list = [None] * _INFO.world
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if _INFO.enabled:
        dist.barrier()


def shard(rows: int, rank: int | None = None, world: int | None = None) -> slice:
    """This rank's slice of a global batch of `rows` rows (rows must divide evenly)."""
    r = _INFO.rank if rank is None else rank
    w = _INFO.world if world is None else world
    per = rows // w
    return slice(r * per, (r + 1) * per)


def launch(nproc: int, argv: list[str]) -> int:
    """`toy train --nproc N ...`: start N processes of `python -m toy train ...` (the same
    arguments less --nproc) on this machine, each told its place as torchrun tells it
    (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE; MASTER_ADDR/MASTER_PORT: a free
    loopback port, where rank 0's store listens for `init`), with OMP_NUM_THREADS=1 where
    it is unset, as torchrun sets it (--threads N still sets torch's count in each process:
    device.Threads). No torchrun agent: no banner, no ChildFailedError traceback, no exit 1
    for every failure. The exit code is the first failing process's own: 2 for a user's
    mistake, 1 for a failed run, 128+N for signal N (rank 0's 2, 130 or 143 wins over a 1
    of a rank that failed first for having lost rank 0).

    When one process fails the others are stopped (SIGTERM a second later, SIGKILL
    `_GRACE_S` after that), unless it stopped on a signal (130, 143: the others stop with
    it, checkpoint and all). Each SIGINT or SIGTERM this launcher gets is passed on once to
    every process and the launcher waits on: a Ctrl-C lets them finish the step in flight
    and checkpoint, a second stops them at once, a third kills them. The processes have a
    process group of their own, so that a terminal's Ctrl-C reaches them once, through
    here, not twice (a second SIGINT would stop them without a checkpoint).

    Rank 0's output is the user's terminal, as it is. The others' stderr comes through here
    line by line, except their last words (from their `toy train: ...` line on, the same
    one-line error or interruption rank 0 prints itself): those are shown only where
    another rank failed first and rank 0 did not tell it."""
    import signal
    import subprocess
    import sys

    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    base = _worker_env(nproc)
    procs: list[subprocess.Popen] = []
    signals: list[int] = []  # the signals this launcher got, forwarded as they came

    def forward(signum, frame):
        signals.append(signum)
        kill = signals.count(signal.SIGINT) >= 3
        for p in procs:
            _send(p, signal.SIGKILL if kill else signum)

    old = {}
    for s in (signal.SIGINT, signal.SIGTERM):
        try:
            old[s] = signal.signal(s, forward)
        except ValueError:  # not the main thread
            pass
    posix = {"process_group": 0, "preexec_fn": _parent_death_signal()} if os.name == "posix" else {}
    relays: list[_Relay] = []
    first: tuple[int, int] | None = None  # (rank, exit code) of the first process to fail
    try:
        for r in range(nproc):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "toy", *rest],
                    env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                    stderr=subprocess.PIPE if r else None,
                    **posix,
                )
            )
        relays = [_Relay(p.stderr) for p in procs[1:]]  # threads: after the forks
        first = _wait(procs, signals)
    finally:
        for p in procs:  # an error of the launcher's own: leave no process behind
            if p.poll() is None:
                _send(p, signal.SIGKILL)
                p.wait()
        for s, h in old.items():
            signal.signal(s, h)
    for relay in relays:
        relay.join()
    if first is None:
        return 0
    rank, code = first
    # Rank 0 told a user's mistake (2) or an interruption (130, 143) itself, the same words
    # as the others'; after a failed run (1) the first failing rank's words are the cause.
    said = procs[0].returncode >= 2
    if said and code == 1:  # a rank that lost rank 0 (a mistake rank 0 alone checks) fails
        rank, code = 0, procs[0].returncode  # first, with 1: rank 0's is the exit code
    if rank > 0 and not said:
        said = relays[rank - 1].say_last_words()
    if procs[rank].returncode < 0 and not said and not signals:
        name = signal.Signals(-procs[rank].returncode).name
        print(f"toy train: error: process {rank} of {nproc} was killed by {name}", file=sys.stderr)
    return code


def _worker_env(nproc: int) -> dict[str, str]:
    """The environment every worker shares: torchrun's variables for a standalone run of
    `nproc` processes on this machine (each adds its RANK and LOCAL_RANK)."""
    base = dict(os.environ)
    base.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for N > 1 processes
    base.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # torchrun's, for NCCL on cuda
    base.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # rank 0 hosts the store, not an agent
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        TOY_LAUNCHER="nproc",  # run.json's distributed.launcher: a resume starts as many
    )
    return base


def launcher(enabled: bool) -> str:
    """Who started this run's processes, as run.json records it: "nproc" (`toy train
    --nproc N`: a resume without --nproc starts N again, on this machine), "torchrun" (any
    other launcher: nodes toy cannot start; a resume runs where it is started), "none"."""
    if not enabled:
        return "none"
    return "nproc" if os.environ.get("TOY_LAUNCHER") == "nproc" else "torchrun"


def _wait(procs: list, signals: list[int]) -> tuple[int, int] | None:
    """Wait for every worker; (rank, exit code) of the first to fail, or None. Once one
    fails (not on a signal), the others get SIGTERM a second later, then SIGKILL _GRACE_S
    after that, unless the launcher itself is forwarding a user's signals."""
    import signal
    import time

    first = None
    stop_at = kill_at = None  # when to SIGTERM, then SIGKILL, the ones still running
    while True:
        codes = [p.poll() for p in procs]  # every one, each look (no short cut)
        for r, c in enumerate(codes):
            if c and first is None:
                first = (r, _exit_code(c))
                if first[1] not in _STOPPED:  # a stop on a signal: the others stop with it
                    stop_at = time.monotonic() + 1.0  # they may end on their own first
        if all(c is not None for c in codes):
            return first
        now = time.monotonic()
        if stop_at is not None and now >= stop_at and not signals:
            stop_at, kill_at = None, now + _GRACE_S
            for p in procs:
                _send(p, signal.SIGTERM)
        if kill_at is not None and now >= kill_at:
            kill_at = None
            for p in procs:
                _send(p, signal.SIGKILL)
        time.sleep(0.05)


_GRACE_S = 10.0  # seconds a stopped process has to end after SIGTERM, before SIGKILL
_STOPPED = (130, 143)  # exit codes of a process that stopped on SIGINT / SIGTERM (checkpointed)


def _free_port() -> int:
    """A TCP port free on the loopback now (the OS picks it)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parent_death_signal():
    """A preexec_fn for the started processes (Linux): SIGTERM when the launcher dies (a
    SIGKILL, a closed terminal's SIGHUP), so that none trains on, orphaned; a SIGTERM lets
    it checkpoint and stop, as a Ctrl-C would. None elsewhere. The call is looked up here,
    before the fork: the child runs one C call, no import."""
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG


def _send(p, signum: int) -> None:
    if p.poll() is None:
        try:
            p.send_signal(signum)
        except ProcessLookupError:
            pass


def _exit_code(returncode: int) -> int:
    """A process's exit code as a shell gives it: 128+N for one killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


class _Relay:
    """A rank's stderr (ranks above 0), copied to ours line by line as it comes, except
    its last words: from its first `toy ...:` line on (the CLI's one-line error, or its
    interruption), held until the launcher knows whether rank 0 said the same."""

    def __init__(self, stream):
        import threading

        self.stream, self.held = stream, []
        self.thread = threading.Thread(target=self._copy, daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        import sys

        for line in iter(self.stream.readline, b""):
            if self.held or line.startswith(b"toy "):
                self.held.append(line)
                continue
            _write(sys.stderr, line)

    def join(self) -> None:
        self.thread.join(timeout=5.0)  # a child of the rank's may hold the pipe open

    def say_last_words(self) -> bool:
        """Print the held lines; whether there were any."""
        import sys

        for line in self.held:
            _write(sys.stderr, line)
        return bool(self.held)


def _write(stream, line: bytes) -> None:
    try:
        stream.write(line.decode(errors="replace"))
        stream.flush()
    except (OSError, ValueError):  # a closed stderr: nothing more to say
        pass
