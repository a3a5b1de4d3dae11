import os

import pytest
import torch
from helpers.common import run_toy

# Nothing is ever fetched from a model hub: transformers/peft run offline in tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

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


# The modules of the longest single tests (minutes each on 2 cores; tests/walks/), started
# first. Named by basename: they are unique across tests/ (area folders, no __init__.py).
LONGEST = ("test_newcomer.py", "test_preference_walk.py", "test_real_dirs.py")


def pytest_collection_modifyitems(config, items):
    """The longest tests first, then the other modules holding slow (real-model) tests, each
    module's tests kept together and in order: under `make test`'s two workers a long test
    begun last would leave one worker idle at the end while the other finishes it."""
    slow = {i.nodeid.split("::")[0] for i in items if i.get_closest_marker("slow")}

    def rank(item) -> tuple[int, int]:
        module = item.nodeid.split("::")[0]
        name = module.rsplit("/", 1)[-1]
        first = LONGEST.index(name) if name in LONGEST else len(LONGEST)
        return (0 if module in slow else 1, first)

    items.sort(key=rank)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """One bundled play, prepped by the real CLI with a 300-token BPE: the smallest real
    corpus a `toy train --preset tiny` run can take."""
    from toy.data.prep import bundled_text_paths

    d = tmp_path_factory.mktemp("small-corpus")
    r = run_toy("prep", bundled_text_paths()[0], "--out", d / "c.bin", "--vocab-size", "300")
    assert r.returncode == 0, r.stderr
    return d / "c.bin"
