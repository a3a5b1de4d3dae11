"""A recipe's own flags belong to it: naming one on another recipe's run is refused (it
used to be silently ignored), and a misspelt recipe gets a suggestion."""

import pytest
from helpers.common import run_toy


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


@pytest.mark.parametrize("recipe", ["lora", "dpo", "grpo"])
def test_a_shape_flag_on_a_given_models_recipe_is_refused(recipe, toy_cli, tmp_path):
    """--n-layer and --preset shape a fresh model; an adapter recipe trains --model's own
    shape, so they were dropped in silence (run.json recorded "n_layer": 2): now one line,
    exit 2, naming them and the recipes that read them, before any work; the recipe's
    --help leaves them out."""
    code, _, err = toy_cli("train", "--recipe", recipe, "--model", "m.gguf", "--data", "d.jsonl",
                           "--preset", "tiny", "--n-layer", "2", "--out", tmp_path)  # fmt: skip
    assert code == 2 and err.count("\n") == 1, err
    assert "--preset, --n-layer" in err and "from-scratch" in err and f"the {recipe} recipe" in err
    assert not any(tmp_path.iterdir())
    r = run_toy("train", "--recipe", recipe, "--help")
    assert r.returncode == 0 and "--n-layer" not in r.stdout and "--seq-len" in r.stdout


def test_an_unknown_recipes_help_is_one_line():
    r = run_toy("train", "--recipe", "lorra", "--help")
    assert r.returncode == 2 and not r.stdout and r.stderr.count("\n") == 1, r
    assert "did you mean 'lora'?" in r.stderr
