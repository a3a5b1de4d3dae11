"""Runs across processes: `torchrun` for toy's CLI and `close` for its processes."""

from __future__ import annotations

import os
import subprocess
import sys


def torchrun(*argv, nproc=2, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOY_DIST_TIMEOUT": "240"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--standalone",
            "-m",
            "toy",
            *map(str, argv),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def close(a, b, rel=1e-5, abs_=0.0):
    """Each pair within `rel` of the second, plus `abs_` for figures near zero (where a
    relative bound alone asks more than float32's rounding of the terms can give)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert abs(x - y) <= rel * abs(y) + abs_, (a, b)
