"""LoRA on a model directory, through the command line, and what each runtime makes of the
result: PEFT on transformers, mlx-lm's own adapter loading, and the merged directories in
transformers and mlx-lm, each against toy's own adapted logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import model_dirs  # noqa: E402
from helpers.common import needs_mlx  # noqa: E402
from helpers.model_dirs import hf_model, mlx_dir, mlx_logits, tiny_dir  # noqa: E402
from helpers.preference import IDS, toy_adapted_logits  # noqa: F401

from toy.data.dialogue import conversations, write_jsonl  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402

TRAIN = [
    "--seq-len",
    "384",
    "--batch-size",
    "4",
    "--eval-batches",
    "2",
    "--lr",
    "2e-2",
    "--warmup",
    "0",
    "--steps",
    "6",
    "--targets",
    "q_proj,v_proj,down_proj",
    "--json",
]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("dir-adapters")
    model_dirs.set_root(root / "models")
    (root / "models").mkdir()
    return write_jsonl(
        conversations(bundled_text_paths(), 60, seed=3, turns=(1, 1), max_chars=80),
        root / "chat.jsonl",
    )


def train(toy_cli, base: Path, chat: Path, out: Path, *extra) -> Path:
    code, o, err = toy_cli(
        "train",
        "--recipe",
        "lora",
        "--model-path",
        base,
        "--data",
        chat,
        "--out",
        out,
        *TRAIN,
        *extra,
    )
    assert code == 0, err
    r = json.loads(o.strip().splitlines()[-1])
    val = [v["loss"] for v in r["val_losses"]]
    assert val[-1] < val[0]  # it learns
    return Path(r["run_dir"])


def test_peft_and_merged_transformers_directory(chat, toy_cli, tmp_path):
    base = tiny_dir("qwen3")
    run = train(toy_cli, base, chat, tmp_path)
    ours = toy_adapted_logits(run)
    with torch.no_grad():
        plain = hf_model(base)(IDS).logits
    assert (ours - plain).abs().max() > 1e-2  # the adapter changes the model
    # PEFT on transformers' own model of the directory.
    code, _, err = toy_cli("export", run, "--format", "peft", "--out", tmp_path / "peft")
    assert code == 0, err
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ] == str(base)
    from peft import PeftModel

    with torch.no_grad():
        theirs = PeftModel.from_pretrained(hf_model(base), tmp_path / "peft").eval()(IDS).logits
    torch.testing.assert_close(theirs, ours, atol=1e-3, rtol=0)
    # The adapter merged into a transformers directory of the base's dtype.
    code, out, err = toy_cli(
        "export", run, "--format", "transformers", "--merge", "--out", tmp_path / "merged"
    )
    assert code == 0 and "transformers model, the adapter merged in" in out, err
    with torch.no_grad():
        merged = hf_model(tmp_path / "merged")(IDS).logits
    torch.testing.assert_close(merged, ours, atol=1e-3, rtol=0)


@needs_mlx
def test_mlx_adapter_and_fused_directory(chat, toy_cli, tmp_path):
    import mlx.core as mx
    import numpy as np
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load_model

    base = mlx_dir("llama", 4, 32)
    run = train(
        toy_cli, base, chat, tmp_path, "--output", tmp_path / "trainer-out" / "adapters.safetensors"
    )
    ours = toy_adapted_logits(run)
    code, _, err = toy_cli("export", run, "--format", "mlx", "--out", tmp_path / "mlx")
    assert code == 0, err
    cfg = json.loads((tmp_path / "mlx" / "adapter_config.json").read_text())
    assert cfg["num_layers"] == 2 and cfg["lora_parameters"]["keys"] == [
        "mlp.down_proj",
        "self_attn.q_proj",
        "self_attn.v_proj",
    ]
    for adapter in (
        tmp_path / "mlx",
        tmp_path / "trainer-out",
    ):  # toy export, and the trainer's --output FILE
        model, _ = load_model(base)
        load_adapters(model, str(adapter))
        theirs = torch.from_numpy(np.array(model(mx.array(IDS.numpy())).astype(mx.float32)))
        torch.testing.assert_close(theirs, ours, atol=1e-3, rtol=0)
    # Fused into the MLX base, re-quantized to its 4 bits, group 32 (as mlx_lm.fuse: on request).
    code, _, err = toy_cli(
        "export", run, "--format", "mlx", "--merge", "--dtype", "base", "--out", tmp_path / "fused"
    )
    assert code == 0, err
    assert (
        json.loads((tmp_path / "fused" / "config.json").read_text())["quantization"]
        == json.loads((base / "config.json").read_text())["quantization"]
    )
    fused = mlx_logits(tmp_path / "fused", IDS)
    plain = mlx_logits(base, IDS)
    # Re-quantizing rounds the update: the fused model is far nearer the adapted one than the
    # base is.
    assert (fused - ours).abs().mean() < 0.5 * (plain - ours).abs().mean()


def test_an_mlx_merge_needs_an_mlx_base(chat, toy_cli, tmp_path):
    run = train(toy_cli, tiny_dir("qwen3"), chat, tmp_path)
    code, _, err = toy_cli("export", run, "--format", "mlx", "--merge", "--out", tmp_path / "x")
    assert (
        code == 2 and "is a transformers directory; merge into it with --format transformers" in err
    )
    code, _, err = toy_cli(
        "export", run, "--format", "gguf", "--merge", "--out", tmp_path / "x.gguf"
    )
    assert code == 2 and "--format transformers or mlx" in err
