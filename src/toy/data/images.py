"""Image folders -> uint8 tensors, and the batches an image classifier trains on.

A folder holds one subfolder per class (class names are the subfolder names, sorted);
PNG and JPEG files inside a class folder (at any depth) are its images. Every image is
decoded once, resized (shorter side to `image_size`, then centre-cropped square) and
kept as one uint8 tensor (N, C, S, S): small (Fashion-MNIST's 60k images are 47 MB)
and shared by every batch.

Channels: a folder whose images are all grayscale stays 1-channel (3x less memory and
a smaller patch embedding); if any image has colour, every image is RGB (grayscale ones
replicated). `toy infer --image` converts its image to the model's channel count.

What is skipped is counted, never fatal on its own: files in class folders without a
PNG/JPEG extension, and images outside any class folder, are ignored (other files beside
the class folders, a README say, are passed over uncounted); zero-byte and undecodable files are
skipped; images over `MAX_PIXELS` are refused from their header, before any pixel is
decoded, so a decompression bomb costs no memory.

Batches are a pure function of (seed, batch index), like `toy.data.tokens.Windows`:
resume needs no iterator state.
"""

from __future__ import annotations

import gzip
import hashlib
import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from toy.errors import InputError

IMAGE_EXTS = (".png", ".jpg", ".jpeg")
MAX_PIXELS = 50_000_000  # 50 megapixels: a photo is ~12-24; past this, refuse rather than decode
GRAY_MODES = ("1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F", "P;gray")
VAL_FRACTION = 0.1


def bundled_images() -> Path:
    """The bundled smoke set: 30 Fashion-MNIST images per class (see its ATTRIBUTION.md)."""
    return Path(str(resources.files("toy") / "data" / "assets" / "fashion-mnist-smoke"))


def fingerprint(data: ImageSet) -> str:
    """sha256 of the decoded pixels and labels: catches a changed folder on resume."""
    h = hashlib.sha256(data.images.numpy().tobytes())
    h.update(data.labels.numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass
class Skipped:
    """What was left out of a folder, by reason, with one example path each."""

    ignored: int = (
        0  # in a class folder but not a PNG/JPEG by extension, or an image outside any class folder
    )
    empty: int = 0  # zero bytes
    corrupt: int = 0  # could not be decoded
    too_large: int = 0  # over MAX_PIXELS
    examples: dict[str, str] = field(default_factory=dict)

    def add(self, reason: str, path: Path) -> None:
        setattr(self, reason, getattr(self, reason) + 1)
        self.examples.setdefault(reason, str(path))

    def counts(self) -> dict[str, int]:
        return {
            "ignored": self.ignored,
            "empty": self.empty,
            "corrupt": self.corrupt,
            "too_large": self.too_large,
        }

    def describe(self) -> str:
        parts = [f"{n} {k.replace('_', ' ')}" for k, n in self.counts().items() if n]
        return ", ".join(parts) if parts else "none"


@dataclass
class ImageSet:
    images: torch.Tensor  # uint8 (N, C, S, S)
    labels: torch.Tensor  # int64 (N,)
    classes: list[str]
    root: Path
    skipped: Skipped
    paths: list[Path] = field(
        default_factory=list
    )  # the file of each image, in order (empty: not from files)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def subset(self, keep: torch.Tensor) -> ImageSet:
        """The images where the boolean mask `keep` (N,) is true; counts are shared."""
        idx = keep.nonzero().flatten()
        return ImageSet(
            self.images[idx],
            self.labels[idx],
            self.classes,
            self.root,
            self.skipped,
            [self.paths[i] for i in idx.tolist()] if self.paths else [],
        )


def scan_folder(
    root: Path, flag: str = "--images", min_classes: int = 2
) -> tuple[list[str], dict[str, list[Path]], Skipped]:
    """Class names (sorted) and each class's candidate image files (sorted). Raises
    InputError for a missing folder, or one with fewer than `min_classes` class folders."""
    root = Path(root)
    if not root.is_dir():
        raise InputError(
            f"{flag} {root}: no such directory; give a folder with one subfolder of PNG/JPEG "
            "images per class"
        )
    skipped = Skipped()
    files: dict[str, list[Path]] = {}
    for entry in sorted(root.iterdir()):
        if entry.is_file():
            # An image beside the class folders has no class: count it. Other files there
            # (README, ATTRIBUTION.md, LICENSE) document the folder: pass over them quietly.
            if entry.suffix.lower() in IMAGE_EXTS:
                skipped.add("ignored", entry)
            continue
        if not entry.is_dir() or entry.name.startswith("."):
            continue
        found = []
        for p in sorted(entry.rglob("*")):
            if not p.is_file():
                continue
            if p.suffix.lower() in IMAGE_EXTS and not p.name.startswith("."):
                found.append(p)
            else:
                skipped.add("ignored", p)
        if found:  # a class folder with no image files is not a class
            files[entry.name] = found
    classes = sorted(files)
    if not classes:
        raise InputError(
            f"{flag} {root}: no class folders with PNG/JPEG images; put each class's images in a "
            f"subfolder named after the class (e.g. {root / 'cat' / '001.png'})"
        )
    if len(classes) < min_classes:
        raise InputError(
            f"{flag} {root}: only one class folder ({classes[0]}); a classifier needs at least "
            "two, add a subfolder of images per class"
        )
    return classes, files, skipped


def split_holdout(
    files: dict[str, list[Path]], root: Path, fraction: float = VAL_FRACTION
) -> tuple[dict[str, list[Path]], dict[str, list[Path]]]:
    """Hold out `fraction` of each class (at least one when it has two or more images).

    Which files are held out depends only on their paths (the smallest sha256 of the
    path relative to the folder): the split is the same for every seed and machine,
    and adding files to a class moves few of the old ones across."""
    train, val = {}, {}
    for c, paths in files.items():
        n_val = max(1, round(fraction * len(paths))) if len(paths) >= 2 else 0
        ranked = sorted(
            paths, key=lambda p: hashlib.sha256(p.relative_to(root).as_posix().encode()).digest()
        )
        held = set(ranked[:n_val])
        train[c] = [p for p in paths if p not in held]
        val[c] = [p for p in paths if p in held]
    return train, val


def open_image(path: Path, skipped: Skipped, max_pixels: int):
    """Open a file's header (no pixels decoded yet); None, counted in `skipped` by reason, when
    unusable."""
    from PIL import Image, UnidentifiedImageError

    try:
        if path.stat().st_size == 0:
            skipped.add("empty", path)
            return None
        with warnings.catch_warnings():
            # Pillow only warns between MAX_IMAGE_PIXELS and twice that: make it an error.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(path)
    except Image.DecompressionBombError:
        skipped.add("too_large", path)
        return None
    except Image.DecompressionBombWarning:
        skipped.add("too_large", path)
        return None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        skipped.add("corrupt", path)
        return None
    if im.width * im.height > max_pixels:
        im.close()
        skipped.add("too_large", path)
        return None
    return im


def _is_gray(im) -> bool:
    return im.mode in GRAY_MODES or (
        im.mode == "P" and im.palette is not None and im.palette.mode == "L"
    )


def decode(im, image_size: int, channels: int) -> np.ndarray:
    """A PIL image -> uint8 (channels, S, S): shorter side to S, centre crop."""
    from PIL import Image, ImageOps

    mode = "L" if channels == 1 else "RGB"
    if im.format == "JPEG":
        # Let libjpeg downscale by up to 8x while decoding: a big photo never exists at full size.
        im.draft(mode, (image_size, image_size))
    if im.mode not in ("L", "RGB"):
        if "A" in im.mode or "transparency" in im.info:
            # Transparent pixels over white, not over whatever colour they happen to store.
            im = im.convert("RGBA")
            bg = Image.new("RGBA", im.size, (255, 255, 255, 255))
            im = Image.alpha_composite(bg, im)
        elif im.mode in ("I", "I;16", "I;16B", "I;16L", "F"):
            # 16-bit/float grayscale: scale to 0..255 rather than clip.
            a = np.asarray(im, dtype=np.float64)
            hi = a.max() if a.max() > 255 else 255.0
            im = Image.fromarray(np.clip(a * (255.0 / hi), 0, 255).astype(np.uint8), "L")
    im = im.convert(mode)
    if im.size != (image_size, image_size):
        im = ImageOps.fit(im, (image_size, image_size), Image.Resampling.BICUBIC)
    a = np.asarray(im, dtype=np.uint8)
    return np.array(
        a[None] if channels == 1 else a.transpose(2, 0, 1), order="C"
    )  # (C, S, S), an owned copy


def load_images(
    files: dict[str, list[Path]],
    classes: list[str],
    root: Path,
    image_size: int,
    skipped: Skipped | None = None,
    channels: int | None = None,
    max_pixels: int = MAX_PIXELS,
    flag: str = "--images",
) -> ImageSet:
    """Decode every file once into a uint8 (N, C, S, S) tensor.

    channels None: 1 if every image is grayscale, else 3. Raises InputError when no
    image is usable."""
    skipped = skipped if skipped is not None else Skipped()
    index = {c: i for i, c in enumerate(classes)}
    # Pass 1: headers only: the pixel-count guard, and the colour decision, before decoding.
    usable: list[tuple[Path, int]] = []
    any_colour = False
    for c, paths in files.items():
        for p in paths:
            im = open_image(p, skipped, max_pixels)
            if im is None:
                continue
            any_colour |= not _is_gray(im)
            im.close()
            usable.append((p, index[c]))
    if channels is None:
        channels = 3 if any_colour else 1
    # Pass 2: decode into one preallocated tensor (no list of arrays, no 2x peak).
    out = torch.empty((len(usable), channels, image_size, image_size), dtype=torch.uint8)
    labels = torch.empty(len(usable), dtype=torch.int64)
    kept: list[Path] = []
    for p, y in usable:
        im = open_image(p, skipped, max_pixels)
        if im is None:
            continue
        try:
            with im:
                im.load()
                a = decode(im, image_size, channels)
        except (OSError, ValueError, SyntaxError, EOFError):  # truncated or corrupt pixel data
            skipped.add("corrupt", p)
            continue
        out[len(kept)] = torch.from_numpy(a)
        labels[len(kept)] = y
        kept.append(p)
    n = len(kept)
    if n == 0:
        total = sum(len(v) for v in files.values())
        raise InputError(
            f"{flag} {root}: none of its {total} image files could be used "
            f"({skipped.describe()}); check that they open in an image viewer"
        )
    if n < len(usable):
        out, labels = out[:n].clone(), labels[:n].clone()
    return ImageSet(out, labels, classes, Path(root), skipped, kept)


def load_image_folders(
    root: Path, image_size: int, val_root: Path | None = None, max_pixels: int = MAX_PIXELS
) -> tuple[ImageSet, ImageSet | None]:
    """The training set from `root`, and a validation set from `val_root` (its class
    folders must be among the training classes) or, without one, a held-out 10% of
    each class's usable images (see `split_holdout`). Channels follow the training
    folder and the validation set is decoded to match."""
    root = Path(root)
    classes, files, skipped = scan_folder(root, "--images")
    data = load_images(files, classes, root, image_size, skipped, None, max_pixels, "--images")
    val = None
    if val_root is None:
        # Split after decoding, so a class's held-out images are ones that decode.
        by_class: dict[str, list[Path]] = {c: [] for c in classes}
        for p, y in zip(data.paths, data.labels.tolist()):
            by_class[classes[y]].append(p)
        _, held = split_holdout(by_class, root)
        held_set = {p for ps in held.values() for p in ps}
        is_val = torch.tensor([p in held_set for p in data.paths], dtype=torch.bool)
        train = data.subset(~is_val)
        val = data.subset(is_val) if bool(is_val.any()) else None
    else:
        train = data
        _, val_files, val_skipped = _scan_val(Path(val_root), classes)
        val = load_images(
            val_files,
            classes,
            Path(val_root),
            image_size,
            val_skipped,
            int(train.images.shape[1]),
            max_pixels,
            "--val-images",
        )
    present = sorted(set(train.labels.tolist()))
    if len(present) < 2:
        raise InputError(
            f"--images {root}: usable images in only one class ({classes[present[0]]}; skipped: "
            f"{skipped.describe()}); a classifier needs images in at least two class folders"
        )
    return train, val


def _scan_val(
    val_root: Path, classes: list[str]
) -> tuple[list[str], dict[str, list[Path]], Skipped]:
    if not val_root.is_dir():
        raise InputError(
            f"--val-images {val_root}: no such directory; give a folder with the same class "
            "subfolders as --images, or leave it out to hold out 10% of --images"
        )
    # One validation class is fine (a small val set may lack some); none is not.
    val_classes, files, skipped = scan_folder(val_root, "--val-images", min_classes=1)
    unknown = [c for c in val_classes if c not in classes]
    if unknown:
        raise InputError(
            f"--val-images {val_root}: class folder {unknown[0]!r} is not a class of --images "
            f"({', '.join(classes)}); rename or remove it"
        )
    return val_classes, files, skipped


def to_float(images: torch.Tensor) -> torch.Tensor:
    """uint8 (B, C, S, S) -> float in [-1, 1]: a fixed affine map, so training and
    inference agree without storing dataset statistics."""
    return images.float().div_(127.5).sub_(1.0)


class ImageBatches:
    """Shuffled epochs of an ImageSet with light augmentation. Batch k is a pure
    function of (seed, k): sample position p = k*B + i reads epoch p // N's permutation
    (itself seeded by (seed, epoch)) at p % N, and the crop offsets and flips come
    from a generator seeded by (seed, k)."""

    def __init__(
        self,
        data: ImageSet,
        batch_size: int,
        seed: int,
        augment: bool = True,
        rank: int = 0,
        world: int = 1,
    ):
        # With `world` processes, batch k is the global batch of world * B images and
        # this rank takes its slice (augmentation drawn for the whole global batch too),
        # so N processes train as one process of batch N * B.
        self.data, self.B, self.seed, self.augment, self.rank, self.world = (
            data,
            batch_size,
            seed,
            augment,
            rank,
            world,
        )
        S = data.images.shape[-1]
        # Pad by 1/8 of the side (4 px at 32, 3 at 28), the usual CIFAR-style crop jitter.
        self.pad = max(1, S // 8)
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch smaller than the set spans at most two epochs
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, 0, 1, epoch]).permutation(
                len(self.data)
            )
        return self._perms[epoch]

    def indices(self, k: int) -> np.ndarray:
        n = len(self.data)
        first = (k * self.world + self.rank) * self.B
        pos = np.arange(first, first + self.B)
        return np.array([self._perm(int(p // n))[p % n] for p in pos], dtype=np.int64)

    def batch(self, k: int) -> dict[str, torch.Tensor]:
        idx = torch.from_numpy(self.indices(k))
        x = self.data.images[idx]  # (B, C, S, S) uint8, a copy
        if self.augment:
            x = self._augment(x, np.random.default_rng([self.seed, 0, 2, k]))
        return {"images": x, "labels": self.data.labels[idx]}

    def _augment(self, x: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        B, C, S, _ = x.shape
        p = self.pad
        # Zero padding = black border: the background of Fashion-MNIST, and a plain one elsewhere.
        padded = torch.nn.functional.pad(x, (p, p, p, p))  # (B, C, S+2p, S+2p)
        G, mine = B * self.world, slice(self.rank * B, (self.rank + 1) * B)
        dy = rng.integers(0, 2 * p, size=G, endpoint=True)[mine]
        dx = rng.integers(0, 2 * p, size=G, endpoint=True)[mine]
        flip = (rng.random(G) < 0.5)[
            mine
        ]  # left-right flips keep a garment (or most photos) what it is
        out = torch.empty_like(x)
        for i in range(B):
            crop = padded[i, :, dy[i] : dy[i] + S, dx[i] : dx[i] + S]
            out[i] = crop.flip(-1) if flip[i] else crop
        return out

    def eval_batches(self, max_batches: int | None = None) -> list[dict[str, torch.Tensor]]:
        """Unaugmented batches: every image once, in order (max_batches None, or enough
        batches for the whole set), else a fixed sample of max_batches * B images.

        The sample is the same for every seed and run (drawn with a constant seed) and
        spread over the whole set: images are stored class by class, so the first
        max_batches * B of them would be the first classes alone (the 16 default batches
        of a 10,000-image Fashion-MNIST test folder were its first two classes)."""
        n = len(self.data)
        idx = torch.arange(n)
        if max_batches is not None and max_batches * self.B < n:
            pick = np.sort(np.random.default_rng(0).permutation(n)[: max_batches * self.B])
            idx = torch.from_numpy(pick)
        return [
            {
                "images": self.data.images[idx[i : i + self.B]],
                "labels": self.data.labels[idx[i : i + self.B]],
            }
            for i in range(0, len(idx), self.B)
        ]


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (MNIST / Fashion-MNIST layout, optionally gzipped) as a numpy array."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise InputError(f"{path}: not an IDX file (bad magic)")
    dtypes = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if raw[2] not in dtypes:
        raise InputError(f"{path}: IDX type code {raw[2]:#x} is unknown")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=dtypes[raw[2]], offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise InputError(
            f"{path}: IDX header says {shape} but holds {data.size} values; the file is truncated"
        )
    return data.reshape(shape)
