"""The memory a new allocation can have on this machine: what `toy infer --base-dtype auto`
and the adapter recipes' auto base dtype weigh a copy of the weights against."""

from __future__ import annotations

import os
from pathlib import Path

# Where the memory limits of a container are read (module constants, so a test can point
# them elsewhere).
CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
MEMINFO = Path("/proc/meminfo")
NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as the largest page count (9223372036854771712)


def available_memory(
    cgroup_root: Path | None = None, self_cgroup: Path | None = None, meminfo: Path | None = None
) -> int | None:
    """Bytes of memory available to a new allocation: the smaller of the machine's
    (Linux: MemAvailable, else its physical memory) and what this process's cgroup memory
    limit still allows (`cgroup_headroom`: inside a 4 GB container, at most 4 GB less
    what is in use). None when none of them can be read."""
    machine = None
    try:
        with open(meminfo or MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    machine = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if machine is None:
        try:
            machine = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    limit = cgroup_headroom(cgroup_root or CGROUP_ROOT, self_cgroup or SELF_CGROUP)
    if limit is None or machine is None:
        return machine if limit is None else limit
    return min(machine, limit)


def cgroup_headroom(root: Path, self_cgroup: Path) -> int | None:
    """Bytes this process's cgroup memory limits still allow: limit minus usage, the
    smallest over its cgroup and every ancestor that sets a limit (a container's limit is
    often set one level up). cgroup v2: ROOT/PATH/memory.max ("max": no limit) and
    memory.current; v1: ROOT/memory/PATH/memory.limit_in_bytes and memory.usage_in_bytes.
    PATH comes from /proc/self/cgroup (`self_cgroup`); a level whose files are missing or
    unreadable is skipped. None when no level sets a limit."""
    paths = {"v2": "/", "v1": "/"}
    try:
        lines = self_cgroup.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[0] == "0" and parts[1] == "":
            paths["v2"] = parts[2]
        elif len(parts) == 3 and "memory" in parts[1].split(","):
            paths["v1"] = parts[2]
    best = None
    for base, rel, limit_file, usage_file in (
        (root, paths["v2"], "memory.max", "memory.current"),
        (root / "memory", paths["v1"], "memory.limit_in_bytes", "memory.usage_in_bytes"),
    ):
        names = [n for n in rel.split("/") if n and n not in (".", "..")]
        for i in range(len(names), -1, -1):  # the process's own cgroup, then each ancestor
            d = base.joinpath(*names[:i])
            h = _headroom(d / limit_file, d / usage_file)
            if h is not None:
                best = h if best is None else min(best, h)
    return best


def _headroom(limit_file: Path, usage_file: Path) -> int | None:
    try:
        limit_text = limit_file.read_text().strip()
        usage = int(usage_file.read_text().strip())
        limit = None if limit_text == "max" else int(limit_text)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if limit is None or limit >= NO_LIMIT:
        return None
    return max(0, limit - usage)
