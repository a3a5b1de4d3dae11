"""Errors a user can act on, and their exit codes.

Every failure that is the user's doing (a bad flag, a missing or malformed file)
is raised as a ToyError subclass with a one-line message that names the file,
line or flag and says how to fix it. The CLI prints the message and exits with
`exit_code`; no traceback is shown for these.
"""

from __future__ import annotations


class ToyError(Exception):
    """Base class: a message meant for the user, and the process exit code."""

    exit_code = 2
    # The optimizer step a run was making when a recipe's input error met it (GRPO: a
    # reward function that fails): at step 1 or before, still a user's mistake (exit 2).
    step: int | None = None

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UsageError(ToyError):
    """A bad flag or flag combination."""


class InputError(ToyError):
    """A file that is missing, unreadable or malformed."""


class RunFailed(ToyError):
    """A run that started and then failed (non-finite loss, I/O error mid-run)."""

    exit_code = 1

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


class Interrupted(ToyError):
    """SIGINT/SIGTERM during a run; the exit code follows the shell convention."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class SecondInterrupt(KeyboardInterrupt):
    """The second Ctrl-C of a run (train/loop.py's signal handler): stop at once. Told apart
    from a KeyboardInterrupt that a user's code raises (a reward function), which is a
    failed run."""
