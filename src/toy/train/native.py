"""AdamW over bfloat16 moments in C (adamw_bf16.c beside this file, HalfStateAdamW's update),
built for this machine by models/native.py's builder (the same cache, checks and one note
where no compiler works); parallel and threads are that module's."""

from __future__ import annotations

import ctypes
from pathlib import Path

from toy.models.native import kernels, parallel, threads

__all__ = ["adamw_bf16", "parallel", "threads"]

SOURCE = Path(__file__).with_name("adamw_bf16.c")


def adamw_bf16():
    """toy_adamw_bf16 from adamw_bf16.c as a ctypes function, or None (models/native.py)."""
    P, I64, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    argtypes = [I64, P, P, P, P, P, I64, I64, P, P, P, F, F, F, F]
    fns = kernels(SOURCE, {"toy_adamw_bf16": (argtypes, None)})
    return fns["toy_adamw_bf16"] if fns else None
