"""Generation on a quantized base: one token's matrix-vector products computed on the codes.

Training and prefill dequantize a layer per use (models/quant.py): for a batch of rows
that cost is shared by all of them. At one token per forward it is not: writing the
float32 weight and reading it back costs ten times the product itself, and a float32
copy of the whole base is read from memory for every token. `pack(model)` turns each
GGUF-quantized linear and embedding into a `PackedSpec`: the same integer codes
(quant.codes: every block type is w = s * q + z per sub-block), laid out so that one
vector lane runs over the output rows and the sum runs down the input:

    4-bit types (Q4_0, Q4_1, Q4_K):  codes (G, 16, N) uint8: byte j of group g holds
        q[32g + j] in its low nibble and q[32g + 16 + j] in its high one (q + 8 for Q4_0);
    other types:                     codes (G, L, N) int8, L = 32 or 16 (the sub-block);
    scales s and offsets z:          (G, N), float16 where that holds them exactly, else
                                     float32; z is empty where the type has none;

with G groups of the input, N output rows. A decode step computes

    y[n] = sum_g s[g, n] * (sum_j q[g, j, n] * x[g, j]) + z[g, n] * (sum_j x[g, j])

in one pass over the codes: inductor generates the loop (vectorised over n) from the
few torch lines of `_matvec4` / `_matvec8`; the kernels are compiled once per shape
(about a second each, then cached by inductor on disk). Every product and sum is float32:
the result equals the dequantized float32 matmul within float32 rounding (the sums are
only reordered; tests/test_decode.py holds it to 1e-5).

More than one row (a prompt's prefill) dequantizes the packed codes and multiplies, as
before. The file's blocks are no longer read after packing: `pack` asks the kernel to
drop their pages (MADV_PAGEOUT: contents kept, re-read from the file if ever touched), so
the packed codes replace the file in memory rather than joining it.
"""

from __future__ import annotations

import mmap
import os
import shutil

import torch

from toy.models.quant import QUANT_TYPES, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q6_K, QuantEmbedding, QuantLinear, QuantSpec, codes, \
    half_split_rows, register_parts

FOUR_BIT = (Q4_0, Q4_1, Q4_K)
_SUB_16 = (Q2_K, Q3_K, Q6_K)  # K-quants whose sub-blocks are 16 long (the others' are 32)


def compile_unavailable(device: torch.device) -> str | None:
    """Why inductor cannot build kernels here, or None."""
    if device.type == "mps":
        return "torch.compile stays off on Apple MPS (inductor fails there)"
    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile does not support this Python/torch ({torch.__version__})"
    if device.type == "cpu" and not any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "c++", "clang++")):
        return "no C++ compiler (g++, c++ or clang++) on PATH for inductor's CPU kernels; install one (e.g. gcc)"
    return None


# ---- the kernels: a few torch lines each, compiled by inductor per shape --------------------

def _matvec4(x: torch.Tensor, packed: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    G, _, N = packed.shape
    xg = x.view(G, 2, 16)
    p = packed.to(torch.int32)  # measured: nibbles from int32 lanes convert faster than from bytes
    dot = ((p & 15).float() * xg[:, 0, :, None] + (p >> 4).float() * xg[:, 1, :, None]).sum(1)  # (G, N)
    y = dot * s.float()
    if z.numel():
        y = y + z.float() * xg.sum((1, 2))[:, None]
    return y.sum(0)


def _matvec8(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    G, L, N = q.shape
    xg = x.view(G, L)
    y = (q.float() * xg[:, :, None]).sum(1) * s.float()  # (G, N)
    if z.numel():
        y = y + z.float() * xg.sum(1)[:, None]
    return y.sum(0)


_KERNELS: dict[tuple, object] = {}


def _kernel(four_bit: bool, parts: tuple[torch.Tensor, ...]):
    """The compiled kernel for these parts' shapes and dtypes (built on first use): called
    with one list [x, *parts], it returns a sequence whose first item is W x."""
    key = (four_bit,) + tuple((tuple(p.shape), p.dtype, p.device.type) for p in parts)
    fn = _KERNELS.get(key)
    if fn is None:
        from torch.fx.experimental.proxy_tensor import make_fx

        body = _matvec4 if four_bit else _matvec8
        K = parts[0].shape[0] * (32 if four_bit else parts[0].shape[1])
        example = (torch.zeros(K, device=parts[0].device), *parts)
        graph = make_fx(body)(*example)
        compiled = torch._inductor.compile(graph, list(example))
        # The compiled graph's own entry takes the inputs as one list and skips the wrapper's
        # bookkeeping (measured: 2.6 us a call against 5.8, about 0.7 ms a token for SmolLM2);
        # torch is pinned, and any other shape of the object falls back to the plain call.
        boxed = getattr(compiled, "current_callable", None)
        if boxed is None or getattr(compiled, "inputs_to_check", None):
            def boxed(args, compiled=compiled):
                return (compiled(*args),)
        fn = _KERNELS[key] = boxed
    return fn


# ---- the spec: what QuantLinear / QuantEmbedding hold after packing --------------------------

class PackedSpec:
    """A GGUF block type's codes packed for generation (see the module's docstring); the
    float shape (out, in) is the one the blocks stood for, rows in the model's order."""

    __slots__ = ("qtype", "shape", "four_bit", "kernel")
    parts = ("codes", "scales", "offsets")
    matvec_ready = True

    def __init__(self, qtype: int, shape: tuple[int, int]):
        self.qtype, self.shape = int(qtype), (int(shape[0]), int(shape[1]))
        self.four_bit = self.qtype in FOUR_BIT
        self.kernel = None  # compiled on first use (inductor caches the code by shape)

    @property
    def name(self) -> str:
        return f"{QUANT_TYPES[self.qtype][2]} (packed for generation)"

    def columns(self, parts: tuple[torch.Tensor, ...], idx=slice(None)) -> torch.Tensor:
        """W^T (in, len(idx)) in float32: the packed codes of output rows idx, dequantized."""
        q, s, z = (p[..., idx] if p.numel() else p for p in parts)
        if self.four_bit:
            q = torch.stack([q & 15, q >> 4], dim=1).flatten(1, 2)  # (G, 32, n)
        w = q.float().mul_(s.float().unsqueeze(1))
        if z.numel():
            w.add_(z.float().unsqueeze(1))
        return w.flatten(0, 1)

    def dequantize(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype = torch.float32,
                   rows: slice | None = None) -> torch.Tensor:
        with torch.profiler.record_function("toy::dequantize"):
            return self.columns(parts, rows if rows is not None else slice(None)).t().to(dtype)

    def gather(self, parts: tuple[torch.Tensor, ...], idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.columns(parts, idx).t().to(dtype)

    def matvec(self, x: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x (in,) float32 -> W x (out,): the compiled kernel on the codes."""
        if self.kernel is None:
            self.kernel = _kernel(self.four_bit, parts)
        return self.kernel([x.contiguous(), *parts])[0]

    def __repr__(self) -> str:
        return f"PackedSpec({self.name}, {self.shape})"


def _narrow(t: torch.Tensor) -> torch.Tensor:
    """float16 where it holds every value exactly (the file's own f16 scales), else float32."""
    h = t.half()
    return h if torch.equal(h.float(), t) else t


def pack_parts(blocks: torch.Tensor, spec: QuantSpec, chunk: int = 4096) -> tuple[torch.Tensor, ...]:
    """A GGUF tensor's blocks (out, row_bytes) -> (codes, scales, offsets) as PackedSpec
    holds them, `chunk` rows at a time (a 49k-row head's float32 codes never all at once)."""
    N, K = spec.shape
    four = spec.qtype in FOUR_BIT
    L = 16 if spec.qtype in _SUB_16 else 32
    step = N if spec.qk_heads else chunk  # Q/K rows move within their head: one piece
    out_q = torch.empty((K // L, L // 2 if four else L, N), dtype=torch.uint8 if four else torch.int8)
    out_s = torch.empty((K // L, N))
    out_z = None
    for r in range(0, N, step):
        q, s, z = codes(blocks[r : r + step], spec.qtype)  # (rows * blocks_per_row, subs, L), (.., subs, 1)
        _page_out(blocks[r : r + step])  # read once: the packed codes stand in for these pages now
        n = q.numel() // K
        q, s = q.reshape(n, K // L, L), s.reshape(n, K // L)
        z = z.reshape(n, K // L) if z is not None else None
        if spec.qk_heads:  # the model's row order (rotary's half-split), as QuantSpec.dequantize gives it
            q, s = half_split_rows(q, spec.qk_heads), half_split_rows(s, spec.qk_heads)
            z = half_split_rows(z, spec.qk_heads) if z is not None else None
        if spec.qtype == Q4_0:  # int8 q - 8 -> nibble q, and the offset -8 d (exact: d * q and 8 d are)
            q, z = q.view(torch.uint8).add(8), s * -8.0
        if four:
            q = q[..., :16] | (q[..., 16:] << 4)  # element j in the low nibble, j + 16 in the high
        elif q.dtype == torch.uint8:
            q = q.view(torch.int8)  # unsigned codes of these types are < 64: int8 holds them
        out_q[..., r : r + n] = q.permute(1, 2, 0)  # (G, L', rows): the lane runs over output rows
        out_s[:, r : r + n] = s.t()
        if z is not None:
            if out_z is None:
                out_z = torch.empty((K // L, N))
            out_z[:, r : r + n] = z.t()
    return out_q, _narrow(out_s), _narrow(out_z) if out_z is not None else torch.empty(0)


def packed_bytes(spec: QuantSpec) -> int:
    """Bytes the packed form of a tensor of this spec takes at most (scales as float32)."""
    N, K = spec.shape
    L = 16 if spec.qtype in _SUB_16 else 32
    code = K // 2 if spec.qtype in FOUR_BIT else K
    return N * (code + 8 * (K // L))


def packable(module: torch.nn.Module) -> bool:
    return isinstance(module, (QuantLinear, QuantEmbedding)) and isinstance(module.spec, QuantSpec) \
        and module.spec.qtype in _PACKED_TYPES


_PACKED_TYPES = set(QUANT_TYPES) - {0, 1, 30}  # the block types (F32, F16, BF16 are plain floats)


def base_packed_bytes(state_dict: dict, device: torch.device) -> int | None:
    """What a base's weights take once packed (its float tensors as they are), or None where
    they cannot be packed: not the cpu, no compiler for the kernels, or a quantized tensor
    of a kind pack leaves alone (MLX, or no quantized tensor at all). `state_dict` is a
    formats.base.Base's, held quantized: tensors and QuantTensors (parts, spec)."""
    if device.type != "cpu" or compile_unavailable(device):
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


def pack(model: torch.nn.Module) -> int:
    """Pack every GGUF-quantized linear and embedding of a model for generation, in place
    (a tied head shares its embedding's packed parts). Returns how many tensors were packed."""
    done: dict[int, tuple[PackedSpec, tuple]] = {}
    for m in list(model.modules()):
        if not packable(m):
            continue
        blocks = m.weight
        key = blocks.data_ptr()
        if key not in done:
            spec = PackedSpec(m.spec.qtype, m.spec.shape)
            done[key] = (spec, pack_parts(blocks, m.spec))
        spec, parts = done[key]
        del m.weight
        m.spec = spec
        register_parts(m, spec, parts)
    return len(done)


def _page_out(t: torch.Tensor) -> None:
    """Ask the kernel to drop t's pages from memory (MADV_PAGEOUT keeps their contents: a
    file-backed page is read again if touched, an anonymous one swapped). Best effort."""
    advice = getattr(mmap, "MADV_PAGEOUT", None)
    if advice is None or t.device.type != "cpu" or t.numel() == 0:
        return
    import ctypes

    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if end > start:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(advice))
