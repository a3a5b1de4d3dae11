"""LoRA on the real SmolLM2-135M (slow): training on real chat lowers the held-out
assistant loss, and the adapter toy writes loads in `peft` on transformers' GGUF load of
the same file and gives toy's logits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_fixtures import smollm2_gguf  # noqa: E402,F401

from toy.data.dialogue import conversations, write_jsonl  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lora_run(smollm2_gguf, tmp_path_factory):
    from toy.cli.main import main

    d = tmp_path_factory.mktemp("smol-lora")
    convs = conversations(bundled_text_paths(), 96, seed=3, turns=(1, 2), max_chars=240)
    write_jsonl(convs[:80], d / "train.jsonl")
    write_jsonl(convs[80:], d / "val.jsonl")
    code = main(["train", "--recipe", "lora", "--model", str(smollm2_gguf), "--data", str(d / "train.jsonl"),
                 "--val-data", str(d / "val.jsonl"), "--steps", "10", "--seq-len", "192", "--batch-size", "4",
                 "--lr", "1e-3", "--warmup", "2", "--rank", "8", "--out", str(d), "--run-id", "smol", "--json"])
    assert code == 0
    events = [json.loads(x) for x in (d / "smol" / "events.jsonl").read_text().splitlines()]
    return d / "smol", [e for e in events if e["event"] == "eval"]


def test_training_lowers_held_out_assistant_loss(lora_run, record_property):
    _, evals = lora_run
    first, last = evals[0]["val_loss"], evals[-1]["val_loss"]
    record_property("val_loss_before", first)
    record_property("val_loss_after", last)
    assert last < first - 0.05, (first, last)


def test_adapter_loads_in_peft_with_toy_logits(lora_run, smollm2_gguf):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from toy.formats.gguf import read_gguf
    from toy.formats.peft import load_peft_adapter
    from toy.lora import apply_lora, load_lora_state_dict

    run_dir, _ = lora_run
    sd, cfg = load_peft_adapter(run_dir / "final")
    assert any(float(v.abs().max()) > 0 for k, v in sd.items() if k.endswith("lora_B"))
    base = read_gguf(smollm2_gguf)
    model = base.build_model()
    base.state_dict.clear()
    apply_lora(model, cfg["target_modules"], cfg["r"], cfg["lora_alpha"], 0.0, seed=0)
    load_lora_state_dict(model, sd)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                           dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, str(run_dir / "final")).eval()
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 2, 198, 1, 4093, 198, 17535, 30, 2, 198]])
    with torch.no_grad():
        ours = model.eval()(ids)
        theirs = hf(input_ids=ids).logits
    assert (ours - theirs).abs().max().item() < 1e-3
