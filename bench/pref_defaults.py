"""Preference settings on a small user set: for a set directory (train.jsonl, valid.jsonl,
probe.txt: one prompt a line, unrelated to the set) and each --config "RECIPE:FLAGS", runs
`toy train --recipe RECIPE --model BASE --data SET --json FLAGS`, then greedy
`toy infer --run` replies to the probe prompts and the first 2 held-out prompts.

    python bench/pref_defaults.py --set bench/pref_sets/captain \\
        --config "dpo:--lr 6e-3 --steps 6 --warmup 0 --batch-size 4 --seq-len 96" \\
        --config "orpo:--epochs 1" [--runs DIR] [--model GGUF]

Prints one JSON line with the base's replies (kept in RUNS/base-SET.json and reused), then
one a config: the held-out preference accuracy and reward margin before and after, wall
seconds, the replies, `collapse` (a reply empty, looping, or full of the set's marker) and
`style` (held-out replies in the chosen style: they open with the marker the chosen answers
share, or, with no marker, are shorter than the base's).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOY = "/work/main/.venv/bin/toy"
MODEL = "~/.cache/toy/models/SmolLM2-135M-Instruct.Q4_1.gguf"
PROBES = ["What colour is grass?", "Name a fruit.", "What is the opposite of hot?"]
HELD_OUT = 2  # held-out prompts sampled a config


def prompt_text(p) -> str:
    """A pair's prompt as one user message (TRL's string form, or its last user turn)."""
    if isinstance(p, str):
        return p
    return [m["content"] for m in p if m.get("role") == "user"][-1]


def read_set(d: Path) -> tuple[str | None, list[str], list[str]]:
    """(the marker every chosen answer opens with and no rejected one does, or None;
    the held-out prompts sampled; the probe prompts)."""
    train = [json.loads(s) for s in (d / "train.jsonl").read_text().splitlines() if s.strip()]
    valid = [json.loads(s) for s in (d / "valid.jsonl").read_text().splitlines() if s.strip()]
    chosen = [p["chosen"] for p in train if isinstance(p.get("chosen"), str)]
    rejected = [p["rejected"] for p in train if isinstance(p.get("rejected"), str)]
    marker = os.path.commonprefix(chosen).strip().rstrip(",.!:;").strip() if chosen else ""
    if len(marker) < 3 or any(r.startswith(marker) for r in rejected):
        marker = None
    probe = d / "probe.txt"
    probes = [s.strip() for s in probe.read_text().splitlines()] if probe.exists() else PROBES
    probes = [p for p in probes if p]
    return marker, [prompt_text(p["prompt"]) for p in valid[:HELD_OUT]], probes


def words(text: str) -> list[str]:
    return re.findall(r"[\w']+", text.lower())


def collapse(text: str, marker: str | None) -> str | None:
    """Why a reply looks degenerate, or None: empty; the marker twice or most of it; a
    phrase repeated back to back (a loop); a 4-word phrase said three times (a base may
    say one twice: "The colour of grass is ... the colour of grass is")."""
    w = words(text)
    if not w:
        return "empty"
    if marker:
        m = words(marker)
        k = sum(w[i : i + len(m)] == m for i in range(len(w)))
        if k >= 2:
            return "marker repeated"
        if k * len(m) * 2 > len(w):
            return "mostly marker"
    for n in range(2, 13):
        if any(w[i : i + n] == w[i + n : i + 2 * n] for i in range(len(w) - 2 * n + 1)):
            return f"loop of {n} words"
    grams = [tuple(w[i : i + 4]) for i in range(len(w) - 3)]
    if any(grams.count(g) >= 3 for g in set(grams)):
        return "4-word phrase said 3 times"
    return None


def infer(args, prompts: list[str], *source: str) -> dict[str, str]:
    """Greedy replies to `prompts` from `toy infer SOURCE`."""
    out = {}
    for p in prompts:
        cmd = [args.toy, "infer", *source, "--chat", p, "--temperature", "0"]
        cmd += ["--max-new-tokens", str(args.max_new_tokens), "--json"]
        cmd += ["--threads", str(args.threads)] if args.threads else []
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            out[p] = f"<infer failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}>"
        else:
            out[p] = json.loads(r.stdout.strip().splitlines()[-1])["text"].strip()
    return out


def base_replies(args, set_dir: Path, runs: Path, prompts: list[str]) -> dict[str, str]:
    """The unadapted base's replies, kept beside the runs (the same for every config)."""
    keep = runs / f"base-{set_dir.name}.json"
    known = json.loads(keep.read_text()) if keep.exists() else {}
    if known.get("model") != args.model or set(prompts) - set(known.get("replies", {})):
        replies = infer(args, prompts, "--model", args.model)
        known = {"model": args.model, "replies": replies}
        keep.write_text(json.dumps(known))
    return {p: known["replies"][p] for p in prompts}


def run_config(args, i: int, spec: str, set_dir: Path, runs: Path, ctx: dict) -> dict:
    recipe, _, flags = spec.partition(":")
    run_id = f"{set_dir.name}-{i:02d}-{recipe}-{time.strftime('%H%M%S')}"
    cmd = [args.toy, "train", "--recipe", recipe, "--model", args.model, "--data", str(set_dir)]
    cmd += ["--json", "--out", str(runs), "--run-id", run_id, *shlex.split(flags)]
    row = {"set": set_dir.name, "recipe": recipe, "flags": flags}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=runs)
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    if r.returncode != 0:
        return {**row, "error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    out = json.loads(r.stdout.strip().splitlines()[-1])
    acc = out.get("val_pref_accuracies") or out.get("val_label_accuracies") or [{}]
    held = out.get("metrics") or [{}]  # the held-out evaluations: rewards, margin, accuracy
    row.update(
        run_dir=out["run_dir"],
        steps=out["steps"],
        train_wall_s=out["wall_s"],
        acc_before=acc[0].get("accuracy"),
        acc_after=acc[-1].get("accuracy"),
        margin_before=held[0].get("margin"),
        margin_after=held[-1].get("margin"),
        loss_last=out["losses"][-1]["loss"] if out["losses"] else None,
    )
    replies = infer(args, ctx["held"] + ctx["probes"], "--run", out["run_dir"])
    why = {p: collapse(t, ctx["marker"]) for p, t in replies.items()}
    if ctx["marker"]:
        style = [replies[p].lower().startswith(ctx["marker"].lower()) for p in ctx["held"]]
    else:
        style = [len(words(replies[p])) < len(words(ctx["base"][p])) for p in ctx["held"]]
    row.update(
        collapse=any(why.values()),
        collapse_why={p: w for p, w in why.items() if w},
        style=style,
        replies=replies,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", required=True, type=Path, help="train.jsonl, valid.jsonl, probe.txt")
    ap.add_argument("--config", action="append", required=True, help='"RECIPE:FLAGS"')
    ap.add_argument("--runs", type=Path, help="where the runs go (default: a temp dir)")
    ap.add_argument("--model", default=os.path.expanduser(MODEL), help="the base")
    ap.add_argument("--toy", default=TOY, help="the toy command")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--threads", type=int, help="toy infer's --threads (train: in FLAGS)")
    args = ap.parse_args(argv)
    set_dir = args.set.resolve()
    runs = (args.runs or Path(tempfile.mkdtemp(prefix="pref-defaults-"))).resolve()
    runs.mkdir(parents=True, exist_ok=True)
    marker, held, probes = read_set(set_dir)
    base = base_replies(args, set_dir, runs, held + probes)
    why = {p: w for p, t in base.items() if (w := collapse(t, marker))}
    print(
        json.dumps(
            {
                "set": set_dir.name,
                "base": args.model,
                "marker": marker,
                "runs": str(runs),
                "collapse_why": why,
                "replies": base,
            }
        ),
        flush=True,
    )
    ctx = {"marker": marker, "held": held, "probes": probes, "base": base}
    for i, spec in enumerate(args.config):
        print(json.dumps(run_config(args, i, spec, set_dir, runs, ctx)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
