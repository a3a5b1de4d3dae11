"""`toy infer --run VIT_RUN --image PATH`: the top-5 classes of one image."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from toy.data.images import IMAGE_EXTS, MAX_PIXELS, Skipped, decode, open_image, to_float
from toy.errors import InputError, UsageError
from toy.formats.model_dir import final_dir, load_model_dir

TOP = 5
WHY = {
    "empty": "it is empty (0 bytes)",
    "corrupt": "it is not a readable PNG/JPEG",
    "too_large": f"it has more than {MAX_PIXELS:,} pixels",
}


def infer_image(args) -> int:
    from toy.train.device import resolve_device

    if not args.run:
        raise UsageError("give --run RUN_DIR (a run trained with --recipe vit-tiny)")
    if args.prompt is not None:
        raise UsageError(
            "--image and --prompt conflict: an image classifier takes no prompt; give one of them"
        )
    device = resolve_device(args.device)
    d = final_dir(args.run, "--run")
    path = Path(args.image)
    if not path.is_file():
        raise InputError(f"--image {path}: no such file")
    if path.suffix.lower() not in IMAGE_EXTS:
        raise InputError(
            f"--image {path}: not a PNG/JPEG file (by its extension); convert it to PNG"
        )
    model, meta, _ = load_model_dir(d, device)
    classes = meta.get("classes")
    cfg = model.cfg
    if not classes or getattr(cfg, "arch", None) != "vit":
        raise InputError(
            f"--run {d}: not an image classifier (arch {getattr(cfg, 'arch', '?')}); "
            "--image needs a run trained with --recipe vit-tiny"
        )
    skipped = Skipped()
    im = open_image(path, skipped, MAX_PIXELS)
    reason = next((k for k, n in skipped.counts().items() if n), None)
    if im is None:
        raise InputError(
            f"--image {path}: {WHY.get(reason, 'it cannot be read')}; give another image"
        )
    try:
        with im:
            im.load()
            # The image is brought to the training set's shape: same side, same channels.
            pixels = decode(im, cfg.image_size, cfg.channels)  # (C, S, S) uint8
    except (OSError, ValueError, SyntaxError, EOFError):
        raise InputError(f"--image {path}: {WHY['corrupt']}; give another image")
    with torch.no_grad():
        x = to_float(torch.from_numpy(pixels)[None].to(device))  # (1, C, S, S)
        probs = torch.softmax(model(x).float(), dim=-1)[0].cpu()  # (n_classes,)
    k = min(TOP, len(classes))
    top = torch.topk(probs, k)
    width = max(len(classes[i]) for i in top.indices.tolist())
    for p, i in zip(top.values.tolist(), top.indices.tolist()):
        sys.stdout.write(f"{classes[i]:<{width}}  {p:.4f}\n")
    return 0
