"""C kernels compiled once for the machine toy runs on, where torch has no fast kernel for
the job: AdamW over bfloat16 moments (train/adamw_bf16.c, HalfStateAdamW's update, loaded by
train/native.py), the tanh GELU on bfloat16 values (models/gelu_bf16.c, layers.gelu_tanh), a
frozen base's GGUF blocks to weights (models/dequant.c, quant.dequantize) and
a llama reply's token through its blocks on packed codes (models/decode_step.c,
models/decode_native.py).

The system's C compiler ($CC, else `cc`) builds a file with -O3 -march=native into
toy's cache folder (native/, keyed by the source, the flags and this CPU's model and
feature flags: a cache folder shared between machines never runs another CPU's code), in
about 0.3 s the first time; later processes load the built library once its sha256 (kept
beside it) matches. Written to a temporary name and renamed, so two processes building at
once (`--nproc 2`) never load half a file.
Where no compiler works (or TOY_NATIVE=0) the caller gets None and keeps its torch path:
one note on stderr says so, once a process."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# -fno-math-errno lets sqrtf vectorize; -ffp-contract=off keeps every product rounded on its
# own, so the vector loop and its tail give the same bits (see the source's head).
FLAGS = ("-O3", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC")
ARCH = ("-march=native",)  # dropped when the compiler refuses it (then still vectorized, narrower)


def _arch() -> tuple[str, ...]:
    """ARCH, held below AVX-512 where torch's own kernels are (ATEN_CPU_CAPABILITY=avx2, as
    `bench/run.py --isa avx2` sets it): an AVX2 machine's code paths on an AVX-512 CPU."""
    capped = os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2"
    return ARCH + ("-mno-avx512f",) if ARCH and capped else ARCH


def advise(start: int, size: int, advice: int) -> None:
    """madvise(2) over the whole pages inside [start, start + size) (a tensor's bytes: its
    first and last pages may hold a neighbour's); best effort."""
    import mmap

    page = mmap.PAGESIZE
    a, b = -(-start // page) * page, (start + size) // page * page
    if b > a:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), ctypes.c_int(advice))


_loaded: dict[str, object] = {}  # "adamw_bf16" -> its functions, or None where none builds
_noted = False


def cache_dir() -> Path:
    """toy's cache folder, as runs.cache_dir finds it ($TOY_CACHE, else
    $XDG_CACHE_HOME/toy, else ~/.cache/toy): models/ imports nothing of toy's lower layers,
    so it reads the same variables here (tests/models/test_gelu.py holds the two equal)."""
    base = os.environ.get("TOY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "toy"
    )
    return Path(base)


def _machine() -> str:
    """The CPU as the built code depends on it: its model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    keep = [
        line
        for line in text.splitlines()
        if line.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")
    ]
    head = "\n".join(dict.fromkeys(keep))  # each distinct line once (every core repeats them)
    return f"{platform.system()} {platform.machine()} {platform.processor()}\n{head}"


def _note(why: str) -> None:
    global _noted
    if not _noted:
        _noted = True
        print(
            f"toy: note: {why}; toy's C kernels are replaced by torch's (AdamW's bf16 "
            "moments about 2x slower an optimizer step, a bf16 GELU about 2x slower, a "
            "llama reply's tokens on a quantized base about 1.8x slower). "
            "Install a C compiler (gcc or clang), or set CC, to build them.",
            file=sys.stderr,
        )


def _intact(lib: Path) -> bool:
    """Whether a built library is the file toy wrote: its sha256 beside it (lib.sha256,
    written after the library). Anything else at that name (damaged, truncated, another
    build's) is built again over it: a library is loaded into the process, never trusted
    for its name alone."""
    try:
        want = lib.with_suffix(".sha256").read_text().strip()
        return hashlib.sha256(lib.read_bytes()).hexdigest() == want
    except OSError:
        return False


def _headers(source: Path) -> list[bytes]:
    """The bytes of the local headers (#include "...") a source takes, in order: part of a
    built library's key, so that a changed header (bf16.h) builds its users again."""
    out = []
    for inc in re.findall(rb'^\s*#\s*include\s+"([^"]+)"', source.read_bytes(), re.M):
        try:
            out.append((source.parent / inc.decode()).read_bytes())
        except (OSError, UnicodeDecodeError):
            out.append(inc)  # missing: the compiler says so when it builds
    return out


def _build(source: Path, name: str, extra: tuple[str, ...] = ()) -> Path | None:
    """The built library for `source` on this machine (built now if it is not): with the
    `extra` flags and -march=native, else without each in turn (a compiler that refuses
    -fopenmp, say, still builds the one-thread loop)."""
    cc = os.environ.get("CC") or "cc"
    text = source.read_bytes() + b"".join(_headers(source))
    base = _arch()
    tries = (extra + base, base, extra, ()) if extra else (base, ())
    for arch in dict.fromkeys(tries):
        key = hashlib.sha256(
            b"\0".join([text, cc.encode(), " ".join(FLAGS + arch).encode(), _machine().encode()])
        ).hexdigest()[:16]
        lib = cache_dir() / "native" / f"{name}-{key}.so"
        if _intact(lib):
            return lib
        try:
            lib.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
            os.close(fd)
        except OSError as e:
            _note(f"cannot write toy's cache folder {lib.parent} ({e.strerror or e})")
            return None
        try:
            done = subprocess.run(
                [cc, *FLAGS, *arch, "-o", tmp, str(source)],
                capture_output=True,
                timeout=120,
            )
            if done.returncode == 0:
                digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
                side = lib.with_suffix(".sha256")
                # the library first, then its digest: a digest names only a whole file
                os.replace(tmp, lib)
                with tempfile.NamedTemporaryFile("w", dir=lib.parent, delete=False) as f:
                    f.write(digest)
                os.replace(f.name, side)
                return lib
        except (OSError, subprocess.SubprocessError):
            pass
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    _note(f"the C compiler {cc!r} did not build {source.name}")
    return None


def kernels(
    source: Path, signatures: dict[str, tuple[list, object]], extra: tuple[str, ...] = ()
) -> dict | None:
    """The functions `signatures` names (name -> (argtypes, restype)) from `source` built
    for this machine (with `extra` flags where the compiler takes them), as ctypes
    functions; None where none builds or loads (see the module: one note, the caller keeps
    its torch path). Built or loaded once a process."""
    name = source.stem
    if name not in _loaded:
        fns = None
        if os.environ.get("TOY_NATIVE", "1") != "0":
            lib = _build(source, name, extra)
            if lib is not None:
                try:
                    cdll = ctypes.CDLL(str(lib))
                    fns = {}
                    for fn_name, (argtypes, restype) in signatures.items():
                        fn = getattr(cdll, fn_name)
                        fn.argtypes, fn.restype = argtypes, restype
                        fns[fn_name] = fn
                except (OSError, AttributeError) as e:
                    _note(f"cannot load {lib} ({e})")
                    fns = None
        _loaded[name] = fns
    return _loaded[name]


GELU_SOURCE = Path(__file__).with_name("gelu_bf16.c")


def gelu_bf16() -> dict | None:
    """toy_gelu_bf16 and toy_gelu_backward_bf16 from gelu_bf16.c, or None (see kernels).
    Built with -fopenmp: its loops share out their values on torch's own OpenMP threads
    (the library takes the libgomp torch loaded; see the source)."""
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    return kernels(
        GELU_SOURCE,
        {
            "toy_gelu_bf16": ([P, P, I64], None),
            "toy_gelu_backward_bf16": ([P, P, P, I64], None),
        },
        extra=("-fopenmp",),
    )


DEQUANT_SOURCE = Path(__file__).with_name("dequant.c")


def dequant() -> dict | None:
    """toy_dequantize from dequant.c, or None (see kernels). Built with -fopenmp, as
    gelu_bf16's: its rows are shared out on torch's own threads."""
    P, I32, I64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    return kernels(
        DEQUANT_SOURCE,
        {"toy_dequantize": ([P, P, I64, I64, I32, I32, I64], ctypes.c_int)},
        extra=("-fopenmp",),
    )
