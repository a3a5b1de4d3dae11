"""ViT-Tiny image classifier on an image folder (one subfolder per class): random
init, cross-entropy on labels, accuracy on a held-out set.

Model defaults are ViT-Tiny/16 at 224 px (preset `vit-tiny`), at half its depth
(`vit-tiny-6`) for a training set under 50,000 images; `--preset tiny` is a 28 px /
7 px-patch test shape, and `--image-size`, `--patch-size`, `--n-layer`, `--d-model`,
`--n-head` override any of them. Without `--images` the bundled Fashion-MNIST smoke set
(300 images, 10 classes) is used.

What the recipe picks from the data (the preset without `--preset`, the augmentation
with `--augment auto`) is printed as a note and recorded in run.json's config, so a
resumed run rebuilds the same job. Why these defaults: docs/results.md, "Fashion-MNIST
ViT" (issue 18).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from toy.data.images import (
    ImageBatches,
    ImageSet,
    bundled_images,
    fingerprint,
    load_image_folders,
    to_float,
)
from toy.errors import UsageError
from toy.formats.model_dir import save_model_dir
from toy.models import registry
from toy.models.vit import VitConfig, check_vit_config
from toy.runs import Project
from toy.train import dist
from toy.train.config import RunConfig
from toy.train.job import Built, Job
from toy.train.recipe import Figure, Flag, Recipe

NAME = "vit-tiny"

# This recipe's defaults for toy's general flags (flag > toy.toml > these).
DEFAULTS: dict[str, Any] = dict(
    arch="vit",
    # From-scratch ViTs want a gentler decay than a decoder LM's 0.1, and a batch of
    # images is cheap next to a batch of 256-token sequences. Warmup 40 (the 10% cap at
    # 400 steps): on 12,000 Fashion-MNIST images, 6 x 192, 400 steps, 82.0% test accuracy
    # against 79.9% with 20 (and 5 was worse than 20 on 4 x 128); docs/results.md.
    lr=1e-3,
    min_lr=1e-5,
    warmup=40,
    batch_size=64,
    weight_decay=0.05,
    eval_batches=16,
)

# Without --preset: ViT-Tiny's width at half its depth below this many training images
# (measured on 12,000 Fashion-MNIST images: 6 layers beat 12 at equal steps, and cost half
# as much a step; docs/results.md). Where 12 layers start to pay is not measured.
SMALL_SET, SMALL_PRESET = 50_000, "vit-tiny-6"

AUGMENT = ("auto", "crop-flip", "none")
# --augment auto: crop-flip only when the run sees each training image at least this many
# times. Below it augmentation is a regulariser the run has no time to need: measured on
# Fashion-MNIST, crop-flip lost at every budget tried, 2 epochs of 12,000 images (4 x 128,
# 200 steps: 54% vs 71%) up to 6.4 epochs of 60,000 (84.6% vs 87.9%); docs/results.md.
# Where it starts to pay is not measured: 10 is a judgement, not a figure.
AUGMENT_EPOCHS = 10
# Flags of the language-model recipes that mean nothing here: naming one is a mistake
# worth reporting rather than silently ignoring.
LM_ONLY = ("corpus", "val_corpus", "tokenizer", "vocab_size", "seq_len", "n_kv_head")


FLAGS = (
    Flag(
        "images",
        metavar="DIR",
        help="image folder, one subfolder of PNG/JPEG files per class",
        shown=": the bundled Fashion-MNIST smoke set",
    ),
    Flag(
        "val_images",
        metavar="DIR",
        help="validation folder with the same class subfolders",
        shown=": hold out 10% of each class of --images",
    ),
    Flag(
        "image_size",
        type=int,
        help="side in pixels images are resized to",
        shown=": the preset's, 224 for vit-tiny",
    ),
    Flag(
        "patch_size",
        type=int,
        help="side of the square patches, must divide --image-size",
        shown=": the preset's, 16 for vit-tiny",
    ),
    Flag(
        "augment",
        "auto",
        "training augmentation: crop-flip (random crop of the image padded by 1/8 of its side, "
        "and left-right flips), none, or auto: crop-flip when the run sees each training image "
        f"{AUGMENT_EPOCHS} times or more, else none",
        metavar="MODE",
        shown="auto; the run prints which",
    ),
)
# The held-out accuracy: on the done line, in --json as val_accuracy.
FIGURES = (Figure("accuracy", "val accuracy", final=True, json_key="val_accuracy"),)


def _int_flag(cfg: RunConfig, key: str, problems: list[str]) -> int | None:
    v = getattr(cfg, key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        problems.append(f"--{key.replace('_', '-')} must be an integer >= 1, got {v!r}")
        return None
    return v


def choose_preset(n_train: int) -> tuple[str, str]:
    """The preset for a training set of `n_train` images when --preset is not given, and
    a note saying why. Both have ViT-Tiny's width and input shape; only the depth differs."""
    if n_train < SMALL_SET:
        return SMALL_PRESET, (
            f"preset {SMALL_PRESET} (auto: {n_train:,} training images, under {SMALL_SET:,}: "
            f"{registry.preset('vit', SMALL_PRESET)['n_layer']} layers learn faster per step than "
            "ViT-Tiny's 12; --preset vit-tiny overrides)"
        )
    return (
        "vit-tiny",
        f"preset vit-tiny (auto: {n_train:,} training images, at least {SMALL_SET:,})",
    )


def model_config(
    cfg: RunConfig, n_classes: int, channels: int, problems: list[str], preset: str | None = None
) -> VitConfig | None:
    """Preset (`preset` when --preset is not given), then flag overrides; shape problems
    are appended to `problems`."""
    presets = registry.family("vit").presets
    preset = cfg.preset or preset or registry.family("vit").default_preset
    if preset not in presets:
        problems.append(
            f"--preset {preset!r} is unknown for vit; valid: {', '.join(sorted(presets))}"
        )
        return None
    fields = dict(presets[preset])
    for key in ("image_size", "patch_size", "n_layer", "d_model", "n_head"):
        v = _int_flag(cfg, key, problems)
        if v is not None:
            fields[key] = v
    if cfg.d_model is not None:
        fields["d_ff"] = 4 * fields["d_model"]  # ViT's MLP ratio follows the width
    vcfg = VitConfig(**fields, n_classes=n_classes, channels=channels)
    problems += check_vit_config(vcfg)
    return vcfg


def build(cfg: RunConfig, project: Project) -> Built:
    problems: list[str] = []
    if cfg.arch not in (None, "vit"):
        problems.append(f"--arch {cfg.arch}: the {NAME} recipe trains arch vit; leave --arch out")
    for key in LM_ONLY:
        if getattr(cfg, key) is not None:
            flag = "--" + key.replace("_", "-")
            fix = (
                "give --images DIR instead"
                if key in ("corpus", "val_corpus", "tokenizer")
                else "leave it out"
            )
            problems.append(f"{flag} does not apply to {NAME} (it is a language-model flag); {fix}")
    if cfg.augment not in AUGMENT:
        problems.append(f"--augment {cfg.augment!r} is unknown; valid: {', '.join(AUGMENT)}")
    # Validate the shape flags before decoding any image: a typo should cost nothing.
    shape = model_config(cfg, n_classes=2, channels=3, problems=problems)
    if problems:
        raise UsageError("; ".join(problems))
    images = Path(cfg.images) if cfg.images else bundled_images()
    val_images = Path(cfg.val_images) if cfg.val_images else None
    train, val = load_image_folders(images, shape.image_size, val_images)
    return make_job(train, val, cfg, str(images), str(val_images) if val_images else None)


def make_job(
    train: ImageSet, val: ImageSet | None, cfg: RunConfig, source: str, val_source: str | None
) -> Built:
    """The job for decoded image sets (what `build` reads from folders; scripts may
    decode other formats, e.g. Fashion-MNIST's IDX files, and call this directly)."""
    problems: list[str] = []
    notes: list[str] = []
    derived: dict[str, Any] = {}
    channels = int(train.images.shape[1])
    preset = cfg.preset
    if preset is None:
        preset, why = choose_preset(len(train))
        notes.append(why)
        derived["preset"] = preset
    vcfg = model_config(cfg, len(train.classes), channels, problems, preset)
    if problems:
        raise UsageError("; ".join(problems))
    torch.manual_seed(cfg.seed)
    model = registry.build_model(vcfg)

    epochs, note = cfg.epoch_steps(
        len(train), cfg.batch_size * cfg.grad_accum * dist.info().world, "images"
    )
    if epochs:
        notes.append(note)
        derived.update(epochs)
        cfg = cfg.replace(**epochs)  # choose_augment counts the run's passes
    augment = cfg.augment or "auto"
    if augment not in AUGMENT:
        raise UsageError(f"--augment {augment!r} is unknown; valid: {', '.join(AUGMENT)}")
    if augment == "auto":
        augment, why = choose_augment(cfg, len(train))
        notes.append(why)
    derived["augment"] = augment
    batches = ImageBatches(
        train,
        cfg.batch_size,
        cfg.seed,
        augment=augment == "crop-flip",
        rank=dist.info().rank,
        world=dist.info().world,
    )
    val_batches = (
        ImageBatches(val, cfg.batch_size, cfg.seed, augment=False) if val is not None else None
    )
    skipped = train.skipped.counts()
    config = {
        "recipe": NAME,
        "arch": "vit",
        "model": vcfg.to_dict(),
        "images": source,
        "val_images": val_source,
        "classes": train.classes,
        "n_train": len(train),
        "n_val": len(val) if val is not None else 0,
        "images_sha256": fingerprint(train),
        "skipped": skipped,
        "augment": augment,
    }
    if val_source is not None and val is not None:
        config["val_skipped"] = val.skipped.counts()

    final = {
        "recipe": NAME,
        "classes": train.classes,
        "image_size": vcfg.image_size,
        "channels": channels,
        "normalize": "x / 127.5 - 1",
        "train": config,
    }
    notes.insert(
        0,
        f"{len(train)} training images in {len(train.classes)} classes from {source}"
        + (f", {len(val)} validation images" if val is not None else ", no validation images"),
    )
    if any(skipped.values()):
        notes.append(
            f"skipped files in {source}: {train.skipped.describe()} "
            f"(e.g. {next(iter(train.skipped.examples.values()))})"
        )
    job = ViTJob(model, config, batches, val_batches, cfg.eval_batches, final)
    return Built(job=job, arch="vit", params=model.num_params(), notes=notes, derived=derived)


def choose_augment(cfg: RunConfig, n_train: int) -> tuple[str, str]:
    """--augment auto: the mode for this run's passes over the data, and a note saying why."""
    seen = (
        cfg.steps * cfg.batch_size * cfg.grad_accum * dist.info().world
    )  # images drawn over the run
    epochs = seen / max(1, n_train)
    mode = "crop-flip" if epochs >= AUGMENT_EPOCHS else "none"
    other = "none" if mode == "crop-flip" else "crop-flip"
    times = f"{epochs:.1f}" if epochs >= 0.1 else f"{epochs:.2g}"  # a short run: 0.0053, not 0.0
    return mode, (
        f"augment {mode} (auto: the run sees each of its {n_train:,} training images {times} "
        f"times, {'at least' if mode == 'crop-flip' else 'under'} {AUGMENT_EPOCHS}; --augment "
        f"{other} overrides)"
    )


class ViTJob(Job):
    """Image classification: cross-entropy over a batch's images, normalised by the images
    of the whole step, and the held-out accuracy from the same forward pass.

    The loop's eval calls `loss` on every held-out batch (model in eval mode) and then
    `eval_figures` on the same batches: counting correct predictions during the loss saves
    a second pass over the validation set. If the tallied image count does not match
    the batches (anyone else called the loss in eval mode), accuracy is recomputed."""

    items_name = "images"
    units = "images"

    def __init__(self, model, config, batches, val_batches, n_eval: int, final: dict):
        super().__init__(NAME, model, config)
        self.batches, self.val_batches, self.n_eval = batches, val_batches, n_eval
        self.final = final  # what final/'s config records beside the model
        self.correct = 0
        self.total = 0

    def micro_batch(self, k: int, live=None) -> dict[str, torch.Tensor]:
        return self.batches.batch(k)

    def eval_batches(self) -> list[dict[str, torch.Tensor]]:
        vb = self.val_batches
        return vb.eval_batches(self.n_eval) if vb is not None else []

    def prepare(self, batch):
        return batch

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["labels"].numel())

    def n_items(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["labels"].numel())

    def decays(self, name: str, p: torch.Tensor) -> bool:
        """Weight decay on matrices only: positions and the class token are 3-D tensors
        but are embeddings, and shrinking them toward zero only blurs where a patch is
        (timm exempts them too)."""
        return p.dim() >= 2 and name not in ("pos_embed", "cls_token")

    def save_final(self, out: Path) -> None:
        save_model_dir(out, self.model, extra=self.final)

    def loss(
        self, model: nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-entropy summed over the batch's images, and the image count (the loop
        divides by the count over the whole accumulation step)."""
        logits = model(to_float(batch["images"]))  # (B, n_classes)
        labels = batch["labels"]
        if not model.training:
            self.correct += int((logits.argmax(-1) == labels).sum())
            self.total += int(labels.numel())
        return F.cross_entropy(logits.float(), labels, reduction="sum"), torch.tensor(
            labels.numel()
        )

    def eval_figures(
        self, model: nn.Module, batches: list[dict[str, torch.Tensor]]
    ) -> dict[str, float]:
        n = sum(int(b["labels"].numel()) for b in batches)
        correct, total = self.correct, self.total
        self.correct = self.total = 0
        if total != n:
            correct, total = accuracy_pass(model, batches)
        return {"accuracy": correct / max(1, total)}


@torch.no_grad()
def accuracy_pass(model: nn.Module, batches: list[dict[str, torch.Tensor]]) -> tuple[int, int]:
    """(correct, total) over `batches` with a forward pass of its own."""
    device = next(model.parameters()).device
    correct, total = 0, 0
    for b in batches:
        logits = model(to_float(b["images"].to(device)))  # (B, n_classes)
        correct += int((logits.argmax(-1).cpu() == b["labels"]).sum())
        total += int(b["labels"].numel())
    return correct, total


RECIPE = Recipe(NAME, build, defaults=DEFAULTS, flags=FLAGS, figures=FIGURES)
