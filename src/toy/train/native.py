"""AdamW over bfloat16 moments in C (adamw_bf16.c beside this file, HalfStateAdamW's update),
built for this machine by models/native.py's builder (the same cache, checks and one note
where no compiler works), and the threads its update is split between."""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from toy.models.native import kernels

SOURCE = Path(__file__).with_name("adamw_bf16.c")


def adamw_bf16():
    """toy_adamw_bf16 from adamw_bf16.c as a ctypes function, or None (models/native.py)."""
    P, I64, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    argtypes = [I64, P, P, P, P, P, I64, I64, P, P, P, F, F, F, F]
    fns = kernels(SOURCE, {"toy_adamw_bf16": (argtypes, None)})
    return fns["toy_adamw_bf16"] if fns else None


_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, threads, pool)


def parallel(parts: int, work) -> None:
    """work(i) for i in range(parts), part 0 on this thread and the others on threads kept
    between calls (a ctypes call lets go of Python's lock, so the parts run at once). A
    forked child (a `--nproc` process) makes its own pool: threads do not cross fork."""
    global _pool
    if parts > 1 and (_pool is None or _pool[0] != os.getpid() or _pool[1] < parts - 1):
        _pool = (os.getpid(), parts - 1, ThreadPoolExecutor(parts - 1, "toy-native"))
    futures = [_pool[2].submit(work, i) for i in range(1, parts)] if parts > 1 else []
    work(0)
    for f in futures:
        f.result()


def threads() -> int:
    """How many parts a kernel's values are split into: torch's thread count (toy sets it
    to the free cores, train/device.py)."""
    return max(1, torch.get_num_threads())
