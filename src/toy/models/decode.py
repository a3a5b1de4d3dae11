"""Generation on a quantized base: one token's matrix-vector products computed on the codes.

Training and prefill dequantize a layer per use (models/quant.py): for a batch of rows
that cost is shared by all of them. At one token per forward it is not: writing the
float32 weight and reading it back costs ten times the product itself, and a float32
copy of the whole base is read from memory for every token. `pack(model)` turns each
GGUF-quantized linear and embedding into a `PackedSpec`: the same integer codes
(quant.codes: every block type is w = s * q + z per sub-block), laid out so that one
vector lane runs over the output rows and the sum runs down the input:

    codes (G, W, N) 32-bit words (held as float32, bit-cast in the kernels): word w of
        group g, row n holds codes 8w..8w+7 of the group as nibbles for the 4-bit types
        (Q4_0, Q4_1, Q4_K; q + 8 for Q4_0), codes 4w..4w+3 as int8 bytes for the others
        (a group is the type's sub-block, 32 or 16 long); the first code in the low bits;
    scales s and offsets z:          (G, N), float16 where that holds them exactly, else
                                     float32; z is empty where the type has none;

with G groups of the input, N output rows. A decode step computes

    y[n] = sum_g s[g, n] * (sum_j q[g, j, n] * x[g, j]) + z[g, n] * (sum_j x[g, j])

in one pass over the codes: inductor generates the loop (vectorised over n) from the
few torch lines of `_matvec4` / `_matvec8`; the kernels are compiled once per shape
(a few seconds each the first time on a machine) ahead of time into shared libraries kept
in inductor's cache folder, which later processes load without tracing (_compile).
Every product and sum is float32: the result equals the dequantized float32 matmul within
float32 rounding (the sums are
only reordered, multiply-adds fused; tests/models/test_decode.py holds it to 1e-5).

More than one row (a prompt's prefill) dequantizes the packed codes and multiplies, as
before. The file's blocks are no longer read after packing: `pack` asks the kernel to
drop their pages (MADV_PAGEOUT: contents kept, re-read from the file if ever touched), so
the packed codes replace the file in memory rather than joining it.
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

import torch

from toy.models.layers import KVCache, StepKV
from toy.models.quant import (
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q6_K,
    QUANT_TYPES,
    QuantEmbedding,
    QuantLinear,
    QuantSpec,
    codes,
    half_split_rows,
    register_parts,
)

FOUR_BIT = (Q4_0, Q4_1, Q4_K)
_SUB_16 = (Q2_K, Q3_K, Q6_K)  # K-quants whose sub-blocks are 16 long (the others' are 32)


def compile_unavailable(device: torch.device) -> str | None:
    """Why inductor cannot build kernels here, or None. On a cpu: the C++ compiler inductor
    calls (CXX, else g++; clang++ on macOS) must be on PATH and answer `--version`, as
    inductor's own check asks; a compiler that is there but fails is caught when it builds
    (compile_failed)."""
    if device.type == "mps":
        return "torch.compile stays off on Apple MPS (inductor fails there)"
    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile does not support this Python/torch ({torch.__version__})"
    if device.type == "cpu":
        return _cxx_unavailable(
            os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
        )
    return None


_CXX_CHECKED: dict[str, str | None] = {}


def _cxx_unavailable(cxx: str) -> str | None:
    """None where `cxx --version` runs and exits 0 (checked once a process), else why not."""
    path = shutil.which(cxx)
    if path is None:
        return (
            f"no C++ compiler ({cxx}) on PATH for inductor's CPU kernels; install one "
            "(e.g. gcc), or set CXX to one"
        )
    if path not in _CXX_CHECKED:
        import subprocess

        try:
            done = subprocess.run([path, "--version"], capture_output=True, timeout=30)
            why = None if done.returncode == 0 else f"exits {done.returncode}"
        except (OSError, subprocess.SubprocessError) as e:
            why = f"fails ({e.__class__.__name__})"
        _CXX_CHECKED[path] = why and (
            f"the C++ compiler {path} {why} on `--version`; inductor cannot build its CPU "
            "kernels (install a working one, e.g. gcc, or set CXX to one)"
        )
    return _CXX_CHECKED[path]


# Set when inductor failed to build a kernel or step in this process (a compiler that answers
# --version and then fails, a missing header): everything after runs eagerly.
compile_failed: str | None = None


def _fell_back(e: Exception) -> None:
    global compile_failed
    if compile_failed is None:
        compile_failed = f"{e.__class__.__name__}: {str(e).strip().splitlines()[0][:200]}"
        print(
            f"note: compiling failed ({compile_failed}); generating without compiled kernels "
            "(the same text, slower per token)",
            file=sys.stderr,
            flush=True,
        )


# ---- the kernels: a few torch lines each, compiled by inductor per shape --------------------
#
# The codes reach the kernel as 32-bit words (8 nibbles or 4 bytes of one output row) held in
# a float32 tensor and bit-cast inside: inductor loads a float32 vector whole, where a vector
# of bytes is loaded through a scalar copy on AVX2 (measured 4-7x slower per product there;
# AVX-512 has a masked load and did not show it).


def _item(w: torch.Tensor, k: int, bits: int) -> torch.Tensor:
    """Code k of int32 words (`bits` wide, unsigned) as float32, 0..2**bits - 1."""
    return ((w >> (bits * k)) & (2**bits - 1)).float()


def _in_place(w: torch.Tensor, k: int, bits: int) -> torch.Tensor:
    """Code k of int32 words, masked where it lies: code * 2**(bits*k) as float32, exact (a few
    significant bits). One operation fewer than _item (no shift); the top code, whose high bit
    is the word's sign, is taken with _item."""
    return (w & ((2**bits - 1) << (bits * k))).float()


# An 8-bit code is stored as q + 128 (its byte with the sign bit flipped), so every code is
# unsigned; the kernel takes the 128 back through the offset (z - 128 s) * sum(x).
BYTE_BIAS = 128


def _matvec(
    x: torch.Tensor, words: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int
) -> torch.Tensor:
    """W x from words (G, W, N): code j of a group is code j % (32 // bits) of word
    j // (32 // bits)."""
    from torch._inductor import inductor_prims

    per_word = 32 // bits
    p = words.view(torch.int32)
    G, W, N = p.shape
    # x scaled by 2**-(bits*k) for the codes taken in place (exact: powers of two), written out
    # once: inductor would otherwise inline the scaling into every product.
    k = torch.arange(per_word, device=x.device)
    shift = torch.where(k == per_word - 1, 0, bits * k)  # the top code is shifted down: scale 1
    scale = (torch.ones_like(k) << shift).float().reciprocal()  # powers of two, exact
    xs = (x.view(G, W, per_word) * scale).unsqueeze(-1)
    xs = inductor_prims.force_stride_order(xs, (W * per_word, per_word, 1, 1))
    # The codes of a word unrolled (each masked in place), the words reduced. Bytes: measured
    # 2.5x faster than one reduction over the codes, 1.2-1.7x faster than unrolling all 32,
    # and a graph of 52 nodes, not 262. Nibbles: 2.4-3.8x faster than one reduction with
    # AVX-512 and 1.25-1.7x held to AVX2 (docs/performance.md; bench/nibble_kernel.py times
    # each kernel against the float32 product).
    acc = None
    for j in range(per_word):
        code = _item(p, j, bits) if j == per_word - 1 else _in_place(p, j, bits)
        t = code * xs[:, :, j]
        acc = t if acc is None else acc + t
    acc = acc.sum(1)  # (G, N)
    y = acc * s.float()
    xsum = x.view(G, -1).sum(1)[:, None]
    if bits == 8:
        y = y + ((z.float() if z.numel() else 0) - BYTE_BIAS * s.float()) * xsum
    elif z.numel():
        y = y + z.float() * xsum
    return y.sum(0)


def _matvec4(x, words, s, z):
    return _matvec(x, words, s, z, 4)


def _matvec8(x, words, s, z):
    return _matvec(x, words, s, z, 8)


# Inductor's settings for these kernels and the steps: multiply-adds fused (FMA rounds once
# where mul + add round twice: still the same sums, tests hold them to 1e-5); no size asserts
# on every call (each kernel and step is looked up by its inputs' exact shapes and strides).
_INDUCTOR = {"cpp.enable_floating_point_contract_flag": "fast", "size_asserts": False}
# Inductor checks which vector instruction sets the compiler can build and load, in every
# process, by building a probe and loading it in a child Python per set: 1.85 s of a 7.9 s
# warm-up on the loaded 2-core Zen 4, most of it waiting for the children. Where this
# machine has built these steps before (steps_marker), the check has passed here: trust_isa()
# skips it (cpp.vec_isa_ok; a compiler changed since fails to build and falls back, as any).
_TRUST_ISA = False
_ISA_OK = {False: {}, True: {"cpp.vec_isa_ok": True}}


def trust_isa() -> None:
    global _TRUST_ISA
    _TRUST_ISA = True


_KERNELS: dict[tuple, object] = {}
_tracing = False  # True while compile_steps traces a block


def _kernel(four_bit: bool, parts: tuple[torch.Tensor, ...]):
    """The compiled kernel for these parts' shapes and dtypes (built on first use): called
    with one list [x, *parts], it returns a sequence whose first item is W x."""
    key = (four_bit,) + tuple((tuple(p.shape), p.stride(), p.dtype, p.device.type) for p in parts)
    fn = _KERNELS.get(key) or _load_built(key)
    if fn is None:
        from torch.fx.experimental.proxy_tensor import make_fx

        body = _matvec4 if four_bit else _matvec8
        K = parts[0].shape[0] * parts[0].shape[1] * (8 if four_bit else 4)
        example = (torch.zeros(K, device=parts[0].device), *parts)
        try:
            if compile_failed:  # one failure is enough: the rest run eagerly at once
                raise RuntimeError(compile_failed)
            graph = make_fx(body, tracing_mode="fake")(*example)
            fn = _compile(graph, list(example), key)
        except Exception as e:  # inductor could not build it: the same torch lines, eagerly
            _fell_back(e)

            def fn(args, body=body):
                return (body(*args),)

    _KERNELS[key] = fn  # built or loaded: once a process, shared by tensors of one shape
    return fn


def _compile(graph, inputs: list[torch.Tensor], key: tuple):
    """Inductor's code for a traced graph, called with one list of cpu inputs of exactly
    these shapes and strides; returns a list of outputs. The code is built ahead of time
    (AOTInductor: one shared library, no Python wrapper) and kept under `key` in inductor's
    cache folder (_keep), so that a later process loads it in a millisecond (_load_built)
    instead of tracing the block again and importing the compiler (~4 s of a SmolLM2 reply
    before its first token, docs/performance.md). Graph inputs that are written (the KV
    cache) are written by the library itself."""
    out = next(n for n in graph.graph.nodes if n.op == "output")
    if not isinstance(out.args[0], (tuple, list)):  # AOTInductor returns a tuple of outputs
        out.args = ((out.args[0],),)
        graph.recompile()
    options = {**_INDUCTOR, **_ISA_OK[_TRUST_ISA], "aot_inductor.package": False}
    with warnings.catch_warnings():  # torch's own deprecation inside it (pytree's LeafSpec)
        warnings.simplefilter("ignore", FutureWarning)
        built = torch._inductor.aot_compile(graph, tuple(inputs), options=options)
    path = _built_path(key)
    try:
        _keep(Path(built), path)
    except OSError:  # a read-only cache: this process uses inductor's own copy
        path = Path(built)
    else:
        prune_builds()
    return _runner(path)


def _keep(built: Path, path: Path) -> None:
    """Copy inductor's library to `path`, then write its digest beside it (_digest_path):
    each to a temporary name in the same folder (the pid in it: prune_builds removes a dead
    process's), flushed to disk, renamed. The digest goes last, so a library cut short by a
    crash or a full disk never has a matching one, and _load_built never maps it (a library
    shorter than its headers say kills the process with SIGBUS on its first call)."""
    data = built.read_bytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_whole(path, data)
    _write_whole(_digest_path(path), _digest(data))
    os.utime(_steps_root())  # in use now: prune_builds leaves it alone for an hour


def _write_whole(path: Path, data: bytes) -> None:
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.{os.getpid()}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _digest(data: bytes) -> bytes:
    import hashlib

    return f"{hashlib.sha256(data).hexdigest()} {len(data)}\n".encode()


def _runner(path: Path):
    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)
    return runner.run  # takes the inputs as one list, returns the outputs as a list


def _load_built(key: tuple):
    """The code _compile kept for `key` on this machine, loaded; None where there is none,
    or its bytes do not match the digest written after it (cut short, damaged, or a write
    that never finished: it is built again and replaces it), or it does not load."""
    path = _built_path(key)
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        digest = _digest_path(path).read_bytes()
    except OSError:
        digest = None
    if digest != _digest(data):
        _say(
            f"note: a built step in {path.parent} does not match its digest (cut short or "
            "damaged); building it again"
        )
        return None
    try:
        return _runner(path)
    except (RuntimeError, OSError):
        return None


_BUILD_ID: str | None = None
# toy/models files no built step traces (nothing the decode path imports reads them).
UNTRACED = frozenset({"losses.py"})
# The environment variables that hold torch's kernels (ATen's dispatch) and oneDNN's below
# what the CPU has: a library built under one setting is not the one for another.
ISA_CAP_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def _build_id() -> str:
    """What a kept library's code depends on besides its graph's key: torch, toy's model code
    (every file of toy/models, where the traced forwards and kernels live, but the training
    losses, which no step traces: a change there rebuilt every step for nothing), inductor's
    settings here, and the CPU's instruction sets as torch and inductor see them (a library
    built for AVX-512 must never load on an AVX2 machine sharing the folder)."""
    global _BUILD_ID
    if _BUILD_ID is None:
        import hashlib
        import platform

        h = hashlib.sha256()
        for f in sorted(Path(__file__).parent.glob("*.py")):
            if f.name not in UNTRACED:
                h.update(f.name.encode() + f.read_bytes())
        flags = ""
        try:
            with open("/proc/cpuinfo") as fh:
                flags = next((x for x in fh if x.startswith("flags")), "")
        except OSError:
            pass
        caps = [os.environ.get(v, "") for v in ISA_CAP_VARS]
        for part in (torch.__version__, platform.machine(), sys.platform, flags, *caps):
            h.update(repr(part).encode())
        h.update(repr(sorted(_INDUCTOR.items())).encode())  # not _ISA_OK: the probe only
        h.update(torch.backends.cpu.get_cpu_capability().encode())
        _BUILD_ID = h.hexdigest()
    return _BUILD_ID


# Build folders kept under toy-steps: this build's and the two used last (another venv or
# toy version, an ISA cap). Each holds a model's libraries (~1.6 MB each, tens a model): a
# user who upgrades toy would otherwise keep every older build's forever. A folder used in
# the last hour is kept whatever the count: another process may be building into it.
KEEP_BUILDS = 3
UNUSED_S = 3600.0
_BUILD_ID_CHARS = 16  # a build folder's name: the build id's first hex digits
_BUILD_DIR = re.compile(f"[0-9a-f]{{{_BUILD_ID_CHARS}}}")
# What toys before build folders wrote in toy-steps itself: a flat built/ folder and markers
# named <packed-cache key>-torch-<torch version>.
_OLD_TOYS = re.compile(r"built|[0-9a-f]{24}-torch-[\w.+-]+")
# A library or digest on its way in (_write_whole): <name>.<pid>.<random>.tmp
_TEMP = re.compile(r"[0-9a-f]{40}\.so(?:\.sha256)?\.(\d+)\.\w+\.tmp")
# The file that says toy-steps is toy's own (made by toy, or holding nothing but toy's
# names when prune_builds first looked): without it nothing there is ever removed.
_HOME_MARK = ".toy-steps"
_TOUCHED: set[Path] = set()
_SAID: set[str] = set()


def _say(note: str) -> None:
    if note not in _SAID:
        _SAID.add(note)
        print(note, file=sys.stderr, flush=True)


def _steps_root() -> Path:
    """toy-steps/<build id> in inductor's cache folder: this build's libraries (built/) and
    the markers that say which models' steps it has built (steps_marker), so a marker never
    speaks for libraries another toy, torch or instruction-set cap built. Its time is set at
    a process's first use and at each library kept: prune_builds keeps the folders used last."""
    root = _inductor_root() / "toy-steps" / _build_id()[:_BUILD_ID_CHARS]
    if root not in _TOUCHED:
        _TOUCHED.add(root)
        try:
            os.utime(root)
        except OSError:  # not there yet (made at the first build), or read-only
            pass
    return root


def _built_path(key: tuple) -> Path:
    import hashlib

    name = hashlib.sha256(repr(key).encode()).hexdigest()[:40]
    return _steps_root() / "built" / f"{name}.so"


def _toys(home: Path) -> str | None:
    """None where toy-steps is toy's own to prune, else why not. A link (to a folder of the
    user's, say) is never pruned, nor a folder holding a name toy never wrote; a folder of
    toy's names only (an older toy's, made before the mark) is marked toy's now."""
    if home.is_symlink():
        return f"{home} is a link"
    mark = home / _HOME_MARK
    if mark.is_file() and not mark.is_symlink():
        return None
    try:
        names = [q.name for q in home.iterdir()]
    except OSError:
        return f"{home} cannot be read"
    stranger = next(
        (n for n in names if not (_BUILD_DIR.fullmatch(n) or _OLD_TOYS.fullmatch(n))), None
    )
    if stranger is not None:
        return f"{home} holds {stranger!r}, which toy did not write"
    try:
        mark.touch()
    except OSError:
        return f"{home} is read-only"
    return None


def prune_builds(keep: int = KEEP_BUILDS) -> list[Path]:
    """Remove from toy-steps what no build uses any more: the build folders beyond the
    `keep` used last and unused for an hour (this build's always kept), what older toys left
    there (_OLD_TOYS), and the temporaries of this build's dead writers. Only real folders
    and files of toy's own names, in a toy-steps that is toy's (_toys); entries of other
    names, and links, are left alone. Best effort; returns what went. Called after a
    library is built, never on the way to a reply."""
    import time

    mine = _steps_root()
    why = _toys(mine.parent)
    if why is not None:
        _say(f"note: old builds are not removed from toy-steps: {why} (remove them yourself)")
        return []

    def used(p: Path) -> float:
        try:
            return p.lstat().st_mtime
        except OSError:
            return 0.0

    def real(p: Path, folder: bool) -> bool:
        return not p.is_symlink() and (p.is_dir() if folder else p.is_file())

    def dead(p: Path) -> bool:
        if now - used(p) > UNUSED_S:
            return True
        pid = int(_TEMP.fullmatch(p.name).group(1))
        if os.name != "posix":  # os.kill(pid, 0) would end the process on Windows
            return False
        try:
            os.kill(pid, 0)  # signal 0: only asks whether the process is there
        except ProcessLookupError:
            return True
        except (OSError, OverflowError):  # another user's process, or no such pid at all
            pass
        return False

    now = time.time()
    try:
        entries = list(mine.parent.iterdir())
    except OSError:
        return []
    builds = [p for p in entries if p != mine and _BUILD_DIR.fullmatch(p.name) and real(p, True)]
    builds.sort(key=used, reverse=True)
    gone = [p for p in builds[max(0, keep - 1) :] if now - used(p) > UNUSED_S]
    gone += [p for p in entries if _OLD_TOYS.fullmatch(p.name) and real(p, p.name == "built")]
    try:
        temps = [p for p in (mine / "built").iterdir() if _TEMP.fullmatch(p.name)]
    except OSError:
        temps = []
    gone += [p for p in temps if real(p, False) and dead(p)]
    for p in gone:
        try:
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
        except OSError:
            pass
    return gone


# ---- the spec: what QuantLinear / QuantEmbedding hold after packing --------------------------


class PackedSpec:
    """A GGUF block type's codes packed for generation (see the module's docstring); the
    float shape (out, in) is the one the blocks stood for, rows in the model's order."""

    __slots__ = ("qtype", "shape", "four_bit", "kernel", "blocked")
    parts = ("codes", "scales", "offsets")
    matvec_ready = True

    def __init__(self, qtype: int, shape: tuple[int, int], blocked: bool = False):
        self.qtype, self.shape = int(qtype), (int(shape[0]), int(shape[1]))
        self.four_bit = self.qtype in FOUR_BIT
        self.kernel = None  # compiled on first use (inductor caches the code by shape)
        # blocked: the parts in decode_step.c's order, rows in blocks of 32, the last padded
        # (codes (ceil(N/32), G, W, 32), scales and offsets (ceil(N/32), G, 32)): a llama
        # reply's products in C (models/decode_native.py); every method here takes either
        self.blocked = blocked

    @property
    def name(self) -> str:
        return f"{QUANT_TYPES[self.qtype][2]} (packed for generation)"

    def grouped(self, parts: tuple[torch.Tensor, ...], idx=slice(None)) -> tuple:
        """The parts of output rows idx in the grouped order (codes (G, W, n), scales and
        offsets (G, n)), from either order (a copy from the blocked one)."""
        if not self.blocked:
            return tuple(p[..., idx] if p.numel() else p for p in parts)
        words, s, z = parts
        nb, G, W, R = words.shape
        if isinstance(idx, slice) and idx.step in (None, 1):  # only the blocks it reaches
            start, end, _ = idx.indices(self.shape[0])  # (the last block's padding dropped)
            if end <= start:  # no rows: the grouped order's empty parts
                return (
                    words.new_empty((G, W, 0)),
                    s.new_empty((G, 0)),
                    z.new_empty((G, 0)) if z.numel() else z,
                )
            b0, b1 = start // R, -(-end // R)
            out = (
                words[b0:b1].permute(1, 2, 0, 3).reshape(G, W, -1),
                s[b0:b1].permute(1, 0, 2).reshape(G, -1),
                z[b0:b1].permute(1, 0, 2).reshape(G, -1) if z.numel() else z,
            )
            cut = slice(start - b0 * R, end - b0 * R)
            return tuple(p[..., cut] if p.numel() else p for p in out)
        if isinstance(idx, slice):
            idx = torch.arange(self.shape[0])[idx]
        idx = torch.where(idx < 0, idx + self.shape[0], idx)  # -1: the last real row
        b, r = idx // R, idx % R
        return (
            words[b, :, :, r].movedim(0, -1),
            s[b, :, r].movedim(0, -1),
            z[b, :, r].movedim(0, -1) if z.numel() else z,
        )

    def columns(self, parts: tuple[torch.Tensor, ...], idx=slice(None)) -> torch.Tensor:
        """W^T (in, len(idx)) in float32: the packed codes of output rows idx, dequantized."""
        words, s, z = self.grouped(parts, idx)
        w = words.view(torch.int32)  # (G, W, n)
        bits = 4 if self.four_bit else 8
        q = torch.stack([_item(w, k, bits) for k in range(32 // bits)], dim=2).flatten(
            1, 2
        )  # (G, L, n)
        if not self.four_bit:
            q.sub_(BYTE_BIAS)
        w = q.mul_(s.float().unsqueeze(1))
        if z.numel():
            w.add_(z.float().unsqueeze(1))
        return w.flatten(0, 1)

    def dequantize(
        self,
        parts: tuple[torch.Tensor, ...],
        dtype: torch.dtype = torch.float32,
        rows: slice | None = None,
    ) -> torch.Tensor:
        with torch.profiler.record_function("toy::dequantize"):
            return self.columns(parts, rows if rows is not None else slice(None)).t().to(dtype)

    def gather(
        self, parts: tuple[torch.Tensor, ...], idx: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        return self.columns(parts, idx).t().to(dtype)

    def matvec(self, x: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x (in,) float32 -> W x (out,): the compiled kernel on the codes."""
        if (
            _tracing
        ):  # inside a decode step being traced (compile_steps): the torch lines themselves,
            # on x written out first: else inductor inlines x's own ops (a norm, SwiGLU's
            # silu) into every code's product
            from torch._inductor import inductor_prims

            x = inductor_prims.force_stride_order(x.contiguous(), (1,))
            return (_matvec4 if self.four_bit else _matvec8)(x, *self.grouped(parts))
        if self.kernel is None:
            if self.blocked:
                from toy.models import decode_native

                self.kernel = decode_native.kernel(self, parts) or self._lines
            else:
                self.kernel = _kernel(self.four_bit, parts)
        return self.kernel([x.contiguous(), *parts])[0]

    def _lines(self, args: list) -> tuple[torch.Tensor]:
        """The kernel's torch lines, eagerly, on parts in either order."""
        return ((_matvec4 if self.four_bit else _matvec8)(args[0], *self.grouped(args[1:])),)

    def __repr__(self) -> str:
        return f"PackedSpec({self.name}, {self.shape})"


def _narrow(t: torch.Tensor) -> torch.Tensor:
    """float16 where it holds every value exactly (the file's own f16 scales), else float32."""
    h = t.half()
    return h if torch.equal(h.float(), t) else t


def pack_parts(
    blocks: torch.Tensor, spec: QuantSpec, chunk: int = 4096
) -> tuple[torch.Tensor, ...]:
    """A GGUF tensor's blocks (out, row_bytes) -> (codes, scales, offsets) as PackedSpec
    holds them, `chunk` rows at a time (a 49k-row head's float32 codes never all at once)."""
    N, K = spec.shape
    four = spec.qtype in FOUR_BIT
    L = 16 if spec.qtype in _SUB_16 else 32
    step = N if spec.qk_heads else chunk  # Q/K rows move within their head: one piece
    out_q = torch.empty((K // L, L // (8 if four else 4), N), dtype=torch.int32)
    out_s = torch.empty((K // L, N))
    out_z = None
    for r in range(0, N, step):
        q, s, z = codes(
            blocks[r : r + step], spec.qtype
        )  # (rows * blocks_per_row, subs, L), (.., subs, 1)
        _page_out(blocks[r : r + step])  # read once: the packed codes stand in for these pages now
        n = q.numel() // K
        q, s = q.reshape(n, K // L, L), s.reshape(n, K // L)
        z = z.reshape(n, K // L) if z is not None else None
        if (
            spec.qk_heads
        ):  # the model's row order (rotary's half-split), as QuantSpec.dequantize gives it
            q, s = half_split_rows(q, spec.qk_heads), half_split_rows(s, spec.qk_heads)
            z = half_split_rows(z, spec.qk_heads) if z is not None else None
        if (
            spec.qtype == Q4_0
        ):  # int8 q - 8 -> nibble q, and the offset -8 d (exact: d * q and 8 d are)
            q, z = q.view(torch.uint8).add(8), s * -8.0
        if four:
            q = q[..., 0::2] | (q[..., 1::2] << 4)  # two codes a byte, the first in the low nibble
        else:  # int8 (or unsigned codes under 64) -> q + 128 as a byte: the sign bit flipped
            q = q.view(torch.uint8) ^ BYTE_BIAS if q.dtype == torch.int8 else q + BYTE_BIAS
        words = q.contiguous().view(
            torch.int32
        )  # 4 bytes a word, the first in the lowest (little-endian)
        out_q[..., r : r + n] = words.permute(
            1, 2, 0
        )  # (G, W, rows): the lane runs over output rows
        out_s[:, r : r + n] = s.t()
        if z is not None:
            if out_z is None:
                out_z = torch.empty((K // L, N))
            out_z[:, r : r + n] = z.t()
    return (
        out_q.view(torch.float32),
        _narrow(out_s),
        _narrow(out_z) if out_z is not None else torch.empty(0),
    )


def packed_bytes(spec: QuantSpec) -> int:
    """Bytes the packed form of a tensor of this spec takes at most (scales as float32)."""
    N, K = spec.shape
    L = 16 if spec.qtype in _SUB_16 else 32
    code = K // 2 if spec.qtype in FOUR_BIT else K
    return N * (code + 8 * (K // L))


def packable(module: torch.nn.Module) -> bool:
    return (
        isinstance(module, (QuantLinear, QuantEmbedding))
        and isinstance(module.spec, QuantSpec)
        and module.spec.qtype in _PACKED_TYPES
        and sys.byteorder == "little"
    )  # the words' byte order


_PACKED_TYPES = set(QUANT_TYPES) - {0, 1, 30}  # the block types (F32, F16, BF16 are plain floats)


def base_packed_bytes(state_dict: dict, device: torch.device) -> int | None:
    """What a base's weights take once packed (its float tensors as they are), or None where
    they cannot be packed: not the cpu, or a quantized tensor
    of a kind pack leaves alone (MLX, or no quantized tensor at all). `state_dict` is a
    formats.base.Base's, held quantized: tensors and QuantTensors (parts, spec)."""
    if device.type != "cpu" or sys.byteorder != "little":
        return None
    total, quantized = 0, 0
    for t in state_dict.values():
        spec = getattr(t, "spec", None)
        if spec is None:
            total += t.numel() * t.element_size()
        elif isinstance(spec, QuantSpec) and spec.qtype in _PACKED_TYPES:
            total += packed_bytes(spec)
            quantized += 1
        else:
            return None
    return total if quantized else None


def pack(model: torch.nn.Module, stored: dict | None = None, out: dict | None = None) -> int:
    """Pack every GGUF-quantized linear and embedding of a model for generation, in place
    (a tied head shares its embedding's packed parts). Returns how many tensors were packed.
    `stored`: module name -> parts packed before (formats/packed_cache.py reads them from
    toy's cache, checked against the spec's shapes); `out`, when given, receives module name
    -> parts for every tensor packed (one name for tied modules)."""
    done: dict[int, tuple[PackedSpec, tuple]] = {}
    for name, m in list(model.named_modules()):
        if not packable(m):
            continue
        blocks = m.weight
        key = blocks.data_ptr()
        if key not in done:
            spec = PackedSpec(m.spec.qtype, m.spec.shape)
            parts = (stored or {}).get(name)
            if parts is None or not _fits(parts, m.spec):
                parts = pack_parts(blocks, m.spec)
            done[key] = (spec, parts)
            if out is not None:
                out[name] = parts
        spec, parts = done[key]
        del m.weight
        m.spec = spec
        register_parts(m, spec, parts)
    return len(done)


def _fits(parts: tuple, spec: QuantSpec) -> bool:
    """Whether stored parts have the shapes and dtypes pack_parts gives for this spec."""
    N, K = spec.shape
    L = 16 if spec.qtype in _SUB_16 else 32
    q, s, z = parts
    words = L // (8 if spec.qtype in FOUR_BIT else 4)
    return (
        q.dtype == torch.float32
        and tuple(q.shape) == (K // L, words, N)
        and tuple(s.shape) == (K // L, N)
        and s.dtype in (torch.float16, torch.float32)
        and (
            z.numel() == 0
            or (tuple(z.shape) == (K // L, N) and z.dtype in (torch.float16, torch.float32))
        )
    )


def _page_out(t: torch.Tensor) -> None:
    """Ask the kernel to drop t's pages from memory (MADV_PAGEOUT keeps their contents: a
    file-backed page is read again if touched, an anonymous one swapped). Best effort."""
    advice = getattr(mmap, "MADV_PAGEOUT", None)
    if advice is None or t.device.type != "cpu" or t.numel() == 0:
        return
    from toy.models import native

    native.advise(t.data_ptr(), t.numel() * t.element_size(), advice)


# ---- a whole block per token: compile_steps -------------------------------------------------
#
# With the products on the codes, a token of SmolLM2 spends as long again in the eager glue
# around them (norms, rotary, views, the cache write, attention: about 60 small ops and their
# Python a layer). compile_steps traces each block's own forward once for one token (make_fx,
# the packed products as their torch lines, the cache as a StepKV: this layer's buffers over a
# fixed span, the position a tensor) and hands the graph to inductor: one call a layer. Blocks
# of the same structure and shapes share the compiled graph; a span (the positions attention
# reads, masked past the token) is SPAN_MIN, then powers of two, then the whole cache (see _span),
# so a long chat compiles a few spans, not one a token.

SPAN_MIN = 256
_STEPS: dict[tuple, object] = {}


def _span(pos: int, max_len: int) -> int:
    """The positions a step attends over for a token at pos: SPAN_MIN, doubling, and the whole
    cache once the next doubling would reach it (a 300-token generation compiles one span)."""
    span = SPAN_MIN
    while span < pos + 1:
        span *= 2
    return max_len if 2 * span >= max_len else span


def _structure(block: torch.nn.Module) -> tuple:
    """What makes two blocks' graphs differ besides tensor shapes: each module's type and its
    plain settings (window, softcap, scale, is_global, eps, the block types of its specs)."""
    out = []
    for name, m in block.named_modules():
        plain = tuple(
            sorted(
                (k, v)
                for k, v in vars(m).items()
                if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))
            )
        )
        spec = getattr(m, "spec", None)
        out.append(
            (name, type(m).__name__, plain, (type(spec).__name__, getattr(spec, "qtype", None)))
        )
    return tuple(out)


def _leaves(args) -> list:
    """The items of nested tuples/lists, in order (the blocks' arguments: tensors, rotary
    tables as tuples, the cache, the layer index)."""
    out = []
    for a in args:
        out.extend(_leaves(a) if isinstance(a, (tuple, list)) else (a,))
    return out


def _rebuild(args, it):
    return type(args)(_rebuild(a, it) if isinstance(a, (tuple, list)) else next(it) for a in args)


def _autocast_dtype() -> torch.dtype | None:
    """The cpu autocast dtype in force, None where autocast is off: a graph traced under
    autocast has its casts written in, so it is a graph of its own."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


ROW_SPAN = 64


FEW_ROWS = 8


def _row_span(pos: int, max_len: int, rows: int) -> int:
    """A batched step's span (see compile_steps' rows): the positions up to pos in whole
    ROW_SPAN units, the whole cache at most (a 32-row cache of 256 positions read whole at
    every token is 2.5x the bytes GRPO's mean answer needs). A batch of FEW_ROWS or fewer
    (the long tail a batch compacts to: models/sample.py) reads a power of two of positions
    instead: its keys are few, and each span is a graph to build for each batch size."""
    if rows <= FEW_ROWS:
        return min(max_len, max(ROW_SPAN, 1 << pos.bit_length()))
    return min(max_len, -(-(pos + 1) // ROW_SPAN) * ROW_SPAN)


class _StepForward:
    """A block's forward: the compiled graph for one token of generation with a KVCache,
    its own eager forward for everything else (prefill, training, other devices)."""

    def __init__(self, block: torch.nn.Module, eager, notes: list, rows: bool = False):
        self.block, self.eager, self.notes = block, eager, notes  # notes: shared, emptied once said
        self.rows = rows  # batches of rows, padded ones, and autocast taken too (compile_steps)
        self.state: dict[str, torch.Tensor] | None = None
        self.spans: dict[tuple, object] = {}  # what makes a step's shapes -> the compiled step

    def __call__(self, *args):
        x = args[0]
        if (
            _tracing
            or x.shape[1] != 1
            or x.device.type != "cpu"
            or torch.is_grad_enabled()
            or (
                not self.rows and (x.shape[0] != 1 or x.dtype != torch.float32 or _autocast_dtype())
            )
        ):
            return self.eager(*args)
        leaves = _leaves(args)
        at = next((i for i, a in enumerate(leaves) if isinstance(a, KVCache)), None)
        if at is None:
            return self.eager(*args)
        cache, layer = leaves[at], leaves[at + 1]  # every family passes (..., cache, layer)
        if cache.pad is not None and not self.rows:  # rows at their own positions
            return self.eager(*args)
        pos, size = cache.pos, cache.max_len
        span = _row_span(pos, size, x.shape[0]) if self.rows else _span(pos, size)
        if self.state is None:
            self.state = dict(self.block.named_parameters())
            self.state.update(self.block.named_buffers())
        inputs = [a for a in leaves if isinstance(a, torch.Tensor)]
        inputs += [
            cache.k[layer][:, :, :span],
            cache.v[layer][:, :, :span],
            torch.tensor([cache.pos]),
        ]
        if cache.pad is not None:
            inputs.append(cache.pad)
        inputs += self.state.values()
        # the buffers' strides follow max_len; a batch's shape, dtype and autocast its graph
        shape = (span, cache.max_len, x.shape[0], x.dtype, cache.pad is None, _autocast_dtype())
        step = self.spans.get(shape)
        if step is None:
            key = (
                _structure(self.block),
                repr([type(a).__name__ for a in leaves]),
                tuple((tuple(t.shape), t.stride(), t.dtype) for t in inputs),
            )
            if shape[-1] is not None:  # keys of the steps built before stay the same
                key += (("autocast", str(shape[-1])),)
            step = _STEPS.get(key) or _load_built(key)
            if step is not None:
                _STEPS[key] = step
            else:
                if compile_failed:
                    return self.eager(*args)
                while self.notes:
                    self.notes.pop()()
                try:
                    step = _STEPS[key] = self._compile(args, list(self.state), inputs, key)
                except Exception as e:  # inductor could not build it: this block stays eager
                    _fell_back(e)
                    return self.eager(*args)
            self.spans[shape] = step
        return step(inputs)[0]

    def _compile(self, args, names: list[str], inputs: list[torch.Tensor], key: tuple):
        from torch.func import functional_call
        from torch.fx.experimental.proxy_tensor import make_fx

        global _tracing
        leaves = _leaves(args)
        n = sum(isinstance(a, torch.Tensor) for a in leaves)
        m = len(inputs) - len(names) - n  # the cache's tensors: k, v, pos (and pad)

        def step(*flat):
            tensors = iter(flat[:n])
            cache = StepKV(*flat[n : n + m])
            it = iter(
                [
                    next(tensors)
                    if isinstance(a, torch.Tensor)
                    else cache
                    if isinstance(a, KVCache)
                    else a
                    for a in leaves
                ]
            )
            return functional_call(
                self.block, dict(zip(names, flat[n + m :])), _rebuild(args, it), tie_weights=False
            )

        _tracing = True
        try:
            graph = make_fx(step, tracing_mode="fake")(*inputs)
        finally:
            _tracing = False
        return _compile(graph, inputs, key)


def compile_steps(model: torch.nn.Module, note=None, check: bool = True, rows: bool = False) -> int:
    """Give every block of a model (model.blocks) the compiled one-token forward (see above);
    compiled (or loaded, where built here before) on first use, `note()` called before the
    first compile. Returns how many blocks; 0 where inductor cannot build (the reason is
    compile_unavailable's; check=False skips the look, for steps built here before).

    rows: the steps also take a batch of rows (padded ones too: KVCache.pad) and a step
    under autocast (GRPO's sampling), each batch size, dtype and span (_row_span) a graph
    of its own; without it, one row of float32 as a reply decodes."""
    blocks = getattr(model, "blocks", None)
    if blocks is None or (check and compile_unavailable(torch.device("cpu"))):
        return 0
    if not rows:  # a llama model's reply tokens: its blocks in C (models/decode_native.py)
        from toy.models import decode_native

        decode_native.install(model)
    notes = [note] if note is not None else []
    for block in blocks:
        fwd = block.__dict__.get("forward")
        if not isinstance(fwd, _StepForward):
            block.forward = _StepForward(block, block.forward, notes, rows)
        elif rows:
            fwd.rows = True
    return len(blocks)


def row_steps(model: torch.nn.Module) -> bool:
    """Whether compile_steps(rows=True) gave this model's blocks their batched steps."""
    blocks = getattr(model, "blocks", None)
    return bool(blocks) and getattr(blocks[0].__dict__.get("forward"), "rows", False)


def steps_marker(key: str) -> Path:
    """A file that says this build (toy's model code, torch, the CPU's instruction sets:
    _steps_root) has compiled the steps of the model `key` names (a GGUF's packed-cache key):
    kept in inductor's own cache folder (found as inductor finds it, without importing it),
    so that it goes when that cache goes. `toy infer`'s auto reads it to know whether packing
    costs a compile (~20 s) or a load of the built steps (milliseconds)."""
    return _steps_root() / key


def _inductor_root() -> Path:
    """Inductor's cache folder, found as inductor finds it, without importing it."""
    import getpass
    import tempfile

    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not root:
        try:
            user = getpass.getuser()
        except (KeyError, ModuleNotFoundError, OSError):
            user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
        root = os.path.join(
            tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)
        )
    return Path(root)


def mark_steps(marker: Path) -> None:
    """Write the marker of steps_marker; best effort (a read-only folder is left alone)."""
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass


def has_steps(model: torch.nn.Module) -> bool:
    """Whether compile_steps gave this model's blocks the compiled one-token step."""
    blocks = getattr(model, "blocks", None)
    return bool(blocks) and isinstance(blocks[0].__dict__.get("forward"), _StepForward)


def span_last(pos: int, max_len: int) -> int:
    """The last position whose step reads the same span as `pos`'s (see _span)."""
    return min(_span(pos, max_len), max_len) - 1


def quiet_steps(model: torch.nn.Module) -> None:
    """From here on a step built where a generation reaches it says nothing: its note goes
    before a reply, never inside it."""
    for block in getattr(model, "blocks", None) or []:
        fwd = block.__dict__.get("forward")
        if isinstance(fwd, _StepForward):
            fwd.notes.clear()


def warm_steps(model: torch.nn.Module, max_len: int, first: int, last: int) -> None:
    """Build (or load from inductor's cache) every compiled one-token step a generation will
    call before it starts: the steps for a cache of max_len positions at positions first..last.
    Run on a scratch cache (the real one is not touched), so that a compile and its note come
    before the reply's first token, never inside it. Nothing to do where compile_steps did not
    wrap the blocks."""
    if not has_steps(model):
        return
    seen = {}
    for p in range(max(0, first), min(last, max_len - 1) + 1):
        seen.setdefault(_span(p, max_len), p)
    for p in seen.values():
        scratch = model.new_cache(1, max_len, lazy=True)  # resident where the step reads
        scratch.pos = p
        with torch.no_grad():  # the blocks' steps and the head's kernel, as a token meets them
            model.lm_head(model.hidden(torch.zeros((1, 1), dtype=torch.long), scratch)[:, -1])
