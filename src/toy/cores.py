"""Which of this process's cores other programs keep busy (Linux's /proc/stat): what toy's
default thread count follows (train/device.py: Threads); and the CPU's flags
(/proc/cpuinfo). Torch-free, so that the first look is taken as a command starts, before
torch loads, and a process that never needs torch (a bench's llama.cpp peer) can ask."""

from __future__ import annotations

import os
from pathlib import Path


def cpuinfo_flags() -> set[str]:
    """The words of /proc/cpuinfo (its flags among them); empty where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return set()
    return set(text.split())


def cpu_has_amx() -> bool:
    """Intel AMX tiles (Sapphire Rapids and later: 'amx_tile' in /proc/cpuinfo). llama.cpp
    built on such a CPU moves Q4_0/Q4_1/Q8_0 weights into its repacked (AMX) buffers, and a
    prompt of more than a few tokens then crashes with SIGSEGV (llama.cpp #20824, open):
    what toy says where it sends a user to llama.cpp (train/device.py AMX_LLAMACPP_NOTE)."""
    return bool({"amx_tile", "amx_bf16"} & cpuinfo_flags())


def physical_cores() -> int:
    """This process's cores, each physical core once (its hyperthreads not counted): the
    thread count torch starts with, for a process that runs without torch (a reply in C,
    models/reply_c.py). From Linux's /sys topology; elsewhere the CPUs it may run on."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    seen = set()
    for c in cpus:
        top = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            seen.add(((top / "physical_package_id").read_text(), (top / "core_id").read_text()))
        except OSError:
            return len(cpus) or os.cpu_count() or 1
    return len(seen) or os.cpu_count() or 1


class Cores:
    """How many of this process's cores other programs keep busy, from /proc/stat (Linux),
    measured between two looks: every core's busy time over the interval, less this
    process's own CPU time (its threads spinning or computing), in cores' worth.

    Why toy watches: with one of two cores taken by another process, torch's threads (each
    parallel region waiting for the thread whose core is shared) collapsed a LoRA step on
    SmolLM2 to 0.26x its quiet speed and a packed reply to 0.31-0.40x, where one thread
    kept 0.6x and 0.8x (a 2-core Zen 4, docs/performance.md, "A busy machine"). OpenMP's
    sleeping waits (OMP_WAIT_POLICY=PASSIVE) saved the LoRA step but cost a packed reply
    81% and a GRPO step 28% on a quiet machine: fewer threads is the remedy that costs
    nothing when the machine is quiet. Elsewhere (no /proc/stat) it sees nothing."""

    def __init__(self):
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.last = self._look()

    def _look(self) -> tuple[float, float, float] | None:
        """(busy jiffies of our cores, all jiffies of our cores, our own jiffies) now."""
        try:
            with open("/proc/stat") as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        busy = total = 0.0
        want = {f"cpu{c}" for c in self.cpus}
        for line in lines:
            parts = line.split()
            if parts and parts[0] in want:
                vals = [float(v) for v in parts[1:]]
                idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)  # idle + iowait
                total += sum(vals[:8])  # guest time is counted in user already
                busy += sum(vals[:8]) - idle
        t = os.times()
        # Ours: this process's threads and the children it has waited for (the C++ compiler
        # inductor runs for a step's first build, models/decode.py): a GRPO run that built
        # its steps took its compilers for another program's load and sampled on at one
        # thread (130-158 ms a 32-row SmolLM2 decode step against 89-103, a Zen 4).
        mine = t.user + t.system + t.children_user + t.children_system
        return busy, total, mine * os.sysconf("SC_CLK_TCK")

    def others(self) -> float | None:
        """Cores' worth of other programs' work since the last look (None: nothing known
        yet, or no /proc/stat), and a new look taken."""
        now, last = self._look(), self.last
        self.last = now
        if now is None or last is None or not self.cpus:
            return None
        span = (now[1] - last[1]) / len(self.cpus)  # jiffies each core had
        if span < 5:  # under ~50 ms: too few ticks to tell
            self.last = last
            return None
        return max(0.0, (now[0] - last[0]) - (now[2] - last[2])) / span

    def free(self, most: int) -> int | None:
        """Threads for the cores other programs leave free (a core counts as taken from a
        third of its time on), between 1 and `most`; None when nothing is known."""
        others = self.others()
        if others is None:
            return None
        return max(1, min(most, len(self.cpus) - int(others + 0.67)))


watching: Cores | None = None


def watch() -> None:
    """The first look at the cores, taken as a command starts (cli/main.py), so that the
    thread count chosen when work begins (train/device.py: apply_threads) measures the
    second or so since (torch loading), at no wait of its own."""
    global watching
    watching = Cores()
