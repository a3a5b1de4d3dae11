"""Resolve --device, before any work is done."""

from __future__ import annotations

import contextlib
import sys

import torch

from toy.errors import UsageError

DEVICES = ("cpu", "cuda", "metal")


def resolve_device(name: str) -> torch.device:
    if name not in DEVICES:
        raise UsageError(f"--device {name!r} is unknown; valid: {', '.join(DEVICES)}")
    if name == "metal":
        if sys.platform != "darwin":
            raise UsageError("--device metal: metal is only available on macOS; use --device cpu")
        if not torch.backends.mps.is_available():
            raise UsageError(
                "--device metal: this PyTorch build has no MPS support; use --device cpu"
            )
        return torch.device("mps")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available here; use --device cpu")
        # The float32 matmuls left under bf16 autocast (the head's weight gradient, the
        # optimizer's) run on tensor cores as TF32 instead of at a fraction of their speed.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return torch.device("cuda")
    return torch.device("cpu")


def autocast(device: torch.device):
    """bf16 autocast on CUDA; float32 elsewhere (CPUs without bf16 units run bf16 matmul
    hundreds of times slower, and MPS bf16 support varies)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def device_info(device: torch.device) -> dict:
    info = {"type": device.type, "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
    return info


def peak_memory(device: torch.device) -> int:
    """Peak memory of the run so far, in bytes: the process's peak RSS on cpu and mps
    (what the machine had to give), torch's peak allocation on cuda."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux
