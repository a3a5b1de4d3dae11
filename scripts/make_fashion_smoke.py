"""One-off: write the bundled Fashion-MNIST smoke set (30 images per class, PNG) from
Debian's `dataset-fashion-mnist` package.

    apt-get install dataset-fashion-mnist
    python scripts/make_fashion_smoke.py [--per-class 30]

Writes src/toy/data/assets/fashion-mnist-smoke/<class>/NNN.png and ATTRIBUTION.md.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from toy.data.images import read_idx

SRC = Path("/usr/share/datasets/fashion-mnist")
OUT = (
    Path(__file__).resolve().parents[1] / "src" / "toy" / "data" / "assets" / "fashion-mnist-smoke"
)
# Label index -> folder name (Fashion-MNIST's README names, made path-safe).
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

ATTRIBUTION = """\
# Fashion-MNIST smoke set

{n} grayscale 28 x 28 images, the first {per} of each of the 10 classes in the
Fashion-MNIST training set (in file order), written as PNG, one folder per class:

| label | Fashion-MNIST name | folder |
| --- | --- | --- |
{rows}

Fashion-MNIST is by Han Xiao, Kashif Rasul and Roland Vollgraf, Zalando Research
(https://github.com/zalandoresearch/fashion-mnist), copyright 2017 Zalando SE,
released under the MIT licence (Expat):

> Permission is hereby granted, free of charge, to any person obtaining a copy of this
> software and associated documentation files (the "Software"), to deal in the Software
> without restriction, including without limitation the rights to use, copy, modify,
> merge, publish, distribute, sublicense, and/or sell copies of the Software, and to
> permit persons to whom the Software is furnished to do so, subject to the following
> conditions:
>
> The above copyright notice and this permission notice shall be included in all copies
> or substantial portions of the Software.
>
> THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED,
> INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A
> PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT
> HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF
> CONTRACT, TORT OR OTHERWISE, ARISING FROM, OUT OF OR IN CONNECTION WITH THE SOFTWARE OR
> THE USE OR OTHER DEALINGS IN THE SOFTWARE.

Taken from Debian's `dataset-fashion-mnist` package ({src}/train-*-ubyte.gz),
by `scripts/make_fashion_smoke.py`.
"""

NAMES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-class", type=int, default=30)
    ap.add_argument("--src", type=Path, default=SRC)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    images = read_idx(a.src / "train-images-idx3-ubyte.gz")  # (60000, 28, 28) uint8
    labels = read_idx(a.src / "train-labels-idx1-ubyte.gz")  # (60000,) uint8
    if a.out.exists():
        shutil.rmtree(a.out)
    for y, name in enumerate(CLASSES):
        d = a.out / name
        d.mkdir(parents=True)
        for j, i in enumerate(np.flatnonzero(labels == y)[: a.per_class]):
            # optimize=True and no metadata: byte-stable output, ~300 bytes a file.
            Image.fromarray(images[i], "L").save(d / f"{j:03d}.png", optimize=True)
    rows = "\n".join(f"| {y} | {NAMES[y]} | `{c}/` |" for y, c in enumerate(CLASSES))
    (a.out / "ATTRIBUTION.md").write_text(
        ATTRIBUTION.format(n=10 * a.per_class, per=a.per_class, rows=rows, src=a.src)
    )
    print(f"wrote {10 * a.per_class} PNGs to {a.out}")


if __name__ == "__main__":
    main()
