"""A llama reply from its first token to its last in C (models/decode_step.c), torch-free.

`toy infer`'s replies on a llama GGUF (one-shot, or an interactive chat's turns on one
State) step every token here: the prompt one token
at a time, then each new one, through the blocks, the final norm and the head, with the
draws taken by `pick` below. A `Model` is a plan (numbers and array names, JSON) and its
arrays (numpy: a torch model's blocked parts seen without a copy, models/decode_native.py
`reply_model`, or the same bytes mapped from toy's cache, formats/reply_image.py); the C
structs are made from them here and nowhere else. Nothing here imports torch: a reply whose
model is in toy's cache starts without it (`import torch` was 1.0-1.4 s of a 2.7 s
100-token reply on a 2-core Zen 4, docs/performance.md).

The draws are sample.pick's and sample.draw's (temperature, then top-k, then top-p, one
inverse-CDF draw a token) from the uniforms torch's CPU generator gives for the same seed
(`TorchUniforms`); the probabilities are numpy's float32 softmax, not torch's, so a token
can differ from sample.pick's where a uniform falls within a rounding of a boundary. Every
reply of a model goes through this loop, the first one (from torch's tensors) as every later
one (from the cache): the same command gives the same text."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from toy.models import native

RB = 32  # rows a block of the blocked order (decode_step.c's RB)
SOURCE = Path(__file__).with_name("decode_step.c")
PROJ = ("q", "k", "v", "o", "gate", "up", "down")
# Positions the rotary tables of a stored model cover (4 MB for SmolLM2's 64 dims): a reply
# that needs more takes torch's path.
TABLE_POSITIONS = 32768


class Packed(ctypes.Structure):
    _fields_ = [
        ("words", ctypes.c_void_p),
        ("s", ctypes.c_void_p),
        ("z", ctypes.c_void_p),
        ("G", ctypes.c_int64),
        ("W", ctypes.c_int64),
        ("N", ctypes.c_int64),
        ("bits", ctypes.c_int32),
        ("wide", ctypes.c_int32),
    ]


class LlamaBlock(ctypes.Structure):
    _fields_ = [(name, Packed) for name in PROJ] + [
        ("norm1", ctypes.c_void_p),
        ("norm2", ctypes.c_void_p),
        ("eps1", ctypes.c_double),
        ("eps2", ctypes.c_double),
        ("scale", ctypes.c_double),
        ("d_model", ctypes.c_int64),
        ("d_ff", ctypes.c_int64),
        ("n_head", ctypes.c_int64),
        ("n_kv", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("rot", ctypes.c_int64),
    ]


BLOCK_NUMBERS = ("eps1", "eps2", "scale", "d_model", "d_ff", "n_head", "n_kv", "head_dim", "rot")
PACKED_NUMBERS = ("G", "W", "N", "bits", "wide")


def library() -> dict | None:
    """decode_step.c's functions, or None where it does not build (models/native.py)."""
    P, I64, F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    return native.kernels(
        SOURCE,
        {
            "toy_packed_matvec": ([P, P, P], None),
            "toy_llama_steps": ([P, I64, P, P, P, P, P, P, I64, I64], None),
            "toy_packed_row": ([P, I64, P], None),
            "toy_rms_norm": ([P, P, F64, I64, P], None),
            "toy_threads": ([ctypes.c_int], ctypes.c_int),
        },
        # the products' multiply-adds fused (one rounding each): the sums are float32 and
        # only reordered against the dequantized product, as inductor's kernels are
        extra=("-fopenmp", "-ffp-contract=fast"),
    )


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None or a.size == 0 else a.ctypes.data


def struct(d: dict, arrays: dict) -> Packed:
    """The C struct of a packed dict (see Model; valid while its arrays live)."""
    z = arrays[d["z"]] if d.get("z") else None
    return Packed(
        _ptr(arrays[d["words"]]),
        _ptr(arrays[d["s"]]) if d.get("s") else None,
        _ptr(z),
        *(d[k] for k in PACKED_NUMBERS),
    )


def block_array(blocks: list[dict], arrays: dict):
    """The C array of a plan's blocks (see Model; valid while its arrays live)."""
    return (LlamaBlock * len(blocks))(
        *(
            LlamaBlock(
                *(struct(b[p], arrays) for p in PROJ),
                _ptr(arrays[b["norm1"]]),
                _ptr(arrays[b["norm2"]]),
                *(b[k] for k in BLOCK_NUMBERS),
            )
            for b in blocks
        )
    )


def _check(d: dict, arrays: dict, rows: int, cols: int, what: str) -> None:
    """A packed dict's arrays are what decode_step.c will read for a (rows, cols) matrix: the
    shapes, dtypes and sizes its loops index by (a kept file's plan is checked, not trusted).
    ValueError where they are not."""
    words = arrays[d["words"]]
    G, W, N, bits, wide = (d[k] for k in PACKED_NUMBERS)
    ok = N == rows and words.flags.c_contiguous
    if bits == 32:
        ok = ok and words.dtype == np.float32 and words.shape == (rows, cols) and W == cols
    else:
        per = 8 if bits == 4 else 4
        nb, sdt = -(-rows // RB), np.dtype(np.float32 if wide else np.float16)
        ok = ok and bits in (4, 8) and G * W * per == cols and words.itemsize == 4
        ok = ok and words.shape == (nb, G, W, RB)
        for key in ("s", "z"):
            a = arrays[d[key]] if d.get(key) else None
            if key == "s" or a is not None:
                ok = ok and a is not None and a.dtype == sdt and a.shape == (nb, G, RB)
                ok = ok and a.flags.c_contiguous
    if not ok:
        raise ValueError(f"{what}: its arrays are not the plan's")


def _check_plan(plan: dict, arrays: dict) -> None:
    """Every matrix, norm and table of a plan as decode_step.c's buffers are sized."""
    first = plan["blocks"][0]
    C = first["d_model"]
    for i, b in enumerate(plan["blocks"]):
        H, K, D, F = b["n_head"], b["n_kv"], b["head_dim"], b["d_ff"]
        if (
            b["d_model"] != C
            or min(H, K, D, F) < 1
            or H % K
            or not 0 < b["rot"] <= D
            or b["rot"] % 2
            or b["rot"] != first["rot"]
        ):
            raise ValueError(f"block {i}: its numbers do not fit")
        shapes = {"q": (H * D, C), "k": (K * D, C), "v": (K * D, C), "o": (C, H * D)}
        shapes |= {"gate": (F, C), "up": (F, C), "down": (C, F)}
        for p in PROJ:
            _check(b[p], arrays, *shapes[p], f"block {i} {p}")
        for n in ("norm1", "norm2"):
            if arrays[b[n]].dtype != np.float32 or arrays[b[n]].shape != (C,):
                raise ValueError(f"block {i} {n}: not {C} float32 values")
    _check(plan["head"], arrays, plan["head"]["N"], C, "head")
    _check(plan["embed"], arrays, plan["embed"]["N"], C, "embedding")
    norm, cos, sin = (arrays[plan[k]] for k in ("norm", "cos", "sin"))
    if norm.dtype != np.float32 or norm.shape != (C,):
        raise ValueError("the final norm: not the model's width")
    for t in (cos, sin):
        if (
            t.dtype != np.float32
            or t.ndim != 2
            or t.shape[1] != first["rot"]
            or not t.shape[0]
            or not t.flags.c_contiguous
            or t.shape != cos.shape
        ):
            raise ValueError("the rotary tables: not (positions, rot) float32")


class Model:
    """A llama model as decode_step.c steps it. plan: {"blocks": [{proj: packed, "norm1",
    "norm2": array names, BLOCK_NUMBERS...}], "head", "embed": packed, "norm": name,
    "norm_eps", "cos", "sin": names ((P, rot) float32 tables), "limit": the context};
    a packed matrix is {"words", "s", "z": array names (z None: none), PACKED_NUMBERS}.
    The arrays are held as long as the model is; ValueError where they do not fit the plan
    (their shapes and dtypes against its numbers, _check_plan)."""

    def __init__(self, plan: dict, arrays: dict[str, np.ndarray]):
        self.plan, self.arrays = plan, arrays
        _check_plan(plan, arrays)
        self.lib = library()
        if self.lib is None:
            raise OSError("toy's C library did not build")
        self.blocks = block_array(plan["blocks"], arrays)
        self.head, self.embed = struct(plan["head"], arrays), struct(plan["embed"], arrays)
        self.norm = arrays[plan["norm"]]
        self.cos, self.sin = arrays[plan["cos"]], arrays[plan["sin"]]
        first = plan["blocks"][0]
        self.d_model, self.n_kv, self.head_dim = first["d_model"], first["n_kv"], first["head_dim"]
        self.vocab = plan["head"]["N"]

    def positions(self) -> int:
        """The most positions a reply may hold: the context, as far as the tables go."""
        return positions(self.plan, self.arrays)


def positions(plan: dict, arrays: dict) -> int:
    """A plan's most positions (Model.positions), before any library is loaded."""
    return min(plan["limit"], arrays[plan["cos"]].shape[0])


def _zeros(shape: tuple) -> np.ndarray:
    """float32 zeros on an anonymous map of their own: pages taken only where written (a
    chat's state holds the model's whole context: 377 MB for SmolLM2, of which a turn writes
    little). np.zeros is calloc, which under toy's malloc setting (runs.tune_malloc: large
    blocks from the heap) writes every page."""
    import mmap

    size = int(np.prod(shape)) * 4
    return np.frombuffer(mmap.mmap(-1, max(size, 1)), np.float32, size // 4).reshape(shape)


class State:
    """One reply's KV cache (every block's keys and values for `positions` positions, the
    pages taken only where written) and its position."""

    def __init__(self, model: Model, positions: int):
        self.m, self.pos, self.positions = model, 0, positions
        n, shape = len(model.blocks), (model.n_kv, positions, model.head_dim)
        self.k = [_zeros(shape) for _ in range(n)]
        self.v = [_zeros(shape) for _ in range(n)]
        self.kp = (ctypes.c_void_p * n)(*(t.ctypes.data for t in self.k))
        self.vp = (ctypes.c_void_p * n)(*(t.ctypes.data for t in self.v))
        self.x = np.empty(model.d_model, np.float32)
        self.out = np.empty(model.d_model, np.float32)

    def truncate(self, keep: int) -> None:
        """Keep the first `keep` positions (an interactive chat's turn: the conversation's
        unchanged start); the next token goes to position keep."""
        self.pos = min(self.pos, keep)

    def reserve(self, positions: int) -> None:
        """KVCache's: nothing to grow (a session's state holds the model's positions, its
        pages taken only where written)."""

    def step(self, token: int, logits: bool) -> np.ndarray | None:
        """The token at the next position through every block; the logits (V,) after it
        where asked."""
        m, lib = self.m, self.m.lib
        if not 0 <= token < m.plan["embed"]["N"]:
            raise ValueError(f"token id {token} is outside the vocabulary")
        lib["toy_packed_row"](ctypes.byref(m.embed), token, self.x.ctypes.data)
        lib["toy_llama_steps"](
            m.blocks,
            len(m.blocks),
            self.x.ctypes.data,
            self.out.ctypes.data,
            m.cos[self.pos].ctypes.data,
            m.sin[self.pos].ctypes.data,
            self.kp,
            self.vp,
            self.positions * m.head_dim,
            self.pos,
        )
        self.pos += 1
        if not logits:
            return None
        h = np.empty_like(self.out)
        lib["toy_rms_norm"](
            self.out.ctypes.data, m.norm.ctypes.data, m.plan["norm_eps"], m.d_model, h.ctypes.data
        )
        y = np.empty(m.vocab, np.float32)
        lib["toy_packed_matvec"](ctypes.byref(m.head), h.ctypes.data, y.ctypes.data)
        return y


class TorchUniforms:
    """The float64 uniforms `torch.rand(1, 1, dtype=torch.float64, generator=g)` draws from
    `torch.Generator().manual_seed(seed)` (sample.seeded on a cpu), one a call, without torch:
    torch's CPU generator is MT19937 seeded as init_genrand(the seed's low 32 bits), and a
    float64 takes the low 53 bits of two outputs, the first the high word
    (tests/models/test_reply_c.py holds the two streams equal)."""

    def __init__(self, seed: int):
        legacy = np.random.RandomState(seed & 0xFFFFFFFF)
        self.bits = np.random.MT19937()
        key, pos = legacy.get_state()[1:3]
        self.bits.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": pos}}

    def __call__(self) -> float:
        hi, lo = (int(v) for v in self.bits.random_raw(2))
        return float(((hi << 32) | lo) & ((1 << 53) - 1)) * 2.0**-53


def pick(
    logits: np.ndarray,
    temperature: float,
    top_k: int,
    top_p: float,
    uniforms: TorchUniforms | None,
) -> int:
    """One token from logits (V,), as sample.pick takes one: temperature <= 0 the argmax;
    else over temperature in float32, top_k's k largest kept (ties with the k-th too), top_p's
    smallest most-likely-first prefix reaching top_p kept (one at least), then one draw
    against the running sum in float64."""
    if temperature <= 0:
        return int(np.argmax(logits))
    V = logits.shape[0]
    x = logits.astype(np.float32) / np.float32(temperature)
    if 0 < top_k < V:
        kth = np.partition(x, V - top_k)[V - top_k]
        x = np.where(x < kth, np.float32(-np.inf), x)
    e = np.exp(x - x.max())
    probs = e / e.sum(dtype=np.float32)
    if 0.0 < top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sp = probs[order]
        sp[np.cumsum(sp, dtype=np.float32) - sp > np.float32(top_p)] = 0.0
        probs = np.zeros_like(probs)
        probs[order] = sp
    cdf = np.cumsum(probs, dtype=np.float64)
    u = uniforms() if uniforms is not None else 0.5
    return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), V - 1)


def reply(
    model: Model,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: set[int] | None = None,
    state: State | None = None,
) -> Iterator[int]:
    """New token ids one at a time, as models/generate.py's `generate` yields them: a stop id
    ends the reply (not yielded), and so does a full context; a prompt longer than the
    context keeps its end. `state` (State of Model.positions()): a conversation carried on,
    prompt_ids only what is new since its position; its last token is fed to it too, as
    generate feeds a cache it is given."""
    if not prompt_ids:
        raise ValueError("empty prompt")
    limit = model.positions()
    last = state is None  # no step after the reply's last token: nothing reads it
    if state is None:
        ids = prompt_ids[-limit:]
        state = State(model, min(limit, len(ids) + max_new_tokens))
    else:
        room = state.positions - state.pos
        if room < 1:
            raise ValueError(f"the cache already holds the model's whole context ({limit} tokens)")
        ids = prompt_ids[-room:]
    uniforms = TorchUniforms(seed) if temperature > 0 else None
    for t in ids[:-1]:
        state.step(t, logits=False)
    logits = state.step(ids[-1], logits=True)
    for i in range(max_new_tokens):
        nxt = pick(logits, temperature, top_k, top_p, uniforms)
        if stop_ids and nxt in stop_ids:
            return
        yield nxt
        if state.pos >= state.positions or (last and i == max_new_tokens - 1):
            return  # the context (or a one-shot reply) is full
        logits = state.step(nxt, logits=True)


def threads(n: int) -> int:
    """OpenMP's thread count for the products in a process without torch (see toy_threads)."""
    lib = library()
    return lib["toy_threads"](n) if lib is not None else 1
