"""A flag, declared once: its config key, default, help, argparse form and check. Recipes
declare theirs (train/recipe.py), `toy train` its general ones (cli/train_flags.py); from
each declaration come the argparse line (the default written into the help by code), the
config key and the problem it reports."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Flag:
    """One flag of a recipe: its config key, default, help, argparse form and check.

    `check(value) -> bool` runs on a given (non-None) value; a False names the flag, says
    what it `must` be and what it got. A flag whose key is one of RunConfig's general fields
    is an alias (e.g. the adapter recipes' --max-seq-len for --seq-len): it adds an option
    string, no config key, and its default lives in the recipe's `defaults`."""

    key: str
    default: Any = None
    help: str = ""
    type: Callable[[str], Any] | None = None  # argparse's; bool: a switch (store_true)
    options: tuple[str, ...] = ()  # the option strings; default ("--key-with-dashes",)
    choices: tuple | None = None
    metavar: str | None = None
    shown: str | None = None  # the default in the help's words, where not the value itself
    check: Callable[[Any], bool] | None = None
    must: str = ""  # what check asks, as "--flag must <must>, got X" says it
    many: bool = False  # repeatable: the values given, in order, as a list (check: each)

    @property
    def option(self) -> str:
        return self.options[0] if self.options else "--" + self.key.replace("_", "-")

    def help_text(self, default: str | None = None) -> str:
        """The help with its default, written from the declaration: `default` (words) where
        given, else `shown` ("" for none; a leading ":" reads "(default: ...)"), else the
        value. A help holding "{default}" takes it there rather than at its end."""
        if default is None:
            default = self.shown
        if default is None:
            if self.type is bool:
                default = "on" if self.default else "off"
            elif self.default is not None:
                default = str(self.default)
        part = "" if not default else f"(default{'' if default.startswith(':') else ' '}{default})"
        text = (
            self.help.replace("{default}", part)
            if "{default}" in self.help
            else (f"{self.help} {part}" if part else self.help)
        )
        return text.replace("%", "%%")  # argparse formats help with %

    def argparse(self, default: str | None = None) -> tuple[tuple[str, ...], dict[str, Any]]:
        """(option strings, keyword arguments) for argparse's add_argument. Every value
        defaults to None there: None is 'not given', so toy.toml and the defaults count."""
        kw: dict[str, Any] = {"dest": self.key, "help": self.help_text(default), "default": None}
        if self.type is bool:
            kw["action"] = "store_true"
        elif self.type is not None:
            kw["type"] = self.type
        if self.many:
            kw["action"] = "append"
        if self.choices is not None:
            kw["choices"] = self.choices
        if self.metavar is not None:
            kw["metavar"] = self.metavar
        return self.options or (self.option,), kw

    def problem(self, value: Any) -> str | None:
        """What is wrong with `value` (given, so not None), naming the flag; None if fine."""
        if value is None or self.check is None:
            return None
        for v in value if self.many and isinstance(value, list) else [value]:
            try:
                ok = bool(self.check(v))
            except (TypeError, ValueError):
                ok = False
            if not ok:
                return f"{self.option} must {self.must}, got {v!r}"
        return None
