"""runs.tune_malloc (issue 46 item 2): a training step allocates and frees the same
transient tensors each time; with toy's setting the memory one step freed serves the next
without new page faults, where the low-memory setting (--checkpointing) hands it back and
faults it in again. Counted in a fresh process (page faults, not time)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = r"""
import json, resource, sys
import torch
from toy.runs import tune_malloc, MMAP_THRESHOLD_LOW_MEMORY
low = sys.argv[1] == "low"
ok = tune_malloc(MMAP_THRESHOLD_LOW_MEMORY, MMAP_THRESHOLD_LOW_MEMORY) if low else tune_malloc()
def step():  # a step's transients: 20 MiB of activations in blocks under the mmap threshold
    ts = [torch.ones(1 << 20) for _ in range(5)]  # 4 MiB each, touched
    del ts
for _ in range(4):  # glibc settles within three steps (the first ones may still map pages)
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step()
after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(json.dumps({"applied": ok, "faults": after - before}))
"""


def faults(mode: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_step_reuses_the_memory_the_step_before_freed():
    default, low = faults("default"), faults("low")
    if not (default["applied"] and low["applied"]):
        pytest.skip("not glibc: tune_malloc is a no-op")
    pages = 4 * (20 << 20) // 4096  # four steps of 20 MiB in 4 KiB pages
    assert default["faults"] < pages // 10, default  # reused, not faulted in again
    assert low["faults"] > pages // 2, low  # the low-memory mode gives it back each time
