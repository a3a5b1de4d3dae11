"""`toy runs [DIR]`: a table of the runs under DIR (default: the project's runs/), read
from each run's run.json and events.jsonl: id, recipe, arch, init, steps, final train
and validation loss, throughput, wall time and status. A resumed run's wall time is the
sum of its segments (each start or resume to its end), not counting the pauses between."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from toy.errors import InputError
from toy.runs import RUNNING, UNFINISHED, find_project, read_events, run_status

FORMAT = "toy/runs-v1"
HEADERS = (
    "id",
    "recipe",
    "arch",
    "init",
    "steps",
    "train loss",
    "val loss",
    "held-out",
    "tokens/s",
    "wall",
    "status",
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "runs", help="list runs with their losses, speed and status", description=__doc__
    )
    p.add_argument(
        "dir",
        nargs="?",
        metavar="DIR",
        help="directory holding run directories, or one run "
        "directory (default: the project's runs/)",
    )
    p.add_argument("--json", action="store_true", help=f"print one JSON object (format {FORMAT})")
    p.set_defaults(func=run)


def _read_json(path: Path) -> dict | None:
    try:
        with open(path) as fh:
            obj = json.load(fh)
        return obj if isinstance(obj, dict) else None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def summarize(run_dir: Path) -> dict[str, Any]:
    """One run's row. Status: toy.runs.run_status (finished, failed, interrupted, running:
    its process still lives on this host, or unfinished: killed before it could say so),
    as `toy list` says it."""
    info = _read_json(run_dir / "run.json") or {}
    try:
        events = read_events(run_dir)
    except InputError:
        events = []
    job = info.get("job") if isinstance(info.get("job"), dict) else {}
    row: dict[str, Any] = {
        "id": run_dir.name,
        "run_dir": str(run_dir),
        "recipe": info.get("recipe"),
        "arch": info.get("arch"),
        "init": job.get("init"),
        "params": info.get("params"),
        "seed": info.get("seed"),
        "started": info.get("started"),
        "steps": None,
        "target_steps": None,
        "loss": None,
        "val_loss": None,
        "held_out": None,  # the recipe's headline figure at its latest evaluation
        "held_out_step": None,
        "items_per_s": None,
        "items": None,
        "tokens_per_s": None,
        "wall_s": None,
        "segments": 0,
        "status": "unknown",
    }
    headline = _headline(info.get("recipe"))
    recorded = info.get("config") if isinstance(info.get("config"), dict) else info.get("train")
    if isinstance(recorded, dict):
        row["target_steps"] = recorded.get("steps")
    for e in events:
        kind = e.get("event")
        if kind in ("run_started", "run_resumed"):
            row["target_steps"] = e.get("steps", row["target_steps"])
        elif kind == "step":
            row["steps"], row["loss"] = e.get("step"), _num(e.get("loss"))
            for k, v in e.items():
                if k.endswith("_per_s") and _num(v) is not None:
                    row["items"], row["items_per_s"] = k[: -len("_per_s")], _num(v)
        elif kind == "eval":
            if "val_loss" in e:
                row["val_loss"] = _num(e.get("val_loss"))
            key = next((k for k in headline if k in e), None)
            if key is not None:
                row["held_out"] = {key: _num(e[key])}
                row["held_out_step"] = e.get("step")
        elif kind == "run_finished":
            for k, v in e.items():
                if (
                    k.endswith("_per_s") and _num(v) is not None
                ):  # the whole run's figure beats the last step's
                    row["items"], row["items_per_s"] = k[: -len("_per_s")], _num(v)
    row["status"] = run_status(events, info)
    walls = segment_walls(events)
    row["segments"] = len(walls)
    if any(w is not None for w in walls):
        row["wall_s"] = round(sum(w for w in walls if w is not None), 3)
    if row["items"] == "tokens":
        row["tokens_per_s"] = row["items_per_s"]
    if not info and not events:
        row["status"] = "unknown"
    return row


def _headline(recipe: Any) -> list[str]:
    """The keys of the held-out figures a recipe ends its done line with (Figure.final:
    GRPO's reward, DPO's accuracy, distill's agreement), else the validation loss."""
    from toy.recipes import RECIPES, load_recipe

    figures = load_recipe(recipe).figures if recipe in RECIPES else ()
    return [f.key for f in figures if f.final] + ["val_loss"]


def segment_walls(events: list[dict]) -> list[float | None]:
    """Wall seconds of each segment of a run: from a run_started or run_resumed event up
    to the next one. A segment that finished counts its run_finished `wall_s` (the loop's
    own measure); one that ended otherwise (interrupted, failed, killed, still running)
    the time from its first event to its last, start-up and evals included (None while
    it has a single event)."""
    segs: list[list] = []  # [first time, last time, wall_s or None]
    for e in events:
        t = _num(e.get("time"))
        if e.get("event") in ("run_started", "run_resumed") or not segs:
            segs.append([t, t, None])
        seg = segs[-1]
        if t is not None:
            seg[0] = t if seg[0] is None else seg[0]
            seg[1] = t
        if e.get("event") == "run_finished" and _num(e.get("wall_s")) is not None:
            seg[2] = _num(e.get("wall_s"))
    return [
        wall
        if wall is not None
        else (last - first if first is not None and last != first else None)
        for first, last, wall in segs
    ]


def find_runs(d: Path) -> list[Path]:
    if (d / "run.json").is_file() or (d / "events.jsonl").is_file():
        return [d]  # DIR is itself a run
    return [
        p
        for p in d.iterdir()
        if p.is_dir() and ((p / "run.json").is_file() or (p / "events.jsonl").is_file())
    ]


def _fmt(v: Any, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "loss":
        return f"{v:.4f}"
    if kind == "wall":
        return f"{v:.1f}s" if v < 120 else f"{v / 60:.1f}m"
    return str(v)


def cells(r: dict[str, Any]) -> list[str]:
    steps = "-" if r["steps"] is None else str(r["steps"])
    if r["target_steps"] is not None and r["steps"] != r["target_steps"]:
        steps += f"/{r['target_steps']}"
    speed = "-"
    if r["items_per_s"] is not None:
        speed = f"{r['items_per_s']:,.0f}" + ("" if r["items"] == "tokens" else f" {r['items']}/s")
    return [
        r["id"],
        r["recipe"] or "-",
        r["arch"] or "-",
        r["init"] or "-",
        steps,
        _fmt(r["loss"], "loss"),
        _fmt(r["val_loss"], "loss"),
        _held_out(r),
        speed,
        _fmt(r["wall_s"], "wall"),
        r["status"],
    ]


def _held_out(r: dict[str, Any]) -> str:
    """The latest evaluation's headline figure and its step: `reward 0.126 @20`."""
    if not r["held_out"]:
        return "-"
    ((key, v),) = r["held_out"].items()
    name = "val loss" if key == "val_loss" else key
    return f"{name} {'-' if v is None else f'{v:.4g}'} @{r['held_out_step']}"


def plain_table(rows: list[list[str]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned."""
    table = [list(HEADERS), *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(HEADERS))]
    right = {4, 5, 6, 8, 9}
    lines = []
    for r in table:
        lines.append(
            "  ".join(
                c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
            ).rstrip()
        )
    return "\n".join(lines)


def run(args) -> int:
    d = Path(args.dir) if args.dir else find_project().runs_dir
    if not d.is_dir():
        hint = (
            "train one with `toy train`"
            if not args.dir
            else "pass a directory of runs (e.g. runs/)"
        )
        raise InputError(f"{d}: no such directory; {hint}")
    rows = [summarize(p) for p in find_runs(d)]
    rows.sort(key=lambda r: (r["started"] or "", r["id"]))
    if args.json:
        print(json.dumps({"format": FORMAT, "dir": str(d), "runs": rows}))
        return 0
    if not rows:
        print(f"no runs under {d}")
        return 0
    text = plain_table([cells(r) for r in rows])
    console = None
    if sys.stdout.isatty():
        from rich.console import Console

        console = Console()
        # A table squeezed below its width truncates every cell ("wa…"): print plain text then.
        if max(map(len, text.splitlines())) + 3 * len(HEADERS) + 1 > console.width:
            console = None
    if console is not None:
        from rich.table import Table

        t = Table(title=str(d), title_justify="left")
        for i, h in enumerate(HEADERS):
            t.add_column(h, justify="right" if 4 <= i <= 8 else "left", no_wrap=True)
        for r in rows:
            c = cells(r)
            style = {
                "failed": "red",
                "interrupted": "yellow",
                UNFINISHED: "cyan",
                RUNNING: "green",
            }.get(r["status"])
            t.add_row(*c[:-1], f"[{style}]{c[-1]}[/]" if style else c[-1])
        console.print(t)
    else:
        print(text)
    return 0
