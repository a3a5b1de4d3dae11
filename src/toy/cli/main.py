"""`toy` command line. Each subcommand validates everything it can before any work,
reports user errors as one line with exit 2, and a failed run with exit 1."""

from __future__ import annotations

import sys
import traceback

from toy.cli.args import Parser
from toy.errors import ToyError



def build_parser() -> Parser:
    from toy.cli import cmd_describe, cmd_infer, cmd_new, cmd_plot, cmd_prep, cmd_runs, cmd_train
    from toy.cli import cmd_export, cmd_list

    p = Parser(prog="toy", description="Train small neural networks: decoder LMs from scratch, "
               "LoRA on GGUF bases, ViT-Tiny. Run `toy COMMAND --help` for a command's flags.")
    from toy import __version__
    p.add_argument("--version", action="version", version=f"toy {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for mod in (cmd_new, cmd_prep, cmd_train, cmd_infer, cmd_describe, cmd_runs, cmd_plot, cmd_list, cmd_export):
        mod.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
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


if __name__ == "__main__":
    raise SystemExit(main())
