"""Fashion-MNIST with toy's ViT recipe on CPU: test accuracy against steps and wall time.

Not a test. Needs Debian's `dataset-fashion-mnist` (IDX files under
/usr/share/datasets/fashion-mnist). The 60k training and 10k test images are read
with numpy, wrapped as `toy.data.images.ImageSet`s, and handed to the same
`toy.recipes.vit_tiny.make_job` that `toy train --recipe vit-tiny` builds from a
folder, then run by toy's one training loop (`toy.train.loop.train`), augmentation,
schedule and AdamW included. Decoding 70k PNGs is skipped: it is the only difference
from `toy train --recipe vit-tiny --images DIR --val-images DIR`.

Every eval is on the full 10k test set. The run has ONE cosine schedule over
--steps, so an intermediate row is the model part-way through that schedule (its
learning rate not yet decayed), not the best a run of that length could do.

    nice python scripts/fashion_mnist_experiment.py --steps 2000 --eval-every 250 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from toy.data.images import ImageSet, Skipped, read_idx
from toy.recipes import vit_tiny
from toy.runs import EventLog
from toy.train.config import RunConfig
from toy.train.loop import train
from toy.train.progress import Reporter

SRC = Path("/usr/share/datasets/fashion-mnist")
CLASSES = [
    "tshirt-top",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle-boot",
]


def load(split: str) -> ImageSet:
    images = read_idx(SRC / f"{split}-images-idx3-ubyte.gz")  # (N, 28, 28) uint8
    labels = read_idx(SRC / f"{split}-labels-idx1-ubyte.gz")  # (N,) uint8
    x = torch.from_numpy(images.copy())[:, None]  # (N, 1, 28, 28): grayscale stays one channel
    return ImageSet(x, torch.from_numpy(labels.astype("int64")), CLASSES, SRC, Skipped())


class Timeline(Reporter):
    """Wall time of each step and eval, so training time can be told apart from eval time."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.last_step_t = self.t0
        self.eval_s = 0.0
        self.rows: list[dict] = []
        self.losses: list[float] = []

    def step(
        self, step: int, loss: float, items_per_s: float | None, peak_mem: int | None = None
    ) -> None:
        self.last_step_t = time.perf_counter()
        self.losses.append(loss)
        if step % 50 == 0:
            print(
                f"step {step} loss {loss:.4f} {items_per_s or 0:.0f} img/s "
                f"train {self.last_step_t - self.t0 - self.eval_s:.0f}s",
                flush=True,
            )

    def eval(self, step: int, metrics: dict[str, float]) -> None:
        now = time.perf_counter()
        took = now - self.last_step_t  # the eval runs right after its step is reported
        self.eval_s += took
        train_s = self.last_step_t - self.t0 - (self.eval_s - took)
        recent = self.losses[-50:]
        row = {
            "step": step,
            "train_s": round(train_s, 1),
            "eval_s": round(took, 1),
            "test_accuracy": round(metrics["accuracy"], 4),
            "test_loss": round(metrics["val_loss"], 4),
            "train_loss_last50": round(sum(recent) / len(recent), 4) if recent else None,
        }
        self.rows.append(row)
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--patch-size", type=int, default=7)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr", type=float, default=2e-5)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument(
        "--augment",
        default="none",
        help="crop-flip or none (the recipe's default is crop-flip; "
        "on 60k images and a few epochs it slows fitting, see docs/results.md)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    t = time.perf_counter()
    train_set, test_set = load("train"), load("t10k")
    load_s = time.perf_counter() - t
    opts = vit_tiny.RECIPE.config(
        preset="tiny",
        image_size=28,
        patch_size=a.patch_size,
        n_layer=a.n_layer,
        d_model=a.d_model,
        n_head=a.n_head,
        seed=a.seed,
        batch_size=a.batch_size,
        eval_batches=10**6,
        augment=a.augment,
    )
    built = vit_tiny.make_job(train_set, test_set, opts, str(SRC / "train-*"), str(SRC / "t10k-*"))
    cfg = RunConfig(
        steps=a.steps,
        batch_size=a.batch_size,
        lr=a.lr,
        min_lr=a.min_lr,
        warmup=a.warmup,
        weight_decay=a.weight_decay,
        clip=1.0,
        eval_every=a.eval_every,
        eval_batches=10**6,
        seed=a.seed,
    )
    machine = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_avg_start": os.getloadavg(),
    }
    print(f"{built.params:,} parameters, model {built.job.config['model']}, {machine}", flush=True)
    timeline = Timeline()
    res = train(built.job, cfg, None, torch.device("cpu"), EventLog(None), timeline)
    machine["load_avg_end"] = os.getloadavg()
    out = {
        "command": " ".join(["python", "scripts/fashion_mnist_experiment.py", *sys.argv[1:]]),
        "params": built.params,
        "model": built.job.config["model"],
        "train": cfg.to_dict(),
        "machine": machine,
        "load_s": round(load_s, 1),
        "images_per_s": res.items_per_s,
        "wall_s": round(res.wall_s, 1),
        "evals": timeline.rows,
    }
    print(json.dumps(out))
    if a.out:
        a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(
        "\n| step | epochs | train wall time | test accuracy | test loss |\n"
        "| ---: | ---: | ---: | ---: | ---: |"
    )
    for r in timeline.rows:
        ep = r["step"] * a.batch_size / len(train_set)
        print(
            f"| {r['step']} | {ep:.2f} | {r['train_s'] / 60:.1f} min "
            f"| {100 * r['test_accuracy']:.2f}% | {r['test_loss']:.3f} |"
        )


if __name__ == "__main__":
    main()
