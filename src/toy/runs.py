"""Projects, run ids, run directories and the append-only event log.

A project is a directory holding `toy.toml` (made by `toy new`). A run lives in
`<runs dir>/<run_id>/` with `run.json`, `events.jsonl`, `checkpoints/`, `final/`.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import re
import socket
import tempfile
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toy.errors import InputError, UsageError

DEFAULT_RUN_ID_TEMPLATE = "{date}-{recipe}-{arch}-{n}"
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


@dataclass
class Project:
    """Where runs and data go. `root` is None outside a project (no toy.toml)."""

    root: Path | None
    run_id_template: str = DEFAULT_RUN_ID_TEMPLATE
    train_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def runs_dir(self) -> Path:
        return (self.root or Path.cwd()) / "runs"

    @property
    def data_dir(self) -> Path | None:
        return self.root / "data" if self.root else None


def find_project(start: Path | None = None) -> Project:
    """The nearest toy.toml at or above `start` (default: cwd), else no project."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        f = d / "toy.toml"
        if f.is_file():
            return load_project(f)
    return Project(root=None)


def load_project(path: Path) -> Project:
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise InputError(
            f"{path}: not valid TOML ({e}); fix the file or recreate it with `toy new`"
        )
    template = doc.get("run_id", DEFAULT_RUN_ID_TEMPLATE)
    if not isinstance(template, str):
        raise InputError(
            f"{path}: run_id must be a string template such as '{DEFAULT_RUN_ID_TEMPLATE}'"
        )
    train = doc.get("train", {})
    if not isinstance(train, dict):
        raise InputError(f"{path}: [train] must be a table of flag defaults")
    return Project(root=path.parent, run_id_template=template, train_defaults=train)


def plural(n: int, word: str, many: str | None = None) -> str:
    """`1 step`, `2 steps`, `1,024 tokens`; `many` for an irregular plural."""
    return f"{n:,} {word if n == 1 else (many or word + 's')}"


def check_run_id(run_id: str, flag: str = "--run-id") -> str:
    """A run id is a plain directory name: it can never escape the runs directory."""
    if not _RUN_ID_RE.match(run_id) or ".." in run_id:
        raise UsageError(
            f"{flag} {run_id!r} is not a plain name; use letters, digits, '.', '_', '-', '+' "
            "(no '/', no '..', at most 128 characters)"
        )
    return run_id


def make_run_id(template: str, runs_dir: Path, **fields: str) -> str:
    """Fill the template; `{n}` is the smallest positive integer not yet taken."""
    fields = {"date": _dt.date.today().strftime("%Y%m%d"), **fields}
    try:
        if "{n}" not in template:
            return check_run_id(template.format(n=0, **fields), "run_id template")
        for n in range(1, 100_000):
            rid = template.format(n=n, **fields)
            if not (runs_dir / rid).exists():
                return check_run_id(rid, "run_id template")
    except (KeyError, IndexError, ValueError) as e:
        raise UsageError(
            f"run_id template {template!r} is invalid ({e}); use the fields "
            "{date}, {recipe}, {arch}, {n}"
        )
    raise UsageError(f"no free run id for template {template!r} under {runs_dir}")


def create_run_dir(runs_dir: Path, run_id: str) -> Path:
    check_run_id(run_id)
    run_dir = runs_dir / run_id
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
        run_dir.mkdir()
    except FileExistsError:
        raise UsageError(
            f"run directory {run_dir} already exists; pick another --run-id or remove it"
        )
    except OSError as e:
        raise UsageError(
            f"cannot create run directory {run_dir}: {e.strerror}; choose a writable --out"
        )
    (run_dir / "checkpoints").mkdir()
    return run_dir


def write_file_atomic(path: Path, fill: Callable[[Path], None]) -> None:
    """The one way toy writes a file: `fill(tmp)` writes a temp file beside `path`; it is
    fsynced, given the usual permissions (0666 less the umask: mkstemp's 0600 would hide
    an exported model from other users), then renamed over `path`. A reader sees the old
    file or the whole new one, never half of one; a failure leaves no temp file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        fill(Path(tmp))
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def current_umask() -> int:
    """The process umask (read by setting it and back: there is no getter)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def json_safe(obj: Any) -> Any:
    """`obj` with every NaN or infinite float as None: JSON has no NaN, and a bare `NaN`
    (what json.dumps writes by default) breaks every strict reader (jq, JavaScript).
    A GRPO step whose completions no reward function scored has a NaN mean reward."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json_atomic(path: Path, obj: Any) -> None:
    """JSON (indented, sorted keys) through write_file_atomic."""
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    write_file_atomic(path, lambda tmp: tmp.write_text(text))


# glibc's allocator (see tune_malloc). Blocks of MMAP_THRESHOLD and up are mapped on their
# own; smaller ones come from the heap, which keeps up to TRIM_THRESHOLD of freed memory
# for the next step instead of handing it back to the OS and faulting it in again.
# --checkpointing, the low-memory mode, maps every block of 128 KiB and up on its own and
# trims at once (freed memory returns to the OS at once; each new block costs page
# faults: about a third slower steps on SmolLM2 LoRA, docs/performance.md).
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling; the loss's 16 MiB logit chunks stay below it
TRIM_THRESHOLD = 1 << 30
MMAP_THRESHOLD_LOW_MEMORY = 128 << 10


def tune_malloc(threshold: int = MMAP_THRESHOLD, trim: int = TRIM_THRESHOLD) -> bool:
    """Set glibc's allocator for training steps: blocks of `threshold` bytes and up are
    mapped and unmapped on their own; the heap keeps up to `trim` bytes of freed memory.

    A step allocates and frees the same transient tensors (activations, casts, logit
    chunks) each time. With glibc's own rules, or a trim threshold as low as the mmap
    threshold, freed memory goes back to the OS after each step and every page of it is
    faulted in (and zeroed) again in the next: 40-70 thousand page faults a step on the
    gpt2 bench, 14% of its time (docs/performance.md, "Page faults"). Kept in the heap it
    is reused; the peak RSS, set by what is live at once, stays the same. Setting the
    mmap threshold explicitly also turns off glibc's rule that raises it after each large
    free. Returns whether it applied (a libc other than glibc: no-op)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        ok = libc.mallopt(M_MMAP_THRESHOLD, int(threshold)) == 1
        libc.mallopt(M_TRIM_THRESHOLD, int(trim))
        return ok
    except (OSError, AttributeError):
        return False


class EventLog:
    """`events.jsonl`: one JSON object a line, flushed per line, append-only.

    Only rank 0 writes; other ranks get a log that drops everything (`enabled=False`).
    """

    def __init__(self, path: Path | None, enabled: bool = True):
        self.path = path
        self._fh = open(path, "a", buffering=1) if (path is not None and enabled) else None
        # Where else each record goes (--report-to: train/report.py), on the writing rank.
        self.sinks: list[Any] = []

    def emit(self, event: str, **fields: Any) -> dict:
        rec = {"event": event, "time": round(time.time(), 3), **fields}
        if self._fh is not None:
            self._fh.write(json.dumps(json_safe(rec), sort_keys=False, allow_nan=False) + "\n")
            self._fh.flush()
            for sink in self.sinks:
                sink.write(rec)
        return rec

    def aside(self, event: str, **fields: Any) -> None:
        """A record for the sinks only (--report-to), one whose contents have a file of
        their own in the run (GRPO's completions.jsonl): TensorBoard shows it as text."""
        if self._fh is not None:
            rec = {"event": event, **fields}
            for sink in self.sinks:
                sink.write(rec)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.is_file():
        raise InputError(f"{path} not found; is {run_dir} a toy run directory?")
    out = []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                # A killed run can leave a half-written last line; earlier lines are whole.
                continue
    return out


# A run's status, in the words `toy runs` and `toy list` both show. The closing events
# name theirs; a run started (or resumed) with none after it is "running" while the
# process its run.json names for that start (this_process) still lives on this host, else
# "unfinished": its process died without a word (SIGKILL, a power cut, the OOM killer), or
# runs on another machine, or the run was made before run.json named its process.
CLOSED = {"run_finished": "finished", "run_failed": "failed", "interrupted": "interrupted"}
UNFINISHED = "unfinished"
RUNNING = "running"


def this_process() -> dict[str, Any]:
    """This process as run.json records it for a start or resume (rank 0's): its pid and
    host, so that `toy runs` can tell a live run from a killed one."""
    return {"pid": os.getpid(), "host": socket.gethostname()}


def run_status(events: list[dict], info: dict | None = None) -> str:
    """finished, failed, interrupted (the last start's closing event), running (none yet,
    and the process of the latest segment in `info`, the run's run.json, still lives),
    unfinished (none yet otherwise), or "no events"."""
    status = UNFINISHED if events else "no events"
    for e in events:
        kind = e.get("event")
        if kind in ("run_started", "run_resumed"):
            status = UNFINISHED
        elif kind in CLOSED:
            status = CLOSED[kind]
    if status == UNFINISHED and isinstance(info, dict) and _latest_segment_lives(info):
        status = RUNNING
    return status


def dir_status(run_dir: Path) -> str:
    """run_status of a run directory, read from its events.jsonl and run.json (a missing
    or unreadable one read as empty)."""
    try:
        events = read_events(Path(run_dir))
    except InputError:
        events = []
    try:
        info = json.loads((Path(run_dir) / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        info = None
    return run_status(events, info)


def _latest_segment_lives(info: dict) -> bool:
    segments = info.get("segments")
    if not isinstance(segments, list) or not segments or not isinstance(segments[-1], dict):
        return False
    seg = segments[-1]
    pid, host, started = seg.get("pid"), seg.get("host"), seg.get("started")
    if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(host, str):
        return False  # a run made before run.json named its process
    if not isinstance(started, (int, float)) or isinstance(started, bool):
        started = None
    return process_lives(pid, host, started)


def process_lives(pid: int, host: str, started: float | None = None) -> bool:
    """Whether the process (pid, host) that began a run segment at `started` (epoch
    seconds, recorded after the process started) still runs. Only this host's processes
    can be seen: another host's is never said to live. A pid the system has since given
    to a later process is told apart by that process's start time (Linux's /proc): one
    that started after the segment did is not the run's. A zombie (killed, not yet
    reaped by its parent) does not live."""
    if os.name != "posix" or pid <= 0 or host != socket.gethostname():
        return False  # os.kill(pid, 0) would end the process on Windows
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    except (OSError, OverflowError):
        return False
    stat = _proc_stat(pid)
    if stat is None:
        return True  # no /proc (macOS), or it just ended: the pid alone says it lives
    state, began = stat
    if state in ("Z", "X"):
        return False
    # btime is whole seconds and the clock may have been stepped since: a little slack.
    return started is None or began is None or began <= started + 2.0


def _proc_stat(pid: int) -> tuple[str, float | None] | None:
    """(state letter, start time in epoch seconds or None) of a process, from
    /proc/PID/stat and /proc/stat's btime; None where /proc cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            text = fh.read().decode("ascii", "replace")
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after
    # the last ")". starttime is field 22, the 20th after comm, in clock ticks since boot.
    fields = text[text.rfind(")") + 1 :].split()
    if len(fields) < 20:
        return None
    began = None
    try:
        ticks = int(fields[19])
        with open("/proc/stat") as fh:
            btime = next(int(ln.split()[1]) for ln in fh if ln.startswith("btime "))
        began = btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        pass
    return fields[0], began


def fingerprint(path: Path, limit: int = 1 << 22, files: list[Path] | None = None) -> str:
    """sha256 of a file's size and first 4 MiB: cheap, and catches a swapped corpus on
    resume. A base's record is content_fingerprint (every byte); this is the form runs
    recorded of their base before (16 hex digits), still accepted where it matches
    (formats.hf_dir.same_base). A directory (a model directory): `files`
    (formats.hf_dir.read_files: the files the model is read from), each one's name, size
    and first 4 MiB. Without `files`, the form before that: every file's name and size, and
    the first 4 MiB of config.json and of each .safetensors file."""
    path = Path(path)
    if path.is_dir() and files is not None:
        h = hashlib.sha256(b"read files")
        for f in sorted(files):
            h.update(f"{f.relative_to(path)}:{f.stat().st_size};".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(limit))
        return h.hexdigest()[:16]
    if path.is_dir():
        h = hashlib.sha256(b"dir")
        for f in sorted(p for p in path.iterdir() if p.is_file()):
            h.update(f"{f.name}:{f.stat().st_size};".encode())
            if f.name == "config.json" or f.suffix == ".safetensors":
                with open(f, "rb") as fh:
                    h.update(fh.read(limit))
        return h.hexdigest()[:16]
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as fh:
        h.update(fh.read(limit))
    return h.hexdigest()[:16]


def file_key(path: Path, *extra) -> str:
    """A key for what toy keeps in its cache from a file (formats/packed_cache.py,
    formats/reply_image.py): its fingerprint, size, mtime and inode, and `extra` (the kept
    layout's version): a changed or replaced file finds nothing kept."""
    st = Path(path).stat()
    parts = [fingerprint(Path(path)), st.st_size, st.st_mtime_ns, st.st_ino, *extra]
    return hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:24]


def cache_dir() -> Path:
    """toy's cache folder: $TOY_CACHE, else $XDG_CACHE_HOME/toy, else ~/.cache/toy."""
    base = os.environ.get("TOY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "toy"
    )
    return Path(base)


def data_fingerprints(key: str, path: Path) -> dict[str, str | None]:
    """What a run records of a data file under job key `key` (corpus, data, val_data):
    `{key}_sha256`, the sha256 of every byte (content_fingerprint), cached as a base's
    digests are (digests.json in toy's cache folder: read once, then a resume costs a
    stat), so a file changed anywhere in place is refused on resume as a base is. Runs
    recorded before kept the first 4 MiB's beside it (train/run.py compares them on every
    byte's, `{key}_sha256_full`). A pipe (--data <(...)) has no bytes to read again: None."""
    path = Path(path)
    full = content_fingerprint(path, cache=cache_dir() / "digests.json") if path.is_file() else None
    return {f"{key}_sha256": full}


def file_sha256(path: Path) -> str:
    """sha256 of a small file's bytes (a reward function's code)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def content_fingerprint(
    path: Path, files: list[Path] | None = None, cache: Path | None = None
) -> str:
    """sha256 (64 hex digits) over every byte of a base: the file at `path`, or a model
    directory's `files` (each one's name relative to `path` and its file_digest). Nothing
    of where the base lies enters it, so a copy at another path has the same one."""
    path = Path(path)
    h = hashlib.sha256(b"every byte")
    for f in sorted(files) if files is not None else [path]:
        name = f.relative_to(path) if files is not None else ""
        h.update(f"{name}:{file_digest(f, cache)};".encode())
    return h.hexdigest()


# file_digest's cache is keyed by what names a file's bytes without reading them: (device,
# inode, size, mtime_ns, ctime_ns). Any write moves a file's ctime, which no user can set
# (`touch -r` puts back only the mtime), so a file changed in place misses and is hashed
# again; a copy is another inode, hashed once to the same digest; a chmod (and on some
# file systems a rename) moves the ctime too: one more hash, never a wrong answer. The
# oldest entries past DIGEST_CACHE_ENTRIES are dropped.
DIGEST_CACHE_ENTRIES = 256


def _digest_key(path: Path) -> str:
    st = os.stat(path)
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _read_digests(cache: Path | None) -> dict[str, str]:
    try:
        known = json.loads(cache.read_text()) if cache is not None else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}  # missing or damaged: the cache only ever saves time
    return known if isinstance(known, dict) else {}


def file_digest(path: Path, cache: Path | None = None) -> str:
    """sha256 (hex) of every byte of the file at `path`. `cache`: a JSON file of earlier
    digests (keyed as above), read first and written atomically after a miss; a multi-GB
    base is read once (~1 GB/s), then each resume costs a stat."""
    key = _digest_key(path)
    known = _read_digests(cache)
    if isinstance(known.get(key), str):
        return known[key]
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    # Not kept when the file changed while it was read: that digest is of neither version.
    if cache is not None and _digest_key(path) == key:
        known = _read_digests(cache)  # another process may have added some meanwhile
        known.pop(key, None)
        known[key] = digest
        text = json.dumps(dict(list(known.items())[-DIGEST_CACHE_ENTRIES:]))  # oldest first
        try:
            write_file_atomic(cache, lambda tmp: tmp.write_text(text))
        except OSError:
            pass
    return digest
