"""Checkpoints are ordered by their step number, not by their names as text: past step
999999 the directory names grow a digit ("step-1000000" sorts before "step-999999")."""

import json

from toy.formats.checkpoint import list_checkpoints, prune_checkpoints


def _ckpt(root, step):
    d = root / f"step-{step:06d}"
    d.mkdir(parents=True)
    (d / "state.json").write_text(json.dumps({"step": step}))
    return d


def test_listing_sorts_by_step_number(tmp_path):
    for s in (1000000, 999999, 998):
        _ckpt(tmp_path, s)
    assert [d.name for d in list_checkpoints(tmp_path)] == [
        "step-000998",
        "step-999999",
        "step-1000000",
    ]


def test_pruning_keeps_the_newest(tmp_path):
    for s in (999998, 999999, 1000000):
        _ckpt(tmp_path, s)
    prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(d.name for d in tmp_path.iterdir()) == ["step-1000000", "step-999999"]


def test_odd_names_are_not_checkpoints(tmp_path):
    _ckpt(tmp_path, 5)
    (tmp_path / "step-abc").mkdir()
    (tmp_path / "step-abc" / "state.json").write_text("{}")
    assert [d.name for d in list_checkpoints(tmp_path)] == ["step-000005"]
