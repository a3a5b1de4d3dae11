"""What `toy export` says against what it writes (issue 47 items 6 and 7), through the
command line: a merged MLX directory's adapted linears are in the dtype the help and the
notes name (float32 on a float32 base, as `toy fetch --as mlx` makes them), and a PEFT
export of a run on a GGUF base names a base PEFT can load (the transformers directory `toy
fetch NAME --as transformers` made of that GGUF), or says in a note how to get one."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import model_dirs  # noqa: E402
from helpers.common import needs_mlx, run_toy  # noqa: E402
from helpers.gguf_fixtures import tiny_model, write_llama_gguf  # noqa: E402
from safetensors import safe_open

from toy.cli import cmd_fetch  # noqa: E402
from toy.data.dialogue import conversations, write_jsonl  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402
from toy.tokenizer import train_bpe  # noqa: E402

FAST = ["--seq-len", "128", "--batch-size", "2", "--steps", "2", "--warmup", "0", "--lr", "2e-2"]
FAST += ["--eval-batches", "1", "--targets", "q_proj,v_proj", "--json"]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    d = tmp_path_factory.mktemp("export-words")
    model_dirs.set_root(d / "models")
    (d / "models").mkdir()
    return write_jsonl(
        conversations(bundled_text_paths(), 12, seed=1, turns=(1, 1), max_chars=100),
        d / "chat.jsonl",
    )


def _lora(toy_cli, chat: Path, out: Path, *base) -> Path:
    code, o, err = toy_cli("train", "--recipe", "lora", *base, "--data", chat, "--out", out, *FAST)
    assert code == 0, err
    return Path(json.loads(o.strip().splitlines()[-1])["run_dir"])


def _words(text: str) -> str:
    return " ".join(text.split())  # argparse wraps the help at the terminal's width


# ---------------------------------------------------------------- item 6: the MLX merge's dtype


@needs_mlx
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_an_mlx_merge_writes_the_dtype_its_words_name(dtype, chat, toy_cli, tmp_path):
    base = model_dirs.mlx_dir("llama", 4, 32, dtype)  # scales in `dtype`, as mlx_lm.convert
    run = _lora(toy_cli, chat, tmp_path, "--model-path", base)
    code, out, err = toy_cli(
        "export", run, "--format", "mlx", "--merge", "--out", tmp_path / "m", "--json"
    )
    assert code == 0, err
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        adapted = {str(f.get_tensor(k).dtype) for k in f.keys() if k.endswith("q_proj.weight")}
    assert adapted == {f"torch.{dtype}"}  # float32 where the base's scales are float32
    assert any(f"written as {dtype} x4" in n for n in json.loads(out)["notes"]), out
    # --dtype base's note names what the default writes instead: this same dtype.
    code, out, err = toy_cli(
        "export", run, "--format", "mlx", "--merge", "--dtype", "base", "--out", tmp_path / "b"
    )
    assert code == 0, err
    assert f"the default --dtype keep writes them unquantized in {dtype}" in _words(out), out


def test_the_help_names_both_widths_of_an_mlx_merge():
    r = run_toy("export", "--help")
    assert r.returncode == 0, r.stderr
    # Not "float16" alone: a float32 base's (`toy fetch --as mlx`'s) are written float32.
    assert "unquantized, in float16, or float32 where the base's scales are float32" in _words(
        r.stdout
    )


# ---------------------------------------------------------------- item 7: PEFT of a GGUF run


@pytest.fixture(scope="module")
def gguf_run(tmp_path_factory, chat):
    """A LoRA run on a tiny GGUF as `toy fetch` leaves one: the file in toy's model cache,
    linked into a project's data/ (the run records the file the link resolves to)."""
    from toy.cli.main import main

    root = tmp_path_factory.mktemp("gguf-run")
    text = bundled_text_paths()[0].read_text()[:20000]
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    model = tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True), max_seq_len=256)
    cache = root / "xdg" / "toy" / "models"
    cache.mkdir(parents=True)
    gguf = write_llama_gguf(cache / "tiny-cached.gguf", model, tok)
    proj = root / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "toy.toml").write_text("")
    (proj / "data" / "tiny.gguf").symlink_to(gguf)
    argv = ["train", "--recipe", "lora", "--model", proj / "data" / "tiny.gguf", "--data", chat]
    argv += ["--out", proj / "runs", "--run-id", "g", *FAST]
    assert main([str(a) for a in argv]) == 0
    whole = gguf.read_bytes()
    known = cmd_fetch.Known(
        "tiny", "a tiny llama", "tiny.gguf", "tiny-cached.gguf", (), (),
        hashlib.sha256(whole).hexdigest(), len(whole), "MIT", "https://example.org/mit",
        ("transformers",),
    )  # fmt: skip
    return {"run": proj / "runs" / "g", "gguf": gguf, "proj": proj, "xdg": root / "xdg"}, known


def _config(d: Path) -> dict:
    return json.loads((d / "adapter_config.json").read_text())


def test_peft_export_of_a_gguf_run_names_its_transformers_twin(
    gguf_run, toy_cli, tmp_path, monkeypatch
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from toy.formats.base_readers import read_base
    from toy.formats.peft import load_peft_adapter
    from toy.lora import apply_lora, load_lora_state_dict

    g, known = gguf_run
    monkeypatch.setitem(cmd_fetch.MODELS, "tiny", known)  # a model `toy fetch` knows
    monkeypatch.setenv("XDG_CACHE_HOME", str(g["xdg"]))
    # No transformers directory made yet: the note says how to make one; the GGUF stays.
    code, out, err = toy_cli("export", g["run"], "--format", "peft", "--out", tmp_path / "p")
    assert code == 0, err
    assert "run `toy fetch tiny --as transformers` (its transformers directory)" in out, out
    assert _config(tmp_path / "p")["base_model_name_or_path"] == str(g["gguf"])
    # Made, as a user makes it: the export names the project's link to it.
    code, _, err = toy_cli("fetch", "tiny", "--as", "transformers", "--out", g["proj"] / "data")
    assert code == 0, err
    twin = g["proj"] / "data" / "tiny-transformers"
    code, out, err = toy_cli(
        "export", g["run"], "--format", "peft", "--out", tmp_path / "p", "--force", "--json"
    )
    assert code == 0, err
    assert any(f"base_model_name_or_path: {twin}," in n for n in json.loads(out)["notes"]), out
    cfg = _config(tmp_path / "p")
    assert cfg["base_model_name_or_path"] == str(twin)
    assert _config(g["run"] / "final")["base_model_name_or_path"] == str(g["gguf"])  # untouched
    # PEFT loads it on that directory, with toy's adapted logits on the GGUF.
    ids = torch.randint(3, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(cfg["base_model_name_or_path"]).eval()
        theirs = PeftModel.from_pretrained(hf, tmp_path / "p").eval()(ids).logits
        sd, c = load_peft_adapter(g["run"] / "final")
        ours = read_base(g["gguf"], "float32").build_model()
        plain = ours(ids)
        apply_lora(ours, ["q_proj", "v_proj"], c["r"], c["lora_alpha"], 0.0, seed=0)
        load_lora_state_dict(ours, sd)
        want = ours(ids)
    assert (want - plain).abs().max() > 1e-3  # the adapter matters
    torch.testing.assert_close(theirs, want, atol=1e-4, rtol=0)


def test_peft_export_of_an_unknown_gguf_run_says_how_to_get_a_base(gguf_run, toy_cli, tmp_path):
    g, _ = gguf_run  # not among the models `toy fetch` knows
    code, out, err = toy_cli("export", g["run"], "--format", "peft", "--out", tmp_path / "p")
    assert code == 0, err
    notes = [line for line in out.splitlines() if "PEFT cannot load the GGUF base" in line]
    assert len(notes) == 1 and "a transformers directory of the same weights" in notes[0], out
    assert "gguf_file='tiny-cached.gguf'" in notes[0]
    assert _config(tmp_path / "p")["base_model_name_or_path"] == str(g["gguf"])  # toy loads it


def test_peft_export_of_a_directory_run_keeps_its_base_and_says_nothing(chat, toy_cli, tmp_path):
    base = tmp_path / "tiny-llama"
    shutil.copytree(model_dirs.tiny_dir("llama"), base)
    run = _lora(toy_cli, chat, tmp_path / "runs", "--model", base)
    code, out, err = toy_cli("export", run, "--format", "peft", "--out", tmp_path / "p", "--json")
    assert code == 0, err
    assert json.loads(out)["notes"] == []
    assert _config(tmp_path / "p")["base_model_name_or_path"] == str(base.resolve())
