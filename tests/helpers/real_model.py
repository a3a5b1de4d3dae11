"""The real SmolLM2-135M-Instruct's clients: llama.cpp and mlx-lm run in their own
processes (LLAMA_CPP, MLX_LM, `client`), and its transformers and MLX directories (the
`smol_dirs` fixture)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.gguf_fixtures import smollm2_gguf  # noqa: E402,F401

LLAMA_CPP = """
import os
import sys
import llama_cpp
import llama_cpp.llama_cpp as C
from transformers import AutoTokenizer
orig = C.llama_model_default_params
def params():  # no AMX/repacked buffers: where the kernel does not grant AMX they crash
    p = orig()
    p.use_extra_bufts = False
    return p
C.llama_model_default_params = params
base, lora, hf_dir, prompt, n = sys.argv[1:6]
text = AutoTokenizer.from_pretrained(hf_dir).apply_chat_template(
    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
llm = llama_cpp.Llama(model_path=base, lora_path=lora, n_ctx=256, verbose=False,
                      n_threads=int(os.environ.get('OMP_NUM_THREADS') or 2))
ids = llm.tokenize(text.encode(), add_bos=False, special=True)
out = []
for t in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
    if t == llm.token_eos() or len(out) >= int(n):
        break
    out.append(t)
print(llm.detokenize(out).decode(errors="replace").strip())
"""


# mlx-lm's answer computed in float32 (the twin's bf16 tensors cast after loading, exactly):
# bf16 on this Linux CPU runs ~0.8 s a token (test_real_dirs.py says more).
MLX_LM = """
import sys
import mlx.core as mx
from mlx_lm import generate, load
from mlx_lm.sample_utils import make_sampler
model_dir, adapter, prompt, n = sys.argv[1:5]
m, t = load(model_dir, adapter_path=adapter)
m.set_dtype(mx.float32)
p = t.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
print(generate(m, t, prompt=p, max_tokens=int(n), sampler=make_sampler(0.0)).strip())
"""


def client(code: str, *args) -> str:
    r = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smol_dirs(smollm2_gguf):
    """(transformers BF16 dir, MLX 4-bit group-32 twin). Groups of 32: at mlx-lm's default
    64 this model, 4-bit already in the GGUF, answers nonsense after the second rounding."""
    env = {**os.environ, "PYTHON": sys.executable}
    r = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "get-smollm2-dirs.sh"),
            "--gguf",
            str(smollm2_gguf),
            "--q-group-size",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    if r.returncode != 0:
        pytest.skip(
            f"SmolLM2 directories could not be made: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
        )
    hf, mlx = (Path(p) for p in r.stdout.strip().splitlines()[-2:])
    return hf, mlx
