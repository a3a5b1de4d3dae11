import os
import sys
from pathlib import Path

import pytest
import torch

# Nothing is ever fetched from a model hub: transformers/peft run offline in tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]

# Under pytest-xdist (`make test` runs two workers on a 2-core machine) each worker and the
# processes it starts use one thread: two workers of two threads each would oversubscribe
# the cores and every step would crawl. Set before torch sizes its thread pool.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _toy_cache(tmp_path_factory):
    # Tests never touch the user's cache: the bundled corpus is tokenized once per session.
    if "TOY_CACHE" not in os.environ:
        os.environ["TOY_CACHE"] = str(tmp_path_factory.mktemp("toy-cache"))
    yield


@pytest.fixture
def toy_cli(capsys):
    """Run the CLI in-process: returns (exit code, stdout, stderr)."""
    from toy.cli.main import main

    def run(*argv):
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def run_toy(*argv, cwd=None, timeout=600, env=None):
    """Run the real `python -m toy` in a subprocess."""
    import subprocess

    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "toy", *map(str, argv)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
    )


def assert_every_parameter_learns(model) -> None:
    """After a backward pass: every parameter has a finite, non-zero gradient."""
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
