"""What a fresh model warm-started from another model's token embedding needs, shared by
warm-start (the donor: --donor) and distill (the teacher: --init): the donor read with
bounded memory (a GGUF's header and `token_embd.weight` alone; a directory memory-mapped),
and `start_embedding`, which starts a model's embedding from the donor's table as --init
says (scratch, donor, pca): the rows as they are, or the centred table, frozen, through a
trainable lens (LensEmbedding, TiedLensHead) that `fold` multiplies out into a plain
model's embedding at the end. Why a frozen table and a lens, why centred, why RMS 0.02:
docs/results.md, "Warm start"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import Tokenizer

from toy import tokenizer as toktools
from toy.errors import InputError, UsageError
from toy.formats.base import QuantTensor
from toy.formats.base_readers import base_kind, read_base
from toy.formats.gguf import read_gguf_tensor
from toy.formats.gguf_header import read_gguf_header
from toy.formats.gguf_plan import supported_archs
from toy.models import registry

INITS = ("scratch", "donor", "pca")
EMBED = "token_embd.weight"
GET_DONOR = "`toy fetch smollm2` fetches SmolLM2-135M"
INIT_STD = 0.02  # Llama.reset_parameters' std: warmed tables start at this RMS (docs/results.md)
# The embedding (or lens) trains at this times --lr: docs/results.md, "Warm start".
EMBED_LR_SCALE = 3.0


# ------------------------------------------------------------------ the donor


@dataclass
class Donor:
    path: Path
    arch: str
    width: int  # the donor's embedding width
    rows: int  # rows of its token embedding (>= the tokenizer's size)
    tokenizer: Tokenizer
    tokenizer_hash: bytes
    table_type: str  # how the table is stored (Q4_K, BF16, MLX_Q4_G64, ...)
    _read: Callable[[], torch.Tensor]  # the whole table, float32 (rows, width)

    def table(self, vocab: int) -> torch.Tensor:
        """The first `vocab` rows of the token embedding, float32 (vocab, width)."""
        t = self._read()
        return t if vocab == t.shape[0] else t[:vocab].clone()


def open_donor(path: Path) -> Donor:
    """Header (or config), family check, embedding shape and tokenizer; no weight is read
    yet. A GGUF, or a transformers or MLX model directory."""
    if not path.exists():
        raise InputError(
            f"--donor {path} not found; pass a GGUF model or a model directory ({GET_DONOR})"
        )
    try:
        kind = base_kind(path)
    except InputError as e:
        raise InputError(f"--donor {e.message}")
    if kind != "gguf":  # a GGUF donor is read from its header and embedding alone
        return _open_dir_donor(path)
    h = read_gguf_header(path)
    arch = h.metadata.get("general.architecture")
    if arch not in supported_archs():
        raise InputError(
            f"--donor {path}: architecture {arch!r} is not one toy reads (supported: "
            f"{', '.join(supported_archs())}); pass a model of one of those families"
        )
    if h.metadata.get("general.type") == "adapter":
        raise InputError(f"--donor {path}: is a LoRA adapter GGUF, not a model; pass a model GGUF")
    width = h.metadata.get(f"{arch}.embedding_length")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise InputError(
            f"--donor {path}: GGUF key '{arch}.embedding_length' is {width!r}; expected the "
            "embedding width (a positive integer)"
        )
    ti = h.tensors.get(EMBED)
    if ti is None:
        raise InputError(
            f"--donor {path}: has no tensor '{EMBED}' (the token embedding warm-start copies); "
            "pass a complete model GGUF"
        )
    if len(ti.shape) != 2 or ti.shape[1] != width:
        raise InputError(
            f"--donor {path}: '{EMBED}' has shape {list(ti.shape)}, expected [rows, {width}] "
            f"({arch}.embedding_length); the file is damaged"
        )
    tok = toktools.from_gguf_metadata(h.metadata, source=str(path))
    return Donor(
        path,
        arch,
        width,
        ti.shape[0],
        tok,
        toktools.tokenizer_hash(tok),
        ti.qtype.name,
        lambda: read_gguf_tensor(h, EMBED),
    )


def _open_dir_donor(path: Path) -> Donor:
    """A transformers or MLX directory: its embedding (dequantized where MLX quantized it)."""
    try:
        base = read_base(path, "quantized")  # memory-mapped: nothing is read but the 1-D tensors
    except InputError as e:
        raise InputError(f"--donor {e.message}")
    emb = base.state_dict["embed_tokens.weight"]
    quantized = isinstance(emb, QuantTensor)
    rows, width = emb.spec.shape if quantized else tuple(emb.shape)
    kind = emb.spec.name if quantized else str(emb.dtype).removeprefix("torch.")

    def read() -> torch.Tensor:
        return emb.spec.dequantize(emb.parts, torch.float32) if quantized else emb.float().clone()

    tok = base.tokenizer
    return Donor(path, base.arch, width, rows, tok, toktools.tokenizer_hash(tok), kind, read)


# ------------------------------------------------------------------ projections


def centre(table: torch.Tensor) -> torch.Tensor:
    """The rows of `table` minus their mean row (the mean taken in float64), float32."""
    x = table.double()
    return (x - x.mean(0)).float()


def principal_axes(table: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k principal axes of the rows of `table` (n, W), largest variance first, and
    the variance along each: ((W, k) float64, (k,) float32). Computed in float64 (a
    576 x 576 covariance); each axis's sign is fixed (its largest entry positive) so the
    result does not depend on the LAPACK build."""
    n, w = table.shape
    if not 1 <= k <= w:
        raise UsageError(f"--d-model {k}: PCA of a width-{w} table gives 1..{w} components")
    x = table.double()
    x = x - x.mean(0)
    evals, evecs = torch.linalg.eigh(x.T @ x / n)  # ascending
    order = torch.argsort(evals, descending=True)[:k]
    axes = evecs[:, order]
    lead = axes.abs().argmax(0)
    axes = axes * torch.sign(axes[lead, torch.arange(k)])
    return axes, evals[order].clamp_min(0).float()


def scaled_lens(table: torch.Tensor, w: torch.Tensor, std: float = INIT_STD) -> torch.Tensor:
    """The lens weight `w` (d_model, W) times the one factor that gives table @ w^T an RMS
    of `std`, float32."""
    w = w.double()
    rms = float((table.double() @ w.T).pow(2).mean().sqrt())
    return (w * (std / max(rms, 1e-12))).float()


def lens_init(table: torch.Tensor, d_model: int, seed: int, std: float = INIT_STD) -> torch.Tensor:
    """`--init donor`'s lens (d_model, W) for a table (vocab, W): a random semi-orthogonal
    map (orthogonal rows when W >= d_model, orthogonal columns otherwise) at the scale that
    gives table @ lens^T an RMS of `std`. It draws from its own generator, so the rest of
    the model's init is the same as with --init scratch."""
    width = table.shape[1]
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(max(width, d_model), min(width, d_model), generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)  # orthonormal columns
    q = q * torch.sign(torch.diagonal(r))  # QR's signs are arbitrary: fix them
    return scaled_lens(table, q.T if width >= d_model else q, std)


class LensEmbedding(nn.Module):
    """Token embedding = table (vocab, W) @ lens^T, with the donor table frozen.

    A lookup costs (B, T, W) x (W, C); `weight` (the whole (vocab, C) product) is built
    only where the full table is needed: the tied output head."""

    def __init__(self, table: torch.Tensor, lens: torch.Tensor):
        super().__init__()
        # Not persistent: checkpoints hold only the lens; the table is re-read from the
        # donor (whose fingerprint a resumed run checks).
        self.register_buffer("table", table, persistent=False)
        # Built on meta then given its weight: no draw from the global RNG, so every init
        # mode leaves the generator where --init scratch leaves it.
        self.lens = nn.Linear(table.shape[1], lens.shape[0], bias=False, device="meta")
        self.lens.weight = nn.Parameter(lens.to(table.dtype))

    @property
    def weight(self) -> torch.Tensor:
        return self.lens(self.table)  # (vocab, C)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lens(F.embedding(idx, self.table))  # (B, T, W) -> (B, T, C)


class TiedLensHead(nn.Module):
    """The output head tied to a LensEmbedding: logits = h @ (table @ lens^T)^T."""

    def __init__(self, emb: LensEmbedding):
        super().__init__()
        self._emb = [emb]  # a plain list: the embedding stays the one owner of the lens

    @property
    def weight(self) -> torch.Tensor:
        return self._emb[0].weight

    @weight.setter
    def weight(self, value: torch.Tensor) -> None:
        # Code that re-ties a llama's head after moving weights (the loop does, after FSDP)
        # assigns embed_tokens.weight here. This head owns no weight: it always reads the
        # embedding's current product, so it is tied already and there is nothing to store.
        pass

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self._emb[0].weight)  # (B, T, C) -> (B, T, vocab)


def install_lens(model: nn.Module, table: torch.Tensor, lens: torch.Tensor) -> LensEmbedding:
    emb = LensEmbedding(table, lens)
    model.embed_tokens = emb
    model.lm_head = TiedLensHead(emb)
    return emb


def fold(model: nn.Module) -> nn.Module:
    """A plain Llama equal to `model`, with table @ lens^T as its (tied) embedding."""
    if not isinstance(model.embed_tokens, LensEmbedding):
        return model
    sd = {
        k: v
        for k, v in model.state_dict().items()
        if not k.startswith(("embed_tokens.", "lm_head."))
    }
    sd["embed_tokens.weight"] = model.embed_tokens.weight.detach()
    with torch.random.fork_rng(devices=[]):  # the throwaway random init must not move the run's RNG
        plain = registry.build_model(model.cfg)
    res = plain.load_state_dict(sd, strict=False)
    assert not res.unexpected_keys and set(res.missing_keys) <= {"lm_head.weight"}, res
    return plain.to(sd["embed_tokens.weight"].device)


def start_embedding(
    model: nn.Module, donor: Donor, init: str, d_model: int, vocab: int, seed: int
) -> tuple[bool, list[str], list[str]]:
    """Start `model`'s embedding from the donor's table as --init says: scratch (random,
    the baseline), donor (the rows as they are, or through a trainable random lens where
    the widths differ) or pca (through a lens on the table's principal axes). Returns
    (whether a lens sits over the frozen table, the parameters --freeze-embed-steps
    holds, the notes)."""
    notes: list[str] = []
    lens = init == "pca" or (init == "donor" and donor.width != d_model)
    frozen = [
        "embed_tokens.lens.weight" if lens else "embed_tokens.weight"
    ]  # tied: lm_head shares it
    src = f"{donor.path.name}'s token embedding ({donor.rows} x {donor.width}, {donor.table_type})"
    if init != "scratch":
        table = donor.table(vocab)
        if not torch.isfinite(table).all():
            raise InputError(
                f"--donor {donor.path}: '{EMBED}' holds NaN or inf values; the file is damaged"
            )
        if not lens:
            with torch.no_grad():
                model.embed_tokens.weight.copy_(table)
            notes.append(f"embedding: {src}, first {vocab} rows copied as they are")
        else:
            table = centre(table)  # the mean row, shared by every token, would swamp the inputs
            if init == "donor":
                install_lens(model, table, lens_init(table, d_model, seed))
                notes.append(
                    f"embedding: {src}, centred (frozen) @ a trainable random lens "
                    f"{donor.width} -> {d_model} (product starts at RMS {INIT_STD}); "
                    "the tied head uses the same product"
                )
            else:
                axes, var = principal_axes(table, d_model)
                install_lens(
                    model, table, scaled_lens(table, axes.T)
                )  # rows: the axes, largest variance first
                share = float(var.sum()) / float(table.double().var(0, unbiased=False).sum())
                notes.append(
                    f"embedding: {src}, centred (frozen) @ a trainable lens {donor.width} -> "
                    f"{d_model} that starts on its top {d_model} principal axes "
                    f"({share:.1%} of its variance; product at RMS {INIT_STD}); the tied head uses "
                    "the same product"
                )
        del table
    else:
        notes.append(
            f"embedding: random N(0, 0.02) (the baseline); tokenizer from {donor.path.name}"
        )
    return lens, frozen, notes
