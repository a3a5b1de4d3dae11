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


def run_llamacpp(a) -> dict:
    import torch
    from llama_cpp import Llama

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("toy", "llamacpp"), required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--base-dtype", default="float32", choices=("float32", "quantized"))
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    out = run_toy(a) if a.impl == "toy" else run_llamacpp(a)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))


if __name__ == "__main__":
    main()
