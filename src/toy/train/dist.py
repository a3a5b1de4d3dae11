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
    """`toy train --nproc N ...` = `python -m torch.distributed.run --standalone
    --nproc-per-node N -m toy train ...` (the same arguments less --nproc)."""
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
    return subprocess.call(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "-m",
            "toy",
            *rest,
        ]
    )
