"""Warm start: a fresh llama whose token embedding starts from a donor GGUF's table.
Everything else (blocks, norms, data order) is from-scratch's with the same seed, so
`--init scratch|donor|pca` compare fairly.

    toy prep TEXT --tokenizer donor.gguf --out corpus.bin
    toy train --recipe warm-start --donor donor.gguf --corpus corpus.bin --init pca

- `scratch`: the plain N(0, 0.02) init through this same path: the baseline.
- `donor`: at d_model == the donor's width, its rows copied as they are; otherwise the
  donor's table, centred and frozen, seen through a trainable lens (W -> d_model) that
  starts as a random semi-orthogonal map.
- `pca`: the same frozen table and lens, the lens starting on the table's top d_model
  principal axes.
Why a frozen table and a lens, why centred, why the embedding (or lens) trains at
`--embed-lr-scale` x --lr and starts at RMS 0.02 (a tied head grows the embedding, and
Adam grows a trained table's rows alike, erasing the donor's differences within tens of
steps): measured in docs/results.md, "Warm start". `final/` is a plain Llama with the
product folded into `embed_tokens.weight`. The donor is read with bounded memory: its
header, then `token_embd.weight` alone; the first `vocab` rows are taken (a padded table
may be longer than its tokenizer).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from toy.errors import InputError, UsageError
from toy.formats.hf_dir import base_fingerprint
from toy.models import registry
from toy.recipes.donor import (
    EMBED,
    EMBED_LR_SCALE,
    GET_DONOR,
    INITS,
    fold,
    open_donor,
    start_embedding,
)
from toy.recipes.lm import WindowJob, lm_config, lm_derived, open_token_data
from toy.runs import Project, data_fingerprints
from toy.train.config import RunConfig
from toy.train.job import Built
from toy.train.recipe import Flag, Recipe

NAME = "warm-start"

# This recipe's flags; the model and optimiser flags are the general ones (as from-scratch).
FLAGS = (
    Flag(
        "donor",
        metavar="DONOR",
        help="a GGUF model, or a transformers or MLX model directory, of any supported family, "
        "whose token embedding warms the embedding and whose tokenizer the corpus must use "
        "(`toy prep TEXT --tokenizer DONOR`)",
        shown=": none, required",
    ),
    Flag(
        "init",
        "donor",
        "embedding init: scratch (random, the baseline), donor (the donor's rows; a trainable "
        "lens when widths differ) or pca (the donor's top --d-model principal components)",
        metavar="{scratch,donor,pca}",
    ),
    Flag(
        "freeze_embed_steps",
        0,
        "keep the warmed embedding (and lens) frozen for the first N steps",
        int,
        metavar="N",
    ),
    Flag(
        "embed_lr_scale",
        EMBED_LR_SCALE,
        "the embedding (the lens, with a donor table) trains at X times --lr, with every "
        "--init, scratch included",
        float,
        metavar="X",
        shown=f"{EMBED_LR_SCALE:g}",
    ),
)


def check_opts(cfg: RunConfig) -> list[str]:
    """Every problem with this recipe's flags, named by flag (nothing is read yet)."""
    p: list[str] = []
    if cfg.init not in INITS:
        p.append(f"--init {cfg.init!r} is unknown; valid: {', '.join(INITS)}")
    n = cfg.freeze_embed_steps
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        p.append(f"--freeze-embed-steps must be an integer >= 0, got {n!r}")
    x = cfg.embed_lr_scale
    if x is not None and (
        isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0
    ):
        p.append(f"--embed-lr-scale must be a number > 0, got {x!r}")
    if not cfg.donor:
        p.append(
            f"--donor DONOR.gguf is required: it gives the embedding and the tokenizer "
            f"({GET_DONOR})"
        )
    elif not Path(cfg.donor).exists():
        p.append(
            f"--donor {cfg.donor} not found; pass a GGUF model or a model directory ({GET_DONOR})"
        )
    if cfg.arch != "llama":
        p.append(
            f"--arch {cfg.arch}: warm-start builds a llama (its tied embedding is what the donor "
            "fills); drop --arch"
        )
    if cfg.tokenizer:
        p.append(
            "--tokenizer conflicts with --donor: warm-start uses the donor's tokenizer; "
            "drop --tokenizer"
        )
    if cfg.raw_i32:
        p.append(
            "--raw-i32: a headerless corpus cannot prove it uses the donor's tokenizer; convert it "
            "with `toy prep FILE --raw-i32 --tokenizer DONOR.gguf --out FILE.bin`"
        )
    return p


class WarmStartJob(WindowJob):
    """Token windows (WindowJob) with the donor's embedding: held still for the first
    --freeze-embed-steps steps, and trained at --embed-lr-scale x the LR.

    Frozen parameters: the loop sets their gradients to None after backward (and after
    the DDP/FSDP reduction, which would otherwise hand back a zero gradient), so AdamW
    skips them outright: a zero gradient would still let decoupled weight decay shrink
    them. Named, not held by reference, because FSDP replaces the parameter objects."""

    def __init__(self, *args, frozen: list[str], freeze_steps: int, embed_scale: float, **kw):
        super().__init__(*args, **kw)
        self.frozen_names, self.freeze_steps = tuple(frozen), freeze_steps
        self.embed_scale = embed_scale

    def frozen(self, step: int) -> tuple[str, ...]:
        # a pure function of the step: resume-safe
        return self.frozen_names if step <= self.freeze_steps else ()

    def lr_scale(self, name: str) -> float:
        return self.embed_scale if name.startswith("embed_tokens.") else 1.0


# ------------------------------------------------------------------ build


def build(cfg: RunConfig, project: Project) -> Built:
    init = cfg.init
    donor = open_donor(Path(cfg.donor))
    data = open_token_data(
        cfg, project, tokenizer=donor.tokenizer, tokenizer_source=str(donor.path), bundled_ok=False
    )
    train = data.train
    if train.vocab_size > donor.rows:
        raise InputError(
            f"--corpus {train.path}: vocabulary {train.vocab_size} is larger than "
            f"--donor {donor.path}'s {EMBED} ({donor.rows} rows); the file is damaged"
        )
    vocab = train.vocab_size
    seq_notes: list[str] = []
    mcfg, seq_len = lm_config(cfg, "llama", train, seq_notes)
    if init == "pca" and mcfg.d_model > donor.width:
        raise UsageError(
            f"--init pca: --d-model {mcfg.d_model} exceeds --donor {donor.path}'s width "
            f"{donor.width}; PCA gives at most {donor.width} components: lower --d-model or use "
            "--init donor "
            "(a trainable lens)"
        )
    # The same seed and the same model class as --init scratch: only the embedding differs.
    torch.manual_seed(cfg.seed)
    model = registry.build_model(mcfg)
    notes: list[str] = list(seq_notes)
    lens, frozen, said = start_embedding(model, donor, init, mcfg.d_model, vocab, cfg.seed)
    notes += said
    if donor.rows > vocab and init != "scratch":
        notes.append(
            f"{donor.rows - vocab} padding rows of the donor table beyond the vocabulary are unused"
        )
    n_embed = vocab * mcfg.d_model
    n_params = sum(p.numel() for p in model.parameters())
    n_folded = n_params - (donor.width * mcfg.d_model if lens else 0) + (n_embed if lens else 0)
    notes.append(
        f"vocabulary {vocab}: the embedding is {n_embed:,} of the final model's {n_folded:,} "
        f"parameters ({n_embed / n_folded:.0%})"
        + (
            f"; the model trained has {n_params:,} (a {donor.width} -> {mcfg.d_model} lens over "
            "the donor's frozen table in place of the embedding; final/ holds their product)"
            if lens and n_folded != n_params
            else ""
        )
    )
    n_freeze = int(cfg.freeze_embed_steps)
    if n_freeze > 0:
        notes.append(f"{'lens' if lens else 'embedding'} frozen for steps 1..{n_freeze}")
    config = {
        "recipe": NAME,
        "arch": "llama",
        "model": mcfg.to_dict(),
        "corpus": str(train.path),
        "corpus_tokens": len(train),
        **data_fingerprints("corpus", train.path),
        "seq_len": seq_len,
        "init": init,
        "donor": str(donor.path),
        "donor_sha256": base_fingerprint(donor.path),
        "donor_arch": donor.arch,
        "donor_width": donor.width,
        "donor_rows": donor.rows,
        "lens": lens,
        "freeze_embed_steps": n_freeze,
    }
    # None: a run recorded before the flag existed (its embedding trained at 1 x --lr);
    # resume then reports the changed job config instead of failing here.
    scale = 1.0 if cfg.embed_lr_scale is None else cfg.embed_lr_scale
    if scale != 1.0:
        notes.append(f"{'lens' if lens else 'embedding'} LR: {scale:g} x --lr (--embed-lr-scale)")
    config["embed_lr_scale"] = scale
    job = WarmStartJob(
        NAME,
        model,
        data,
        cfg,
        seq_len,
        config,
        export=lambda: fold(model),
        frozen=frozen,
        freeze_steps=n_freeze,
        embed_scale=scale,
    )
    return Built(
        job=job,
        arch="llama",
        params=n_params,
        notes=notes,
        derived=lm_derived(cfg, train, seq_len, notes),
    )


RECIPE = Recipe("warm-start", build, flags=FLAGS, check=check_opts)
