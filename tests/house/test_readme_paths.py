"""README.md's commands, in order, read only paths that the commands before them made (issue
35): a new user copying them never meets a data/... or runs/... that does not exist yet.

Every ```sh block's `toy ...` lines are read in order. A path a line reads must come from
`toy new` (run here for real: what it writes is what it makes), a `toy fetch` (named from
toy.cli.cmd_fetch.MODELS, as the command names them), an `--out` / `--output`, or a run an
earlier `toy train` made (`runs/<lora-id>` needs an earlier `--recipe lora`); else it must be
one of the files the README names as the user's own (their text, their images)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Paths the README hands to toy as the user's own: "your text", an image folder. Nothing in
# the README makes them and nothing should.
USER_FILES = {"my.txt", "more.jsonl", "train", "test", "shirt.png"}
OUTPUT_FLAGS = {"--out", "--output"}
# Flags whose value is a path, whatever it looks like; other arguments are paths when PATHY.
PATH_FLAGS = {"--model", "--model-path", "--data", "--val-data", "--corpus", "--donor"}
PATH_FLAGS |= {"--tokenizer", "--run", "--resume", "--adapter", "--images", "--val-images"}
PATH_FLAGS |= {"--image", "--chat-template"}
PATHY = re.compile(r"^(data|runs)/|/|\.(txt|jsonl|json|gguf|bin|safetensors|png|jpe?g|toml)$")
PLACEHOLDER = re.compile(r"^runs/<(?:(?P<recipe>[a-z0-9-]+)-)?id>(?:/|$)")


def sh_commands(markdown: str) -> list[list[str]]:
    """Each command of each ```sh block, in order, as argv (comments dropped, `\\` lines
    joined, `a && b` split)."""
    out = []
    for block in re.findall(r"^```sh\n(.*?)^```", markdown, flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv: list[str] = []
            for tok in shlex.split(line, comments=True) + ["&&"]:
                if tok == "&&":
                    out += [argv] if argv else []
                    argv = []
                else:
                    argv.append(tok)
    return out


def toy_argv(argv: list[str]) -> list[str] | None:
    """The toy arguments of `toy ...` or `torchrun ... -m toy ...`; None for other commands."""
    if argv[0] == "toy":
        return argv[1:]
    for i in range(len(argv) - 1):
        if argv[i] == "-m" and argv[i + 1] == "toy":
            return argv[i + 2 :]
    return None


def _norm(p: str) -> str:
    return p.rstrip("/")


def unmade_paths(markdown: str, made_by_new) -> list[str]:
    """'command: path' for each path a README command reads before any command made it.
    made_by_new(name) -> the relative paths `toy new name` writes."""
    from toy.cli.cmd_fetch import MODELS

    made: set[str] = set()  # toy new's files and folders: these paths exactly
    trees: set[str] = set()  # what later commands wrote: these paths and anything in them
    recipes: list[str] = []  # of the runs made so far
    problems = []
    for argv in sh_commands(markdown):
        args = toy_argv(argv)
        if args is None:
            continue
        cmd = args[0]
        reads, writes = [], []
        i = 1
        while i < len(args):
            a = args[i]
            if a in OUTPUT_FLAGS and i + 1 < len(args):
                writes.append(args[i + 1])
                i += 2
                continue
            if a in PATH_FLAGS and i + 1 < len(args):
                reads.append(args[i + 1])
                i += 2
                continue
            if not a.startswith("-") and PATHY.search(a):
                reads.append(a)
            i += 1
        if cmd == "new":
            made |= set(made_by_new(args[1]))
            continue
        if cmd == "fetch":
            m = MODELS[args[1]]
            kind = args[args.index("--as") + 1] if "--as" in args else "gguf"
            out = writes[0] if writes else "data"
            writes = [f"{out}/{m.target if kind == 'gguf' else Path(m.target).stem + '-' + kind}"]
        for p in reads:
            p = _norm(p)
            ph = PLACEHOLDER.match(p)
            if ph:
                want = ph["recipe"]
                ok = any(r.startswith(want) for r in recipes) if want else bool(recipes)
            else:
                ok = p in USER_FILES or p in made
                ok = ok or any(p == t or p.startswith(t + "/") for t in trees)
            if not ok:
                problems.append(f"toy {' '.join(args)}: {p}")
        trees |= {_norm(w) for w in writes}
        if cmd == "train" and "--resume" not in args:
            recipe = args[args.index("--recipe") + 1] if "--recipe" in args else "from-scratch"
            recipes.append(recipe)
            if "--run-id" in args:
                trees.add("runs/" + args[args.index("--run-id") + 1])
    return problems


def _made_by_new(tmp_path, toy_cli):
    def made(name: str) -> list[str]:
        code, _, err = toy_cli("new", tmp_path / name)
        assert code == 0, err
        return [p.relative_to(tmp_path / name).as_posix() for p in (tmp_path / name).rglob("*")]

    return made


def test_readme_commands_read_only_paths_made_before_them(tmp_path, toy_cli):
    readme = (ROOT / "README.md").read_text()
    toy_lines = [a for a in sh_commands(readme) if toy_argv(a) is not None]
    assert len(toy_lines) >= 20, toy_lines  # the parser found the README's commands
    assert unmade_paths(readme, _made_by_new(tmp_path, toy_cli)) == []


def test_the_check_finds_a_path_read_before_it_is_made():
    # The README before issue 35 (fd60640^): its model-directory examples named a directory
    # the user does not have and `chat.jsonl`, which toy new writes as data/chat.jsonl.
    readme = """
```sh
toy new p && cd p
toy train --recipe lora --model ~/models/Qwen3-0.6B --data chat.jsonl --epochs 1
toy train --recipe lora --model-path mlx_model --data data/chat.jsonl
toy infer --run runs/<lora-id> --chat hi
toy describe data/smollm2-135m.gguf
toy fetch smollm2 --as mlx
toy train --recipe lora --model-path data/smollm2-135m-mlx --data data/chat.jsonl
toy export runs/<vit-id> --format mlx
toy prep my.txt --out data/mine.bin
toy train --corpus data/mine.bin --run-id mine
toy infer --run runs/mine/final
```
"""
    made = lambda name: ["data", "data/chat.jsonl"]  # noqa: E731
    assert unmade_paths(readme, made) == [
        "toy train --recipe lora --model ~/models/Qwen3-0.6B --data chat.jsonl --epochs 1: "
        "~/models/Qwen3-0.6B",
        "toy train --recipe lora --model ~/models/Qwen3-0.6B --data chat.jsonl --epochs 1: "
        "chat.jsonl",
        "toy train --recipe lora --model-path mlx_model --data data/chat.jsonl: mlx_model",
        "toy describe data/smollm2-135m.gguf: data/smollm2-135m.gguf",
        "toy export runs/<vit-id> --format mlx: runs/<vit-id>",
    ]
