"""argparse with one-line errors and exit code 2, and flag-default resolution."""

from __future__ import annotations

import argparse
import sys

from toy.errors import UsageError


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, no usage dump
        print(f"{self.prog}: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


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
            raise UsageError(f"toy.toml [train] has unknown key {k!r}; valid: {', '.join(sorted(builtin))}")
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
