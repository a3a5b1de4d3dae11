"""LoRA: low-rank adapters wrapped around a loaded base model's linear layers.

Applied *after* the base is loaded (mlx-lm's `from_base`, torchtune's shape):

    model = Llama(cfg); model.load_state_dict(base_sd, strict=True)
    names = apply_lora(model, ["q_proj", "v_proj"], rank=8, alpha=16, dropout=0.05, seed=0)

`LoRALinear` keeps the base's parameter names `weight` / `bias` on itself, so the
wrapped model's keys for the base are unchanged and a base state dict still loads
with `strict=True` (the adapter's own `lora_A` / `lora_B` may be absent from it).

    y = x W^T + b + (dropout(x) A^T B^T) * alpha / r      A: (r, in), B: (out, r)

B starts at zero, so at init the wrapped model computes exactly what the base does.
A is kaiming-uniform as in PEFT, drawn from a generator seeded by (seed, module name):
the same seed gives the same adapter whatever order the modules are visited in.

The tied output head (`lm_head`, which *is* the token embedding in SmolLM2-style
models) is never a target: PEFT and llama.cpp's converter both mishandle it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from toy.errors import InputError, UsageError
from toy.models.ordered import ordered, ordered_mm
from toy.models.quant import QuantLinear, Spec, frozen_linear, parts_of, register_parts
from toy.models.registry import lora_targets

# Every family's linear layers (llama-style, and Phi-3's fused ones), as the families
# declare them; a model takes the ones it has (apply_lora says which, when one matches nothing).
VALID_TARGETS = lora_targets()


class LoRALinear(nn.Module):
    """A frozen `nn.Linear` (or a QuantLinear over GGUF blocks) plus a trainable
    low-rank update.

    Built from an existing linear layer with `LoRALinear.from_linear`; the base
    `weight` / `bias` tensors are reused (not copied), so tying and device placement are
    preserved. A quantized base keeps its blocks as the `weight` buffer and its
    spec (GGUF or MLX): the base path dequantizes per use (models.quant.frozen_linear).
    """

    def __init__(
        self,
        weight: torch.Tensor | tuple[torch.Tensor, ...],
        bias: nn.Parameter | None,
        rank: int,
        alpha: float,
        dropout: float,
        generator: torch.Generator | None = None,
        spec: Spec | None = None,
    ):
        super().__init__()
        self.spec = spec
        if spec is not None:  # the quantized parts, under the spec's names (as in QuantLinear)
            self.out_features, self.in_features = spec.shape
            register_parts(self, spec, weight if isinstance(weight, tuple) else (weight,))
            weight = self.weight
        else:
            self.out_features, self.in_features = weight.shape
            self.weight = weight
        self.bias = bias
        self.rank = rank
        self.alpha = alpha
        self.scaling = alpha / rank
        # Adapter weights stay in float32 when the base is half precision or quantized:
        # AdamW's small updates to B would round away in bf16 (the base is frozen, so it
        # may stay low).
        dtype = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
        self.lora_A = nn.Parameter(
            torch.empty(rank, self.in_features, dtype=dtype, device=weight.device)
        )
        self.lora_B = nn.Parameter(
            torch.zeros(self.out_features, rank, dtype=dtype, device=weight.device)
        )
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.disabled = False  # disable_adapter: the base's output alone
        self.reset_lora(generator)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear | QuantLinear,
        rank: int,
        alpha: float,
        dropout: float,
        generator: torch.Generator | None = None,
    ) -> LoRALinear:
        if isinstance(linear, QuantLinear):
            return cls(parts_of(linear), linear.bias, rank, alpha, dropout, generator, linear.spec)
        return cls(linear.weight, linear.bias, rank, alpha, dropout, generator)

    def reset_lora(self, generator: torch.Generator | None = None) -> None:
        # PEFT's default: A ~ kaiming_uniform(a=sqrt(5)) (nn.Linear's own init, bound
        # 1/sqrt(in)), B = 0. Drawn on the CPU so a seed means the same A on every device.
        a = torch.empty(self.rank, self.in_features, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        with torch.no_grad():
            self.lora_A.copy_(a.to(self.lora_A.device, self.lora_A.dtype))
            self.lora_B.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = parts_of(self) if self.spec is not None else self.weight
        if torch.is_autocast_enabled(x.device.type):
            # The input in the compute dtype once, for the base and the adapter alike
            # (each would cast it again); the matmuls then run in that dtype.
            x = x.to(torch.get_autocast_dtype(x.device.type))
        y = frozen_linear(x, base, self.bias, self.spec)  # (..., out)
        if self.disabled:
            return y
        # Low rank first: (..., in) -> (..., r) -> (..., out). Never forms B @ A (out x in).
        h = self.dropout(x)
        if not torch.is_autocast_enabled(x.device.type):
            h = h.to(self.lora_A.dtype)
        if h.dtype == torch.float32 and torch.is_grad_enabled() and ordered(h):
            # float32 on the CPU: the adapter's gradients the same bytes at any thread count
            # (bf16's products are not, forward either: models/ordered.py)
            lora = _LowRank.apply(h, self.lora_A, self.lora_B)
        else:
            lora = F.linear(F.linear(h, self.lora_A), self.lora_B)
        return y + (lora * self.scaling).to(y.dtype)

    def base_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The frozen base weight as floats (out, in), dequantized when it is blocks."""
        if self.spec is not None:
            return self.spec.dequantize(parts_of(self), dtype)
        return self.weight.detach().to(dtype)

    def delta_weight(self) -> torch.Tensor:
        """B @ A * scaling, (out, in): what `merge_lora` adds to the base weight."""
        return (self.lora_B @ self.lora_A) * self.scaling

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # A base checkpoint knows nothing of the adapter: its absence is not an error, so
        # `model.load_state_dict(base_sd, strict=True)` works on the wrapped model. The
        # adapter itself is loaded strictly by `load_lora_state_dict`.
        n = len(missing_keys)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        lora_keys = {prefix + "lora_A", prefix + "lora_B"}
        missing_keys[n:] = [k for k in missing_keys[n:] if k not in lora_keys]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, rank={self.rank}, alpha={self.alpha}"
        )


class _LowRank(torch.autograd.Function):
    """(h A^T) B^T in float32: the same products, forward and for h's gradient, as two
    F.linear calls; A's and B's gradients, sums over the batch's tokens, by `ordered_mm`
    (models/ordered.py): the same bytes at any thread count, and autograd's own to the bit
    for a batch of at most SUM_RUN tokens."""

    @staticmethod
    def forward(ctx, h, a, b):
        mid = F.linear(h, a)
        ctx.save_for_backward(h, a, b, mid)
        return F.linear(mid, b)

    @staticmethod
    def backward(ctx, g):
        h, a, b, mid = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        dmid = g2.mm(b)
        grad_b = ordered_mm(g2.t(), mid.reshape(-1, mid.shape[-1]))
        grad_a = ordered_mm(dmid.t(), h.reshape(-1, h.shape[-1]))
        dh = dmid.mm(a).view(h.shape) if ctx.needs_input_grad[0] else None
        return dh, grad_a, grad_b


def _module_seed(seed: int, name: str) -> int:
    # A stable hash (not Python's salted hash()) of (seed, name): per-module streams that
    # do not depend on the order modules are wrapped in.
    digest = hashlib.sha256(f"toy-lora/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _check_args(targets: list[str], rank: int, alpha: float, dropout: float) -> None:
    problems = []
    valid = ", ".join(VALID_TARGETS)
    if isinstance(targets, str) or not targets:
        problems.append(f"--targets must be a non-empty list of module names from: {valid}")
    else:
        for t in targets:
            if t == "lm_head":
                problems.append(
                    f"--targets lm_head is not allowed: the output head is tied to the token "
                    f"embedding and PEFT/llama.cpp mishandle adapters on it; choose from: {valid}"
                )
            elif t not in VALID_TARGETS:
                problems.append(f"--targets {t!r} is not a valid target; choose from: {valid}")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        problems.append(f"--rank must be >= 1, got {rank}")
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        problems.append(f"--alpha must be > 0, got {alpha}")
    if not (isinstance(dropout, (int, float)) and 0 <= dropout < 1):
        problems.append(f"--dropout must be in [0, 1), got {dropout}")
    if problems:
        raise UsageError("; ".join(problems))


def apply_lora(
    model: nn.Module,
    targets: list[str],
    rank: int,
    alpha: float,
    dropout: float,
    seed: int,
    layers: Iterable[int] | None = None,
) -> list[str]:
    """Wrap every `nn.Linear` whose attribute name is in `targets`, in place; with
    `layers`, only those inside the blocks of those indices (`layers.<i>.`: mlx-lm's
    `--num-layers`, the last N blocks, and PEFT's `layers_to_transform`).

    Every parameter of the model is frozen first; only the new `lora_A` / `lora_B`
    train. Returns the full names of the wrapped modules, in model order.
    """
    _check_args(targets, rank, alpha, dropout)
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise UsageError(
            "this model already has LoRA adapters; merge them (merge_lora) before applying new ones"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    wanted = set(targets)
    blocks = None if layers is None else {f"layers.{int(i)}." for i in layers}
    found = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, QuantLinear))
        and name.rsplit(".", 1)[-1] in wanted
        and (blocks is None or any(name.startswith(b) for b in blocks))
    ]
    if not found:
        raise UsageError(
            f"--targets {','.join(targets)} matched no linear layer of this model; "
            f"choose from: {', '.join(VALID_TARGETS)}"
        )
    seen = {name.rsplit(".", 1)[-1] for name, _ in found}
    if missing := [t for t in targets if t not in seen]:
        has = sorted(
            {
                n.rsplit(".", 1)[-1]
                for n, m in model.named_modules()
                if isinstance(m, (nn.Linear, QuantLinear)) and n.startswith("layers.")
            }
        )
        raise UsageError(
            f"--targets {','.join(missing)} matched no linear layer of this model; "
            f"it has: {', '.join(has)}"
        )
    names = []
    for name, lin in found:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        g = torch.Generator(device="cpu").manual_seed(_module_seed(seed, name))
        setattr(parent, attr, LoRALinear.from_linear(lin, rank, alpha, dropout, g))
        names.append(name)
    return names


def adapted_layers(sd: dict[str, torch.Tensor]) -> list[int] | None:
    """The block indices an adapter's tensors (toy-named) cover, for apply_lora's
    `layers`; None where one adapts a module outside the blocks (then every matching
    module is wrapped, and a strict load names what does not match)."""
    layers = set()
    for k in sd:
        head, i, _ = (k.split(".", 2) + ["", ""])[:3]
        if head != "layers" or not i.isdigit():
            return None
        layers.add(int(i))
    return sorted(layers)


def _lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


@contextmanager
def disable_adapter(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block the wrapped model computes exactly what its base does (each
    LoRALinear returns its frozen layer's output, without the update or its dropout): the
    reference model of preference tuning, with no second copy of the weights (PEFT's and
    torchtune's `disable_adapter`). The adapters are switched back on after, as they were."""
    mods = [m for _, m in _lora_modules(model)]
    if not mods:
        raise UsageError("disable_adapter: the model has no LoRA modules (apply_lora first)")
    was = [m.disabled for m in mods]
    for m in mods:
        m.disabled = True
    try:
        yield model
    finally:
        for m, w in zip(mods, was):
            m.disabled = w


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter parameters (A then B for each wrapped module, in model order)."""
    return [p for _, m in _lora_modules(model) for p in (m.lora_A, m.lora_B)]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter tensors only, keyed `<module>.lora_A` (r, in) / `<module>.lora_B` (out, r)."""
    sd = {}
    for name, m in _lora_modules(model):
        sd[f"{name}.lora_A"] = m.lora_A.detach()
        sd[f"{name}.lora_B"] = m.lora_B.detach()
    return sd


def load_lora_state_dict(
    model: nn.Module, sd: dict[str, torch.Tensor], source: str = "adapter"
) -> None:
    """Copy adapter tensors into a model that already has `apply_lora` applied.

    Strict: every adapter tensor of the model must be present with its shape, and no
    other key may be; `source` (a file name) is named in the error.
    """
    own = lora_state_dict(model)
    if not own:
        raise UsageError(
            f"{source}: the model has no LoRA modules; call apply_lora with the adapter's "
            "targets first"
        )
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    bad_shape = [
        f"{k} {tuple(sd[k].shape)} != {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(sd))
        if tuple(sd[k].shape) != tuple(own[k].shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensors (first: {', '.join(missing[:3])})")
    if unexpected:
        problems.append(
            f"unexpected {len(unexpected)} tensors (first: {', '.join(unexpected[:3])})"
        )
    if bad_shape:
        problems.append(
            f"wrong shape for {len(bad_shape)} tensors (first: {'; '.join(bad_shape[:3])})"
        )
    if problems:
        raise InputError(
            f"{source} does not match the model's LoRA modules (check --targets and --rank): "
            + "; ".join(problems)
        )
    with torch.no_grad():
        for k, p in own.items():
            p.copy_(sd[k].to(p.device, p.dtype))


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold each adapter into its base weight (W' = W + B A * scaling) and put a plain
    `nn.Linear` with W' back in its place (a quantized base becomes float32 there). The
    model is changed in place; the base tensors are not (a loaded base may share them
    with the file's map or with other models built from it). Returns the model."""
    for name, m in _lora_modules(model):
        if m.spec is not None:
            weight = nn.Parameter(
                m.base_weight(torch.float32) + m.delta_weight().float(), requires_grad=False
            )
        else:
            weight = nn.Parameter(
                m.weight.detach() + m.delta_weight().to(m.weight.dtype),
                requires_grad=m.weight.requires_grad,
            )
        lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        lin.weight = weight
        lin.bias = m.bias
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, lin)
    return model
