"""llama.cpp through llama-cpp-python (skips where it is not installed): a GGUF loaded
(`_llama`) and its greedy continuation (`_cpp_greedy`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.gguf_fixtures import (
    gemma3_gguf,  # noqa: E402,F401
    smollm2_gguf,  # noqa: E402,F401
)

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (pip install -e .[llamacpp])"
)


# One thread a worker under `make test`'s two xdist workers (conftest.py sets OMP_NUM_THREADS):
# two llama.cpp threads beside the other worker's busy one made a 40-token Gemma greedy
# 28.6 s against 3.2 s with one (ggml's threads spin-wait for each other).
THREADS = int(os.environ.get("OMP_NUM_THREADS") or 2)


def _llama(path: Path, lora: Path | None = None, n_ctx: int = 512, logits_all: bool = False):
    """llama.cpp on `path` (+ a LoRA), CPU, with two settings fixed for the comparison:

    - an f32 KV cache (llama.cpp's default f16 cache rounds every K and V: noise that is
      llama.cpp's, not the file's);
    - no "extra buffer types" (use_extra_bufts=False): on CPUs that advertise AMX, ggml
      moves quantized weights into AMX/repacked buffers, and where the kernel does not
      grant AMX (containers) every quantized matmul segfaults -- llama.cpp's own
      Q8_0/Q4_0 quantizations and the published SmolLM2 Q4_1 file crash the same way.
      The plain CPU kernels compute the same function from the same bytes.
    """
    import llama_cpp.llama_cpp as C

    orig = C.llama_model_default_params

    def params():
        p = orig()
        p.use_extra_bufts = False
        return p

    C.llama_model_default_params = params
    try:
        return llama_cpp.Llama(
            model_path=str(path),
            lora_path=str(lora) if lora else None,
            n_ctx=n_ctx,
            n_threads=THREADS,
            n_batch=512,
            logits_all=logits_all,
            verbose=False,
            seed=0,
            type_k=C.GGML_TYPE_F32,
            type_v=C.GGML_TYPE_F32,
        )
    finally:
        C.llama_model_default_params = orig


def _cpp_greedy(llm, prompt: list[int], n: int, stop: set[int]) -> list[int]:
    out: list[int] = []
    for t in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        if t in stop or len(out) >= n:
            break
        out.append(t)
    return out


def _teacher_forced_margin(model, prompt: list[int], chosen: list[int]) -> float:
    """The largest gap, over positions, between toy's best logit and the logit of the
    token llama.cpp chose there (0 when every choice is toy's argmax too)."""
    import torch

    if not chosen:
        return 0.0
    ids = torch.tensor([prompt + chosen])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1 : -1]  # (len(chosen), V): each choice's logits
    picked = logits.gather(1, torch.tensor(chosen)[:, None])[:, 0]
    return float((logits.max(-1).values - picked).max())
