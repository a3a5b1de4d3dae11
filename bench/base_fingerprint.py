"""What a run's base fingerprint costs (formats.hf_dir.base_fingerprint: a sha256 of every
byte of a GGUF file or of a model directory's read files, each file's digest cached in
toy's cache folder by device, inode, size, mtime and ctime): a run's start hashes the base
once ("cold"), a resume or `toy infer --run` of the same file finds it cached ("warm").

    python bench/base_fingerprint.py BASE [--repeats 3] [--evict]

BASE: a GGUF file or a model directory (bench/make_big_llama.py writes the 1B test model).
Rows: cold with the file's pages evicted from the OS page cache first (--evict:
posix_fadvise DONTNEED on each file, this process's files only: a read from disk), cold
from the page cache, warm; the 4 MiB fingerprint runs recorded before, for scale; sha256
and blake2b throughput on 256 MiB in memory (sha256 wins on CPUs with SHA extensions,
blake2b on those without). The digest cache is a temporary folder (TOY_CACHE), never the
user's. Prints one line a figure, then one JSON line with them all and the CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sha_extensions() -> bool | None:
    """Whether the CPU hashes sha256 in hardware (x86 sha_ni, arm sha2); None: unknown."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return None
    return "sha_ni" in flags or "sha2" in flags


def evict(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def hash_rate(name: str, mib: int = 256) -> float:
    """GB/s of hashlib's `name` over `mib` MiB already in memory, in 8 MiB updates."""
    buf = memoryview(os.urandom(1 << 20) * mib)
    t = time.perf_counter()
    h = hashlib.new(name)
    for i in range(0, len(buf), 8 << 20):
        h.update(buf[i : i + (8 << 20)])
    return len(buf) / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base", type=Path, help="a GGUF file or a model directory")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--evict", action="store_true", help="a cold row read from disk too")
    a = ap.parse_args()
    os.environ["TOY_CACHE"] = tempfile.mkdtemp(prefix="toy-bench-fingerprint-")
    from toy.formats.hf_dir import base_fingerprint, read_files
    from toy.runs import fingerprint
    from toy.train.device import cpu_kind

    files = read_files(a.base) if a.base.is_dir() else [a.base]
    size = sum(f.stat().st_size for f in files)
    cache = Path(os.environ["TOY_CACHE"]) / "digests.json"

    def timed(before=None) -> float:
        if before:
            before()
        t = time.perf_counter()
        base_fingerprint(a.base)
        return time.perf_counter() - t

    def empty() -> None:
        cache.unlink(missing_ok=True)

    rows: dict[str, float] = {}
    if a.evict:
        rows["cold_disk_s"] = statistics.median(
            timed(lambda: (empty(), evict(files))) for _ in range(a.repeats)
        )
    rows["cold_page_cache_s"] = statistics.median(timed(empty) for _ in range(a.repeats))
    timed()  # cached now
    rows["warm_s"] = statistics.median(timed() for _ in range(a.repeats))
    t = time.perf_counter()
    fingerprint(a.base, files=files if a.base.is_dir() else None)
    rows["first_4mib_s"] = time.perf_counter() - t
    out = {
        "base": str(a.base),
        "bytes": size,
        "files": len(files),
        "cpu": cpu_model(),
        "cpu_kind": cpu_kind(),
        "sha_extensions": sha_extensions(),
        "cpus": os.cpu_count(),
        **rows,
        "cold_gb_per_s": size / rows["cold_page_cache_s"] / 1e9,
        "sha256_gb_per_s": hash_rate("sha256"),
        "blake2b_gb_per_s": hash_rate("blake2b"),
    }
    print(
        f"{a.base}: {size / 1e6:,.0f} MB in {len(files)} file(s); {out['cpu']} ({out['cpu_kind']})"
    )
    for k, v in rows.items():
        print(f"  {k:<20} {v * 1e3:12.3f} ms")
    print(f"  sha256 {out['sha256_gb_per_s']:.2f} GB/s, blake2b {out['blake2b_gb_per_s']:.2f} GB/s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
