"""What a model family declares, once, in its own file (models/llama.py, phi3.py, gemma.py,
gpt2.py, vit.py), and the helpers those declarations share.

A family file holds its config, its torch module, and a `FAMILY = Family(...)` naming:
the file formats it reads (`archs`: a GGUF `general.architecture` each, with the config
read from the header's keys and the plan of every tensor: names and shapes only), its
LoRA targets, its built-in chat format, and its presets for training from scratch.
models/registry.py finds every module here that declares a FAMILY: adding a family is
adding one file (docs/architecture.md, "Adding a family").

Nothing here imports torch or anything above models/: formats/ hands a reader of the
file's keys (`Keys`) in and gets configs and plans out, and turns a `BadConfig` into an
error naming the file.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# A header's context length sizes the rotary tables: the one hyper-parameter the tensors
# actually present in a file do not bound.
MAX_CONTEXT = 1 << 20


def shown(v) -> str:
    """A value read from a user's file, safe inside a one-line message: as it is where every
    character prints, else its repr (a carriage return in a config value split the line a
    refusal promises: tests/formats/test_hostile_dirs.py's fuzzing found one)."""
    s = str(v)
    return s if s.isprintable() else repr(s)


class BadConfig(ValueError):
    """A file's hyper-parameters that toy cannot use; the reader adds the file's name."""


@dataclass(frozen=True)
class Planned:
    """One tensor of a file, as toy's model holds it."""

    name: str  # toy's parameter name
    shape: tuple[int, ...]  # torch order (out, in)
    qk_heads: int = 0  # GGUF: rows llama.cpp's converter interleaved per head (the heads to undo)
    offset: float = (
        0.0  # added to the file's values (HF Gemma stores norm weights w of x * (1 + w))
    )


class Keys:
    """Typed reads of a file's key/value metadata (a GGUF header's, or a config.json) and
    its tensor shapes, each failure a BadConfig naming the key (`label`: "GGUF key")."""

    def __init__(
        self,
        metadata: Mapping[str, Any],
        shapes: Mapping[str, tuple[int, ...]],
        label: str = "GGUF key",
    ):
        self.metadata, self.shapes, self.label = metadata, shapes, label

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def int(self, key: str, default: int | None = None) -> int:
        v = self.metadata.get(key)
        if v is None:
            if default is None:
                what = self.metadata.get("general.architecture") or self.metadata.get("model_type")
                raise BadConfig(
                    f"{self.label} {key!r} is missing; the file is not a complete {what} model"
                )
            return default
        if isinstance(v, list):  # per-layer values (some archs): toy needs them all equal
            if not v or any(x != v[0] for x in v):
                raise BadConfig(
                    f"{self.label} {key!r} varies per layer ({v[:8]}...); toy needs one value"
                )
            v = v[0]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise BadConfig(f"{self.label} {key!r} is {v!r}; expected a positive integer")
        return v

    def float(self, key: str, default: float) -> float:
        v = self.metadata.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < float("inf")):
            raise BadConfig(f"{self.label} {key!r} is {v!r}; expected a positive number")
        return float(v)

    def float_or(self, key: str, default: float) -> float:
        """A number that may be 0 or absent (soft-capping, sliding windows): default then."""
        v = self.metadata.get(key, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < float("inf")):
            raise BadConfig(f"{self.label} {key!r} is {v!r}; expected a number >= 0")
        return float(v)

    def count(self, key: str, default: int = 0) -> int:
        """An integer >= 0 that may be absent or null (a sliding window: 0 for none)."""
        v = self.metadata.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise BadConfig(f"{self.label} {key!r} is {v!r}; expected an integer >= 0")
        return v

    def number(self, key: str, default: float, low: float, high: float = math.inf) -> float:
        """A finite number in [low, high] (NaN and infinities refused), default when absent."""
        v = self.metadata.get(key)
        return default if v is None else in_range(v, f"{self.label} {key!r}", low, high)


def in_range(v: Any, what: str, low: float, high: float = math.inf) -> float:
    """v as a float when it is a finite number in [low, high]; a BadConfig naming `what`."""
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or not math.isfinite(v)
        or not low <= v <= high
    ):
        bounds = f"from {low:g} to {high:g}" if high < math.inf else f">= {low:g}"
        raise BadConfig(f"{what} is {v!r}; expected a finite number {bounds}")
    return float(v)


@dataclass(frozen=True)
class Arch:
    """One architecture of a file format that a family reads (GGUF's general.architecture)."""

    name: str
    config: Callable[[Keys], Any]  # the family's config from the file's keys
    plan: Callable[[Any], dict[str, Planned]]  # file tensor name -> where toy holds it
    chat_format: str | None = None  # toy's built-in chat template for files without one


@dataclass(frozen=True)
class HFType:
    """A transformers `model_type` a family reads (from a transformers or an MLX directory:
    mlx-lm keeps the config.json and the tensor names)."""

    name: str
    config: Callable[
        [Keys], Any
    ]  # the family's config from config.json (the text part of a multimodal one)
    chat_format: str | None = None
    gguf: str | None = (
        None  # the GGUF architecture llama.cpp's converter makes of it (for GGUF adapters)
    )


@dataclass(frozen=True)
class Family:
    name: str
    config: type  # the config dataclass (its `arch` field names the family)
    model: type  # the torch module
    archs: dict[str, Arch] = field(default_factory=dict)  # GGUF architectures read as this family
    hf_types: dict[str, HFType] = field(
        default_factory=dict
    )  # transformers model_types read as this family
    # config -> transformers tensor name -> where toy holds it (with `model.`, as HF's
    # *ForCausalLM).
    hf_plan: Callable[[Any], dict[str, Planned]] | None = None
    # (config, GGUF architecture) -> a transformers config.json for it (None: toy cannot
    # write this family as a model directory; formats/dir_write.py asks).
    hf_config_out: Callable[[Any, str], dict[str, Any]] | None = None
    # LoRA: the linear layers an adapter may target (their attribute names), and the default.
    targets: tuple[str, ...] = ()
    default_targets: str = ""
    # Named shapes for training from scratch (none: read from files only).
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)
    default_preset: str | None = None
    language_model: bool = True
    # A tiny config's fields (2 layers, small widths) for the tests every family must pass.
    tiny: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------ GGUF keys the families share


@dataclass
class Common:
    """The hyper-parameters every decoder family states the same way (in a GGUF's keys or a
    config.json)."""

    arch: str
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    head_dim: int
    d_ff: int
    context: int
    vocab: int
    eps: float
    tied: bool
    rope_theta: float | None = (
        None  # config.json: None where it does not say (the family's default)
    )


def gguf_common(k: Keys, arch: str, eps_default: float = 1e-5) -> Common:
    a = arch + "."
    d_model = k.int(a + "embedding_length")
    n_head = k.int(a + "attention.head_count")
    n_kv_head = k.int(a + "attention.head_count_kv", default=n_head)
    if n_head > d_model and a + "attention.key_length" not in k.metadata:
        raise BadConfig(
            f"head_count {n_head} exceeds embedding_length {d_model}; the file is damaged"
        )
    head_dim = k.int(a + "attention.key_length", default=d_model // n_head)
    value_len = k.int(a + "attention.value_length", default=head_dim)
    if value_len != head_dim:
        raise BadConfig(
            f"key length {head_dim} != value length {value_len}; toy's attention needs them equal"
        )
    if n_head % n_kv_head:
        raise BadConfig(f"head_count {n_head} is not a multiple of head_count_kv {n_kv_head}")
    if head_dim % 2:
        raise BadConfig(f"head size {head_dim} is odd; rotary positions need an even head size")
    scaling = k.get(a + "rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in k.shapes:
        what = scaling if scaling not in ("none", None) else "rope_freqs.weight"
        raise BadConfig(
            f"rope scaling ({shown(what)}) is not supported by toy; use a model without "
            "long-context rope scaling"
        )
    n_layer = k.int(a + "block_count")
    if n_layer > len(k.shapes):  # checked before anything loops over the layers
        raise BadConfig(
            f"block_count {n_layer} cannot be right: the file holds only {len(k.shapes)} tensors; "
            "the file is damaged"
        )
    context = k.int(a + "context_length", default=2048)
    if context > MAX_CONTEXT:
        raise BadConfig(
            f"context_length {context} is beyond toy's limit of {MAX_CONTEXT}; the file is damaged "
            "or needs rope scaling toy lacks"
        )
    emb = k.shapes.get("token_embd.weight")
    if emb is None:
        raise BadConfig(
            f"missing tensor 'token_embd.weight'; the file is not a complete {arch} model"
        )
    if len(emb) != 2:
        raise BadConfig(
            f"misshapen tensor 'token_embd.weight': expected 2 dims [vocab, {d_model}], found "
            f"{list(emb)}"
        )
    # The embedding's rows are the model's vocabulary; the token list may be shorter
    # (padding rows) but a model cannot have fewer rows than tokens it can emit.
    vocab = emb[0]
    tokens = k.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > vocab:
        raise BadConfig(
            f"{len(tokens)} tokens but token_embd.weight has only {vocab} rows; the file is damaged"
        )
    return Common(
        arch,
        n_layer,
        d_model,
        n_head,
        n_kv_head,
        head_dim,
        k.int(a + "feed_forward_length"),
        context,
        vocab,
        k.float(a + "attention.layer_norm_rms_epsilon", eps_default),
        "output.weight" not in k.shapes,
    )


def rope_dims(k: Keys, c: Common) -> int:
    dims = k.int(c.arch + ".rope.dimension_count", default=c.head_dim)
    if dims > c.head_dim or dims % 2:
        raise BadConfig(f"rope.dimension_count {dims} does not fit head size {c.head_dim}")
    return dims


def gguf_top(cfg, tied: bool) -> dict[str, Planned]:
    """The tensors outside the blocks: embedding, final norm, and the head when untied."""
    m = {
        "token_embd.weight": Planned("embed_tokens.weight", (cfg.vocab_size, cfg.d_model)),
        "output_norm.weight": Planned("norm.weight", (cfg.d_model,)),
    }
    if not tied:
        m["output.weight"] = Planned("lm_head.weight", (cfg.vocab_size, cfg.d_model))
    return m


def gguf_linears(cfg, i: int, qk_heads: tuple[int, int] = (0, 0)) -> dict[str, Planned]:
    """Block i's attention and gated-MLP projections (llama's and gemma's names), and the
    q/k norms when the config has them. `qk_heads`: the heads llama.cpp interleaved in
    the Q and K rows (llama), or none."""
    D, H, K, C, F = cfg.head_dim, cfg.n_head, cfg.n_kv_head, cfg.d_model, cfg.d_ff
    b, t = f"blk.{i}.", f"layers.{i}."
    m = {
        b + "attn_q.weight": Planned(t + "self_attn.q_proj.weight", (H * D, C), qk_heads[0]),
        b + "attn_k.weight": Planned(t + "self_attn.k_proj.weight", (K * D, C), qk_heads[1]),
        b + "attn_v.weight": Planned(t + "self_attn.v_proj.weight", (K * D, C)),
        b + "attn_output.weight": Planned(t + "self_attn.o_proj.weight", (C, H * D)),
        b + "ffn_gate.weight": Planned(t + "mlp.gate_proj.weight", (F, C)),
        b + "ffn_up.weight": Planned(t + "mlp.up_proj.weight", (F, C)),
        b + "ffn_down.weight": Planned(t + "mlp.down_proj.weight", (C, F)),
    }
    if cfg.qk_norm:
        m[b + "attn_q_norm.weight"] = Planned(t + "self_attn.q_norm.weight", (D,))
        m[b + "attn_k_norm.weight"] = Planned(t + "self_attn.k_norm.weight", (D,))
    return m


# ------------------------------------------------------------------ transformers config.json


_LAYER = re.compile(r"model\.layers\.(\d+)\.")  # a block's tensors, as the plans name them


def hf_name(toy_name: str) -> str:
    """toy's parameter name -> HF *ForCausalLM's: the body under `model.`, the head as is."""
    return toy_name if toy_name.startswith("lm_head.") else "model." + toy_name


def hf_from_plan(plan: dict[str, Planned], norm_offset: float = 0.0) -> dict[str, Planned]:
    """The transformers names of a plan's tensors (toy's names are HF's without `model.`);
    `norm_offset` is added to every norm weight read (HF Gemma's 1 + w)."""
    out = {}
    for p in plan.values():
        off = norm_offset if p.name.endswith("norm.weight") else 0.0
        out[hf_name(p.name)] = Planned(p.name, p.shape, 0, off)
    return out


def rope_theta_of(k: Keys, layer_type: str | None = None) -> float | None:
    """rope_theta from a 4.x config (top level) or a 5.x one (`rope_parameters`, per layer
    type for Gemma 3); rope scaling of any kind is refused (toy has none)."""
    params = k.get("rope_parameters")
    if (
        isinstance(params, dict)
        and layer_type is not None
        and isinstance(params.get(layer_type), dict)
    ):
        params = params[layer_type]
    for scaling in (k.get("rope_scaling"), params if isinstance(params, dict) else None):
        if (
            isinstance(scaling, dict)
            and scaling.get("rope_type", scaling.get("type", "default")) != "default"
        ):
            raise BadConfig(
                f"rope scaling ({shown(scaling.get('rope_type', scaling.get('type')))}) is not "
                "supported by toy; use a model without long-context rope scaling"
            )
    # A base below 1 makes 1 / theta^(2i/d) overflow: rotary angles of inf, NaN outputs.
    top = k.number("rope_theta", None, 1.0)
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return in_range(params["rope_theta"], f"{k.label} 'rope_parameters.rope_theta'", 1.0)
    return top


def hf_common(k: Keys, head_dim_key: bool = True) -> Common:
    """What every decoder's config.json states alike. `head_dim_key`: the family reads
    `head_dim` (qwen2 and phi3 derive it from the width)."""
    d_model = k.int("hidden_size")
    n_head = k.int("num_attention_heads")
    n_kv = k.int("num_key_value_heads", default=n_head)
    head_dim = (
        k.int("head_dim", default=d_model // n_head)
        if head_dim_key and k.get("head_dim")
        else d_model // n_head
    )
    if n_head % n_kv:
        raise BadConfig(
            f"num_attention_heads {n_head} is not a multiple of num_key_value_heads {n_kv}"
        )
    if head_dim % 2:
        raise BadConfig(f"head size {head_dim} is odd; rotary positions need an even head size")
    context = k.int("max_position_embeddings", default=2048)
    if context > MAX_CONTEXT:
        raise BadConfig(f"max_position_embeddings {context} is beyond toy's limit of {MAX_CONTEXT}")
    # A norm's epsilon keeps 1 / sqrt(mean(x^2) + eps) finite: it must be positive (and small).
    eps_key = "rms_norm_eps" if k.get("rms_norm_eps") is not None else "layer_norm_eps"
    eps = k.number(eps_key, 1e-6, 1e-30, 1.0)
    emb = k.shapes.get("model.embed_tokens.weight")
    vocab = emb[0] if emb else k.int("vocab_size")  # the embedding's rows are the vocabulary
    # Checked against the tensors present before anything loops over the layers (a plan of
    # a billion layers would take all the memory): each layer's tensors are in the files.
    n_layer = k.int("num_hidden_layers")
    present = {m.group(1) for name in k.shapes if (m := _LAYER.match(name))}
    if n_layer > len(present):
        raise BadConfig(
            f"{k.label} 'num_hidden_layers' is {n_layer} but the weights hold "
            f"{len(present)} layers; config.json does not match the weights"
        )
    return Common(
        str(k.get("model_type", "")),
        n_layer,
        d_model,
        n_head,
        n_kv,
        head_dim,
        k.int("intermediate_size"),
        context,
        vocab,
        eps,
        "lm_head.weight" not in k.shapes,
        rope_theta_of(k),
    )
