"""What a run shows while it trains: `step N loss X` lines (byte-stable for a seed),
and on a terminal a rich progress bar with loss, tokens/s, peak memory and ETA. The
figures that vary between runs (speed, memory) stay out of the step lines, so those
compare byte for byte; events.jsonl and --json carry them."""

from __future__ import annotations

import os
import sys
from typing import TextIO


def stdout_closed() -> None:
    """The reader of stdout went away (`toy train ... | head`): send the rest of the
    run's output to /dev/null. The run itself goes on: a closed pipe is not a failure.
    Whatever sits in stdout's buffer is flushed there too, so nothing raises again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is not a real file (tests): nothing to redirect
        pass


class Reporter:
    """Quiet base: --json mode and non-zero ranks use it as is."""

    def start(self, total_steps: int, first_step: int) -> None: ...
    def step(
        self,
        step: int,
        loss: float,
        items_per_s: float | None,
        peak_mem: int | None = None,
        extra: dict[str, float] | None = None,
    ) -> None: ...
    def eval(self, step: int, metrics: dict[str, float]) -> None: ...
    def eval_progress(self, step: int, done: int, total: int, elapsed: float) -> None: ...
    def message(self, text: str) -> None: ...
    def close(self) -> None: ...


class TextReporter(Reporter):
    """Plain lines on stdout; on a terminal, a rich bar drawn below them (transient)."""

    def __init__(
        self,
        out: TextIO | None = None,
        items_name: str = "tokens",
        show_bar: bool | None = None,
        bar: dict[str, str] | None = None,
    ):
        self.out = out or sys.stdout
        self.items_name = items_name
        self.bar = self.out.isatty() if show_bar is None else show_bar
        self.figures = bar or {}  # the recipe's figures the bar shows: key -> short label
        self._progress = None
        self._task = None
        self._eval_said = 0.0  # seconds into an evaluation when its progress was last shown

    def start(self, total_steps: int, first_step: int) -> None:
        if not self.bar:
            return
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console(file=self.out)
        self._progress = Progress(
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[speed]}"),
            TextColumn("{task.fields[mem]}"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        self._task = self._progress.add_task(
            "train", total=total_steps, completed=first_step, loss="-", speed="", mem=""
        )
        self._progress.start()

    def _print(self, line: str) -> None:
        try:
            if self._progress is not None:
                self._progress.console.print(line, markup=False, highlight=False)
            else:
                print(line, file=self.out, flush=True)
        except BrokenPipeError:
            stdout_closed()

    def step(
        self,
        step: int,
        loss: float,
        items_per_s: float | None,
        peak_mem: int | None = None,
        extra: dict[str, float] | None = None,
    ) -> None:
        figures = "".join(f" {k} {v:.6f}" for k, v in (extra or {}).items())
        self._print(f"step {step} loss {loss:.6f}{figures}")
        if self._progress is not None:
            speed = f"{items_per_s:,.0f} {self.items_name}/s" if items_per_s else ""
            mem = f"peak {peak_mem / 1e9:.2f} GB" if peak_mem else ""
            shown = f"{loss:.4f}" + "".join(
                f" {label} {(extra or {})[k]:.2f}"
                for k, label in self.figures.items()
                if k in (extra or {})
            )
            self._progress.update(self._task, completed=step, loss=shown, speed=speed, mem=mem)

    def eval_progress(self, step: int, done: int, total: int, elapsed: float) -> None:
        """A long evaluation says where it is (on stderr, so step lines stay byte-stable):
        once it has run 5 s, then every 5 s."""
        if elapsed < 5.0 or elapsed - self._eval_said < 5.0:
            if done == 1:
                self._eval_said = 0.0
            return
        self._eval_said = elapsed
        print(
            f"  evaluating (step {step}): {done}/{total} batches, {elapsed:.0f} s",
            file=sys.stderr,
            flush=True,
        )

    def eval(self, step: int, metrics: dict[str, float]) -> None:
        parts = " ".join(f"{k} {v:.6f}" for k, v in metrics.items())
        self._print(f"eval step {step} {parts}")

    def message(self, text: str) -> None:
        self._print(text)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
