"""A frozen base model, whatever it was read from: a GGUF file (formats/gguf.py), a
transformers directory or an MLX directory (formats/hf_dir.py), each reader found through
formats/base_readers.py's table. What every reader shares lives here, and this module
imports none of them.

    base = read_base("model.gguf" | "Qwen3-0.6B/" | "SmolLM2-mlx-4bit/", "quantized")
    model = base.build_model()       # toy's module of the base's family, weights in place
    base.tokenizer, base.special, base.chat_template ...

The weights come in the form `--base-dtype` asks: `quantized` keeps each 2-D weight in the
file's own form (GGUF blocks, MLX packed integers with scales and biases, or a
transformers directory's F16/BF16 values), a zero-copy view of the memory-mapped file
that models.quant dequantizes per use; `float32` and `bfloat16` convert once at load.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from tokenizers import Tokenizer

from toy.errors import InputError
from toy.models.family import Family
from toy.models.quant import MLXSpec, QuantEmbedding, QuantLinear, QuantSpec, parts_of
from toy.models.quant_types import BF16


@dataclass
class QuantTensor:
    """A base weight kept quantized (`--base-dtype quantized`): its parts as the spec
    names them (GGUF: the (rows, row_bytes) uint8 blocks; MLX: weight, scales, biases)."""

    parts: tuple[torch.Tensor, ...]
    spec: QuantSpec | MLXSpec


@dataclass(frozen=True)
class Specials:
    """The base's special tokens: BOS and EOS as the chat template names them, what ends a
    reply (`stops`: EOS and end-of-turn markers) and padding. Whether raw text gets BOS is
    the tokenizer's own rule (toy.tokenizer.encode_prompt)."""

    bos: int | None = None
    eos: int | None = None
    pad: int | None = None
    stops: frozenset[int] = frozenset()

    def reply_stops(self) -> set[int]:
        """What ends a sampled reply: the stops, else EOS alone, else nothing."""
        return set(self.stops) or ({self.eos} if self.eos is not None else set())


# End-of-turn markers of the chat formats toy knows: generation stops at any the
# vocabulary has, besides EOS (a chat model ends its reply with one, not with EOS).
TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>", "<end_of_turn>")


def stop_ids(tok: Tokenizer, eos: list[int]) -> frozenset[int]:
    return frozenset(eos) | {i for name in TURN_ENDS if (i := tok.token_to_id(name)) is not None}


@dataclass
class Base:
    kind: str  # gguf | transformers | mlx
    path: Path
    arch: str  # the file's architecture: GGUF general.architecture or config.json model_type
    family: Family
    config: Any  # the family's config
    state_dict: dict[str, torch.Tensor | QuantTensor]  # toy names; no lm_head.weight when tied
    tokenizer: Tokenizer
    special: Specials
    chat_template: str | None
    chat_format: str | None  # toy's built-in template when the base has none (data/chat.py)
    metadata: dict[str, Any]  # GGUF: every key/value; a directory: its config.json
    tensor_types: Counter = field(default_factory=Counter)  # type name -> tensor count
    base_dtype: str = "float32"
    notes: list[str] = field(default_factory=list)
    # Where mlx-lm holds the model body (its adapters' tensor names): `model.`, or a
    # multimodal Gemma 3 directory's `language_model.model.`.
    mlx_prefix: str = "model."
    # A GGUF read as stored: drops a block tensor's pages of the file's map from this
    # process once it has been read (formats/gguf.py: page_dropper); None: nothing to drop.
    drop_pages: Callable[[torch.Tensor], None] | None = None

    @property
    def default_targets(self) -> str:
        return self.family.default_targets

    @property
    def gguf_arch(self) -> str | None:
        """Its llama.cpp architecture: a GGUF's own, or the one llama.cpp's converter gives
        a directory of this model_type (None: one llama.cpp does not know)."""
        return self.arch if self.kind == "gguf" else self.family.hf_types[self.arch].gguf

    @property
    def vocab_tokens(self) -> list[str]:
        """Token strings by id (for finding a built-in template's turn markers)."""
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        out = [""] * (max(vocab.values()) + 1 if vocab else 0)
        for t, i in vocab.items():
            out[i] = t
        return out

    def float32_bytes(self) -> int:
        """What the weights take as float32 (a tied head counted once)."""
        n = 0
        for t in self.state_dict.values():
            n += t.spec.shape[0] * t.spec.shape[1] if isinstance(t, QuantTensor) else t.numel()
        return 4 * n

    def token(self, i: int | None) -> str:
        return self.tokenizer.id_to_token(i) if i is not None else ""

    def build_model(self, device: torch.device | str = "cpu") -> nn.Module:
        """toy's model of the base's family with these weights, in eval mode. Built on the
        meta device (no random init to throw away), then each tensor is put in place: a
        float one as the parameter itself (so the base exists once), a quantized one as
        a QuantLinear / QuantEmbedding over its parts. A tied head shares the embedding."""
        with torch.device("meta"), _no_init():
            model = self.family.model(self.config)
        weights = {n: _frozen_half(t) for n, t in self.state_dict.items()}
        for name, t in weights.items():
            if isinstance(t, QuantTensor):
                owner = name.rpartition(".")[0]
                mod = model.get_submodule(owner)
                new = (
                    QuantEmbedding(t.parts, t.spec)
                    if isinstance(mod, nn.Embedding)
                    else QuantLinear(t.parts, t.spec)
                )
                parent, _, child = owner.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, new)
        for name, t in weights.items():
            if isinstance(t, QuantTensor):
                continue
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, nn.Parameter(t, requires_grad=False))
        if getattr(self.config, "tie_embeddings", False):
            emb = model.embed_tokens
            if isinstance(emb, QuantEmbedding):
                model.lm_head = QuantLinear(
                    parts_of(emb), emb.spec
                )  # the same parts, read as a head
            else:
                model.tie_weights()
        left = [
            n
            for n, p in [*model.named_parameters(), *model.named_buffers()]
            if p.device.type == "meta"
        ]
        if left:
            raise InputError(
                f"{self.path}: weights do not fit toy's {self.arch} (no weight for {left[:3]})"
            )
        for p in model.parameters():
            p.requires_grad_(True)  # what is trainable is the recipe's call (LoRA freezes them)
        return model.to(device).eval()


def _frozen_half(t: torch.Tensor | QuantTensor) -> torch.Tensor | QuantTensor:
    """A bfloat16 weight (`--base-dtype bfloat16`) as the frozen layers over a file's
    BF16 rows hold it: used in the activations' dtype at each use (the autocast dtype
    under autocast, where the cast is none; float32 otherwise), as a quantized weight is.
    As a plain bf16 parameter it would meet float32 activations (the norms and the
    adapters stay float32) in F.linear, which refuses mixed dtypes without autocast."""
    if isinstance(t, QuantTensor) or t.dtype != torch.bfloat16 or t.dim() != 2:
        return t
    raw = t.contiguous().view(torch.uint8)  # (out, 2 * in): BF16 rows, no copy
    return QuantTensor((raw,), QuantSpec(BF16, (t.shape[0], t.shape[1])))


@contextlib.contextmanager
def _no_init():
    """Build a model without initialising it: every weight is about to be replaced by the
    file's. On the meta device each torch.nn.init call would still run torch's meta
    kernels, whose first use costs over a second of one-off setup."""
    names = (
        "normal_",
        "uniform_",
        "kaiming_uniform_",
        "kaiming_normal_",
        "trunc_normal_",
        "ones_",
        "zeros_",
        "constant_",
        "xavier_uniform_",
        "xavier_normal_",
    )
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)
