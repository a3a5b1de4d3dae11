"""Where `toy export` may write (issue 32 items 1-2, issue 35 item 9), through the command
line: no export writes over an existing file or non-empty directory without --force, none
ever writes over the run's base (or into, or above, a directory base) or its own run, the
files it writes get the usual permissions, and an adapter saved into a directory base's
own folder leaves the run usable (the base's fingerprint covers the files it is read from)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import model_dirs  # noqa: E402
from helpers.gguf_fixtures import tiny_model, write_llama_gguf  # noqa: E402

from toy.data.dialogue import conversations, write_jsonl  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402
from toy.tokenizer import train_bpe  # noqa: E402

FAST = ["--seq-len", "128", "--batch-size", "2", "--steps", "1", "--warmup", "0"]
FAST += ["--eval-batches", "1", "--targets", "q_proj,v_proj", "--json"]


def _lora(toy_cli, base: Path, chat: Path, runs: Path, run_id: str, *extra) -> Path:
    code, out, err = toy_cli(
        "train", "--recipe", "lora", "--model", base, "--data", chat, "--out", runs,
        "--run-id", run_id, *FAST, *extra,
    )  # fmt: skip
    assert code == 0, err
    return runs / run_id


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    d = tmp_path_factory.mktemp("export-policy")
    return write_jsonl(
        conversations(bundled_text_paths(), 12, seed=1, turns=(1, 1), max_chars=100),
        d / "chat.jsonl",
    )


@pytest.fixture(scope="module")
def gguf_run(tmp_path_factory, chat):
    """A LoRA run on a tiny GGUF base kept in a folder of its own."""
    from toy.cli.main import main

    d = tmp_path_factory.mktemp("gguf-base")
    text = bundled_text_paths()[0].read_text()[:20000]
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    model = tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True), max_seq_len=256)
    (d / "models").mkdir()
    base = write_llama_gguf(d / "models" / "base.gguf", model, tok)
    argv = ["train", "--recipe", "lora", "--model", base, "--data", chat]
    argv += ["--out", d / "runs", "--run-id", "g", *FAST]
    assert main([str(a) for a in argv]) == 0
    return {"run": d / "runs" / "g", "base": base}


@pytest.fixture(scope="module")
def dir_run(tmp_path_factory, chat):
    """A LoRA run on a tiny transformers directory, its mlx-lm adapter saved into the
    base's own folder (`--output DIR/adapters.safetensors`, as mlx-lm users keep them)."""
    from toy.cli.main import main

    d = tmp_path_factory.mktemp("dir-base")
    model_dirs.set_root(d / "made")
    base = d / "models" / "tiny-llama"
    shutil.copytree(model_dirs.tiny_dir("llama"), base)
    argv = ["train", "--recipe", "lora", "--model", base, "--data", chat]
    argv += ["--out", d / "runs", "--run-id", "t", *FAST]
    argv += ["--output", base / "adapters.safetensors"]
    assert main([str(a) for a in argv]) == 0
    assert (base / "adapters.safetensors").is_file()
    return {"run": d / "runs" / "t", "base": base}


def _one_line_naming(code: int, err: str, *words: str) -> None:
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert str(w) in err, (w, err)


# ------------------------------------------------------------------ the run's base


@pytest.mark.parametrize("force", [False, True])
def test_merge_onto_its_own_gguf_base_is_refused_even_with_force(gguf_run, toy_cli, force):
    base = gguf_run["base"]
    before = base.read_bytes()
    argv = ["export", gguf_run["run"], "--format", "gguf", "--merge", "--out", base]
    code, _, err = toy_cli(*argv, *(["--force"] if force else []))
    _one_line_naming(code, err, base, "base")
    assert base.read_bytes() == before
    assert sorted(p.name for p in base.parent.iterdir()) == ["base.gguf"]  # no temp left


def test_exports_beside_a_gguf_base_are_written(gguf_run, toy_cli):
    """Only the base itself is protected: a merged GGUF next to it is where users keep them."""
    out = gguf_run["base"].parent / "merged.gguf"
    code, _, err = toy_cli("export", gguf_run["run"], "--format", "gguf", "--merge", "--out", out)
    assert code == 0 and out.is_file(), err
    out.unlink()


@pytest.mark.parametrize(
    "fmt,out",
    [
        (["--format", "transformers", "--merge"], "."),  # the base directory itself
        (["--format", "transformers", "--merge"], "merged"),  # a folder inside it
        (["--format", "peft"], "peft"),
        (["--format", "mlx"], "."),  # mlx-lm's adapter files beside the model
        (["--format", "gguf-lora"], "a.gguf"),
        (["--format", "peft"], ".."),  # a folder that holds the base: replaced whole
    ],
)
def test_nothing_is_written_into_a_directory_base_even_with_force(dir_run, toy_cli, fmt, out):
    base = dir_run["base"]
    target = (base / out).resolve()
    listing = sorted(p.name for p in base.iterdir())
    config = (base / "config.json").read_bytes()
    for force in ([], ["--force"]):
        code, _, err = toy_cli("export", dir_run["run"], *fmt, "--out", target, *force)
        _one_line_naming(code, err, base, "base")
    assert sorted(p.name for p in base.iterdir()) == listing
    assert (base / "config.json").read_bytes() == config


@pytest.mark.parametrize("where", ["run", "final"])
def test_an_export_never_replaces_its_own_run(gguf_run, toy_cli, where):
    run = gguf_run["run"]
    target = run if where == "run" else run / "final"
    listing = sorted(p.name for p in target.iterdir())
    code, _, err = toy_cli("export", run, "--format", "peft", "--out", target, "--force")
    _one_line_naming(code, err, target)
    assert sorted(p.name for p in target.iterdir()) == listing


# ------------------------------------------------------------------ existing outputs


@pytest.mark.parametrize(
    "fmt,name",
    [
        (["--format", "gguf", "--merge"], "m.gguf"),
        (["--format", "gguf-lora"], "a.gguf"),
        (["--format", "peft"], "peft"),
        (["--format", "mlx"], "mlx"),
    ],
)
def test_an_existing_output_needs_force(gguf_run, toy_cli, tmp_path, fmt, name):
    out = tmp_path / name
    code, _, err = toy_cli("export", gguf_run["run"], *fmt, "--out", out)
    assert code == 0, err
    files = sorted(out.iterdir()) if out.is_dir() else [out]
    stamp = {f: f.stat().st_mtime_ns for f in files}
    code, _, err = toy_cli("export", gguf_run["run"], *fmt, "--out", out)
    _one_line_naming(code, err, out, "--force")
    assert {f: f.stat().st_mtime_ns for f in files} == stamp  # untouched
    code, o, err = toy_cli("export", gguf_run["run"], *fmt, "--out", out, "--force")
    assert code == 0, err
    # no temp or old copy left; an Ollama Modelfile beside a GGUF
    beside = [name.replace(".gguf", ".Modelfile")] if name.endswith(".gguf") else []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, *beside])


def test_the_default_path_is_not_overwritten_either(gguf_run, toy_cli, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(gguf_run["run"], run)
    code, out, err = toy_cli("export", run, "--format", "gguf-lora", "--json")
    assert code == 0, err
    path = Path(json.loads(out)["path"])
    code, _, err = toy_cli("export", run, "--format", "gguf-lora")
    _one_line_naming(code, err, path, "--force")
    code, out, err = toy_cli("export", run, "--format", "gguf-lora", "--force")
    assert code == 0 and str(path) in out, err


def test_a_directory_of_other_files_is_never_replaced(gguf_run, toy_cli, tmp_path):
    """--force replaces an earlier export, never a folder of something else (it would be
    deleted whole)."""
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "sub").mkdir()
    code, _, err = toy_cli(
        "export", gguf_run["run"], "--format", "peft", "--out", tmp_path, "--force"
    )
    _one_line_naming(code, err, tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "sub").is_dir()


def test_a_model_run_export_needs_force_too(toy_cli, tmp_path):
    code, out, err = toy_cli(
        "train", "--preset", "tiny", "--batch-size", "2", "--seq-len", "16", "--steps", "1",
        "--eval-batches", "1", "--out", tmp_path / "runs", "--run-id", "m",
    )  # fmt: skip
    assert code == 0, err
    out = tmp_path / "m.gguf"
    code, _, err = toy_cli("export", tmp_path / "runs" / "m", "--format", "gguf", "--out", out)
    assert code == 0, err
    before = out.read_bytes()
    code, _, err = toy_cli(
        "export", tmp_path / "runs" / "m", "--format", "gguf", "--dtype", "f16", "--out", out
    )
    _one_line_naming(code, err, out, "--force")
    assert out.read_bytes() == before


# ------------------------------------------------------------------ modes


def test_a_merged_directory_has_the_usual_file_modes(dir_run, toy_cli, tmp_path):
    out = tmp_path / "merged"
    code, _, err = toy_cli("export", dir_run["run"], "--format", "transformers", "--merge",
                           "--out", out)  # fmt: skip
    assert code == 0, err
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes and set(modes.values()) == {0o666 & ~mask}, modes


# ------------------------------------------------------------------ a directory base's fingerprint


def test_an_adapter_saved_into_the_base_folder_leaves_the_run_usable(dir_run, toy_cli):
    code, out, err = toy_cli(
        "infer", "--run", dir_run["run"], "--prompt", "hi", "--max-new-tokens", "2"
    )
    assert code == 0, err


def test_a_changed_directory_base_is_told_to_pass_a_directory(dir_run, toy_cli, tmp_path):
    run, base = tmp_path / "run", tmp_path / "base"
    shutil.copytree(dir_run["run"], run)
    shutil.copytree(dir_run["base"], base)
    cfg = json.loads((run / "final" / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(base)
    (run / "final" / "adapter_config.json").write_text(json.dumps(cfg))
    (base / "README.md").write_text("notes beside the model change nothing")
    code, _, err = toy_cli("infer", "--run", run, "--prompt", "hi", "--max-new-tokens", "1")
    assert code == 0, err
    gen = json.loads((base / "generation_config.json").read_text())
    (base / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2]}))
    code, _, err = toy_cli("infer", "--run", run, "--prompt", "hi", "--max-new-tokens", "1")
    _one_line_naming(code, err, base, "changed since the run trained", "--model MODEL_DIR")
    assert ".gguf" not in err


def test_a_run_recorded_with_the_older_directory_fingerprint_still_finds_its_base(
    dir_run, toy_cli, tmp_path
):
    """Runs made before the fingerprint covered only the read files recorded every file's
    name and size: they are still accepted while the folder is as it was."""
    from toy.runs import fingerprint

    run, base = tmp_path / "run", tmp_path / "base"
    shutil.copytree(dir_run["run"], run)
    shutil.copytree(dir_run["base"], base)
    cfg = json.loads((run / "final" / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(base)
    (run / "final" / "adapter_config.json").write_text(json.dumps(cfg))
    info = json.loads((run / "run.json").read_text())
    info["job"]["model_sha256"] = fingerprint(base)  # every file: the form before
    (run / "run.json").write_text(json.dumps(info))
    code, _, err = toy_cli("infer", "--run", run, "--prompt", "hi", "--max-new-tokens", "1")
    assert code == 0, err


def test_a_run_whose_adapter_sits_in_the_base_folder_resumes(dir_run, toy_cli, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(dir_run["run"], run)
    code, _, err = toy_cli("train", "--resume", run, "--steps", "2")
    assert code == 0, err
