"""`--epochs N` on every recipe: N passes over the training data, turned into a step count
from the data (token windows, images, chat batches) and recorded as --steps."""

import json
import math

import pytest

from toy.data.prep import bundled_text_paths
from toy.data.tokens import read_tokens

TINY = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "1", "--json"]


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    from toy.cli.main import main

    d = tmp_path_factory.mktemp("epochs")
    txt = d / "t.txt"
    txt.write_text(bundled_text_paths()[0].read_text()[:6000])
    assert main(["prep", str(txt), "--out", str(d / "c.bin"), "--vocab-size", "300"]) == 0
    return d / "c.bin"


def _steps(out: str) -> int:
    return json.loads(out.strip().splitlines()[-1])["steps"]


def test_from_scratch_epochs_is_one_pass_of_the_windows(small_corpus, toy_cli, tmp_path):
    code, out, err = toy_cli(
        "train", "--corpus", small_corpus, "--epochs", "2", "--out", tmp_path, *TINY
    )
    assert code == 0, err
    windows = (len(read_tokens(small_corpus)) - 1) // 32
    assert _steps(out) == 2 * math.ceil(windows / 4) and len(json.loads(out)["losses"]) == _steps(
        out
    )
    run = json.loads((tmp_path / json.loads(out)["run_id"] / "run.json").read_text())
    assert run["config"]["steps"] == _steps(out) and run["config"]["epochs"] == 2


def test_epochs_and_steps_conflict(small_corpus, toy_cli, tmp_path):
    code, _, err = toy_cli(
        "train", "--corpus", small_corpus, "--epochs", "1", "--steps", "3", "--out", tmp_path
    )
    assert code == 2 and "--epochs and --steps conflict" in err


def test_warm_start_epochs(tmp_path, toy_cli):
    from helpers.donor import make_donor

    donor = make_donor(tmp_path)
    code, out, err = toy_cli(
        "train",
        "--recipe",
        "warm-start",
        "--donor",
        donor["gguf"],
        "--corpus",
        donor["corpus"],
        "--epochs",
        "1",
        "--out",
        tmp_path / "runs",
        *TINY,
    )
    assert code == 0, err
    windows = (len(read_tokens(donor["corpus"])) - 1) // 32
    assert _steps(out) == math.ceil(windows / 4)


def test_vit_epochs_is_one_pass_of_the_images(tmp_path, toy_cli):
    from helpers.images import make_folder

    folder = make_folder(
        tmp_path / "img", per_class=10
    )  # 2 classes; 10% of each held out: 18 training images
    code, out, err = toy_cli(
        "train",
        "--recipe",
        "vit-tiny",
        "--images",
        folder,
        "--preset",
        "tiny",
        "--batch-size",
        "4",
        "--epochs",
        "2",
        "--json",
        "--out",
        tmp_path / "runs",
    )
    assert code == 0, err
    run = json.loads((tmp_path / "runs" / json.loads(out)["run_id"] / "run.json").read_text())
    assert _steps(out) == 2 * math.ceil(run["job"]["n_train"] / 4)
