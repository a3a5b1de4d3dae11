"""`toy infer --model BASE --adapter X` takes every adapter form toy writes: a PEFT directory
(`toy export --format peft`, a run's final/), an mlx-lm adapter directory (`toy export
--format mlx`, `toy train --output DIR/adapters.safetensors`) or that adapters.safetensors
itself, and a LoRA adapter GGUF; each gives the run's own greedy text. Anything else is one
line, exit 2, naming the forms it takes."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers.common import needs_mlx  # noqa: E402
from helpers.gguf_fixtures import gguf_name, tiny_model, write_llama_gguf  # noqa: E402
from helpers.model_dirs import mlx_dir  # noqa: E402

PROMPT = "HAMLET. "
FORMS = "an mlx-lm adapter directory or its .safetensors file"  # in every refusal


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """A tiny LoRA run on a tiny Q8_0 GGUF (a few seconds), its mlx-lm adapter written by
    the trainer's --output, and its three exports."""
    from toy.cli.main import main
    from toy.data.dialogue import conversations, write_jsonl
    from toy.data.prep import bundled_text_paths
    from toy.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("adapter-forms")
    text = bundled_text_paths()[0].read_text()[:30000]
    tok = train_bpe([text[i : i + 500] for i in range(0, len(text), 500)], vocab_size=300)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    model = tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True), max_seq_len=256)
    qtypes = {gguf_name(n): "Q8_0" for n, p in model.named_parameters() if p.dim() == 2}
    base = write_llama_gguf(d / "base.gguf", model, tok, qtypes=qtypes)
    chat = write_jsonl(
        conversations(bundled_text_paths(), 12, seed=1, turns=(1, 1), max_chars=120), d / "c.jsonl"
    )
    # lr 3e-2 for 3 steps moves the adapter far enough to change the greedy text (asserted).
    flags = ["--steps", "3", "--seq-len", "128", "--batch-size", "2", "--eval-batches", "1"]
    flags += ["--lr", "3e-2", "--warmup", "0", "--targets", "q_proj,k_proj,v_proj", "--rank", "4"]
    flags += ["--output", str(d / "trained" / "adapters.safetensors")]
    argv = ["train", "--recipe", "lora", "--model", str(base), "--data", str(chat)]
    assert main([*argv, "--out", str(d / "runs"), "--run-id", "l", *flags]) == 0
    run = d / "runs" / "l"
    out = {"base": base, "run": run, "chat": chat, "dir": d}
    for fmt, name in (("peft", "peft"), ("mlx", "mlx"), ("gguf-lora", "adapter.gguf")):
        assert main(["export", str(run), "--format", fmt, "--out", str(d / name)]) == 0
        out[fmt] = d / name
    return out


def _greedy(toy_cli, *flags) -> str:
    code, out, err = toy_cli(
        "infer", "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "16", *flags
    )
    assert code == 0, err
    return out


def _one_line_exit_2(code, err, *needles):
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err


def test_every_adapter_form_gives_the_runs_own_text(lora, toy_cli):
    d = lora["dir"]
    ours = _greedy(toy_cli, "--run", lora["run"])
    assert ours != _greedy(toy_cli, "--model", lora["base"])  # the adapter changes the text
    forms = [
        lora["peft"],
        lora["mlx"],  # toy export --format mlx
        lora["mlx"] / "adapters.safetensors",
        d / "trained",  # toy train --output trained/adapters.safetensors
        d / "trained" / "adapters.safetensors",
        lora["gguf-lora"],
    ]
    for form in forms:
        assert _greedy(toy_cli, "--model", lora["base"], "--adapter", form) == ours, form


def test_an_mlx_adapter_under_another_name_is_read_beside_its_config(lora, toy_cli, tmp_path):
    # `toy train --output DIR/NAME.safetensors` names the weights file as asked.
    shutil.copyfile(lora["mlx"] / "adapter_config.json", tmp_path / "adapter_config.json")
    shutil.copyfile(lora["mlx"] / "adapters.safetensors", tmp_path / "mine.safetensors")
    ours = _greedy(toy_cli, "--run", lora["run"])
    via = _greedy(toy_cli, "--model", lora["base"], "--adapter", tmp_path / "mine.safetensors")
    assert via == ours


def test_a_path_that_is_no_adapter_names_the_forms(lora, toy_cli, tmp_path):
    (tmp_path / "empty").mkdir()
    lone = tmp_path / "lone" / "adapters.safetensors"  # no adapter_config.json beside it
    lone.parent.mkdir()
    shutil.copyfile(lora["mlx"] / "adapters.safetensors", lone)
    for path, what in (
        (tmp_path / "nowhere", "no such run or adapter directory or file"),
        (tmp_path / "nowhere.safetensors", "no such run or adapter directory or file"),
        (lora["chat"], "not a LoRA adapter"),
        (lone, "not a LoRA adapter"),
        (tmp_path / "empty", "no adapter_config.json, not an adapter"),
    ):
        code, _, err = toy_cli("infer", "--model", lora["base"], "--adapter", path, "--prompt", "x")
        _one_line_exit_2(code, err, f"--adapter {path}: {what}", FORMS, "LoRA adapter GGUF")


def test_a_broken_mlx_adapter_is_one_line(lora, toy_cli, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(lora["mlx"], bad)
    (bad / "adapter_config.json").write_text('{"fine_tune_type": "lora"}')
    code, _, err = toy_cli("infer", "--model", lora["base"], "--adapter", bad, "--prompt", "x")
    _one_line_exit_2(code, err, "adapter_config.json: not an mlx-lm LoRA adapter config")
    shutil.copyfile(lora["mlx"] / "adapter_config.json", bad / "adapter_config.json")
    text = (bad / "adapter_config.json").read_text().replace('"rank": 4', '"rank": 2')
    (bad / "adapter_config.json").write_text(text)
    code, _, err = toy_cli("infer", "--model", lora["base"], "--adapter", bad, "--prompt", "x")
    _one_line_exit_2(code, err, "adapters.safetensors", "do not match the rank 2")


@needs_mlx
def test_an_adapter_mlx_lm_wrote_itself_gives_mlx_lms_text(toy_cli, tmp_path):
    """The reader inverts mlx-lm's own layout (not only toy's writer): LoRA layers made and
    saved by mlx-lm's tuner, as `mlx_lm.lora` saves them, give mlx-lm's greedy reply."""
    import mlx.core as mx
    from helpers.preference import mlx_greedy
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    base = mlx_dir("llama", 4, 32)
    model, _ = load(str(base))
    model.freeze()
    params = {
        "rank": 4,
        "scale": 2.0,
        "dropout": 0.0,
        "keys": ["self_attn.q_proj", "mlp.down_proj"],
    }
    linear_to_lora_layers(model, len(model.layers), params)
    # mlx-lm starts lora_b at zero (no change): random ones make the adapter change the text.
    mx.random.seed(0)
    b = [
        (k, 0.2 * mx.random.normal(v.shape)) for k, v in tree_flatten(model.trainable_parameters())
    ]
    model.update(tree_unflatten([(k, v) for k, v in b if k.endswith("lora_b")]))
    mx.save_safetensors(
        str(tmp_path / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters()))
    )
    config = {"fine_tune_type": "lora", "num_layers": len(model.layers), "lora_parameters": params}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    message, n = "What news?", 12
    chat = ["--chat", message, "--temperature", "0", "--max-new-tokens", n]
    chat += ["--base-dtype", "float32", "--precision", "float32"]
    code, plain, err = toy_cli("infer", "--model", base, *chat)
    assert code == 0, err
    code, out, err = toy_cli("infer", "--model", base, "--adapter", tmp_path, *chat)
    assert code == 0, err
    assert out.strip() != plain.strip()  # the adapter changes the text
    assert mlx_greedy(base, tmp_path, message, n).strip() == out.strip()
