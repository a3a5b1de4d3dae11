"""`make bench`: toy against the peers its users would pick instead, measured in the
same run, alternating peer and toy, medians of the repeats. Prints a table and writes
bench/out/results.json with the machine's details.

    python bench/run.py [--only matmul,scratch,lora,chat,big,generate,mlx,dpo] [--repeats 3]
        [--quick]

toy's rows are its real recipes and training loop, timed after their warm-up steps:
the same `tokens_per_s` `toy train --json` prints (the scratch section checks that by
running the CLI on the same shape). "toy --compile" is the same with `--compile`.
LoRA rows: toy's default on CPU holds the base as a bf16 copy where it trains in bf16 (a
CPU with bf16 units) and as its GGUF blocks in float32; the `--checkpointing` and
`--base-dtype quantized` rows are the same run with those flags.
Section 5 ("big") trains LoRA on a 1.07B-parameter Q4_0 llama that
bench/make_big_llama.py writes (600 MB), quantized and float32, for peak memory.
Section 6 ("generate"): greedy generation on SmolLM2's GGUF, toy float32 and quantized
(packed for generation, each block compiled for one token: models/decode.py) against
llama.cpp (llama-cpp-python, when installed), decode tokens/s and peak RSS.
Section 7 ("mlx"): LoRA on SmolLM2's MLX 4-bit twin (scripts/get-smollm2-dirs.sh), toy
against mlx-lm's own trainer, and toy on the Q4_1 GGUF for the memory comparison.
Section 8 ("dpo"): DPO on SmolLM2 (bench/dpo_step.py), its peak RSS against a LoRA SFT
run over the same tokens, and toy against TRL's DPOTrainer + PEFT on the transformers
directory: pairs/s and peak RSS.
Every row is printed with the CPU's kind (AVX2, AVX-512, AVX-512+bf16, AMX: torch's
capability and the CPU's bf16 units): figures from machines of different kinds are never
comparable.

Precision (issue 33): the matmul ceiling is measured in float32 and, where the CPU has bf16
units, in bf16; each scratch row's share is of the ceiling of the precision it ran in. The
peers (transformers; for gpt2 also nano_gpt, Karpathy's build-nanogpt GPT from PyPI's
`nano-gpt`, fetched into build/ at bench time with pip and never committed; for LoRA
transformers + PEFT) run in float32 and under `torch.autocast("cpu", bfloat16)`, toy in
`--precision float32` and bf16; each toy row names its ratio to every peer row.

`--isa avx2` runs the whole bench (this process and every child) with torch's own
kernels, MKL and oneDNN held to AVX2 (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS,
ONEDNN_MAX_CPU_ISA): an AVX2 machine's code paths on an AVX-512 CPU. Its cache, memory
and clocks stay this CPU's, and llama.cpp's build keeps its own instructions: results.json
records `isa_restricted`, and rows say "AVX2 (restricted)".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ISA_ENV = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    }
}


def restrict_isa(argv: list[str]) -> None:
    """`--isa avx2`: re-run this script with the instruction set held down before torch loads."""
    if "--isa" in argv and argv.index("--isa") + 1 < len(argv):
        env = ISA_ENV.get(argv[argv.index("--isa") + 1])
        if env is None:
            raise SystemExit(f"--isa: one of {sorted(ISA_ENV)}")
        if any(os.environ.get(k) != v for k, v in env.items()):
            os.environ.update(env)
            os.execv(sys.executable, [sys.executable, *sys.argv])


restrict_isa(sys.argv)

import torch  # noqa: E402  (after restrict_isa: the capability is fixed when torch loads)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def matmul_ceiling(n: int = 2048, reps: int = 10, dtype: torch.dtype | None = None) -> float:
    """FLOP/s of a large matmul in `dtype` (default: float32 on CPU, bf16 on CUDA): the
    machine's ceiling for that precision."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = dtype or (torch.bfloat16 if dev == "cuda" else torch.float32)
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


DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}


def nanogpt_dir() -> Path | None:
    """nano_gpt (PyPI `nano-gpt`: Karpathy's build-nanogpt GPT, packaged) unpacked under
    build/bench/peers at bench time with pip's own client; never committed. None if pip
    cannot get it (offline, gone)."""
    d = ROOT / "build" / "bench" / "peers"
    if (d / "nano_gpt" / "model.py").is_file():
        return d
    d.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "nano-gpt", "-d", str(d)],
        capture_output=True,
        text=True,
    )
    wheels = sorted(d.glob("nano_gpt-*.whl"))
    if r.returncode != 0 or not wheels:
        return None
    import zipfile

    with zipfile.ZipFile(wheels[-1]) as z:
        z.extractall(d)
    return d if (d / "nano_gpt" / "model.py").is_file() else None


def alternate_args(
    script: str, args: list[str], repeats: int, variants: dict[str, list[str]]
) -> dict[str, list[dict]]:
    """Each variant (name -> its args) in turn, `repeats` rounds: drift hits all alike."""
    out: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(repeats):
        for v, extra in variants.items():
            out[v].append(child(script, *extra, *args))
    return out


def child(script: str, *args: str) -> dict:
    r = subprocess.run(
        [sys.executable, str(HERE / script), *args], capture_output=True, text=True, cwd=ROOT
    )
    if r.returncode != 0:
        raise SystemExit(f"bench child {script} {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


VARIANTS = {
    "hf": ["--impl", "hf"],
    "toy": ["--impl", "toy"],
    "toy --compile": ["--impl", "toy", "--compile"],
    "toy --checkpointing": ["--impl", "toy", "--checkpointing"],
    "toy --base-dtype float32": ["--impl", "toy", "--base-dtype", "float32"],
    "hf, toy's malloc setting": ["--impl", "hf", "--tune-malloc"],
    "dpo toy": ["--impl", "toy"],
    "dpo toy-sft": ["--impl", "toy-sft"],
    "dpo trl": ["--impl", "trl"],
}


def alternate(
    script: str, args: list[str], repeats: int, variants=("hf", "toy")
) -> dict[str, list[dict]]:
    """peer, toy, peer, toy, ...: drift in the machine's speed hits both alike."""
    out: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            out[v].append(child(script, *VARIANTS[v], *args))
    return out


def cli_tokens_per_s(arch: str, steps: int) -> float:
    """`toy train --json` on the scratch bench's shape and synthetic corpus."""
    corpus = ROOT / "build" / "bench" / "synthetic.bin"
    if not corpus.is_file():
        child("scratch_step.py", "--write-corpus", str(corpus))
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "toy",
                "train",
                "--corpus",
                str(corpus),
                "--arch",
                arch,
                "--n-layer",
                "6",
                "--d-model",
                "384",
                "--n-head",
                "6",
                "--n-kv-head",
                "6",
                "--seq-len",
                "256",
                "--batch-size",
                "8",
                "--steps",
                str(3 + steps),
                "--warmup",
                "0",
                "--eval-batches",
                "1",
                "--json",
                "--out",
                d,
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
    if r.returncode != 0:
        raise SystemExit(f"toy train failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])["tokens_per_s"]


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def smollm2() -> Path | None:
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "get-smollm2.sh"), str(ROOT / "build" / "bench")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    return Path(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None


def smollm2_hf() -> Path | None:
    """SmolLM2's transformers directory (BF16), made once from the GGUF."""
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "get-smollm2-dirs.sh"), "--q-group-size", "32"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    return Path(r.stdout.strip().splitlines()[-2]) if r.returncode == 0 else None


def smollm2_mlx() -> Path | None:
    """SmolLM2's MLX 4-bit twin (groups of 32), made once from the GGUF."""
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "get-smollm2-dirs.sh"), "--q-group-size", "32"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    return Path(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None


def make_text_data(d: Path, n: int = 64) -> None:
    """{"text"} lines of ~1,400 characters (~300 tokens: each fills a 256-token row)."""
    d.mkdir(parents=True, exist_ok=True)
    text = (ROOT / "src" / "toy" / "data" / "assets" / "shakespeare" / "hamlet.txt").read_text()
    with open(d / "train.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": text[i * 1400 : (i + 1) * 1400]}) + "\n")


def dpo_section(model: Path, repeats: int, quick: bool, results: dict, rows: list) -> None:
    """Section 8: DPO (bench/dpo_step.py), pairs of scripts/make_pref_pairs.py, r8 q,v B4
    T128. Its peak RSS against a LoRA SFT run over the same tokens (both on the GGUF), and
    toy against TRL's DPOTrainer + PEFT on the transformers directory (both reference
    models: the base with the adapter off)."""
    data = ROOT / "build" / "bench" / "pref"
    if not (data / "train.jsonl").is_file():
        child("dpo_step.py", "--make-data", str(data), "--pairs", "64")
    # --quick: 2 steps, both timed (a smoke run); else 6 after 3 untimed.
    args = ["--data", str(data), *(["--steps", "2", "--warm", "0"] if quick else ["--steps", "6"])]
    n = max(1, min(repeats, 2))  # a DPO step is slow on CPU: at most 2 repeats
    r = alternate("dpo_step.py", ["--model", str(model), *args], n, ("dpo toy-sft", "dpo toy"))
    d, s = r["dpo toy"], r["dpo toy-sft"]
    results["dpo"] = {"toy_gguf": d, "toy_sft_gguf": s}
    rows.append(
        (
            "8 DPO SmolLM2 Q4_1 r8 q,v B4 pairs T128: peak RSS vs LoRA SFT, same tokens",
            f"{med(d, 'peak_rss_mb'):,.0f} MB",
            f"{med(s, 'peak_rss_mb'):,.0f} MB (toy SFT)",
            f"{med(d, 'peak_rss_mb') / med(s, 'peak_rss_mb'):.2f}x (goal <= 1.3x)",
        )
    )
    hf_dir = smollm2_hf()
    if hf_dir is None or importlib.util.find_spec("trl") is None:
        rows.append(("8 DPO vs TRL", "skipped: no transformers directory or no trl", "", ""))
        return
    r = alternate("dpo_step.py", ["--model", str(hf_dir), *args], n, ("dpo trl", "dpo toy"))
    t, p = r["dpo toy"], r["dpo trl"]
    results["dpo"].update(toy_hf=t, trl_hf=p)
    rows.append(
        (
            "8 DPO SmolLM2 transformers dir r8 q,v B4 T128, toy vs TRL DPOTrainer+PEFT",
            f"{med(t, 'pairs_per_s'):,.2f} pairs/s",
            f"{med(p, 'pairs_per_s'):,.2f} pairs/s",
            f"{med(t, 'pairs_per_s') / med(p, 'pairs_per_s'):.2f}x (goal >= 1.5x)",
        )
    )
    rows.append(
        (
            "    peak RSS",
            f"{med(t, 'peak_rss_mb'):,.0f} MB",
            f"{med(p, 'peak_rss_mb'):,.0f} MB",
            f"{med(t, 'peak_rss_mb') / med(p, 'peak_rss_mb'):.2f}x (goal <= 0.6x)",
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="matmul,scratch,lora,chat,big,generate,mlx,dpo")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--quick", action="store_true", help="fewer steps (a smoke run, not for the record)"
    )
    ap.add_argument(
        "--isa", choices=sorted(ISA_ENV), help="hold torch, MKL and oneDNN to this instruction set"
    )
    a = ap.parse_args()
    only = set(a.only.split(","))
    steps = "2" if a.quick else "6"
    from toy.train.device import cpu_bf16_units, cpu_kind

    bf16_units = cpu_bf16_units() if not a.isa else None  # AVX2-restricted: no bf16 rows
    results: dict = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_kind": cpu_kind(),
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "bf16_units": bf16_units,
            "isa_restricted": a.isa,
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "python": platform.python_version(),
        },
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    rows: list[tuple[str, str, str, str]] = []
    precisions = ["float32"] + (["bf16"] if bf16_units else [])
    ceilings: dict[str, float] = {}
    if {"matmul", "scratch", "lora"} & only:
        for p in precisions:
            ceilings[p] = matmul_ceiling(dtype=DTYPES[p])
            rows.append(
                (f"1 matmul ceiling ({p} 2048^3)", f"{ceilings[p] / 1e9:.1f} GFLOP/s", "", "")
            )
        results["matmul_flops"] = ceilings
        if not bf16_units:
            rows.append(("1 bf16 rows", "skipped: this CPU has no bf16 units", "", ""))
    if "scratch" in only:
        nano = nanogpt_dir()
        for arch in ("gpt2", "llama"):
            variants = {}
            for p in precisions:
                variants[f"hf {p}"] = ["--impl", "hf", "--precision", p]
                if arch == "gpt2" and nano is not None:
                    variants[f"nanogpt {p}"] = ["--impl", "nanogpt", "--peer-dir", str(nano)]
                    variants[f"nanogpt {p}"] += ["--precision", p]
                variants[f"toy {p}"] = ["--impl", "toy", "--precision", p]
            if arch == "gpt2" and nano is not None:  # what the allocator alone gives a peer
                last = f"nanogpt {precisions[-1]}"
                variants[f"{last}, toy's malloc setting"] = variants[last] + ["--tune-malloc"]
            variants[f"toy {precisions[-1]} --compile"] = variants[f"toy {precisions[-1]}"] + [
                "--compile"
            ]
            r = alternate_args(
                "scratch_step.py", ["--arch", arch, "--steps", steps], a.repeats, variants
            )
            fpt = r[f"toy {precisions[0]}"][0]["flops_per_token"]
            results[f"scratch_{arch}"] = {"runs": r, "flops_per_token": fpt}
            peers = [v for v in variants if not v.startswith("toy")]
            for v in variants:
                tps = med(r[v], "tokens_per_s")
                p = "bf16" if " bf16" in v else "float32"
                frac = tps * fpt / ceilings[p]
                vs = [
                    f"{q} {med(r[q], 'tokens_per_s'):,.0f}: {tps / med(r[q], 'tokens_per_s'):.2f}x"
                    for q in peers
                    if v.startswith("toy")
                ]
                rows.append(
                    (
                        f"2 from-scratch {arch} 6x384 T256 B8, {v}",
                        f"{tps:,.0f} tok/s ({frac:.0%} of the {p} ceiling)",
                        "; ".join(vs),
                        "",
                    )
                )
        cli = cli_tokens_per_s("llama", int(steps))
        bench_tps = med(results["scratch_llama"]["runs"][f"toy {precisions[-1]}"], "tokens_per_s")
        results["scratch_llama"]["cli_tokens_per_s"] = cli
        rows.append(
            (
                f"  `toy train --json` tokens_per_s, llama shape, default ({precisions[-1]})",
                f"{cli:,.0f} tok/s",
                "",
                f"{cli / bench_tps:.2f}x of the toy {precisions[-1]} row",
            )
        )
    model = smollm2() if {"lora", "chat", "big", "generate", "mlx", "dpo"} & only else None
    if {"lora", "chat"} & only and model is None:
        rows.append(("3, 4 SmolLM2", "skipped: SmolLM2 not available", "", ""))
    if "lora" in only and model is not None:
        corpus = ROOT / "build" / "bench" / "smol.bin"
        if not corpus.is_file():
            texts = sorted(
                (ROOT / "src" / "toy" / "data" / "assets" / "shakespeare").glob("*.txt")
            )[:3]
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "toy",
                    "prep",
                    *map(str, texts),
                    "--out",
                    str(corpus),
                    "--tokenizer",
                    str(model),
                ],
                check=True,
                capture_output=True,
            )
        d = precisions[-1]  # toy's default here: bf16 where the CPU has the units
        variants = {}
        for p in precisions:
            variants[f"hf {p}"] = ["--impl", "hf", "--precision", p]
        for p in precisions:
            variants[f"toy {p}"] = ["--impl", "toy", "--precision", p]
        for extra in (["--compile"], ["--checkpointing"], ["--base-dtype", "quantized"]):
            variants[f"toy {d} {' '.join(extra)}"] = variants[f"toy {d}"] + extra
        variants["hf float32, toy's malloc setting"] = variants["hf float32"] + ["--tune-malloc"]
        r = alternate_args(
            "lora_step.py",
            ["--model", str(model), "--corpus", str(corpus), "--steps", steps],
            a.repeats,
            variants,
        )
        results["lora"] = r
        peers = [v for v in variants if v.startswith("hf")]
        toy32 = med(r["toy float32"], "peak_rss_mb")
        for v in variants:
            t = r[v]
            tps = med(t, "tokens_per_s")
            vs = [
                f"{q} {med(r[q], 'tokens_per_s'):,.0f}: {tps / med(r[q], 'tokens_per_s'):.2f}x"
                for q in peers[: len(precisions)]
                if v.startswith("toy")
            ]
            rows.append(
                (f"3 LoRA SmolLM2 r8 q,v B4 T256, {v}", f"{tps:,.0f} tok/s", "; ".join(vs), "")
            )
            rows.append(
                (
                    "    peak RSS",
                    f"{med(t, 'peak_rss_mb'):,.0f} MB",
                    f"toy float32 {toy32:,.0f} MB",
                    f"{med(t, 'peak_rss_mb') / toy32:.2f}x",
                )
            )
        t, h = r[f"toy {d}"], r["hf float32"]
        rows.append(
            (
                "  model load (toy: its default base form)",
                f"{med(t, 'load_s'):.2f} s",
                f"{med(h, 'load_s'):.1f} s",
                f"{med(t, 'load_s') / med(h, 'load_s'):.3f}x",
            )
        )
    if "chat" in only and model is not None:
        data = ROOT / "build" / "bench" / "chat.jsonl"
        if not data.is_file():
            child("chat_epoch.py", "--make-data", str(data), "--n", "200")
        extra = ["--limit-steps", "2"] if a.quick else []
        r = alternate(
            "chat_epoch.py",
            ["--model", str(model), "--data", str(data), *extra],
            max(1, min(a.repeats, 2)),
        )  # an epoch takes minutes: at most 2 repeats
        t, h = r["toy"], r["hf"]
        results["chat"] = {"toy": t, "peer": h}
        rows.append(
            (
                f"4 chat SFT epoch, {t[0]['conversations']} convs, B4 T512",
                f"{med(t, 'epoch_s'):,.1f} s",
                f"{med(h, 'epoch_s'):,.1f} s",
                f"{med(h, 'epoch_s') / med(t, 'epoch_s'):.2f}x faster",
            )
        )
        rows.append(
            ("  tokens through the model", f"{t[0]['tokens_fed']:,}", f"{h[0]['tokens_fed']:,}", "")
        )
        rows.append(
            (
                "  peak RSS",
                f"{med(t, 'peak_rss_mb'):,.0f} MB",
                f"{med(h, 'peak_rss_mb'):,.0f} MB",
                f"{med(t, 'peak_rss_mb') / med(h, 'peak_rss_mb'):.2f}x",
            )
        )
    if "big" in only and model is not None:
        big = ROOT / "build" / "bench" / "big-q4_0.gguf"
        if not big.is_file():
            subprocess.run(
                [
                    sys.executable,
                    str(HERE / "make_big_llama.py"),
                    "--smollm2",
                    str(model),
                    "--out",
                    str(big),
                ],
                check=True,
            )
        corpus = ROOT / "build" / "bench" / "smol.bin"
        if not corpus.is_file():
            texts = sorted(
                (ROOT / "src" / "toy" / "data" / "assets" / "shakespeare").glob("*.txt")
            )[:3]
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "toy",
                    "prep",
                    *map(str, texts),
                    "--out",
                    str(corpus),
                    "--tokenizer",
                    str(model),
                ],
                check=True,
                capture_output=True,
            )
        big_args = [
            "--model",
            str(big),
            "--corpus",
            str(corpus),
            "--steps",
            "1" if a.quick else "2",
            "--batch",
            "1",
            "--seq",
            "128",
        ]
        results["big"] = {}
        for v in ("toy", "toy --base-dtype float32"):
            t = child("lora_step.py", *VARIANTS[v], *big_args)
            results["big"][v] = t
            rows.append(
                (
                    f"5 LoRA 1.07B llama Q4_0 B1 T128, {v}",
                    f"{t['peak_rss_mb']:,.0f} MB peak RSS",
                    f"{t['tokens_per_s']:,.1f} tok/s",
                    f"load {t['load_s']:.1f} s",
                )
            )
    if "generate" in only and model is not None:
        gen_args = ["--model", str(model), "--tokens", "16" if a.quick else "128"]
        results["generate"] = {}
        impls = [
            ("toy float32", ["--impl", "toy", "--base-dtype", "float32"]),
            (
                "toy quantized (packed, compiled step)",
                ["--impl", "toy", "--base-dtype", "quantized"],
            ),
        ]
        if importlib.util.find_spec("llama_cpp") is not None:
            impls.append(("llama.cpp", ["--impl", "llamacpp"]))
        else:
            rows.append(
                ("6 generation: llama.cpp", "skipped: llama-cpp-python not installed", "", "")
            )
        for name, args in impls:
            results["generate"][name] = [
                child("generate.py", *args, *gen_args) for _ in range(max(1, a.repeats - 1))
            ]
        peer = results["generate"].get("llama.cpp")
        for name, _ in impls:
            g = results["generate"][name]
            ratio = f"{med(g, 'tokens_per_s') / med(peer, 'tokens_per_s'):.2f}x" if peer else ""
            rows.append(
                (
                    f"6 SmolLM2 Q4_1 greedy decode, {name}",
                    f"{med(g, 'tokens_per_s'):,.1f} tok/s",
                    f"{med(peer, 'tokens_per_s'):,.1f} tok/s" if peer else "",
                    ratio,
                )
            )
            first = ("load_s", "prefill_s", "first_decode_s")  # summed in this order
            rows.append(
                (
                    "    load + prefill + first decode step",
                    f"{sum(med(g, k) for k in first):,.2f} s",
                    f"{sum(med(peer, k) for k in first):,.2f} s" if peer else "",
                    "",
                )
            )
            rows.append(
                (
                    "    peak RSS",
                    f"{med(g, 'peak_rss_mb'):,.0f} MB",
                    f"{med(peer, 'peak_rss_mb'):,.0f} MB" if peer else "",
                    f"{med(g, 'peak_rss_mb') / med(peer, 'peak_rss_mb'):.2f}x" if peer else "",
                )
            )
        rows.append(("    file size", f"{model.stat().st_size / 1e6:,.0f} MB", "", ""))
    if "mlx" in only and model is not None:
        mlx_dir = smollm2_mlx()
        if mlx_dir is None:
            rows.append(
                (
                    "7 MLX",
                    "skipped: the MLX twin could not be made (scripts/get-smollm2-dirs.sh)",
                    "",
                    "",
                )
            )
        else:
            data = ROOT / "build" / "bench" / "text"
            if not (data / "train.jsonl").is_file():
                make_text_data(data)
            steps = "2" if a.quick else "6"
            toy_mlx = [
                child(
                    "mlx_lora.py",
                    "--impl",
                    "toy",
                    "--model",
                    str(mlx_dir),
                    "--data",
                    str(data),
                    "--steps",
                    steps,
                )
                for _ in range(max(1, a.repeats - 1))
            ]
            toy_gguf = [
                child(
                    "mlx_lora.py",
                    "--impl",
                    "toy",
                    "--model",
                    str(model),
                    "--data",
                    str(data),
                    "--steps",
                    steps,
                )
                for _ in range(max(1, a.repeats - 1))
            ]
            peer = None
            if importlib.util.find_spec("mlx_lm") is not None:
                peer = child(
                    "mlx_lora.py",
                    "--impl",
                    "mlx",
                    "--model",
                    str(mlx_dir),
                    "--data",
                    str(data),
                    "--steps",
                    "1" if a.quick else "2",
                    "--timeout",
                    "600" if a.quick else "1800",
                )
            results["mlx"] = {"toy_mlx": toy_mlx, "toy_gguf": toy_gguf, "peer": peer}
            tps = med(toy_mlx, "tokens_per_s")
            if peer and peer["tokens_per_s"]:
                rows.append(
                    (
                        "7 LoRA SmolLM2 MLX 4-bit r8 q,v B4 T256, toy vs mlx-lm",
                        f"{tps:,.0f} tok/s",
                        f"{peer['tokens_per_s']:,.1f} tok/s",
                        f"{tps / peer['tokens_per_s']:.1f}x",
                    )
                )
            elif peer:
                rows.append(
                    (
                        "7 LoRA SmolLM2 MLX 4-bit r8 q,v B4 T256, toy vs mlx-lm",
                        f"{tps:,.0f} tok/s",
                        f"no iteration in {peer['wall_s']:.0f} s",
                        "",
                    )
                )
            if peer:
                rows.append(
                    (
                        "    peak RSS",
                        f"{med(toy_mlx, 'peak_rss_mb'):,.0f} MB",
                        f"{peer['peak_rss_mb']:,.0f} MB",
                        f"{med(toy_mlx, 'peak_rss_mb') / peer['peak_rss_mb']:.2f}x",
                    )
                )
            rows.append(
                (
                    "  toy on the MLX 4-bit twin vs on the Q4_1 GGUF, peak RSS",
                    f"{med(toy_mlx, 'peak_rss_mb'):,.0f} MB",
                    f"{med(toy_gguf, 'peak_rss_mb'):,.0f} MB",
                    f"{med(toy_mlx, 'peak_rss_mb') / med(toy_gguf, 'peak_rss_mb'):.2f}x",
                )
            )
            rows.append(
                (
                    "    tokens/s",
                    f"{tps:,.0f} tok/s",
                    f"{med(toy_gguf, 'tokens_per_s'):,.0f} tok/s",
                    f"{tps / med(toy_gguf, 'tokens_per_s'):.2f}x",
                )
            )
    if "dpo" in only and model is not None:
        dpo_section(model, a.repeats, a.quick, results, rows)
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    name = (
        f"results-{a.isa}.json" if a.isa else "results.json"
    )  # a restricted run keeps the plain one
    (out / name).write_text(json.dumps(results, indent=2))
    w = [max(len(r[i]) for r in rows + [("what", "toy", "peer", "toy/peer")]) for i in range(4)]
    print(
        f"machine: {results['machine']['processor'] or platform.machine()}, CPU kind "
        f"{results['machine']['cpu_kind']}, {results['machine']['cpus']} cpus, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads)"
    )
    kind = results["machine"]["cpu_kind"] + (" (restricted)" if a.isa else "")
    for r in [("what", "toy", "peer (same run)", "toy/peer")] + rows:
        print(
            "  ".join(c.ljust(w[i]) for i, c in enumerate(r))
            + ("" if r[0] == "what" else f"  [{kind}]")
        )
    print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
