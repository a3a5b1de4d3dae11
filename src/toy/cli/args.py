"""argparse with one-line errors and exit code 2, flag-default resolution, and the
small text helpers the commands share (sizes, plurals, aligned columns)."""

from __future__ import annotations

import argparse
import difflib
import re
import sys

from toy.errors import UsageError

# Other tools' names for toy's flags (HF Trainer, nanoGPT, mlx-lm, llama.cpp) and the long
# forms of toy's short ones. They are matched like option strings when a flag is not
# recognised, so `--learning-rate`, `--learning_rate` or a typo of them (`--lerning-rate`)
# suggest `--lr`, which no edit distance would find. Only flags the failing parser has are
# offered.
ALIASES: dict[str, tuple[str, ...]] = {
    "--lr": ("learning-rate", "lr-max", "max-lr", "peak-lr"),
    "--min-lr": ("min-learning-rate", "lr-min", "final-lr"),
    "--steps": (
        "step",
        "max-steps",
        "num-steps",
        "train-steps",
        "iters",
        "max-iters",
        "iterations",
    ),
    "--epochs": ("epoch", "num-epochs", "num-train-epochs"),
    "--batch-size": (
        "bs",
        "batch",
        "train-batch-size",
        "per-device-train-batch-size",
        "micro-batch-size",
    ),
    "--grad-accum": (
        "gradient-accumulation-steps",
        "gradient-accumulation",
        "grad-accum-steps",
        "accum",
    ),
    "--warmup": ("warmup-steps", "warmup-iters", "lr-warmup"),
    "--clip": ("grad-clip", "clip-grad", "max-grad-norm", "gradient-clipping"),
    "--weight-decay": ("wd",),
    "--seq-len": (
        "sequence-length",
        "seq-length",
        "context-length",
        "block-size",
        "max-length",
        "ctx-size",
    ),
    "--eval-every": ("eval-interval", "eval-steps", "val-every"),
    "--save-every": ("save-interval", "save-steps", "checkpoint-every"),
    "--n-layer": ("n-layers", "num-layers", "num-hidden-layers", "layers"),
    "--d-model": ("hidden-size", "n-embd", "dim", "embed-dim"),
    "--n-head": ("n-heads", "num-heads", "num-attention-heads"),
    "--n-kv-head": ("n-kv-heads", "num-kv-heads", "num-key-value-heads"),
    "--rank": ("lora-r", "lora-rank"),
    "--alpha": ("lora-alpha",),
    "--dropout": ("lora-dropout",),
    "--targets": ("target-modules", "lora-targets"),
    "--max-new-tokens": ("max-tokens", "n-predict", "num-tokens", "new-tokens"),
    "--temperature": ("temp",),
    "--val-fraction": ("val-split", "validation-split", "test-size"),
    "--vocab-size": ("vocab",),
}


class Parser(argparse.ArgumentParser):
    """One-line errors (exit 2) that point to the failing command's own help, suggest
    the flag a user most likely meant, and never take an abbreviation for a flag
    (`--step 5` is not silently `--steps 5`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # subparsers are made with this class too
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # one line, exit 2, no usage dump
        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if m:
            choices = re.findall(r"'([^']*)'", m.group(2))
            close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
            if close:
                message += f"; did you mean {close[0]!r}?"
        print(f"{self.prog}: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)

    def parse_args(self, args=None, namespace=None):
        # argparse reports a subcommand's unknown flags from the top parser ("toy"): report
        # them from the subcommand's parser instead, with a suggestion.
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            p = self._chosen(ns)
            p.error(unrecognized_message(extras, p))
        return ns

    def _chosen(self, ns) -> Parser:
        """The (sub)parser that parsed the chosen subcommand's flags."""
        for a in self._actions:
            if isinstance(a, argparse._SubParsersAction):
                sub = a.choices.get(getattr(ns, a.dest, None) or "")
                if isinstance(sub, Parser):
                    return sub._chosen(ns)
        return self


def suggest_flag(arg: str, parser: argparse.ArgumentParser) -> str | None:
    """The flag of `parser` closest to the unrecognised `arg` (by its name or an alias in
    ALIASES, `_` read as `-`), or None when nothing is close."""
    name = arg.split("=", 1)[0].lstrip("-").lower().replace("_", "-")
    if not name or not arg.startswith("-"):
        return None
    table = {
        o.lstrip("-"): o
        for a in parser._actions
        for o in a.option_strings
        if o.startswith("--") and o != "--help"
    }
    flags = set(table.values())
    for flag, names in ALIASES.items():
        if flag in flags:
            for n in names:
                table.setdefault(n, flag)
    if name in table:
        return table[name]
    close = difflib.get_close_matches(name, list(table), n=1, cutoff=0.75)
    return table[close[0]] if close else None


def unrecognized_message(extras: list[str], parser: argparse.ArgumentParser) -> str:
    msg = f"unrecognized arguments: {' '.join(extras)}"
    pairs = [(a, s) for a in extras if (s := suggest_flag(a, parser)) is not None]
    if len(pairs) == 1:
        msg += f"; did you mean {pairs[0][1]}?"
    elif pairs:
        msg += "; did you mean " + ", ".join(f"{s} (for {a})" for a, s in pairs) + "?"
    return msg


def positive_int(flag: str):
    def conv(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not an integer")
        if v < 1:
            raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
        return v

    conv.__name__ = flag
    return conv


def nonneg_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer")
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def finite_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number")
    if v != v or v in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{s!r} is not a finite number")
    return v


def resolve(cli: dict, toml: dict, builtin: dict, flag_of) -> dict:
    """CLI flag > toy.toml [train] > built-in default. Unknown toml keys are an error."""
    out = dict(builtin)
    for k, v in toml.items():
        key = k.replace("-", "_")
        if isinstance(v, dict):  # a per-recipe table, applied by the caller
            continue
        if key not in builtin:
            raise UsageError(
                f"toy.toml [train] has unknown key {k!r}; valid: {', '.join(sorted(builtin))}"
            )
        out[key] = v
    for k, v in cli.items():
        if v is not None:
            out[k] = v
    return out


def human_size(n: float) -> str:
    """Bytes in decimal units: 98.4 MB."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


from toy.runs import plural  # noqa: E402,F401  (it lives low so recipes and the loop use it too)


def columns(rows: list[list[str]], right: set[int] = frozenset(), indent: str = "") -> list[str]:
    """Rows of cells as lines with every column padded to its widest cell (`right`:
    indices of right-aligned columns); trailing blanks stripped."""
    if not rows:
        return []
    n = max(len(r) for r in rows)
    rows = [list(r) + [""] * (n - len(r)) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(n)]
    return [
        (
            indent
            + "  ".join(
                c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
            )
        ).rstrip()
        for r in rows
    ]
