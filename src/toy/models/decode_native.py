"""One token through a llama block in C (models/decode_step.c), for a reply on a packed base.

A reply decodes one row of float32 at a time; models/decode.py compiles each block's step
with inductor, whose product on the codes read them at half the machine's memory speed
(decode_step.c's head says why). Where a model is llama's (RMSNorm, attention with grouped
K/V heads and half-split rotary, SwiGLU; no biases, no per-head norms, no sliding window or
capped scores) and its blocks' products are packed codes (decode.pack), or float32 rows
where an adapter was merged into them, `install` gives its `hidden` a C path for a reply's
tokens: at a generation's first call the codes of the blocks and of the head are put in
decode_step.c's order (decode.PackedSpec's blocked parts, in place of the grouped ones: no
second copy), and each token is then one library call for all the blocks and one for the
head. A prompt's prefill dequantizes the same parts (PackedSpec.columns takes either
order). Every other call (more rows, autocast, a gradient, a padded cache), family, device
or a model with no packed block keeps decode.py's path, and so does a machine where the
library does not build (no C compiler, TOY_NATIVE=0)."""

from __future__ import annotations

import ctypes

import torch

from toy.models import native, reply_c
from toy.models.reply_c import RB, Packed, library


def _packed_spec(spec) -> bool:
    """Whether a spec is decode.PackedSpec's (read by what it holds: decode imports this
    module, not the other way round)."""
    return hasattr(spec, "blocked") and getattr(spec, "matvec_ready", False)


def blockable(m) -> bool:
    """Whether a module's packed parts can be put in the blocked order (on the cpu)."""
    spec = getattr(m, "spec", None)
    if not _packed_spec(spec) or m.codes.device.type != "cpu":
        return False
    return True


def _padded(t: torch.Tensor, blocks: int) -> torch.Tensor:
    """t (..., N) with zero rows after the last, to blocks * RB rows."""
    extra = blocks * RB - t.shape[-1]
    return torch.nn.functional.pad(t, (0, extra)) if extra else t


def to_blocked(modules) -> None:
    """Put these modules' packed parts in the blocked order, in place of the grouped ones
    (modules that share parts, a tied head and embedding, share the new ones)."""
    from toy.models.quant import parts_of, register_parts

    done: dict[int, tuple] = {}
    files = _file_maps()
    for m in modules:
        if m.spec.blocked:
            continue
        key = id(m.codes)
        if key not in done:
            words, s, z = parts_of(m)
            if z.numel() and z.dtype != s.dtype:  # decode._narrow kept one in float16: both
                s, z = s.float(), z.float()  # float32 (exact), one dtype for the C loop
            G, W, N = words.shape
            nb = -(-N // RB)
            parts = (
                _padded(words.view(torch.int32), nb).view(words.dtype).reshape(G, W, nb, RB),
                _padded(s, nb).reshape(G, nb, RB),
                _padded(z, nb).reshape(G, nb, RB) if z.numel() else None,
            )
            parts = (
                parts[0].permute(2, 0, 1, 3).contiguous(),
                parts[1].permute(1, 0, 2).contiguous(),
                # a new empty tensor, not the cache's: that one held the packed cache file's
                # whole map (96 MB of SmolLM2's old order) alive
                parts[2].permute(1, 0, 2).contiguous() if z.numel() else z.new_empty(0),
            )
            done[key] = (type(m.spec)(m.spec.qtype, m.spec.shape, blocked=True), parts)
            for t in (words, s, z):
                _drop_file_pages(t, files)
        spec, parts = done[key]
        m.spec = spec
        register_parts(m, spec, parts)


def _file_maps() -> list[tuple[int, int]]:
    """The address ranges of this process's private maps of files (toy's packed cache is
    read as one: safetensors maps the file)."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                cols = line.split()
                if len(cols) >= 6 and cols[5].startswith("/") and cols[1].endswith("p"):
                    lo, hi = cols[0].split("-")
                    out.append((int(lo, 16), int(hi, 16)))
    except OSError:
        pass
    return out


def _drop_file_pages(t: torch.Tensor, files: list[tuple[int, int]]) -> None:
    """Drop the resident pages of a tensor that lies in a private map of a file, once its
    parts are copied into the blocked order: read again from the file if anything touches
    them (their bytes are the file's: nothing writes them), so the old order does not stay in
    memory beside the new until the last of the file's tensors goes (+74 MB of SmolLM2's peak
    while they did). MADV_PAGEOUT did not drop them on the 2-core VM of docs/performance.md."""
    import mmap

    start, size = t.data_ptr(), t.numel() * t.element_size()
    if size and any(lo <= start and start + size <= hi for lo, hi in files):
        native.advise(start, size, mmap.MADV_DONTNEED)


def packed(spec, parts: tuple[torch.Tensor, ...]) -> Packed:
    """The struct decode_step.c reads for blocked parts (valid while they live)."""
    words, s, z = parts
    nb, G, W, R = words.shape
    return Packed(
        words.data_ptr(),
        s.data_ptr(),
        z.data_ptr() if z.numel() else None,
        G,
        W,
        spec.shape[0],
        4 if spec.four_bit else 8,
        int(s.dtype == torch.float32),
    )


def kernel(spec, parts: tuple[torch.Tensor, ...]):
    """PackedSpec.matvec's kernel for blocked parts: called with [x, *parts], returns (W x,)
    from decode_step.c; the parts it was made for are held (a call with others, which a
    spec shared by modules of one shape could see, is made a struct of its own). None where
    the library does not load (never blocked then: the caller keeps its torch lines)."""
    lib = library()
    if lib is None:
        return None
    fn, held = lib["toy_packed_matvec"], tuple(parts)
    mine = packed(spec, held)

    def run(args):
        x, *ps = args
        p = mine if ps[0] is held[0] else packed(spec, tuple(ps))
        y = torch.empty(spec.shape[0], dtype=torch.float32)
        fn(ctypes.byref(p), x.data_ptr(), y.data_ptr())
        return (y,)

    return run


def _float_rows(m) -> bool:
    """Whether a projection is float rows the step takes as they are: an nn.Linear (an adapter
    merged into it: toy/lora.py merge_lora) or a GGUF tensor stored as F32/F16/BF16 (which
    decode.pack leaves unpacked), on the cpu, without a bias."""
    from toy.models.quant import QuantLinear, QuantSpec
    from toy.models.quant_types import BF16, F16, F32

    if type(m) is torch.nn.Linear:
        w = m.weight
        return m.bias is None and w.dtype == torch.float32 and w.device.type == "cpu"
    return (
        type(m) is QuantLinear
        and type(m.spec) is QuantSpec
        and m.spec.qtype in (F32, F16, BF16)
        and m.bias is None
        and m.weight.device.type == "cpu"
    )


def _plain_linear(m) -> bool:
    """A projection the step takes: packed codes, or float rows (_float_rows)."""
    from toy.models.quant import QuantLinear

    if _float_rows(m):
        return True
    return (
        type(m) is QuantLinear
        and _packed_spec(m.spec)
        and getattr(m, "bias", None) is None
        and m.codes.device.type == "cpu"
    )


def _rows_weight(m) -> torch.Tensor:
    """A _float_rows projection's weight as float32 rows (N, K): its own, or the file's
    F16/BF16 widened (a copy, held by the step)."""
    if type(m) is torch.nn.Linear:
        return m.weight.detach().contiguous()
    return m.dequantized(torch.float32).contiguous()


def _projections(block) -> list | None:
    """A llama block's seven linears in _PROJ's order, None where it is not one (see the
    module's docstring for what a step here covers)."""
    from toy.models.layers import Attention, RMSNorm, SwiGLU

    a, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
    norms = (
        getattr(block, "input_layernorm", None),
        getattr(block, "post_attention_layernorm", None),
    )
    if (
        type(block).__name__ != "Block"
        or type(block).__module__ != "toy.models.llama"
        or type(a) is not Attention
        or type(mlp) is not SwiGLU
        or not all(type(n) is RMSNorm and n.weight.dtype == torch.float32 for n in norms)
        or a.q_norm is not None
        or a.window
        or a.softcap
        or a.n_head % a.n_kv_head
    ):
        return None
    lins = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return lins if all(_plain_linear(m) for m in lins) else None


def _rows_cols(m) -> tuple[int, int]:
    return (m.out_features, m.in_features)


def _shapes_fit(block, lins: list) -> bool:
    """Whether the projections' shapes are the ones decode_step.c sizes its buffers by (a
    llama.Block's always are; checked, not trusted)."""
    a = block.self_attn
    C, H, K, D = block.input_layernorm.weight.shape[0], a.n_head, a.n_kv_head, a.head_dim
    F = lins[4].out_features
    want = [(H * D, C), (K * D, C), (K * D, C), (C, H * D), (F, C), (F, C), (C, F)]
    return [_rows_cols(m) for m in lins] == want


class _Plan:
    """reply_c.Model's plan and arrays for a model's torch tensors: each tensor once (a tied
    head and embedding share their parts), seen by numpy without a copy; `held` keeps the
    tensors (copies among them: a file's F16 rows widened) alive with the model."""

    def __init__(self):
        self.arrays: dict[str, object] = {}
        self.names: dict[tuple[int, int], str] = {}
        self.held: list[torch.Tensor] = []

    def name(self, t: torch.Tensor) -> str:
        key = (t.data_ptr(), t.numel())
        if key not in self.names:
            self.names[key] = f"t{len(self.names)}"
            self.held.append(t)
            self.arrays[self.names[key]] = t.detach().numpy()
        return self.names[key]

    def matrix(self, m) -> dict:
        """A projection or head as reply_c's packed dict: its blocked parts, or float32 rows
        (_float_rows)."""
        if _float_rows(m):
            w = _rows_weight(m)
            return {
                "words": self.name(w),
                "s": None,
                "z": None,
                **dict(zip(reply_c.PACKED_NUMBERS, (1, w.shape[1], w.shape[0], 32, 1))),
            }
        from toy.models.quant import parts_of

        words, sc, z = parts_of(m)
        nb, G, W, R = words.shape
        return {
            "words": self.name(words),
            "s": self.name(sc),
            "z": self.name(z) if z.numel() else None,
            "G": G,
            "W": W,
            "N": m.spec.shape[0],
            "bits": 4 if m.spec.four_bit else 8,
            "wide": int(sc.dtype == torch.float32),
        }

    def block(self, block, lins: list) -> dict:
        """A llama block as decode_step.c takes it, its linears' parts already blocked."""
        a = block.self_attn
        n1, n2 = block.input_layernorm, block.post_attention_layernorm
        return {
            **{p: self.matrix(m) for p, m in zip(reply_c.PROJ, lins)},
            "norm1": self.name(n1.weight.detach().contiguous()),
            "norm2": self.name(n2.weight.detach().contiguous()),
            "eps1": float(n1.eps),
            "eps2": float(n2.eps),
            "scale": float(a.scale if a.scale is not None else a.head_dim**-0.5),
            "d_model": n1.weight.shape[0],
            "d_ff": lins[4].out_features,
            "n_head": a.n_head,
            "n_kv": a.n_kv_head,
            "head_dim": a.head_dim,
            "rot": a.head_dim,  # llama's Rotary turns the whole head (Hidden checks the tables)
        }


def _tied_to_head(model) -> list:
    head = model.lm_head
    return [m for m in model.modules() if m is not head and getattr(m, "codes", None) is head.codes]


class Hidden:
    """A llama model's `hidden` (see models/llama.py) with one token of a reply through
    decode_step.c: one row of float32, no gradient, no autocast, a cache without padding
    on the cpu; the model's own `hidden` for everything else. The blocks' specs are built,
    and the parts put in the blocked order, at a generation's first call (its prompt: None
    until then; False where a block has none)."""

    def __init__(self, model, eager):
        self.model, self.eager = model, eager
        self.blocks = None  # ctypes array of LlamaBlock, or False
        self.plan = None  # _Plan of the blocks (reply_model adds the rest)
        self.held: list[torch.Tensor] = []

    def _build(self) -> bool:
        """The blocks' specs, their parts (and the head's) put in the blocked order; False
        (for good) where a block is not one decode_step.c steps or the library does not build."""
        lib = library()
        lins = [_projections(b) for b in self.model.blocks]
        if (
            lib is None
            or not all(ls and all(_float_rows(m) or blockable(m) for m in ls) for ls in lins)
            or all(_float_rows(m) for ls in lins for m in ls)  # a float model: decode.py's
            or not all(_shapes_fit(b, ls) for b, ls in zip(self.model.blocks, lins))
        ):
            self.blocks = False
            return False
        to_blocked([m for ls in lins for m in ls if not _float_rows(m)])
        head = self.model.lm_head
        if blockable(head) and not head.spec.blocked:
            to_blocked([head] + _tied_to_head(self.model))
        plan = _Plan()
        blocks = [plan.block(b, ls) for b, ls in zip(self.model.blocks, lins)]
        self.blocks = reply_c.block_array(blocks, plan.arrays)
        self.plan, self.block_plans, self.held = plan, blocks, plan.held
        self.fn = lib["toy_llama_steps"]
        return True

    def __call__(self, idx: torch.Tensor, cache=None) -> torch.Tensor:
        if self.blocks is False or cache is None or torch.is_grad_enabled() or self.model.training:
            return self.eager(idx, cache)
        if self.blocks is None and not self._build():  # at a generation's first call, the
            return self.eager(idx, cache)  # prompt's: its head's row runs in C too
        if (
            idx.shape != (1, 1)
            or cache.pad is not None
            or cache.pos >= cache.max_len
            or torch.is_autocast_enabled("cpu")
        ):
            return self.eager(idx, cache)
        kc, vc = cache.k, cache.v
        k0 = kc[0]
        D = self.blocks[0].head_dim
        if (
            len(kc) != len(self.blocks)
            or len(vc) != len(kc)
            or k0.dtype != torch.float32
            or k0.device.type != "cpu"
            or k0.shape[:2] != (1, self.blocks[0].n_kv)
            or k0.shape[2] <= cache.pos
            or k0.shape[3] != D
            or k0.stride(-1) != 1
            or k0.stride(-2) != D
            or any(
                t.shape != k0.shape or t.stride() != k0.stride() or t.dtype != k0.dtype
                for t in (*kc, *vc)
            )
        ):
            return self.eager(idx, cache)
        x = self.model.embed_tokens(idx)
        if x.dtype != torch.float32:
            return self.eager(idx, cache)
        cos, sin = self.model.rotary.tables(cache.pos, 1)
        cos, sin = cos.reshape(-1).contiguous(), sin.reshape(-1).contiguous()
        if cos.numel() != self.blocks[0].rot:
            return self.eager(idx, cache)
        x = x.contiguous()
        out = torch.empty_like(x)
        n = len(self.blocks)
        kp = (ctypes.c_void_p * n)(*(t.data_ptr() for t in kc))
        vp = (ctypes.c_void_p * n)(*(t.data_ptr() for t in vc))
        self.fn(
            self.blocks,
            n,
            x.data_ptr(),
            out.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            kp,
            vp,
            k0.stride(1),
            cache.pos,
        )
        cache.pos += 1
        return self.model.norm(out)


def reply_model(model) -> reply_c.Model | None:
    """reply_c's Model of a llama model whose reply tokens the C step takes (Hidden, built
    here where it was not: the parts put in the blocked order), on the model's own tensors:
    its blocks, final norm and head, its embedding (the head's parts where tied, else put in
    the blocked order too, or float32 rows), and the rotary tables of its context (as far as
    reply_c.TABLE_POSITIONS). None where a part is not one decode_step.c takes."""
    from toy.models.layers import RMSNorm

    hidden = getattr(model, "__dict__", {}).get("hidden")
    if not isinstance(hidden, Hidden) or model.training or model.final_softcap:
        return None
    if hidden.blocks is None:
        hidden._build()
    norm, head, emb = model.norm, model.lm_head, model.embed_tokens
    if (
        not hidden.blocks
        or type(norm) is not RMSNorm
        or norm.weight.dtype != torch.float32
        or not (blockable(head) or _float_rows(head))
        or getattr(head, "bias", None) is not None
    ):
        return None
    plan = hidden.plan
    if blockable(head) and not head.spec.blocked:
        to_blocked([head] + _tied_to_head(model))
    head_d = plan.matrix(head)
    if getattr(emb, "codes", None) is not None and emb.codes is getattr(head, "codes", None):
        embed_d = head_d  # tied: the head's rows are the embeddings
    elif blockable(emb):
        to_blocked([emb])
        embed_d = plan.matrix(emb)
    elif (
        type(emb) is torch.nn.Embedding
        and emb.weight.dtype == torch.float32
        and emb.weight.device.type == "cpu"
    ):
        w = emb.weight.detach().contiguous()
        embed_d = {"words": plan.name(w), "s": None, "z": None}
        embed_d |= dict(zip(reply_c.PACKED_NUMBERS, (1, w.shape[1], w.shape[0], 32, 1)))
    else:
        return None
    limit = int(model.cfg.max_seq_len)
    cos, sin = model.rotary.tables(0, min(limit, reply_c.TABLE_POSITIONS))
    if cos.dtype != torch.float32 or cos.shape[-1] != hidden.block_plans[0]["rot"]:
        return None
    out = reply_c.Model(
        {
            "blocks": hidden.block_plans,
            "head": head_d,
            "embed": embed_d,
            "norm": plan.name(norm.weight.detach().contiguous()),
            "norm_eps": float(norm.eps),
            "cos": plan.name(cos.contiguous()),
            "sin": plan.name(sin.contiguous()),
            "limit": limit,
        },
        plan.arrays,
    )
    out.held = plan.held
    return out


def serving(model) -> bool:
    """Whether a model's reply tokens went through the C step (its blocks' specs built): then
    decode.py's steps were not built, and nothing is to be marked as built."""
    hidden = getattr(model, "__dict__", {}).get("hidden")
    return isinstance(hidden, Hidden) and bool(hidden.blocks)


def covers(cfg) -> bool:
    """Whether a packed model of this config takes its reply's tokens here, so that packing it
    costs no compile (cmd_infer's auto: decode.py's steps take ~20 s to build the first time):
    llama's plain block, the library built. A base whose projections do not all pack still
    finds out at its first call."""
    from toy.models.llama import LlamaConfig

    if type(cfg) is not LlamaConfig or cfg.qkv_bias or cfg.qk_norm or cfg.sliding_window:
        return False
    return cfg.n_head % cfg.n_kv_head == 0 and library() is not None


def install(model) -> bool:
    """Give a llama model on packed codes the C step for a reply's tokens (Hidden); False
    where the model is not llama's. Whether its blocks qualify is seen at the first token."""
    from toy.models.llama import Llama

    if type(model) is not Llama or isinstance(model.__dict__.get("hidden"), Hidden):
        return False
    model.hidden = Hidden(model, model.hidden)
    return True
