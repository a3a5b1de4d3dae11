"""Image folders for the ViT recipe: PNGs written by hand (`write_png`, `make_folder`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def write_png(path: Path, seed: int, size=(28, 28), mode="L") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shape = size[::-1] if mode == "L" else (*size[::-1], 3)
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(path)
    return path


def make_folder(root: Path, classes=("a", "b"), per_class=5) -> Path:
    for ci, c in enumerate(classes):
        for i in range(per_class):
            write_png(root / c / f"{i:03d}.png", 100 * ci + i)
    return root
