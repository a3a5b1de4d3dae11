"""`toy train --recipe lora --output PATH` writes only into a new path or a directory of
toy's own adapter files (issue 23 item 1: it ran `shutil.rmtree(PATH)` first, so
`--output .` deleted the project). Anything else exits 2 before training, naming PATH."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.gguf_fixtures import tiny_model, write_llama_gguf  # noqa: E402

from toy.data.dialogue import conversations, write_jsonl  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402
from toy.tokenizer import train_bpe  # noqa: E402

FAST = [
    "--seq-len",
    "128",
    "--batch-size",
    "2",
    "--steps",
    "1",
    "--warmup",
    "0",
    "--eval-batches",
    "1",
]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("output-policy")
    text = bundled_text_paths()[0].read_text()[:20000]
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    model = tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True), max_seq_len=256)
    gguf = write_llama_gguf(d / "base.gguf", model, tok)
    chat = write_jsonl(
        conversations(bundled_text_paths(), 12, seed=1, turns=(1, 1), max_chars=100),
        d / "chat.jsonl",
    )
    return {"gguf": gguf, "chat": chat}


def train(toy_cli, base, runs: Path, output, *extra):
    return toy_cli(
        "train",
        "--recipe",
        "lora",
        "--model",
        base["gguf"],
        "--data",
        base["chat"],
        "--out",
        runs,
        "--output",
        output,
        *FAST,
        *extra,
    )


def test_output_holding_other_files_is_refused_before_training(base, toy_cli, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("important\n")
    runs = tmp_path / "runs"
    code, out, err = train(toy_cli, base, runs, victim)
    assert code == 2
    assert (victim / "notes.txt").read_text() == "important\n"
    assert f"--output {victim}" in err and "notes.txt" in err and "Traceback" not in err
    assert not runs.exists() or not any(runs.iterdir())  # refused before the run directory exists


def test_output_dot_or_a_parent_of_the_working_directory_is_refused(
    base, toy_cli, tmp_path, monkeypatch
):
    project = tmp_path / "project"
    (project / "sub").mkdir(parents=True)
    (project / "toy.toml").write_text("")
    monkeypatch.chdir(project / "sub")
    for output in (".", ".."):
        code, _, err = train(toy_cli, base, tmp_path / "runs", output)
        assert code == 2 and f"--output {output}" in err, err
    assert (project / "toy.toml").is_file() and (project / "sub").is_dir()
    # An empty working directory is no better a target: it would be replaced under the shell.
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    code, _, err = train(toy_cli, base, tmp_path / "runs", ".")
    assert code == 2 and "--output ." in err and empty.is_dir()


def test_output_that_is_a_file_is_refused(base, toy_cli, tmp_path):
    f = tmp_path / "adapter"
    f.write_text("not a directory")
    code, _, err = train(toy_cli, base, tmp_path / "runs", f)
    assert code == 2 and f"--output {f}" in err
    assert f.read_text() == "not a directory"


def test_output_new_path_and_own_adapter_directory_are_written(base, toy_cli, tmp_path):
    copy = tmp_path / "deep" / "copy"
    code, _, err = train(toy_cli, base, tmp_path / "runs", copy, "--run-id", "a", "--json")
    assert code == 0, err
    assert (copy / "adapter_model.safetensors").is_file() and (
        copy / "adapter_config.json"
    ).is_file()
    # A directory of toy's adapter files (a stale one here) is replaced by the new adapter,
    # atomically: no temp directory is left beside it.
    (copy / "adapter_config.json").write_text("{}")
    code, _, err = train(
        toy_cli, base, tmp_path / "runs", copy, "--run-id", "b", "--json", "--seed", "3"
    )
    assert code == 0, err
    assert json.loads((copy / "adapter_config.json").read_text())["r"] == 8
    final = tmp_path / "runs" / "b" / "final"
    assert (copy / "adapter_model.safetensors").read_bytes() == (
        final / "adapter_model.safetensors"
    ).read_bytes()
    assert sorted(p.name for p in copy.parent.iterdir()) == ["copy"]


def test_output_that_becomes_the_run_directory_is_not_replaced(base, toy_cli, tmp_path):
    """--output naming the run's own directory: unknown until the run starts, so it is
    refused when the copy would be made; the run and its final/ stay."""
    runs = tmp_path / "runs"
    code, _, err = train(toy_cli, base, runs, runs / "r", "--run-id", "r")
    assert code != 0 and f"--output {runs / 'r'}" in err
    assert (runs / "r" / "run.json").is_file() and (
        runs / "r" / "final" / "adapter_model.safetensors"
    ).is_file()
