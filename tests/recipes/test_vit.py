"""The ViT model, image folders (every skip reason counted, every error one line with
exit 2), deterministic augmented batches, and `toy train --recipe vit-tiny` ->
`toy infer --image` end to end on the bundled Fashion-MNIST smoke set."""

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.common import assert_every_parameter_learns
from helpers.images import make_folder, write_png  # noqa: F401
from PIL import Image

from toy.data.images import (
    MAX_PIXELS,
    ImageBatches,
    bundled_images,
    load_image_folders,
    read_idx,
    scan_folder,
    split_holdout,
)
from toy.errors import InputError
from toy.models.vit import ViT, VitConfig, sincos_2d

TINY = ["--recipe", "vit-tiny", "--preset", "tiny", "--batch-size", "16", "--json"]


def tiny_vit(**kw) -> ViT:
    cfg = dict(
        image_size=28,
        patch_size=7,
        channels=1,
        n_layer=2,
        d_model=64,
        n_head=4,
        d_ff=256,
        n_classes=10,
    )
    cfg.update(kw)
    torch.manual_seed(0)
    return ViT(VitConfig(**cfg))


# ---------------------------------------------------------------- the model


def test_vit_tiny_defaults_and_shapes():
    cfg = VitConfig(n_classes=10)
    shape = (cfg.image_size, cfg.patch_size, cfg.n_layer, cfg.d_model, cfg.n_head, cfg.d_ff)
    assert shape == (224, 16, 12, 192, 3, 768)
    assert cfg.n_patches == 196 and cfg.to_dict()["arch"] == "vit"
    m = ViT(cfg)
    assert m.pos_embed.shape == (1, 197, 192)  # 196 patches + the class token
    assert 5.4e6 < m.num_params() < 5.8e6  # ViT-Tiny/16 is 5.7M with a 1000-class head
    with torch.no_grad():
        assert m(torch.randn(2, 3, 224, 224)).shape == (2, 10)


def test_small_shape_patch_count_and_logits():
    m = tiny_vit()
    assert m.cfg.n_patches == 16 and m.pos_embed.shape == (1, 17, 64)
    x = torch.randn(5, 1, 28, 28)
    assert m(x).shape == (5, 10) and m.features(x).shape == (5, 64)


def test_every_parameter_gets_a_finite_gradient():
    m = tiny_vit()
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    torch.nn.functional.cross_entropy(m(x), y).backward()
    assert_every_parameter_learns(m)


def test_block_linears_start_fan_in_scaled_and_the_head_small():
    """Not timm's 0.02 inside the blocks: at 0.02 attention starts flat and learns slowly
    (docs/results.md, Fashion-MNIST ViT)."""
    m = tiny_vit()
    linears = [(n, x) for n, x in m.blocks.named_modules() if isinstance(x, torch.nn.Linear)]
    assert len(linears) == 2 * 4  # qkv, proj, c_fc, c_proj in each block
    for name, lin in linears:
        want = lin.in_features**-0.5
        assert abs(float(lin.weight.detach().std()) / want - 1) < 0.15, name
        assert not lin.bias.detach().any()
    assert abs(float(m.head.weight.detach().std()) / 0.02 - 1) < 0.15


def test_positions_start_as_a_2d_sincos_table():
    """Positions start at the scale of a patch's embedding, not N(0, 0.02): where a patch
    is must be visible from step 1 (docs/results.md, Fashion-MNIST ViT)."""
    m = tiny_vit()
    pos = m.pos_embed.detach()[0]  # (1 + 16, 64)
    assert torch.equal(pos[0], torch.zeros(64))  # the class token has no place
    assert torch.equal(pos[1:], sincos_2d(4, 64)) and m.pos_embed.requires_grad
    assert 0.6 < float(pos[1:].pow(2).mean().sqrt()) < 0.8  # sin/cos: RMS 1/sqrt(2)
    # Row-major 4 x 4 grid: patch 5 is (1, 1); its neighbour (1, 2) is closer than (3, 3).
    d = torch.cdist(pos[1:], pos[1:])
    assert d[5, 6] < d[5, 15] and d[5, 9] < d[5, 15]
    assert (d + torch.eye(16)).min() > 0.5  # every patch has a place of its own
    assert sincos_2d(3, 6).shape == (9, 6)  # widths not divisible by 4 are cut, not refused


def test_non_causal_every_patch_reaches_the_class_token():
    m = tiny_vit().eval()
    x = torch.randn(1, 1, 28, 28)
    y = x.clone()
    y[..., 21:, 21:] += 1.0  # only the last patch changes
    with torch.no_grad():
        assert not torch.allclose(m(x), m(y))


def test_registry_rebuilds_vit():
    from toy.models import registry

    m = tiny_vit()
    cfg = registry.config_from_dict(json.loads(json.dumps(m.cfg.to_dict())))
    assert isinstance(registry.build_model(cfg), ViT) and cfg == m.cfg
    assert {"vit-tiny", "vit-tiny-6", "tiny"} <= set(registry.preset_names("vit"))


# ---------------------------------------------------------------- image folders


def huge_png_header(path: Path, width: int, height: int) -> Path:
    """A valid PNG signature and IHDR claiming width x height, with a token IDAT: tiny
    on disk, enormous if anything tried to decode it."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )
    return path


def test_folder_classes_sorted_and_holdout_split_stable(tmp_path):
    root = make_folder(tmp_path / "imgs", classes=("zebra", "ant"), per_class=20)
    classes, files, skipped = scan_folder(root)
    assert classes == ["ant", "zebra"] and sum(skipped.counts().values()) == 0
    tr, va = split_holdout(files, root)
    assert [len(va[c]) for c in classes] == [2, 2] and [len(tr[c]) for c in classes] == [18, 18]
    assert split_holdout(files, root) == (tr, va)  # the same split every time
    train, val = load_image_folders(root, 28)
    assert train.images.shape == (36, 1, 28, 28) and train.images.dtype == torch.uint8
    assert val.images.shape == (4, 1, 28, 28) and sorted(set(val.labels.tolist())) == [0, 1]


def test_colour_anywhere_makes_every_image_rgb_and_sizes_are_fitted(tmp_path):
    root = make_folder(tmp_path / "imgs", per_class=3)
    write_png(root / "a" / "colour.png", 7, size=(40, 30), mode="RGB")  # colour and not square
    train, val = load_image_folders(root, 16)
    assert train.images.shape[1:] == (3, 16, 16) and val.images.shape[1:] == (3, 16, 16)
    gray = train.images[train.labels == 1][0]
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2])  # grayscale replicated


def test_skips_are_counted(tmp_path):
    root = make_folder(tmp_path / "imgs", per_class=4)
    (root / "a" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not really a png")
    (root / "a" / "truncated.png").write_bytes(
        write_png(tmp_path / "t.png", 9, size=(64, 64)).read_bytes()[:120]
    )
    (root / "b" / "empty.jpg").write_bytes(b"")
    (root / "b" / "notes.txt").write_text("not an image")
    (root / "b" / "thumbs.db").write_bytes(b"\0" * 10)
    (root / "README.md").write_text("documentation beside the class folders is passed over")
    huge_png_header(root / "a" / "bomb.png", 20000, 20000)  # 400 MP: Pillow's own bomb guard
    huge_png_header(
        root / "b" / "big.png", 8000, 7000
    )  # 56 MP: over toy's 50 MP, under Pillow's limit
    train, val = load_image_folders(root, 28)
    assert train.skipped.counts() == {"ignored": 2, "empty": 1, "corrupt": 2, "too_large": 2}
    assert len(train) + len(val) == 8


def test_too_large_is_refused_from_the_header(tmp_path):
    root = make_folder(tmp_path / "imgs", per_class=2)
    classes, files, skipped = scan_folder(root)
    from toy.data.images import load_images

    with pytest.raises(InputError, match="too large"):
        load_images(files, classes, root, 28, skipped, max_pixels=28 * 28 - 1)
    assert MAX_PIXELS == 50_000_000


@pytest.mark.parametrize(
    "setup,needle",
    [
        ("missing", "no such directory"),
        ("empty", "no class folders"),
        ("one_class", "only one class folder"),
        ("none_usable", "none of its 4 image files could be used"),
        ("one_usable_class", "only one class"),
    ],
    ids=lambda v: v if isinstance(v, str) and " " not in v else "",
)
def test_folder_errors_exit_2_with_one_line(setup, needle, tmp_path, toy_cli):
    root = tmp_path / "imgs"
    if setup != "missing":
        root.mkdir()
    if setup == "empty":
        (root / "a").mkdir()
        (root / "a" / "notes.txt").write_text("x")
    elif setup == "one_class":
        make_folder(root, classes=("only",))
    elif setup == "none_usable":
        for c in ("a", "b"):
            (root / c).mkdir()
            (root / c / "0.png").write_bytes(b"")
            (root / c / "1.png").write_bytes(b"garbage")
    elif setup == "one_usable_class":
        make_folder(root, classes=("a",))
        (root / "b").mkdir()
        (root / "b" / "0.png").write_bytes(b"garbage")
    out = tmp_path / "runs"
    code, _, err = toy_cli("train", *TINY, "--images", root, "--out", out, "--steps", "1")
    assert code == 2, err
    assert needle in err and str(root) in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()  # nothing half-made


@pytest.mark.parametrize(
    "argv,needles",
    [
        (
            ["--image-size", "28", "--patch-size", "5"],
            ["--image-size 28 must be a multiple of --patch-size 5"],
        ),
        (
            ["--d-model", "30", "--n-head", "4", "--patch-size", "0"],
            ["--patch-size must be an integer >= 1", "--d-model 30 must be divisible"],
        ),
        (
            ["--seq-len", "8", "--n-kv-head", "2"],
            ["--seq-len does not apply to vit-tiny", "--n-kv-head does not"],
        ),
        (
            ["--arch", "llama", "--augment", "mixup"],
            ["trains arch vit", "--augment 'mixup' is unknown"],
        ),
        (["--preset", "gpt2-124m"], ["valid: tiny, vit-tiny, vit-tiny-6"]),
    ],
)
def test_flag_problems_reported_together(argv, needles, tmp_path, toy_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = toy_cli("train", "--recipe", "vit-tiny", *argv, "--steps", "1")
    assert code == 2, err
    for n in needles:
        assert n in err, err
    assert len(err.strip().splitlines()) == 1


def test_val_images_folder_and_unknown_class(tmp_path, toy_cli):
    root = make_folder(tmp_path / "imgs", per_class=6)
    val = make_folder(
        tmp_path / "val", classes=("b",), per_class=3
    )  # one class in a val set is fine
    train, v = load_image_folders(root, 28, val)
    assert len(train) == 12 and len(v) == 3 and set(v.labels.tolist()) == {1}
    write_png(val / "c" / "0.png", 1)
    code, _, err = toy_cli(
        "train", *TINY, "--images", root, "--val-images", val, "--out", tmp_path / "r"
    )
    assert code == 2 and "'c' is not a class of --images" in err, err


# ---------------------------------------------------------------- batches


def test_batch_k_is_a_pure_function_of_seed_and_k():
    train, _ = load_image_folders(bundled_images(), 28)
    a = ImageBatches(train, 32, seed=3)
    later = a.batch(17)
    for k in range(5):
        a.batch(k)
    b = ImageBatches(train, 32, seed=3)
    again = b.batch(17)
    assert torch.equal(later["images"], again["images"]) and torch.equal(
        later["labels"], again["labels"]
    )
    c = ImageBatches(train, 32, seed=4).batch(17)
    assert not torch.equal(later["images"], c["images"])
    # One epoch (270 images / 32 per batch, whole batches) sees every image once.
    plain = ImageBatches(train, 27, seed=3, augment=False)
    seen = np.concatenate([plain.indices(k) for k in range(10)])
    assert sorted(seen.tolist()) == list(range(len(train)))


def test_augment_none_trains_on_the_images_as_they_are(tmp_path, toy_cli):
    r = train_json(toy_cli, tmp_path, "--steps", "1", "--augment", "none", "--run-id", "n")
    assert json.loads((tmp_path / "n" / "run.json").read_text())["job"]["augment"] == "none"
    assert len(r["losses"]) == 1


def test_augment_auto_follows_the_passes_over_the_data(tmp_path, toy_cli):
    from toy.recipes import vit_tiny

    def mode(steps, batch, n):
        return vit_tiny.choose_augment(vit_tiny.RECIPE.config(steps=steps, batch_size=batch), n)

    assert vit_tiny.RECIPE.flag_defaults()["augment"] == "auto"
    assert mode(400, 64, 12000)[0] == "none"  # 2.1 passes: the Fashion-MNIST run
    assert mode(200, 16, 270)[0] == "crop-flip"  # 11.9 passes over the smoke set
    assert "2.1 times" in mode(400, 64, 12000)[1]
    assert "0.0053 times" in mode(1, 64, 12000)[1]  # a one-step run does not read "0.0 times"
    code, out, err = toy_cli(
        "train",
        *[a for a in TINY if a != "--json"],
        "--steps",
        "2",
        "--out",
        tmp_path,
        "--run-id",
        "a",
    )
    assert (
        code == 0 and "augment none (auto: the run sees each of its 270 training images" in out
    ), err
    info = json.loads((tmp_path / "a" / "run.json").read_text())
    assert info["job"]["augment"] == info["config"]["augment"] == "none"  # resolved once, recorded


def test_preset_follows_the_training_set_size(tmp_path, toy_cli):
    from toy.models import registry
    from toy.recipes import vit_tiny

    assert vit_tiny.choose_preset(12_000)[0] == "vit-tiny-6"  # the Fashion-MNIST folder
    assert vit_tiny.choose_preset(60_000)[0] == "vit-tiny"
    assert registry.preset("vit", "vit-tiny-6") == {
        **registry.preset("vit", "vit-tiny"),
        "n_layer": 6,
    }
    # No --preset: the smoke set's 270 images get the half-depth shape (at 28 px, to stay small).
    code, out, err = toy_cli(
        "train",
        "--recipe",
        "vit-tiny",
        "--image-size",
        "28",
        "--patch-size",
        "7",
        "--batch-size",
        "4",
        "--steps",
        "1",
        "--out",
        tmp_path,
        "--run-id",
        "p",
    )
    assert code == 0 and "preset vit-tiny-6 (auto: 270 training images, under 50,000" in out, err
    info = json.loads((tmp_path / "p" / "run.json").read_text())
    assert info["config"]["preset"] == "vit-tiny-6" and info["job"]["model"]["n_layer"] == 6


def test_recipe_schedule_defaults_and_help(toy_cli, capsys):
    """The defaults docs/results.md measured (Fashion-MNIST ViT), and --help shows them."""
    from toy.recipes import vit_tiny

    f = vit_tiny.RECIPE.flag_defaults()
    assert (f["lr"], f["warmup"], f["min_lr"], f["batch_size"], f["augment"]) == (
        1e-3,
        40,
        1e-5,
        64,
        "auto",
    )
    with pytest.raises(SystemExit) as e:
        toy_cli("train", "--help")
    flat = " ".join(capsys.readouterr().out.split())
    assert (
        e.value.code == 0
        and "vit-tiny 40" in flat
        and "vit-tiny-6 under 50,000 training images" in flat
    )


def test_eval_batches_sample_the_whole_set_not_its_first_classes():
    train, _ = load_image_folders(bundled_images(), 28)  # 270 images stored class by class
    sample = ImageBatches(train, 8, seed=0, augment=False).eval_batches(4)
    labels = torch.cat([b["labels"] for b in sample])
    assert len(labels) == 32 and len(set(labels.tolist())) >= 8  # the first 32 are 1-2 classes
    again = ImageBatches(train, 8, seed=5, augment=False).eval_batches(4)
    assert all(
        torch.equal(a["images"], b["images"]) for a, b in zip(sample, again)
    )  # every seed: same images
    whole = ImageBatches(train, 8, seed=0, augment=False).eval_batches()
    assert torch.equal(
        torch.cat([b["labels"] for b in whole]), train.labels
    )  # all of them, in order


def test_augmentation_is_crop_and_flip_of_the_original():
    train, _ = load_image_folders(bundled_images(), 28)
    aug = ImageBatches(train, 8, seed=0).batch(0)
    plain = ImageBatches(train, 8, seed=0, augment=False).batch(0)
    assert torch.equal(aug["labels"], plain["labels"])
    assert aug["images"].shape == plain["images"].shape and aug["images"].dtype == torch.uint8
    assert not torch.equal(aug["images"], plain["images"])
    # Every pixel of an augmented image is black padding or a pixel of the original.
    for x, y in zip(aug["images"], plain["images"]):
        assert set(x.unique().tolist()) <= set(y.unique().tolist()) | {0}


def test_bundled_smoke_set():
    root = bundled_images()
    classes, files, skipped = scan_folder(root)
    assert len(classes) == 10 and all(len(files[c]) == 30 for c in classes)
    assert (root / "ATTRIBUTION.md").is_file() and sum(skipped.counts().values()) == 0
    assert sum(p.stat().st_size for c in classes for p in files[c]) < 1_000_000


def test_read_idx(tmp_path):
    import gzip

    arr = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    raw = bytes([0, 0, 8, 3]) + b"".join(struct.pack(">I", n) for n in arr.shape) + arr.tobytes()
    (tmp_path / "x.gz").write_bytes(gzip.compress(raw))
    assert np.array_equal(read_idx(tmp_path / "x.gz"), arr)
    (tmp_path / "bad").write_bytes(raw[:-1])
    with pytest.raises(InputError, match="truncated"):
        read_idx(tmp_path / "bad")


# ---------------------------------------------------------------- end to end


def train_json(toy_cli, tmp_path, *extra):
    code, out, err = toy_cli("train", *TINY, "--out", tmp_path, *extra)
    assert code == 0, err
    return json.loads(out)


def test_train_then_infer_image(tmp_path, toy_cli):
    r = train_json(toy_cli, tmp_path, "--steps", "6", "--eval-every", "3", "--run-id", "v")
    assert (r["recipe"], r["arch"]) == ("vit-tiny", "vit") and len(r["losses"]) == 6
    assert [a["step"] for a in r["val_accuracy"]] == [0, 3, 6]
    assert all(set(a) == {"step", "accuracy"} for a in r["val_accuracy"])
    assert all(
        a["accuracy"] in {i / 30 for i in range(31)} for a in r["val_accuracy"]
    )  # counts of the 30
    assert r["images_per_s"] > 0
    final = tmp_path / "v" / "final"
    meta = json.loads((final / "config.json").read_text())
    assert (
        meta["recipe"] == "vit-tiny"
        and len(meta["classes"]) == 10
        and meta["model"]["image_size"] == 28
    )
    info = json.loads((tmp_path / "v" / "run.json").read_text())
    assert info["job"]["n_train"] == 270 and info["job"]["n_val"] == 30
    png = bundled_images() / "sneaker" / "000.png"
    code, out, err = toy_cli("infer", "--run", tmp_path / "v", "--image", png)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 5
    names = [line.rsplit(None, 1)[0] for line in lines]
    probs = [float(line.rsplit(None, 1)[1]) for line in lines]
    assert set(names) <= set(meta["classes"]) and len(set(names)) == 5
    assert probs == sorted(probs, reverse=True) and sum(probs) <= 1.0 + 1e-3
    # A colour JPEG of another size is converted to the model's shape.
    jpg = tmp_path / "photo.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8)).save(
        jpg
    )
    code, out, err = toy_cli("infer", "--run", tmp_path / "v", "--image", jpg)
    assert code == 0 and len(out.strip().splitlines()) == 5, err
    for bad, needle in (
        (tmp_path / "none.png", "no such file"),
        (tmp_path / "t.txt", "not a PNG/JPEG"),
    ):
        if bad.suffix == ".txt":
            bad.write_text("x")
        code, _, err = toy_cli("infer", "--run", tmp_path / "v", "--image", bad)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    (tmp_path / "empty.png").write_bytes(b"")
    code, _, err = toy_cli("infer", "--run", tmp_path / "v", "--image", tmp_path / "empty.png")
    assert code == 2 and "empty" in err
    # Text to an image classifier: it says what the run is and what it takes (not "no tokenizer").
    for argv in (["--prompt", "hi"], ["--chat", "hi"]):
        code, _, err = toy_cli("infer", "--run", tmp_path / "v", *argv)
        assert (
            code == 2
            and "image classifier" in err
            and "--image PATH" in err
            and "tokenizer" not in err
        ), err
        assert len(err.strip().splitlines()) == 1


def test_corrupt_files_train_and_are_recorded(tmp_path, toy_cli):
    root = make_folder(tmp_path / "imgs", per_class=5)
    (root / "a" / "bad.png").write_bytes(b"garbage")
    (root / "b" / "zero.png").write_bytes(b"")
    (root / "b" / "x.txt").write_text("x")
    r = train_json(toy_cli, tmp_path, "--images", root, "--steps", "2", "--run-id", "c")
    info = json.loads((tmp_path / "c" / "run.json").read_text())
    assert info["job"]["skipped"] == {"ignored": 1, "empty": 1, "corrupt": 1, "too_large": 0}
    assert info["job"]["classes"] == ["a", "b"] and r["val_accuracy"]


def test_accuracy_from_the_eval_loss_equals_a_separate_pass():
    from toy.recipes import vit_tiny

    train, val = load_image_folders(bundled_images(), 28)

    opts = vit_tiny.RECIPE.config(preset="tiny", seed=0, batch_size=8, eval_batches=100)
    built = vit_tiny.make_job(train, val, opts, "bundled", None)
    job, model = built.job, built.job.model
    from toy.train.loop import evaluate

    batches = job.eval_batches()
    assert sum(len(b["labels"]) for b in batches) == len(val) == 30
    got = evaluate(job, batches, torch.device("cpu"))["accuracy"]
    correct, total = vit_tiny.accuracy_pass(model.eval(), batches)
    assert got == correct / total
    assert job.eval_figures(model, batches)["accuracy"] == got  # no tally: the fallback pass


def test_same_seed_same_losses_other_seed_differs(tmp_path, toy_cli):
    def losses(seed, rid):
        return [
            x["loss"]
            for x in train_json(toy_cli, tmp_path, "--steps", "3", "--seed", seed, "--run-id", rid)[
                "losses"
            ]
        ]

    a, b, c = losses(1, "a"), losses(1, "b"), losses(2, "c")
    assert a == b and a != c


def test_resume_is_exact(tmp_path, toy_cli):
    import shutil

    from safetensors.torch import load_file

    from toy.runs import read_events

    straight = train_json(toy_cli, tmp_path, "--steps", "4", "--save-every", "2", "--run-id", "s")
    shutil.copytree(
        tmp_path / "s", tmp_path / "p"
    )  # the same run, killed after its step-2 checkpoint
    shutil.rmtree(tmp_path / "p" / "checkpoints" / "step-000004")
    shutil.rmtree(tmp_path / "p" / "final")
    part = {"losses": straight["losses"][:2]}
    code, out, err = toy_cli("train", "--resume", tmp_path / "p", "--json")
    assert code == 0, err
    # What the resumed segment recomputed, and the weights it ends with.
    resumed = [(e["step"], e["loss"]) for e in read_events(tmp_path / "p") if e["event"] == "step"][
        -2:
    ]
    assert resumed == [(x["step"], x["loss"]) for x in straight["losses"][2:]]
    assert part["losses"] == straight["losses"][:2]
    a = load_file(tmp_path / "s" / "final" / "model.safetensors")
    b = load_file(tmp_path / "p" / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_vit_learns_the_smoke_set(tmp_path, toy_cli):
    """A recipe that learns nothing fails here: 10 classes (chance 10%), 30 held-out images."""
    r = train_json(
        toy_cli,
        tmp_path,
        "--steps",
        "40",
        "--augment",
        "none",
        "--lr",
        "3e-3",
        "--warmup",
        "4",
        "--eval-every",
        "40",
        "--eval-batches",
        "10",
    )
    acc = r["val_accuracy"]
    # 9 of 30 right where chance gives 3 (P(>= 9) at chance is about 0.002)
    assert acc[0]["accuracy"] <= 0.2 and acc[-1]["accuracy"] >= 0.3, acc
    assert r["val_losses"][-1]["loss"] < 0.9 * r["val_losses"][0]["loss"], r["val_losses"]
