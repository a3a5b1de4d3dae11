"""--report-to: where a run's figures go besides events.jsonl, as the other trainers'
`report_to` sends them. `tensorboard`: the run directory's tensorboard/, one scalar a
figure, readable by TensorBoard (`tensorboard --logdir runs/`) and its event reader.
`trackio` (Hugging Face's local-first tracker): the run directory's trackio/, trackio's
SQLite store, readable by its dashboard (`TRACKIO_DIR=runs/<run>/trackio trackio show`)
and its storage API. Both packages are optional (`pip install tensorboard` / `trackio`);
nothing goes over the network.

A sink takes every record the run's EventLog writes (runs.py), on the writing rank only:
a "step" record's numbers become train/<name> at its step, an "eval" record's eval/<name>;
text, times and the step itself are not figures."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from toy.errors import UsageError

REPORT_TO = ("none", "tensorboard", "trackio")
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
    # Looked up, not imported: trackio fixes its storage directory when first imported, and
    # the run directory it must be is not made yet.
    if name == "trackio" and importlib.util.find_spec("trackio") is None:
        raise UsageError(
            "--report-to trackio needs the trackio package: pip install trackio "
            "(or pip install 'toy[trackio]'), or leave --report-to out"
        )


def figures(rec: dict[str, Any]) -> tuple[int, dict[str, float]] | None:
    """A record's figures as (step, {"<group>/<name>": value}), or None for a record that
    has none (run_started, checkpoint ...)."""
    group = {"step": "train", "eval": "eval"}.get(rec.get("event"))
    if group is None or "step" not in rec:
        return None
    out = {}
    for key, value in rec.items():
        if key in SKIP or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key == "peak_mem_bytes":
            key, value = "peak_mem_gb", value / 1e9
        if group == "eval":
            key = key.removeprefix("val_")  # eval/loss, not eval/val_loss
        out[f"{group}/{key}"] = value
    return rec["step"], out


def completions_table(rows: list[dict]) -> str:
    """Completions as a Markdown table (TensorBoard's text panel renders it): the prompt,
    the completion, the reward and each function's."""

    def cell(v: Any) -> str:
        text = v if isinstance(v, str) else json.dumps(v, default=str)
        # every line break splitlines knows (a sampled \r too) ends a table row: <br>
        return "<br>".join(text.replace("\\", "\\\\").replace("|", "\\|").splitlines())

    names = list(rows[0].get("rewards", {})) if rows else []
    head = ["prompt", "completion", "reward", *names]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        vals = [r.get("prompt"), r.get("completion"), r.get("reward")]
        vals += [r.get("rewards", {}).get(n) for n in names]
        out.append("| " + " | ".join(cell(v) for v in vals) + " |")
    return "\n".join(out)


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
        if rec.get("event") == "completions":  # GRPO's sampled texts (EventLog.aside)
            self.w.add_text(f"{rec['split']}/completions", completions_table(rec["rows"]),
                            rec["step"])  # fmt: skip
            self.w.flush()
            return
        if (got := figures(rec)) is None:
            return
        step, values = got
        for tag, value in values.items():
            self.w.add_scalar(tag, value, step)
        self.w.flush()

    def close(self) -> None:
        self.w.close()


class TrackioSink:
    """The figures logged with trackio into run_dir/trackio/ (project: the runs directory's
    name; run: the run's), the run's config with them. Local only: TRACKIO_SPACE_ID and
    TRACKIO_SERVER_URL are not followed, no dashboard or system-sampling thread is started,
    and trackio's Hub call for the user's name is not made.

    A resumed run continues the same trackio run, after what an earlier life logged past the
    checkpoint is purged (as TensorBoard's purge_step), so the curves hold each step once and
    the numbers of the life that went on."""

    def __init__(self, run_dir: Path, resumed_from: int | None = None):
        # trackio takes its storage directory from TRACKIO_DIR when first imported (which
        # check_report_to does not do), a Space or server to send to from the other two.
        os.environ["TRACKIO_DIR"] = str(run_dir / "trackio")
        for key in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
            os.environ.pop(key, None)
        import huggingface_hub.constants
        import trackio
        from trackio.sqlite_storage import SQLiteStorage

        self.trackio = trackio
        project, name = run_dir.parent.name or "toy", run_dir.name
        try:
            SQLiteStorage.validate_project_name(project)
        except ValueError:  # a name trackio keeps for itself (registry-..., ..._system)
            project = "toy"
        config = json.loads((run_dir / "run.json").read_text())["config"]
        if resumed_from is not None:
            purge(project, name, resumed_from)
        # Hub offline while the run starts: with a token at hand, trackio would ask the Hub
        # (whoami) for a user name to put in the config. Its "* ..." lines would go into
        # stdout, which --json keeps for one object.
        offline = huggingface_hub.constants.HF_HUB_OFFLINE
        huggingface_hub.constants.HF_HUB_OFFLINE = True
        try:
            with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
                trackio.init(project=project, name=name, config=config, resume="allow",
                             embed=False, auto_log_cpu=False, auto_log_gpu=False)  # fmt: skip
        finally:
            huggingface_hub.constants.HF_HUB_OFFLINE = offline

    def write(self, rec: dict[str, Any]) -> None:
        if (got := figures(rec)) is None:
            return
        step, values = got
        self.trackio.log(values, step=step)

    def close(self) -> None:
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
            self.trackio.finish()  # its writer thread puts what is queued into the store


def purge(project: str, name: str, step: int) -> None:
    """Drop what a trackio run logged past `step`. trackio 0.43 deletes only whole runs, so
    the run is deleted and what it held up to `step` written back as it was (its steps,
    times and id); events.jsonl still has every record should this be cut short."""
    from trackio.sqlite_storage import SQLiteStorage as store

    rows = store.get_logs(project, name)
    if all(row["step"] <= step for row in rows):
        return
    run_id = next(r["id"] for r in store.get_run_records(project) if r["name"] == name)
    kept = [row for row in rows if row["step"] <= step]
    store.delete_run(project, name, run_id=run_id)
    store.bulk_log(
        project,
        name,
        [{k: v for k, v in row.items() if k not in ("step", "timestamp")} for row in kept],
        steps=[row["step"] for row in kept],
        timestamps=[row["timestamp"] for row in kept],
        run_id=run_id,
    )


def attach(events, report_to: str, run_dir: Path, resumed_from: int | None = None) -> None:
    """Add --report-to's sink to a run's EventLog (nothing for none, or on a rank that does
    not write)."""
    sink = {"tensorboard": TensorBoardSink, "trackio": TrackioSink}.get(report_to)
    if sink is not None and events._fh is not None:
        events.sinks.append(sink(run_dir, resumed_from))
