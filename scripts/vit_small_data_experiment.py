"""ViT on a few thousand Fashion-MNIST images: which setting makes a short run learn.

Not a test. One run per invocation, one line of results (issue 18). Like
scripts/fashion_mnist_experiment.py it reads Debian's `dataset-fashion-mnist` IDX files
with numpy and hands them to `toy.recipes.vit_tiny.make_job` and toy's one training loop
(`toy.train.loop.train`): the path `toy train --recipe vit-tiny` takes, minus PNG decoding.

Training images: the first --n-train of the training split (12,000: the issue's folder).
Test images: the first --n-test of the test split (all of them are evaluated, once, at the
end). The ablation flags change one thing each, from toy's current defaults:

    --pos timm        positions from N(0, 0.02) (toy's init before issue 18) instead of sin-cos
    --block-init timm the blocks' Linear weights from N(0, 0.02) (before issue 18) instead of
                      fan-in scaled ("qkv" or "qkv,c_fc": only those layers fan-in scaled)
    --pool mean       mean of the patch tokens instead of the class token
    --patch-std S     patch embedding N(0, S) instead of fan-in scaled
    --norm standard   inputs standardised with the data set's mean/std instead of x/127.5 - 1
    --label-smoothing cross-entropy with label smoothing

    OMP_NUM_THREADS=1 python scripts/vit_small_data_experiment.py --steps 200 --n-layer 4 \
        --d-model 128 --n-head 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fashion_mnist_experiment import load  # noqa: E402

from toy.models import vit  # noqa: E402
from toy.recipes import vit_tiny  # noqa: E402
from toy.runs import EventLog  # noqa: E402
from toy.train.loop import train  # noqa: E402
from toy.train.progress import Reporter  # noqa: E402


class Losses(Reporter):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def step(
        self, step: int, loss: float, items_per_s: float | None, peak_mem: int | None = None
    ) -> None:
        self.losses.append(loss)
        if step % 50 == 0:
            print(
                f"  step {step}: mean train loss of the last 50 steps "
                f"{sum(self.losses[-50:]) / 50:.3f}",
                flush=True,
            )


def ablate(a: argparse.Namespace) -> None:
    """Patch the one thing an ablation flag changes (this process only)."""
    reset = vit.ViT.reset_parameters

    def reset_parameters(self: vit.ViT) -> None:
        reset(self)
        if a.block_init != "fan-in":
            keep = () if a.block_init == "timm" else tuple(a.block_init.split(","))
            for name, m in self.blocks.named_modules():
                if isinstance(m, nn.Linear) and not name.endswith(keep or ("-",)):
                    nn.init.trunc_normal_(m.weight, std=0.02)
        if a.pos == "timm":
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if a.patch_std is not None:
            nn.init.trunc_normal_(self.patch_embed.weight, std=a.patch_std)

    vit.ViT.reset_parameters = reset_parameters
    if a.pool == "mean":

        def features(self: vit.ViT, images: torch.Tensor) -> torch.Tensor:
            x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, N, C)
            x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embed
            for block in self.blocks:
                x = block(x)
            return self.norm(x)[:, 1:].mean(1)

        vit.ViT.features = features
    if a.norm == "standard":
        vit_tiny.to_float = lambda x: (
            (x.float() / 255 - 0.286) / 0.353
        )  # Fashion-MNIST's pixel mean and std
    if a.label_smoothing:
        ce = F.cross_entropy
        vit_tiny.F = type(
            "F",
            (),
            {
                "cross_entropy": staticmethod(
                    lambda logits, y, reduction="mean": ce(
                        logits, y, reduction=reduction, label_smoothing=a.label_smoothing
                    )
                )
            },
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-train", type=int, default=12000)
    ap.add_argument("--n-test", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--preset", help="vit preset (default: what the recipe picks for the data)")
    ap.add_argument("--patch-size", type=int, default=4)
    ap.add_argument("--n-layer", type=int)
    ap.add_argument("--d-model", type=int)
    ap.add_argument("--n-head", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--min-lr", type=float)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--weight-decay", type=float)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--augment", default="auto")
    ap.add_argument("--pos", choices=("sincos", "timm"), default="sincos")
    ap.add_argument(
        "--block-init", default="fan-in", help="fan-in, timm, or the layers to keep fan-in scaled"
    )
    ap.add_argument("--pool", choices=("cls", "mean"), default="cls")
    ap.add_argument("--patch-std", type=float)
    ap.add_argument("--norm", choices=("pm1", "standard"), default="pm1")
    ap.add_argument("--label-smoothing", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    ablate(a)

    train_set, test_set = load("train"), load("t10k")
    train_set = train_set.subset(torch.arange(len(train_set)) < a.n_train)
    test_set = test_set.subset(torch.arange(len(test_set)) < a.n_test)
    given = {
        k: v
        for k, v in dict(
            lr=a.lr,
            min_lr=a.min_lr,
            warmup=a.warmup,
            weight_decay=a.weight_decay,
            preset=a.preset,
            n_layer=a.n_layer,
            d_model=a.d_model,
            n_head=a.n_head,
        ).items()
        if v is not None
    }
    opts = vit_tiny.RECIPE.config(
        **{
            **given,
            "image_size": 28,
            "patch_size": a.patch_size,
            "seed": a.seed,
            "batch_size": a.batch_size,
            "steps": a.steps,
            "augment": a.augment,
            "clip": a.clip,
            "eval_batches": 10**6,
        },
    )
    built = vit_tiny.make_job(train_set, test_set, opts, "train", "t10k")
    opts = opts.with_derived(built.derived)
    for note in built.notes:
        print(f"  {note}", flush=True)
    cfg = opts
    t0 = time.perf_counter()
    res = train(built.job, cfg, None, torch.device("cpu"), EventLog(None), Losses())
    args = " ".join(sys.argv[1:])
    row = {
        "args": args,
        "model": {k: built.job.config["model"][k] for k in ("n_layer", "d_model", "n_head")},
        "augment": built.job.config["augment"],
        "lr": cfg.lr,
        "warmup": cfg.warmup,
        "steps": cfg.steps,
        "test_images": len(test_set),
        "test_accuracy": round(res.metrics[-1]["accuracy"], 4),
        "test_loss": round(res.val_losses[-1]["loss"], 4),
        "wall_s": round(time.perf_counter() - t0),
    }
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
