"""A recipe's own flags belong to it: naming one on another recipe's run is refused (it
used to be silently ignored), and a misspelt recipe gets a suggestion."""

import pytest


@pytest.mark.parametrize(
    "argv, needles",
    [
        (
            ["--rank", "4", "--targets", "foo"],
            ["--rank", "--targets", "lora recipe", "--recipe lora"],
        ),
        (["--donor", "x.gguf"], ["--donor", "warm-start"]),
        (["--images", "imgs"], ["--images", "vit-tiny"]),
    ],
)
def test_another_recipes_flag_is_refused(argv, needles, toy_cli, tmp_path):
    code, out, err = toy_cli(
        "train", "--recipe", "from-scratch", "--steps", "1", "--out", tmp_path, *argv
    )
    assert code == 2 and err.count("\n") == 1, err
    for n in needles:
        assert n in err, (n, err)
    assert not any(tmp_path.iterdir())  # refused before any run directory


def test_a_misspelt_recipe_gets_a_suggestion(toy_cli, tmp_path):
    code, _, err = toy_cli("train", "--recipe", "lroa", "--out", tmp_path)
    assert code == 2 and "did you mean 'lora'?" in err, err


def test_a_shared_flag_is_fine_on_any_recipe(toy_cli, tmp_path):
    # --seq-len is general (LoRA only changes its default): from-scratch takes it.
    code, _, err = toy_cli(
        "train",
        "--preset",
        "tiny",
        "--steps",
        "1",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--eval-batches",
        "1",
        "--out",
        tmp_path,
    )
    assert code == 0, err
