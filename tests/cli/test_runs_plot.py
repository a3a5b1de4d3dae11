"""End to end: prep with a donor's tokenizer -> warm-start training -> infer -> `toy runs`
lists it -> `toy plot` draws it. Then `toy runs` statuses on hand-made event logs, and
the plot command's bad inputs (matplotlib missing included)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers.donor import TINY, make_donor  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two finished runs on the donor's tokenizer: --init donor (through a lens) and scratch."""
    from toy.cli.main import main

    d = tmp_path_factory.mktemp("e2e")
    donor = make_donor(d)
    out = d / "runs"
    common = [
        "train",
        "--recipe",
        "warm-start",
        "--donor",
        str(donor["gguf"]),
        "--corpus",
        str(donor["corpus"]),
        "--out",
        str(out),
        *TINY,
        "--d-model",
        "32",
        "--n-head",
        "4",
        "--n-kv-head",
        "2",
        "--steps",
        "6",
        "--eval-every",
        "3",
        "--lr",
        "1e-2",
    ]
    assert main([*common, "--init", "donor", "--run-id", "ws-donor"]) == 0
    assert main([*common, "--init", "scratch", "--run-id", "ws-scratch"]) == 0
    return {"dir": out, "donor": donor}


def test_warm_start_run_infers(runs, toy_cli):
    run = runs["dir"] / "ws-donor"
    assert (run / "final" / "model.safetensors").is_file() and (
        run / "final" / "tokenizer.json"
    ).is_file()
    code, out, err = toy_cli(
        "infer", "--run", run, "--prompt", "HAMLET.", "--max-new-tokens", "8", "--temperature", "0"
    )
    assert code == 0, err
    assert out.startswith("HAMLET.") and len(out) > len("HAMLET.\n")


def test_runs_json_lists_the_runs(runs, toy_cli, capsys):
    code, out, err = toy_cli("runs", runs["dir"], "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["format"] == "toy/runs-v1"
    by_id = {x["id"]: x for x in r["runs"]}
    assert set(by_id) == {"ws-donor", "ws-scratch"}
    w = by_id["ws-donor"]
    assert (w["recipe"], w["arch"], w["init"], w["status"]) == (
        "warm-start",
        "llama",
        "donor",
        "finished",
    )
    assert by_id["ws-scratch"]["init"] == "scratch"
    assert w["steps"] == w["target_steps"] == 6
    events = [
        json.loads(x) for x in (runs["dir"] / "ws-donor" / "events.jsonl").read_text().splitlines()
    ]
    assert w["loss"] == [e for e in events if e["event"] == "step"][-1]["loss"]
    assert w["val_loss"] == [e for e in events if e["event"] == "eval"][-1]["val_loss"]
    assert w["tokens_per_s"] > 0 and w["wall_s"] > 0
    # One run directory works as DIR too.
    code, out, _ = toy_cli("runs", runs["dir"] / "ws-donor", "--json")
    assert [x["id"] for x in json.loads(out)["runs"]] == ["ws-donor"]


def test_runs_plain_table(runs, toy_cli):
    code, out, err = toy_cli("runs", runs["dir"])
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["id", "recipe", "arch", "init"] and "status" in lines[0]
    row = next(line for line in lines if line.startswith("ws-donor"))
    assert "warm-start" in row and "donor" in row and row.rstrip().endswith("finished")


def test_plot_writes_a_png(runs, toy_cli, tmp_path):
    png = tmp_path / "loss.png"
    code, out, err = toy_cli(
        "plot",
        runs["dir"] / "ws-donor",
        runs["dir"] / "ws-scratch",
        "--out",
        png,
        "--title",
        "warm start",
    )
    assert code == 0, err
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    from PIL import Image

    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] >= 600 and im.size[1] >= 400
    assert not list(tmp_path.glob(".loss.png.tmp*"))


def test_plot_without_matplotlib_says_how_to_install(runs, toy_cli, tmp_path, monkeypatch):
    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(
        sys.modules, "matplotlib", None
    )  # `import matplotlib` now raises ImportError
    code, _, err = toy_cli("plot", runs["dir"] / "ws-donor", "--out", tmp_path / "x.png")
    assert code == 2 and "pip install 'toy[plot]'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["plot", "no/such/run"], "no/such/run"),
        (["plot", "RUN", "--out", "missing-dir/x.png"], "missing-dir"),
        (["plot", "RUN", "--out", "x.bogus"], "unknown image type"),
        (["runs", "no/such/dir"], "no/such/dir"),
    ],
    ids=["missing-run", "out-dir", "out-type", "runs-dir"],
)
def test_bad_inputs_exit_2(runs, toy_cli, tmp_path, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    argv = [str(runs["dir"] / "ws-donor") if a == "RUN" else a for a in argv]
    code, _, err = toy_cli(*argv)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


# ---------------------------------------------------------------- statuses from event logs


def _fake_run(root: Path, rid: str, events: list[dict], recipe: str = "from-scratch") -> None:
    d = root / rid
    d.mkdir(parents=True)
    (d / "run.json").write_text(
        json.dumps(
            {
                "run_id": rid,
                "recipe": recipe,
                "arch": "llama",
                "train": {"steps": 4},
                "job": {},
                "started": f"2025-01-01T00:00:0{len(list(root.iterdir()))}",
            }
        )
    )
    lines = [json.dumps({"time": 100.0 + i, **e}) for i, e in enumerate(events)]
    (d / "events.jsonl").write_text("\n".join(lines) + "\n")


def test_runs_statuses(toy_cli, tmp_path):
    start = {"event": "run_started", "steps": 4}
    step = lambda s, loss: {"event": "step", "step": s, "loss": loss, "tokens_per_s": 1000.0}  # noqa: E731
    _fake_run(
        tmp_path,
        "done",
        [
            start,
            step(1, 3.0),
            {"event": "eval", "step": 4, "val_loss": 2.5},
            {"event": "run_finished", "step": 4, "wall_s": 12.5, "tokens_per_s": 900.0},
        ],
    )
    _fake_run(
        tmp_path,
        "boom",
        [start, step(1, 3.0), {"event": "run_failed", "step": 1, "error": "loss became nan"}],
    )
    _fake_run(
        tmp_path,
        "cut",
        [
            start,
            step(1, 3.0),
            {"event": "checkpoint", "step": 1},
            {"event": "interrupted", "step": 1, "signal": "SIGINT"},
        ],
    )
    _fake_run(tmp_path, "live", [start, step(1, 3.0), step(2, 2.9)])
    _fake_run(
        tmp_path,
        "again",
        [
            start,
            step(1, 3.0),
            {"event": "interrupted", "step": 1},
            {"event": "run_resumed", "from_step": 1, "steps": 6},
            step(2, 2.8),
        ],
    )
    (tmp_path / "not-a-run").mkdir()
    code, out, err = toy_cli("runs", tmp_path, "--json")
    assert code == 0, err
    by_id = {r["id"]: r for r in json.loads(out)["runs"]}
    assert set(by_id) == {"done", "boom", "cut", "live", "again"}
    assert {k: r["status"] for k, r in by_id.items()} == {
        "done": "finished",
        "boom": "failed",
        "cut": "interrupted",
        "live": "unfinished",
        "again": "unfinished",
    }
    assert by_id["done"]["wall_s"] == 12.5 and by_id["done"]["tokens_per_s"] == 900.0
    assert by_id["done"]["val_loss"] == 2.5 and by_id["done"]["init"] is None
    assert (
        by_id["live"]["steps"] == 2
        and by_id["live"]["loss"] == 2.9
        and by_id["live"]["wall_s"] == 2.0
    )
    assert by_id["again"]["target_steps"] == 6
    # Two segments (100..102 and 103..104): their sum, not the span with the pause between.
    assert by_id["again"]["wall_s"] == 3.0 and by_id["again"]["segments"] == 2
    code, out, _ = toy_cli("runs", tmp_path)
    assert "2/6" in next(line for line in out.splitlines() if line.startswith("again"))


def test_resumed_run_wall_time_sums_the_segments(toy_cli, tmp_path):
    """`toy runs` showed only the last segment's wall_s for a resumed run. Each finished
    segment counts its run_finished wall_s; one cut short counts its first to last event."""
    step = lambda s: {"event": "step", "step": s, "loss": 3.0, "tokens_per_s": 1000.0}  # noqa: E731
    _fake_run(
        tmp_path,
        "resumed",
        [
            {"event": "run_started", "steps": 4},
            step(1),
            step(2),
            {"event": "run_finished", "step": 2, "wall_s": 1.5},
            {"event": "run_resumed", "from_step": 2, "steps": 6},
            step(3),
            {"event": "interrupted", "step": 3},
            {"event": "run_resumed", "from_step": 3, "steps": 6},
            step(4),
            {"event": "run_finished", "step": 6, "wall_s": 10.25},
        ],
    )
    code, out, err = toy_cli("runs", tmp_path, "--json")
    assert code == 0, err
    r = json.loads(out)["runs"][0]
    # 1.5 (finished) + 2.0 (times 104..106, interrupted) + 10.25 (finished)
    assert r["wall_s"] == 13.75 and r["segments"] == 3 and r["status"] == "finished"
    code, out, _ = toy_cli("runs", tmp_path)
    assert "13.8s" in out.splitlines()[1]


def test_runs_empty_dir(toy_cli, tmp_path):
    code, out, _ = toy_cli("runs", tmp_path)
    assert code == 0 and "no runs under" in out
