import os

import pytest
import torch

# Nothing is ever fetched from a model hub: transformers/peft run offline in tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# `toy infer`'s auto starts no background build of compiled steps from a test (one test
# checks the start itself, with this unset).
os.environ.setdefault("TOY_BACKGROUND_BUILDS", "0")

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


@pytest.fixture
def toy_run(capsys):
    """The CLI in-process, answered as run_toy's subprocess result (.returncode, .stdout,
    .stderr): for runs whose process itself is not under test (no signal, exit through the
    real process, environment, or count of stderr lines a user would see), without the
    2-3 s of a fresh interpreter importing torch. Takes no env or cwd: use run_toy there."""
    import subprocess

    from toy.cli.main import main

    def run(*argv, timeout=None):  # timeout: run_toy's, unused here
        capsys.readouterr()  # what the test printed before is not this run's output
        argv = [str(a) for a in argv]
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's refusals leave through the process's exit code
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        out, err = capsys.readouterr()
        # as run_toy's pipes read them (text=True: universal newlines, "\r" read as "\n")
        out, err = (t.replace("\r\n", "\n").replace("\r", "\n") for t in (out, err))
        return subprocess.CompletedProcess(argv, code, out, err)

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
    from toy.cli.main import main
    from toy.data.prep import bundled_text_paths

    d = tmp_path_factory.mktemp("small-corpus")
    argv = ["prep", bundled_text_paths()[0], "--out", d / "c.bin", "--vocab-size", "300"]
    assert main([str(a) for a in argv]) == 0  # in this process: no interpreter to start
    return d / "c.bin"
