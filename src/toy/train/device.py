"""Resolve --device, before any work is done."""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from dataclasses import dataclass

import torch

from toy import cores
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


PRECISIONS = ("auto", "float32", "bf16")


@dataclass(frozen=True)
class Precision:
    """What a run computes its matmuls in, and why (run.json records both)."""

    name: str  # "bf16" | "float32"
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.name == "bf16" else torch.float32


cpu_has_amx = cores.cpu_has_amx  # torch-free there (bench/generate.py's llama.cpp child)


AMX_LLAMACPP_NOTE = (
    "this CPU has AMX: llama.cpp built here can crash (SIGSEGV) on prompts of more than a few "
    "tokens while it repacks weights (llama.cpp #20824); run llama-cli/llama-server with "
    "--no-repack, or in llama-cpp-python set use_extra_bufts=False in the model params "
    "(README: 'llama.cpp on a CPU with AMX')"
)


def _mac_bf16() -> bool:
    """Apple M2 and later: the FEAT_BF16 instructions (sysctl says)."""
    if sys.platform != "darwin" or platform.machine() != "arm64":
        return False
    import subprocess

    try:
        out = subprocess.run(
            ["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True, timeout=5
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return out.strip() == "1"


def _isa_capped() -> str | None:
    """The environment setting that holds this process's kernels below bf16, or None.
    ATEN_CPU_CAPABILITY=avx2|default (torch's own kernels) or ONEDNN_MAX_CPU_ISA below
    AVX512_CORE_BF16 (oneDNN's matmuls): the units are there, but the code that uses them
    is not run, so bf16 would be as slow as on a CPU without them."""
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if aten in ("avx2", "default"):
        return f"ATEN_CPU_CAPABILITY={aten}"
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if onednn and onednn not in ("ALL", "DEFAULT"):
        if not any(w in onednn for w in ("BF16", "AMX", "AVX10", "FP16")):
            return f"ONEDNN_MAX_CPU_ISA={onednn}"
    return None


def cpu_bf16_units() -> str | None:
    """The CPU's bf16 units, or None: what torch's cpuinfo says (AMX tiles, avx512_bf16),
    then /proc/cpuinfo's flags ('amx_bf16', 'avx512_bf16'; 'bf16' on Arm), then macOS's
    sysctl (Apple M2+). Without them a bf16 matmul runs hundreds of times slower than
    float32 (pytorch #146508), so nothing here guesses: no flag, no bf16. Units that the
    environment holds the kernels below (_isa_capped: an AVX2 machine's code paths on
    this CPU) count as absent."""
    if _isa_capped():
        return None
    try:  # torch's own cpuinfo (private helpers: absent in some builds)
        if torch.cpu._is_amx_tile_supported():
            return "amx_bf16"
        if torch.cpu._is_avx512_bf16_supported():
            return "avx512_bf16"
    except (AttributeError, RuntimeError):
        pass
    flags = cores.cpuinfo_flags()
    for unit in ("amx_bf16", "avx512_bf16"):
        if unit in flags:
            return unit
    if platform.machine() in ("aarch64", "arm64") and "bf16" in flags:
        return "arm bf16"
    if _mac_bf16():
        return "arm bf16"
    return None


def cpu_kind() -> str:
    """The CPU's kind as bench rows and docs name it: AMX, AVX-512+bf16, AVX-512, AVX2,
    or torch's own word for anything else (NEON, SVE256, DEFAULT)."""
    units = cpu_bf16_units()
    if units == "amx_bf16":
        return "AMX"
    cap = torch.backends.cpu.get_cpu_capability()
    if cap.startswith("AVX512"):
        return "AVX-512+bf16" if units == "avx512_bf16" else "AVX-512"
    if cap == "AVX2":
        return "AVX2"
    return f"{cap}+bf16" if units else cap


def resolve_precision(name: str, device: torch.device, flag: str = "--precision") -> Precision:
    """auto: bf16 on CUDA and on a CPU with bf16 units, float32 elsewhere (metal too);
    bf16 asked for on a CPU without the units is a usage error that says why."""
    if name not in PRECISIONS:
        raise UsageError(f"{flag} {name!r} is unknown; valid: {', '.join(PRECISIONS)}")
    if name == "float32":
        return Precision("float32", f"{flag} float32")
    if device.type == "cuda":
        return Precision("bf16", "cuda computes bf16 on its tensor cores")
    if device.type == "cpu":
        unit = cpu_bf16_units()
        held = _isa_capped()
        if held:
            if name == "bf16":
                raise UsageError(
                    f"{flag} bf16: {held} holds this process's kernels below bf16, where bf16 "
                    f"runs hundreds of times slower than float32; unset {held.split('=')[0]} "
                    "or use --precision float32"
                )
            return Precision("float32", f"{held} holds the kernels below bf16")
        if unit:
            return Precision("bf16", f"this cpu ({cpu_kind()}) has bf16 units ({unit})")
        if name == "bf16":
            raise UsageError(
                f"{flag} bf16: this cpu ({cpu_kind()}) has no bf16 units (avx512_bf16, amx_bf16), "
                "where bf16 runs hundreds of times slower than float32; use --precision float32 "
                "(or auto)"
            )
        return Precision(
            "float32", f"this cpu ({cpu_kind()}) has no bf16 units (avx512_bf16, amx_bf16)"
        )
    if name == "bf16":
        raise UsageError(f"{flag} bf16: not supported on {device.type}; use --precision float32")
    return Precision("float32", f"{device.type}: float32")


def autocast(device: torch.device, precision: Precision | None = None):
    """bf16 autocast where the precision is bf16 (by default: on CUDA only); float32
    elsewhere. Norms, softmax and losses keep float32 inside (models/layers.py, losses.py)."""
    bf16 = precision.name == "bf16" if precision is not None else device.type == "cuda"
    if bf16 and device.type in ("cuda", "cpu"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Threads:
    """torch's CPU thread count for a run: the user's (--threads N, or OMP_NUM_THREADS) as
    given, else the cores other programs leave free, looked at again every few seconds
    (`check`, between optimizer steps) and changed when two looks in a row agree. A float32
    step's gradients are the same bytes on any count (models/ordered.py); a bf16 step's
    products, and a float32 sampler's few-row ones, follow the count (docs/architecture.md,
    "Threads and the same bytes"): `--threads N` holds it for a run that must repeat."""

    EVERY = 2.0  # seconds between looks while training

    def __init__(self, n: int | None):
        import time

        self.fixed = bool(n) or "OMP_NUM_THREADS" in os.environ
        self.most = n or torch.get_num_threads()
        self.clock, self.next, self.want = time.monotonic, 0.0, None
        if n:
            torch.set_num_threads(n)
        elif not self.fixed and cores.watching is not None:
            got = cores.watching.free(self.most)
            if got is not None and got != torch.get_num_threads():
                torch.set_num_threads(got)
        self.next = self.clock() + self.EVERY

    @property
    def n(self) -> int:
        return torch.get_num_threads()

    def check(self) -> int | None:
        """The new count when it changed, else None."""
        if self.fixed or cores.watching is None or self.clock() < self.next:
            return None
        self.next = self.clock() + self.EVERY
        got = cores.watching.free(self.most)
        if got is None or got == self.n:
            self.want = None
        elif got == self.want:  # two looks agree: change
            torch.set_num_threads(got)
            self.want = None
            return got
        else:
            self.want = got
        return None


_threads: Threads | None = None


def apply_threads(n: int | None) -> Threads:
    """`--threads N` (None: toy's default, Threads) applied from now on; run.json records the
    count it starts with as device.torch_threads."""
    global _threads
    _threads = Threads(n)
    return _threads


def check_threads() -> int | None:
    """Between optimizer steps: the thread count follows the free cores (Threads.check);
    the new count when it changed."""
    return _threads.check() if _threads is not None else None


def device_info(device: torch.device) -> dict:
    info = {"type": device.type, "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
    elif device.type == "cpu":
        info["cpu_kind"] = cpu_kind()
    return info


def peak_memory(device: torch.device) -> int:
    """Peak memory of the run so far, in bytes: the process's peak RSS on cpu and mps
    (what the machine had to give), torch's peak allocation on cuda."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux
