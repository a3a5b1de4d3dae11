"""toy and llama.cpp on a machine with one core taken by another process (issue 46, item 1).

    python bench/busy.py --model data/smollm2-135m.gguf [--steps 8] [--tokens 128]
                         [--only lora,reply,grpo,llamacpp] [--base-dtype quantized]

A user's laptop is always busy with something. Each case runs in a fresh process, as a
user runs toy: `toy train --recipe lora` on the SmolLM2 GGUF (r8 q,v, the bundled chat
set, --steps steps; tokens/s over the steps after the second, from events.jsonl) and
`toy infer --prompt` (a --tokens greedy reply, --base-dtype quantized: the packed decode;
its steady tokens/s and the first token's wait since the command), `toy train --recipe grpo`
(issue 57 item 4: a step is mostly sampling; `toy new`'s arithmetic prompts, --reward
accuracy, --grpo-steps steps, the seconds a step after the first, from events.jsonl), then
llama.cpp (llama-cpp-python) decoding the same prompt. Each under:

- quiet: nothing else running;
- busy: a process spinning on core 0 (pinned there, bounded in time, killed after the
  case), as a browser tab or a build would.

and each thread setting: toy's default (no flag), --threads 1 and --threads 2 (as many
threads as cores here); llama.cpp's n_threads 2 and 1. Prints one JSON line a case and a
summary: the busy default against the best busy thread count (goal >= 0.9x) and against its
own quiet speed (goal >= 0.4x); the CPU kind named. The machine must be otherwise quiet:
figures taken while other work shares the cores are not these.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Here is a short story about a lighthouse keeper who finds a message in a bottle."


class Busy:
    """A process spinning on core 0 for at most `limit` seconds (or until closed)."""

    def __init__(self, on: bool, limit: float = 900.0):
        self.on, self.limit, self.p = on, limit, None

    def __enter__(self):
        if self.on:
            code = (
                "import os, time\n"
                "os.sched_setaffinity(0, {0})\n"
                f"end = time.time() + {self.limit}\n"
                "while time.time() < end:\n"
                "    pass\n"
            )
            self.p = subprocess.Popen([sys.executable, "-c", code])
            time.sleep(0.5)  # spinning before the case starts
        return self

    def __exit__(self, *exc):
        if self.p is not None:
            self.p.kill()
            self.p.wait()
        return False


def toy(args: list[str], env: dict | None = None, timeout: float = 900) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "toy", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def train_steps(args: list[str], out: Path, threads: list[str]) -> tuple[list[dict], dict]:
    """`toy train ARGS` into out/r, quiet (--json, no evaluation): its step events and the
    torch thread count run.json records; raises RuntimeError with its last stderr line."""
    r = toy(["train", *args, "--out", str(out), "--run-id", "r", "--json", "--eval-every", "0"]
            + threads)  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip().splitlines()[-1:])
    events = [json.loads(x) for x in (out / "r" / "events.jsonl").read_text().splitlines()]
    info = json.loads((out / "r" / "run.json").read_text())
    steps = [e for e in events if e["event"] == "step"]
    return steps, {"torch_threads": info.get("device", {}).get("torch_threads")}


def lora(a, work: Path, threads: list[str], name: str) -> dict:
    try:
        steps, info = train_steps(
            ["--recipe", "lora", "--model", str(a.model), "--data", str(a.chat)]
            + ["--steps", str(a.steps)],
            work / name,
            threads,
        )
    except RuntimeError as e:
        return {"error": e.args[0]}
    timed = steps[2:]  # after the second step: warm-up and first-call costs out of it
    span = timed[-1]["time"] - steps[1]["time"]
    return {"tokens_per_s": round(sum(e["items"] for e in timed) / span, 1), **info}


def grpo(a, work: Path, threads: list[str], name: str) -> dict:
    try:
        steps, info = train_steps(
            ["--recipe", "grpo", "--model", str(a.model), "--data", str(a.arith)]
            + ["--reward", "accuracy", "--max-completion-length", "32"]
            + ["--steps", str(a.grpo_steps)],
            work / name,
            threads,
        )
    except RuntimeError as e:
        return {"error": e.args[0]}
    span = steps[-1]["time"] - steps[0]["time"]  # after the first step: its builds out of it
    return {
        "steps_per_h": round((len(steps) - 1) / span * 3600, 1),  # a rate: higher, faster
        "s_per_step": round(span / (len(steps) - 1), 2),
        **info,
    }


def reply(a, threads: list[str]) -> dict:
    r = toy(
        ["infer", "--model", str(a.model), "--prompt", PROMPT, "--temperature", "0"]
        + ["--max-new-tokens", str(a.tokens), "--json", "--base-dtype", a.base_dtype]
        + threads
    )
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1:]}
    rep = json.loads(r.stdout)
    return {
        "tokens_per_s": rep.get("tokens_per_s"),
        "first_token_since_command_s": rep.get("first_token_since_command_s"),
        "base_dtype": rep.get("base_dtype"),
        "torch_threads": rep.get("threads"),
    }


LLAMA = """
import json, sys, time
from llama_cpp import Llama
model, tokens, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kw = {}
if "amx_bf16" in open("/proc/cpuinfo").read():
    kw["use_extra_bufts"] = False  # llama.cpp #20824: AMX repacking segfaults
llm = Llama(model, n_ctx=512, n_threads=threads, verbose=False, **kw)
ids = llm.tokenize(sys.argv[4].encode())
times, t = [], time.perf_counter()
for i, tok in enumerate(llm.generate(ids, temp=0.0)):
    now = time.perf_counter()
    times.append(now - t)
    t = now
    if i + 1 == tokens:
        break
print(json.dumps({"tokens_per_s": round(len(times[2:]) / sum(times[2:]), 2)}))
"""


def llamacpp(a, threads: int) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", LLAMA, str(a.model), str(a.tokens), str(threads), PROMPT],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or [f"rc {r.returncode}"])[-1:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    from toy.train.device import cpu_kind

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("data/smollm2-135m.gguf"))
    ap.add_argument("--chat", type=Path, default=None, help="default: the bundled chat set")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--grpo-steps", type=int, default=4)
    ap.add_argument("--only", default="lora,reply,grpo,llamacpp")
    ap.add_argument(
        "--base-dtype",
        default="quantized",
        help="the reply's --base-dtype (quantized: the packed decode, toy's fast path)",
    )
    a = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    settings = [("default", []), ("1", ["--threads", "1"]), (str(cores), ["--threads", str(cores)])]
    only = set(a.only.split(","))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        r = toy(["new", str(work / "p")])
        assert r.returncode == 0, r.stderr
        a.chat = a.chat or work / "p" / "data" / "chat.jsonl"
        a.arith = work / "p" / "data" / "arith"
        # Packed codes and compiled steps built once, before anything is timed.
        toy(["infer", "--model", str(a.model), "--prompt", "Hi", "--max-new-tokens", "4"]
            + ["--base-dtype", a.base_dtype])  # fmt: skip
        for load in ("quiet", "busy"):
            for name, flag in settings:
                for job in ("lora", "reply", "grpo"):
                    if job not in only:
                        continue
                    with Busy(load == "busy"):
                        if job == "lora":
                            got = lora(a, work, flag, f"{load}-{name}")
                        elif job == "grpo":
                            got = grpo(a, work, flag, f"{load}-{name}-grpo")
                        else:
                            got = reply(a, flag)
                    row = {"job": job, "load": load, "threads": name} | got
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            if "llamacpp" in only:
                for n in (cores, 1):
                    with Busy(load == "busy"):
                        got = llamacpp(a, n)
                    row = {"job": "llama.cpp", "load": load, "threads": str(n)} | got
                    rows.append(row)
                    print(json.dumps(row), flush=True)

    def rate(job, load, threads):
        return next(
            (
                r.get("tokens_per_s", r.get("steps_per_h"))
                for r in rows
                if (r["job"], r["load"], r["threads"]) == (job, load, threads)
            ),
            None,
        )

    summary = {"cpu": cpu_kind(), "cores": cores}
    for job in ("lora", "reply", "grpo"):
        busy = {n: rate(job, "busy", n) for n, _ in settings}
        quiet = rate(job, "quiet", "default")
        if busy["default"] and quiet and all(busy.values()):
            best = max(v for k, v in busy.items() if k != "default")
            summary[job] = {
                "busy_default_over_best_busy": round(busy["default"] / best, 2),
                "busy_default_over_quiet_default": round(busy["default"] / quiet, 2),
            }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
