"""One benchmark child: greedy generation on a GGUF, toy or llama.cpp (llama-cpp-python).

    python bench/generate.py --impl toy --base-dtype float32|quantized --model FILE.gguf
                             [--tokens 64]
    python bench/generate.py --impl llamacpp --model FILE.gguf [--tokens 64]

The same prompt, greedy, the same number of new tokens, as many threads as torch uses
here (llama.cpp is given the same count). tokens_per_s is the steady decode rate: the new
tokens after the second, over their time. The prompt's prefill (the first token) and the
first decode step (where toy's packed kernels compile, `--base-dtype quantized`) are
timed apart as prefill_s and first_decode_s; end_to_end_s is load to last token.
Prints one JSON line: load_s, prefill_s, first_decode_s, tokens_per_s, end_to_end_s,
peak_rss_mb, text.

    python bench/generate.py --reply --model FILE.gguf [--tokens 100] [--repeats 3]

The wait a user feels: a whole chat reply of --tokens greedy tokens, each from a fresh
process (`python -m toy infer --chat ...` against llama-cpp-python's own process start,
load and create_chat_completion, both on 2 threads), toy and llama.cpp alternating,
wall-clock medians; the CPU kind is named. One toy reply runs first, untimed in the
medians (toy_first_reply_s): it leaves toy's caches warm (the packed codes, and for a
llama GGUF the model its C loop reads, from which later replies start without torch),
as the issue's target says.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

PROMPT = (
    "Here is a short story about a lighthouse keeper who finds a message in a bottle. "
    "Once upon a time,"
)


def run_toy(a) -> dict:
    from toy.cli.cmd_infer import load_base_lm
    from toy.models.generate import generate

    t0 = time.perf_counter()
    lm = load_base_lm(a.model, None, "cpu", a.base_dtype)
    load_s = time.perf_counter() - t0
    from toy.tokenizer import encode_prompt

    ids = encode_prompt(lm.tok, PROMPT)
    times, new = [], []
    t = time.perf_counter()
    for tok in generate(lm.model, ids, a.tokens, temperature=0.0, stop_ids=set()):
        now = time.perf_counter()
        times.append(now - t)
        t = now
        new.append(tok)
    return _rates(load_s, times) | {"text": lm.tok.decode(new), "n": len(new)}


def llamacpp_safe_on_amx() -> None:
    """On a CPU with AMX, llama.cpp's repacked (AMX) weights crash a prompt of more than a few
    tokens (llama.cpp #20824): turn the repacking off there, as the README tells users to
    (`--no-repack`). Elsewhere the peer keeps its default (repacking is its fast path)."""
    import llama_cpp.llama_cpp as C

    from toy.cores import cpu_has_amx  # torch-free: this peer's process never loads torch

    if not cpu_has_amx() or getattr(C.llama_model_default_params, "toy_no_repack", False):
        return
    orig = C.llama_model_default_params

    def params():
        p = orig()
        p.use_extra_bufts = False
        return p

    params.toy_no_repack = True
    C.llama_model_default_params = params


def run_llamacpp(a) -> dict:
    import torch
    from llama_cpp import Llama

    llamacpp_safe_on_amx()

    t0 = time.perf_counter()
    llm = Llama(
        model_path=str(a.model), n_ctx=512, n_threads=torch.get_num_threads(), verbose=False, seed=0
    )
    load_s = time.perf_counter() - t0
    ids = llm.tokenize(PROMPT.encode(), add_bos=True)
    times, new = [], []
    t = time.perf_counter()
    for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        now = time.perf_counter()
        times.append(now - t)
        t = now
        new.append(tok)
        if len(new) == a.tokens:
            break
    return _rates(load_s, times) | {
        "text": llm.detokenize(new).decode(errors="replace"),
        "n": len(new),
    }


def _rates(load_s: float, times: list[float]) -> dict:
    return {
        "load_s": load_s,
        "prefill_s": times[0],
        "first_decode_s": times[1],
        "tokens_per_s": (len(times) - 2) / sum(times[2:]),
        "end_to_end_s": load_s + sum(times),
    }


LLAMA_REPLY = """
import sys
from llama_cpp import Llama
sys.path.insert(0, sys.argv[4])
from generate import llamacpp_safe_on_amx
llamacpp_safe_on_amx()
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=2, verbose=False, seed=0)
out = llm.create_chat_completion(
    [{"role": "user", "content": sys.argv[2]}], max_tokens=int(sys.argv[3]), temperature=0,
    top_k=1)
print(out["usage"]["completion_tokens"])
"""
QUESTION = "Tell me about the sea."


def reply_times(a) -> dict:
    """Median wall seconds of a whole reply from a fresh process, toy and llama.cpp
    alternating (`--repeats` each)."""
    import os
    import statistics
    import subprocess
    import sys

    from toy.train.device import cpu_kind

    env = dict(os.environ, OMP_NUM_THREADS="2")
    toy = [sys.executable, "-m", "toy", "infer", "--model", str(a.model), "--chat", QUESTION]
    toy += ["--max-new-tokens", str(a.tokens), "--temperature", "0"]
    peer = [
        sys.executable,
        "-c",
        LLAMA_REPLY,
        str(a.model),
        QUESTION,
        str(a.tokens),
        str(Path(__file__).parent),
    ]
    f32 = toy + ["--base-dtype", "float32"]
    times: dict[str, list[float]] = {"toy": [], "toy float32": [], "llamacpp": []}
    # toy's first reply on a machine keeps the model its C loop reads (formats/reply_image.py)
    # and later ones start from it without torch, as a compile cache is warm after a first
    # build: one reply first, untimed in the medians, its wall reported as the first's
    t = time.perf_counter()
    r = subprocess.run(toy, capture_output=True, text=True, env=env)
    first_s = time.perf_counter() - t
    if r.returncode:
        raise SystemExit(f"toy failed: {r.stderr[-2000:]}")
    for _ in range(a.repeats):
        for name, cmd in (("llamacpp", peer), ("toy", toy), ("toy float32", f32)):
            t = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            times[name].append(time.perf_counter() - t)
            if r.returncode:
                raise SystemExit(f"{name} failed: {r.stderr[-2000:]}")
            if name.startswith("toy"):
                line = r.stderr.strip().splitlines()[-1]
                times.setdefault(f"{name} speed line", []).append(line)
    med = {k: statistics.median(v) for k, v in times.items() if "line" not in k}
    return {
        "cpu_kind": cpu_kind(),  # the house's names: AVX2, AVX-512, AVX-512+bf16, AMX
        "tokens": a.tokens,
        "toy_reply_s": med["toy"],
        "toy_first_reply_s": first_s,  # before the timed ones (the model kept or not yet)
        "toy_float32_reply_s": med["toy float32"],
        "llamacpp_reply_s": med["llamacpp"],
        "toy_over_llamacpp": med["toy"] / med["llamacpp"],
        "toy_float32_over_llamacpp": med["toy float32"] / med["llamacpp"],
        "runs": times,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("toy", "llamacpp"), default="toy")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--base-dtype", default="float32", choices=("float32", "quantized"))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reply", action="store_true", help="a whole reply from a fresh process")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if a.reply:
        print(json.dumps(reply_times(a)))
        return
    out = run_toy(a) if a.impl == "toy" else run_llamacpp(a)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))


if __name__ == "__main__":
    main()
