"""A user's first hour (issue 35): what a new user trips on, each through the command line."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_dirs  # noqa: E402
from model_dirs import hf_model, mlx_dir, mlx_logits, tiny_dir  # noqa: E402

from toy.data.dialogue import conversations, write_jsonl  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402

IDS = torch.randint(3, model_dirs.VOCAB, (1, 30), generator=torch.Generator().manual_seed(2))
needs_mlx = pytest.mark.skipif(
    importlib.util.find_spec("mlx_lm") is None,
    reason="mlx-lm (a test-only dependency) is the MLX reference",
)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("first-hour")
    model_dirs.set_root(root / "models")
    (root / "models").mkdir()
    return write_jsonl(
        conversations(bundled_text_paths(), 60, seed=3, turns=(1, 1), max_chars=80),
        root / "chat.jsonl",
    )


def lora_run(toy_cli, base: Path, chat: Path, out: Path, lr: str = "2e-3") -> Path:
    """A short LoRA run on a directory base with a small, realistic update (a LoRA update is
    about 1e-3 of a weight: far below a 4-bit quantization step)."""
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
        "--seq-len",
        "384",
        "--batch-size",
        "4",
        "--eval-batches",
        "1",
        "--lr",
        lr,
        "--warmup",
        "0",
        "--steps",
        "4",
        "--targets",
        "q_proj,v_proj,down_proj",
        "--json",
    )
    assert code == 0, err
    return Path(json.loads(o.strip().splitlines()[-1])["run_dir"])


def adapted_logits(run: Path) -> torch.Tensor:
    """toy's own logits for IDS with the run's adapter on its base (float32)."""
    from toy.formats.base import read_base
    from toy.formats.peft import load_peft_adapter
    from toy.lora import apply_lora, load_lora_state_dict

    sd, cfg = load_peft_adapter(run / "final")
    model = read_base(cfg["base_model_name_or_path"], "float32").build_model()
    apply_lora(
        model, sorted({k.rsplit(".", 2)[-2] for k in sd}), cfg["r"], cfg["lora_alpha"], 0.0, seed=0
    )
    load_lora_state_dict(model, sd)
    with torch.no_grad():
        return model(IDS)


# ---------------------------------------------------------------- 35.1: a merge keeps the update


@needs_mlx
def test_an_mlx_merge_keeps_the_fine_tune_by_default(chat, toy_cli, tmp_path):
    base = mlx_dir("llama", 4, 32)
    run = lora_run(toy_cli, base, chat, tmp_path)
    ours, plain = adapted_logits(run), mlx_logits(base, IDS)
    gap = (ours - plain).abs().mean()
    code, out, err = toy_cli("export", run, "--format", "mlx", "--merge", "--out", tmp_path / "m")
    assert code == 0, err
    assert "keep 100% of the adapter's update" in out and "unquantized" in out, out
    merged = mlx_logits(tmp_path / "m", IDS)  # mlx-lm's own loader on the merged directory
    assert (merged - ours).abs().mean() < 0.05 * gap  # the adapted model, not the base
    from mlx_lm import load

    load(str(tmp_path / "m"))  # mlx_lm.load (model and tokenizer) takes it as it is
    # The lossy form, on request: re-quantized to the base's 4 bits, as mlx_lm.fuse does.
    code, out, err = toy_cli(
        "export", run, "--format", "mlx", "--merge", "--dtype", "base", "--out", tmp_path / "q",
        "--json",
    )  # fmt: skip
    assert code == 0, err
    r = json.loads(out)
    assert r["dtype"] == "base" and r["update_kept"] < 0.5, r
    assert any("--dtype base" in n and "4 bits" in n for n in r["notes"]), r["notes"]
    lossy = mlx_logits(tmp_path / "q", IDS)
    assert (lossy - ours).abs().mean() > 0.3 * gap  # much of the update rounded away


def test_a_transformers_merge_on_a_bf16_base_keeps_the_fine_tune(chat, toy_cli, tmp_path):
    base = tiny_dir("llama", dtype="bfloat16")
    run = lora_run(toy_cli, base, chat, tmp_path, lr="2e-4")  # an update bf16 rounds away
    ours = adapted_logits(run)
    with torch.no_grad():
        plain = hf_model(base)(IDS).logits
    gap = (ours - plain).abs().mean()
    code, out, err = toy_cli(
        "export", run, "--format", "transformers", "--merge", "--out", tmp_path / "m", "--json"
    )
    assert code == 0, err
    r = json.loads(out)
    assert r["update_kept"] > 0.99 and r["update_error"] < 0.05, r
    import transformers

    # As a user loads it: the dtype config.json names (float32 now, where the update survives).
    m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype="auto").eval()
    with torch.no_grad():
        merged = m(IDS).logits.float()
    assert (merged - ours).abs().mean() < 0.05 * gap
    code, out, err = toy_cli(
        "export", run, "--format", "transformers", "--merge", "--dtype", "base",
        "--out", tmp_path / "b",
    )  # fmt: skip
    assert code == 0 and "--dtype base" in out and "rounds part of the update away" in out, out
