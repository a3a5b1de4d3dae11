#!/usr/bin/env bash
# Fetch llama.cpp's HF -> GGUF converter (convert_hf_to_gguf.py + conversion/ + gguf-py/)
# and print the directory that holds it.
#
# Usage: scripts/get-llama-converter.sh [DEST]
#   DEST, if given, gets a link `DEST/llama-converter` to the cached copy; the printed
#   path is then that link. Without DEST the cache directory itself is printed.
#
# The converter comes from PyPI: llama-cpp-python's sdist vendors llama.cpp, so this
# needs only `pip download`. The version is pinned (and the sdist's sha256 checked) so
# tests always convert with the same code. Cached once in
# ${XDG_CACHE_HOME:-$HOME/.cache}/toy/llama-converter/<version>/; a second run only checks
# the cache.
#
# Run it as a subprocess with its own gguf-py first on PYTHONPATH (it inserts gguf-py
# into sys.path itself, too), so the gguf package installed for toy is not the one used:
#   PYTHONPATH=<dir>/gguf-py python <dir>/convert_hf_to_gguf.py MODEL_DIR --outtype f32 --outfile X.gguf
# It imports torch, numpy, sentencepiece, transformers (and protobuf for some tokenizers).
# Environment: PYTHON (default: the repo's .venv/bin/python if present, else python3).
set -euo pipefail

VERSION="0.3.36"
SDIST_SPEC="llama-cpp-python==$VERSION"
SDIST="llama_cpp_python-$VERSION.tar.gz"
SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
PREFIX="llama_cpp_python-$VERSION/vendor/llama.cpp"

dest_root="${1:-}"
cache_dir="${XDG_CACHE_HOME:-$HOME/.cache}/toy/llama-converter"
cached="$cache_dir/$VERSION"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$repo_root/.venv/bin/python" ]]; then PYTHON="$repo_root/.venv/bin/python"; else PYTHON=python3; fi
fi

# The marker is written last, so a cache without it is half an extraction.
if [[ ! -f "$cached/.complete" ]]; then
    mkdir -p "$cache_dir"
    tmp="$(mktemp -d "$cache_dir/.fetch.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    echo "downloading $SDIST_SPEC (sdist, ~77 MB) from PyPI ..." >&2
    if ! "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
            "$SDIST_SPEC" -d "$tmp" >&2; then
        echo "error: could not download $SDIST_SPEC with '$PYTHON -m pip' (no network or no pip?)" >&2
        exit 1
    fi
    if [[ ! -f "$tmp/$SDIST" ]]; then
        echo "error: pip download of $SDIST_SPEC produced no $SDIST in $tmp" >&2
        exit 1
    fi
    # Python's tarfile: no dependence on GNU tar's wildcard flags; the sdist's sha256 is
    # checked first, and only the converter's files are extracted (with the 'data' filter).
    "$PYTHON" - "$tmp/$SDIST" "$SHA256" "$PREFIX" "$tmp/out" <<'PY'
import hashlib, sys, tarfile
sdist, want, prefix, out = sys.argv[1:5]
h = hashlib.sha256()
with open(sdist, "rb") as f:
    while chunk := f.read(1 << 20):
        h.update(chunk)
if h.hexdigest() != want:
    sys.exit(f"error: {sdist} has sha256 {h.hexdigest()}, expected {want}")
keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/", "gguf-py/LICENSE", "LICENSE")
with tarfile.open(sdist) as t:
    members = []
    for m in t.getmembers():
        if not m.name.startswith(prefix + "/"):
            continue
        rel = m.name[len(prefix) + 1:]
        if ".." in rel.split("/") or rel.startswith("/"):
            continue
        if (m.isfile() or m.isdir()) and any(rel == k or (k.endswith("/") and rel.startswith(k)) for k in keep):
            m.name = rel
            members.append(m)
    if not any(m.name == "convert_hf_to_gguf.py" for m in members):
        sys.exit(f"error: {sdist} has no {prefix}/convert_hf_to_gguf.py")
    try:
        t.extractall(out, members=members, filter="data")
    except TypeError:  # Python < 3.11.4 has no extraction filters; members are checked above
        t.extractall(out, members=members)
PY
    touch "$tmp/out/.complete"
    if [[ ! -f "$cached/.complete" ]]; then  # another run may have finished first: keep its copy
        rm -rf "$cached"
        mv "$tmp/out" "$cached"  # same filesystem: a cache hit is never half an extraction
    fi
fi

if [[ -z "$dest_root" ]]; then
    echo "$cached"
    exit 0
fi
mkdir -p "$dest_root"
target="$dest_root/llama-converter"
abs_cached="$(cd "$cached" && pwd)"
if [[ ! ( -L "$target" && "$(readlink "$target")" == "$abs_cached" ) ]]; then
    rm -rf "$target"
    ln -s "$abs_cached" "$target" 2>/dev/null || cp -R "$abs_cached" "$target"
fi
echo "$(cd "$dest_root" && pwd)/llama-converter"
