"""`toy plot RUN... --out loss.png`: train and validation loss curves of one or more
runs on one chart, from their events.jsonl, and under it a panel each for the learning
rate, the throughput, the peak memory and the gradient norm; `--watch` redraws while the
runs go. Needs matplotlib (pip install 'toy[plot]')."""

from __future__ import annotations

from pathlib import Path

from toy.cli.args import plural
from toy.errors import InputError, UsageError
from toy.runs import read_events, write_file_atomic
from toy.train.recipe import Figure

INSTALL = "pip install 'toy[plot]'"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plot", help="plot runs' train and validation loss curves to an image", description=__doc__
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (made by `toy train`)")
    p.add_argument(
        "--out",
        default="loss.png",
        metavar="FILE",
        help="image to write; the suffix picks the format: .png, .svg, .pdf (default loss.png)",
    )
    p.add_argument("--title", help="chart title (default: none)")
    p.add_argument(
        "--smooth",
        type=int,
        default=0,
        metavar="N",
        help="draw train loss as a running mean over N steps (default 0: raw)",
    )
    p.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=10.0,
        default=None,
        metavar="SECONDS",
        help="redraw every SECONDS (default 10) until every run has finished, failed or "
        "stopped (Ctrl-C ends it sooner); open the image in a viewer that reloads it",
    )
    p.set_defaults(func=run)


# The panels under the loss: (title, the step events' key or keys, a scale on the value).
PANELS = (
    ("learning rate", ("lr",), 1.0),
    ("throughput ({unit}/s)", ("tokens_per_s", "completion_tokens_per_s", "pairs_per_s",
                         "images_per_s", "examples_per_s"), 1.0),
    ("peak memory (GB)", ("peak_mem_bytes",), 1e-9),
    ("gradient norm", ("grad_norm",), 1.0),
)  # fmt: skip
CLOSED = ("run_finished", "run_failed", "interrupted")


def step_series(run_dir: Path, keys: tuple[str, ...], scale: float) -> list[tuple[int, float]]:
    """(step, value) of the first of `keys` each step event has; the latest value of a
    step wins (a resumed run logs the steps after its checkpoint again)."""
    got: dict[int, float] = {}
    for e in read_events(run_dir):
        if e.get("event") != "step" or not isinstance(e.get("step"), int):
            continue
        for k in keys:
            if isinstance(e.get(k), (int, float)) and not isinstance(e.get(k), bool):
                got[e["step"]] = float(e[k]) * scale
                break
    return sorted(got.items())


def unit_of(dirs: list[Path], keys: tuple[str, ...]) -> str:
    """What a throughput panel counts, in words: the first of `keys` the runs' step events
    hold ("tokens_per_s" -> "tokens"); "items" where the runs count different things."""
    found = {
        k.removesuffix("_per_s").replace("_", " ")
        for d in dirs
        for e in read_events(d)
        if e.get("event") == "step"
        for k in keys
        if k in e
    }
    return found.pop() if len(found) == 1 else "items"


def finished(run_dir: Path) -> bool:
    """The run's last life closed with an event of its own (finished, failed, stopped)."""
    last = None
    for e in read_events(run_dir):
        if e.get("event") in CLOSED + ("run_started", "run_resumed"):
            last = e["event"]
    return last in CLOSED


def curves(run_dir: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(step, train loss) and (step, val loss) pairs. A resumed run logs the steps after
    its checkpoint again: the latest value of a step wins."""
    train: dict[int, float] = {}
    val: dict[int, float] = {}
    for e in read_events(run_dir):
        step, kind = e.get("step"), e.get("event")
        if not isinstance(step, int):
            continue
        if kind == "step" and isinstance(e.get("loss"), (int, float)):
            train[step] = float(e["loss"])
        elif kind == "eval" and isinstance(e.get("val_loss"), (int, float)):
            val[step] = float(e["val_loss"])
    return sorted(train.items()), sorted(val.items())


def figure_curves(run_dir: Path) -> list[tuple[Figure, list[tuple[int, float]]]]:
    """(figure, its held-out (step, value) curve) of each figure the run's recipe declares
    for the plot (Figure.plot: a preference accuracy, an agreement); [] for others."""
    from toy.formats.checkpoint import read_json
    from toy.recipes import load_recipe, recipe_names

    try:
        recipe = (read_json(run_dir / "run.json").get("config") or {}).get("recipe")
    except (InputError, AttributeError):
        return []
    if recipe not in recipe_names():
        return []
    out = []
    for f in load_recipe(recipe).figures:
        if not f.plot:
            continue
        curve: dict[int, float] = {}
        for e in read_events(run_dir):
            if e.get("event") == "eval" and isinstance(e.get(f.key), (int, float)):
                curve[int(e["step"])] = float(e[f.key])
        if curve:
            out.append((f, sorted(curve.items())))
    return out


def label(run_dir: Path) -> str:
    from toy.formats.checkpoint import read_json

    init = None
    if (run_dir / "run.json").is_file():
        try:
            job = read_json(run_dir / "run.json").get("job") or {}
            init = job.get("init") if isinstance(job, dict) else None
        except InputError:
            pass
    return f"{run_dir.name} (init {init})" if init else run_dir.name


def running_mean(ys: list[float], n: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= n:
            acc -= ys[i - n]
        out.append(acc / min(i + 1, n))
    return out


def run(args) -> int:
    import time

    if args.watch is not None and not args.watch > 0:
        raise UsageError(f"--watch must be > 0 seconds, got {args.watch:g}")
    draws = 0
    try:
        while True:
            draw(args, note=f" (redraw {draws})" if draws else "")
            draws += 1
            if args.watch is None or all(finished(Path(r)) for r in args.runs):
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:  # the way to stop watching a run that goes on
        return 0


def draw(args, note: str = "") -> None:
    out = Path(args.out)
    if args.smooth < 0:
        raise UsageError(f"--smooth must be >= 0, got {args.smooth}")
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: directory {out.parent} does not exist")
    dirs = [Path(r) for r in args.runs]
    for d in dirs:
        if not (d / "events.jsonl").is_file():
            raise InputError(
                f"{d}: no events.jsonl there; pass run directories made by `toy train`"
            )
    data = [(d, *curves(d)) for d in dirs]
    if not any(tr or va for _, tr, va in data):
        raise InputError(
            f"{', '.join(map(str, dirs))}: no step or eval events yet; nothing to plot"
        )
    try:
        # The object API with its own Agg canvas: no pyplot, no global backend switch,
        # no display needed.
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError(f"toy plot needs matplotlib, which is not installed; {INSTALL}")

    panels = [
        (title.format(unit=unit_of(dirs, keys)), [step_series(d, keys, sc) for d in dirs])
        for title, keys, sc in PANELS
    ]
    panels = [(title, series) for title, series in panels if any(series)]
    rows = (len(panels) + 1) // 2
    fig = Figure(figsize=(8, 5 + 2.2 * rows), dpi=120)
    canvas = FigureCanvasAgg(fig)
    suffix = out.suffix.lower().lstrip(".")
    if suffix not in canvas.get_supported_filetypes():
        raise UsageError(f"--out {out}: unknown image type {out.suffix!r}; use .png, .svg or .pdf")
    grid = fig.add_gridspec(1 + rows, 2, height_ratios=[5] + [2.2] * rows)
    ax = fig.add_subplot(grid[0, :])
    colors = [c["color"] for c in matplotlib.rcParams["axes.prop_cycle"]]
    for j, (title, series) in enumerate(panels):
        pax = fig.add_subplot(grid[1 + j // 2, j % 2])
        for i, curve in enumerate(series):
            if curve:
                xs, ys = zip(*curve)
                pax.plot(xs, ys, color=colors[i % len(colors)], linewidth=1.0)
        pax.set_title(title, fontsize=9)
        pax.tick_params(labelsize=7)
        pax.grid(True, alpha=0.3)
    for i, (d, tr, va) in enumerate(data):
        color, name = colors[i % len(colors)], label(d)
        if tr:
            xs, ys = zip(*tr)
            ys = running_mean(list(ys), args.smooth) if args.smooth > 1 else list(ys)
            ax.plot(xs, ys, color=color, alpha=0.55, linewidth=1.0, label=f"{name} train")
        if va:
            xs, ys = zip(*va)
            ax.plot(
                xs,
                ys,
                color=color,
                linestyle="--",
                marker="o",
                markersize=3.5,
                linewidth=1.6,
                label=f"{name} val",
            )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    figs = [(i, d, f, c) for i, (d, _, _) in enumerate(data) for f, c in figure_curves(d)]
    if figs:  # the recipes' own held-out figures (preference accuracy), right-hand axis
        ax2 = ax.twinx()
        for i, d, f, curve in figs:
            xs, ys = zip(*curve)
            color = colors[i % len(colors)]
            ax2.plot(
                xs,
                ys,
                color=color,
                linestyle=":",
                marker="^",
                markersize=3.5,
                label=f"{label(d)} {f.label}",
            )
        ax2.set_ylabel(", ".join(sorted({f.label.removeprefix("held-out ") for *_, f, _ in figs})))
        spans = {f.span for *_, f, _ in figs if f.span}
        if len(spans) == 1:
            ax2.set_ylim(*spans.pop())
        ax2.legend(fontsize=8, loc="lower right")
    if args.title:
        ax.set_title(args.title)
    fig.tight_layout()
    write_file_atomic(out, lambda tmp: fig.savefig(tmp, format=suffix))
    print(f"wrote {out} ({plural(len(dirs), 'run')}){note}", flush=True)
