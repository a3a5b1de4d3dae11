#!/usr/bin/env bash
# Make SmolLM2-135M-Instruct as a transformers directory (BF16 safetensors, tokenizer, chat
# template) and as its MLX 4-bit twin (mlx_lm.convert -q: affine, group size 64), from the Q4_1
# GGUF that scripts/get-smollm2.sh fetches. Offline; each is made once and kept in
# ${XDG_CACHE_HOME:-$HOME/.cache}/toy/models/. Prints the two paths (transformers, then MLX).
#
# Usage: scripts/get-smollm2-dirs.sh [--check] [--gguf FILE]
#   --check: compare greedy text (directory against GGUF) and show mlx_lm's (see
#            scripts/make_smollm2_dirs.py, which does the work).
# Needs torch, transformers, gguf, accelerate and mlx-lm (mlx[cpu] off macOS).
# Environment: PYTHON (default: the repo's .venv/bin/python if present, else python3).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$repo_root/.venv/bin/python" ]]; then PYTHON="$repo_root/.venv/bin/python"; else PYTHON=python3; fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PYTHONPATH="$repo_root/src${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" "$repo_root/scripts/make_smollm2_dirs.py" "$@"
