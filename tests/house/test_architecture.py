"""Import arrows point down the layers of docs/architecture.md; this test reads every
module's imports with `ast` and fails on one that runs the wrong way."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "toy"

# Bottom to top. A module may import toy modules of its own layer or lower ones only.
LAYERS = [
    "errors",
    "runs",
    "tokenizer",
    "models",
    "lora",
    "data",
    "formats",
    "train",
    "recipes",
    "cli",
]
RANK = {name: i for i, name in enumerate(LAYERS)}
# What recipes share without being recipes: the recipe table, the decoder-LM part and
# the adapter recipes' part (base, flags, --output, the final adapter, chat data), the
# donor embedding a fresh model starts from (warm-start, distill),
# the preference recipes' part (pairs, references, figures), and the answers' log-probs
# after their prompts, each prompt's blocks once (GRPO's completions, the pairs' answers).
SHARED_RECIPE_PARTS = (
    "toy.recipes",
    "toy.recipes.lm",
    "toy.recipes.adapter",
    "toy.recipes.donor",
    "toy.recipes.pairs",
    "toy.recipes.scoring",
)


def layer_of(module: str) -> str | None:
    """'toy.models.llama' -> 'models'; 'toy' itself and '__main__' have no layer."""
    parts = module.split(".")
    if parts[0] != "toy" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in RANK else None


def module_name(path: Path, src: Path = SRC) -> str:
    rel = path.relative_to(src.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def toy_imports(path: Path, src: Path = SRC) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path, src).split(".")
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "toy"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module's package
                base = me if is_pkg else me[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "toy":
                if node.module is None or mod in (
                    "toy",
                    "toy.models",
                    "toy.data",
                    "toy.formats",
                    "toy.train",
                    "toy.recipes",
                    "toy.cli",
                ):
                    out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
                else:
                    out.append((node.lineno, mod))
    return out


def violations(src: Path = SRC) -> list[str]:
    bad = []
    for path in sorted(src.rglob("*.py")):
        me = module_name(path, src)
        mine = layer_of(me)
        for lineno, imp in toy_imports(path, src):
            theirs = layer_of(imp)
            if mine is None or theirs is None:
                continue
            where = f"{path.relative_to(src.parent)}:{lineno} imports {imp}"
            if RANK[theirs] > RANK[mine]:
                bad.append(f"{where}: {mine} may not import the higher layer {theirs}")
            if mine == "models" and theirs == "models":
                pass
            elif mine == "models":
                bad.append(f"{where}: models imports only torch and toy.models")
            if mine == "data" and theirs == "models":
                bad.append(f"{where}: data never imports models")
            if (
                mine == "recipes"
                and theirs == "recipes"
                and me != "toy.recipes"
                and imp not in SHARED_RECIPE_PARTS
            ):
                bad.append(f"{where}: a recipe never imports another recipe")
            if theirs == "cli" and mine != "cli":
                bad.append(f"{where}: nothing imports cli")
    return bad


def test_no_import_runs_up_the_layers():
    assert violations() == []


def test_checker_catches_a_wrong_way_import(tmp_path):
    # The checker itself must be able to fail: plant bad imports in a copy of the layout.
    pkg = tmp_path / "toy"
    for sub in ("models", "data", "recipes"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("from toy.train.loop import train\n")
    (pkg / "models" / "llama.py").write_text("from toy.lora import LoRALinear\n")
    (pkg / "data" / "chat.py").write_text("import toy.models.llama\n")
    (pkg / "recipes" / "a.py").write_text("from toy.recipes import b\n")
    (pkg / "recipes" / "b.py").write_text("from . import a\n")
    found = "\n".join(violations(pkg))
    assert "errors.py:1" in found and "higher layer train" in found
    assert "models imports only torch" in found
    assert "data never imports models" in found
    assert "recipes/a.py:1" in found and "recipes/b.py:1" in found


@pytest.mark.parametrize("layer", LAYERS)
def test_every_layer_exists(layer):
    assert (SRC / f"{layer}.py").is_file() or (SRC / layer).is_dir(), layer


def test_cli_holds_no_training_policy():
    """`toy train` is argparse and a call into train.run: the loop, the schedule, jobs and
    checkpoints are the run's business, not the command line's."""
    policy = ("toy.train.loop", "toy.train.schedule", "toy.train.job", "toy.formats.checkpoint")
    bad = [
        f"{p.name}:{line} imports {imp}"
        for p in sorted((SRC / "cli").glob("*.py"))
        for line, imp in toy_imports(p)
        if imp.startswith(policy) and (p.name == "cmd_train.py" or not imp.startswith(policy[-1]))
    ]
    assert bad == []
    assert any(imp == "toy.train.run" for _, imp in toy_imports(SRC / "cli" / "cmd_train.py"))


def test_no_probing_of_recipes_or_models_in_train():
    """The loop, the job and a run's life use the Recipe and model contracts as declared:
    no hasattr/getattr guessing at a named attribute that an object might have (reading a
    dataclass field by a variable name is not guessing)."""
    bad = []
    for p in sorted((SRC / "train").glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("hasattr", "getattr")
            ):
                target, attr = node.args[0], node.args[1]
                if isinstance(attr, ast.Constant) and ast.unparse(target) != "os":
                    bad.append(f"train/{p.name}:{node.lineno} {ast.unparse(node)}")
    assert bad == []


def test_base_readers_are_one_table_and_never_import_each_other():
    """formats/base_readers.py is the one place that knows every base kind: base.py
    imports no reader, a reader imports neither another reader nor the table, and nothing
    outside formats/ imports a reader's module to choose a kind (the table chooses)."""
    readers = {"toy.formats.gguf", "toy.formats.hf_dir"}
    table = "toy.formats.base_readers"
    for name in ("base", "gguf", "hf_dir"):
        mod = f"toy.formats.{name}"
        imported = {m for _, m in toy_imports(SRC / "formats" / f"{name}.py")}
        assert not (imported & (readers | {table}) - {mod}), (mod, imported & readers)
    from toy.formats import base_readers

    assert base_readers.KINDS == ("gguf", "transformers", "mlx")
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        for old in ("base_kind", "read_base"):  # now only in the table's module
            assert f"from toy.formats.base import {old}" not in text, path
