"""Where a distillation run's memory goes, over time: `toy train --recipe distill` with the
whole teacher at every step, and with --teacher-top-k K (the teacher kept as its top K in
one pass over the data, then let go), each in a process of its own whose resident set
(VmRSS) is read every 0.2 s; the run's events (its first evaluation, each step) mark the
curve. Linux only (/proc).

    python bench/distill_memory.py --teacher data/smollm2-135m.gguf --data DIR \\
        [--steps 20] [--k 64] [-- extra toy train flags]

DIR: a data directory as bench/distill_learn.py makes (train.jsonl, valid.jsonl). Prints,
for each run, the RSS curve sampled at a few marks (start of training, first step, last
step) and the peak before and after the first step; one JSON line a run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def watch(name: str, argv: list[str], run_dir: Path) -> dict:
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    curve: list[tuple[float, float]] = []
    while p.poll() is None:
        r = rss_mb(p.pid)
        if r is not None:
            curve.append((time.perf_counter() - t0, r))
        time.sleep(0.2)
    err = p.stderr.read() if p.stderr else ""
    if p.returncode != 0:
        sys.exit(f"{name}: {err[-2000:]}")
    wall0 = time.time() - (time.perf_counter() - t0)  # the events' clock at t0
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    steps = [e["time"] - wall0 for e in events if e["event"] == "step"]
    first = steps[0] if steps else curve[-1][0]
    before = max((r for t, r in curve if t <= first), default=0.0)
    after = max((r for t, r in curve if t > first + 0.5), default=0.0)
    row = {
        "run": name,
        "peak_before_step1_mb": round(before, 1),
        "peak_after_step1_mb": round(after, 1),
        "first_step_s": round(first, 1),
        "wall_s": round(curve[-1][0], 1) if curve else None,
        "curve": [(round(t, 1), round(r)) for t, r in curve[:: max(1, len(curve) // 40)]],
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--keep-layers", default="15")
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="distill-memory-"))
    common = [sys.executable, "-m", "toy", "train", "--recipe", "distill", "--teacher",
              str(a.teacher), "--data", str(a.data), "--keep-layers", a.keep_layers,
              "--seq-len", "128", "--batch-size", "8", "--steps", str(a.steps),
              "--eval-every", "0", "--out", str(out), *a.extra]  # fmt: skip
    for name, more in (("whole teacher", []), (f"top-{a.k}", ["--teacher-top-k", str(a.k)])):
        rid = name.replace(" ", "-")
        watch(name, [*common, *more, "--run-id", rid], out / rid)


if __name__ == "__main__":
    main()
