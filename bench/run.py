"""`make bench`: toy against the peers its users would pick instead, measured in the
same run, alternating peer and toy, medians of the repeats. Prints a table and writes
bench/out/results.json with the machine's details.

    python bench/run.py [--only matmul,scratch,lora] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def matmul_ceiling(n: int = 2048, reps: int = 10) -> float:
    """FLOP/s of a large fp32 matmul on CPU (bf16 on CUDA): the machine's ceiling."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(reps):
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        if dev == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def child(script: str, *args: str) -> dict:
    r = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"bench child {script} {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def alternate(script: str, args: list[str], repeats: int) -> dict[str, list[dict]]:
    """peer, toy, peer, toy, ...: drift in the machine's speed hits both alike."""
    out: dict[str, list[dict]] = {"hf": [], "toy": []}
    for _ in range(repeats):
        for impl in ("hf", "toy"):
            out[impl].append(child(script, "--impl", impl, *args))
    return out


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def smollm2() -> Path | None:
    r = subprocess.run(["bash", str(ROOT / "scripts" / "get-smollm2.sh"), str(ROOT / "build" / "bench")],
                       capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable})
    return Path(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="matmul,scratch,lora")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="fewer steps (a smoke run, not for the record)")
    a = ap.parse_args()
    only = set(a.only.split(","))
    steps = "2" if a.quick else "6"
    results: dict = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "python": platform.python_version()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    rows: list[tuple[str, str, str, str]] = []
    ceiling = None
    if "matmul" in only or "scratch" in only:
        ceiling = matmul_ceiling()
        results["matmul_flops"] = ceiling
        rows.append(("1 matmul ceiling (fp32 2048^3)", f"{ceiling / 1e9:.1f} GFLOP/s", "", ""))
    if "scratch" in only:
        for arch in ("gpt2", "llama"):
            r = alternate("scratch_step.py", ["--arch", arch, "--steps", steps], a.repeats)
            toy_tps, hf_tps = med(r["toy"], "tokens_per_s"), med(r["hf"], "tokens_per_s")
            fpt = r["toy"][0]["flops_per_token"]
            frac = toy_tps * fpt / ceiling if ceiling else float("nan")
            results[f"scratch_{arch}"] = {"toy": r["toy"], "peer": r["hf"], "ratio": toy_tps / hf_tps,
                                          "toy_flops_fraction": frac}
            rows.append((f"2 from-scratch {arch} 6x384, T256 B8", f"{toy_tps:,.0f} tok/s ({frac:.0%} of matmul)",
                         f"{hf_tps:,.0f} tok/s", f"{toy_tps / hf_tps:.2f}x"))
    if "lora" in only:
        model = smollm2()
        if model is None:
            rows.append(("3 LoRA SmolLM2", "skipped: SmolLM2 not available", "", ""))
        else:
            corpus = ROOT / "build" / "bench" / "smol.bin"
            if not corpus.is_file():
                texts = sorted((ROOT / "src" / "toy" / "data" / "assets" / "shakespeare").glob("*.txt"))[:3]
                subprocess.run([sys.executable, "-m", "toy", "prep", *map(str, texts), "--out", str(corpus),
                                "--tokenizer", str(model)], check=True, capture_output=True)
            r = alternate("lora_step.py", ["--model", str(model), "--corpus", str(corpus), "--steps", steps],
                          a.repeats)
            t, h = r["toy"], r["hf"]
            results["lora"] = {"toy": t, "peer": h}
            rows.append(("3 LoRA SmolLM2 r8 q,v B4 T256", f"{med(t, 'tokens_per_s'):,.0f} tok/s",
                         f"{med(h, 'tokens_per_s'):,.0f} tok/s",
                         f"{med(t, 'tokens_per_s') / med(h, 'tokens_per_s'):.2f}x"))
            rows.append(("  model load", f"{med(t, 'load_s'):.1f} s", f"{med(h, 'load_s'):.1f} s",
                         f"{med(t, 'load_s') / med(h, 'load_s'):.2f}x"))
            rows.append(("  peak RSS", f"{med(t, 'peak_rss_mb'):,.0f} MB", f"{med(h, 'peak_rss_mb'):,.0f} MB",
                         f"{med(t, 'peak_rss_mb') / med(h, 'peak_rss_mb'):.2f}x"))
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    w = [max(len(r[i]) for r in rows + [("what", "toy", "peer", "toy/peer")]) for i in range(4)]
    print(f"machine: {results['machine']['processor'] or platform.machine()}, {results['machine']['cpus']} cpus, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
    for r in [("what", "toy", "peer (same run)", "toy/peer")] + rows:
        print("  ".join(c.ljust(w[i]) for i, c in enumerate(r)))
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
