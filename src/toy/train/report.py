"""--report-to: where a run's figures go besides events.jsonl, as the other trainers'
`report_to` sends them. `tensorboard`: the run directory's tensorboard/, one scalar a
figure, readable by TensorBoard (`tensorboard --logdir runs/`) and its event reader; the
package is optional (`pip install tensorboard`), nothing goes over the network.

A sink takes every record the run's EventLog writes (runs.py), on the writing rank only:
a "step" record's numbers become train/<name> at its step, an "eval" record's eval/<name>;
text, times and the step itself are not figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toy.errors import UsageError

REPORT_TO = ("none", "tensorboard")
SKIP = {"event", "time", "step", "items"}  # not figures (items: a step's count, not a rate)


def check_report_to(name: str) -> None:
    """Refuse, before any work, a --report-to whose package is missing (one line, exit 2)."""
    if name == "tensorboard":
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise UsageError(
                "--report-to tensorboard needs the tensorboard package: pip install tensorboard "
                "(or pip install 'toy[tensorboard]'), or leave --report-to out"
            ) from None


class TensorBoardSink:
    """Scalars into run_dir/tensorboard/. After a resume from step s, whatever an earlier
    life wrote past s is purged (purge_step), so the curves hold each step once."""

    def __init__(self, run_dir: Path, resumed_from: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(
            str(run_dir / "tensorboard"),
            purge_step=None if resumed_from is None else resumed_from + 1,
        )

    def write(self, rec: dict[str, Any]) -> None:
        group = {"step": "train", "eval": "eval"}.get(rec.get("event"))
        if group is None or "step" not in rec:
            return
        for key, value in rec.items():
            if key in SKIP or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if key == "peak_mem_bytes":
                key, value = "peak_mem_gb", value / 1e9
            if group == "eval":
                key = key.removeprefix("val_")  # eval/loss, not eval/val_loss
            self.w.add_scalar(f"{group}/{key}", value, rec["step"])
        self.w.flush()

    def close(self) -> None:
        self.w.close()


def attach(events, report_to: str, run_dir: Path, resumed_from: int | None = None) -> None:
    """Add --report-to's sink to a run's EventLog (nothing for none, or on a rank that does
    not write)."""
    if report_to == "tensorboard" and events._fh is not None:
        events.sinks.append(TensorBoardSink(run_dir, resumed_from))
