"""LoRA on the real SmolLM2-135M (slow): training on real chat lowers the held-out
assistant loss, and the adapter toy writes loads in `peft` on transformers' GGUF load of
the same file and gives toy's logits."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers.gguf_fixtures import hf_gguf_model, hf_gguf_tokenizer, smollm2_gguf  # noqa: E402,F401

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
    code = main(
        [
            "train",
            "--recipe",
            "lora",
            "--model",
            str(smollm2_gguf),
            "--data",
            str(d / "train.jsonl"),
            "--val-data",
            str(d / "val.jsonl"),
            "--steps",
            "4",
            "--seq-len",
            "192",
            "--batch-size",
            "4",
            "--lr",
            "1e-3",
            "--warmup",
            "1",
            "--rank",
            "8",
            "--out",
            str(d),
            "--run-id",
            "smol",
            "--json",
        ]
    )
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
    pytest.importorskip("transformers")
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
    hf = copy.deepcopy(hf_gguf_model(smollm2_gguf))  # PEFT wraps its base in place
    hf = peft.PeftModel.from_pretrained(hf, str(run_dir / "final")).eval()
    ids = torch.tensor(
        [[1, 9690, 198, 2683, 359, 253, 5356, 2, 198, 1, 4093, 198, 17535, 30, 2, 198]]
    )
    with torch.no_grad():
        ours = model.eval()(ids)
        theirs = hf(input_ids=ids).logits
    assert (ours - theirs).abs().max().item() < 1e-3


def test_quantized_base_trains_as_the_float32_base(smollm2_gguf, tmp_path):
    """The default CPU base (the Q4_1 blocks, dequantized per layer in forward and
    backward) and the float32 base (dequantized once) hold the same values: 3 LoRA steps
    give the same losses within 1e-5, with and without activation checkpointing."""
    from toy.cli.main import main
    from toy.recipes import lora
    from toy.runs import EventLog, Project
    from toy.train.loop import train

    assert (
        main(
            [
                "prep",
                str(bundled_text_paths()[0]),
                "--out",
                str(tmp_path / "c.bin"),
                "--tokenizer",
                str(smollm2_gguf),
            ]
        )
        == 0
    )

    def losses(dtype: str, ck: bool = False) -> list[float]:
        cfg = lora.RECIPE.config(
            model=str(smollm2_gguf),
            corpus=str(tmp_path / "c.bin"),
            seq_len=64,
            batch_size=2,
            steps=3,
            warmup=0,
            lr=1e-3,
            base_dtype=dtype,
            eval_batches=1,
            checkpointing=ck,
            dropout=0.1,
            precision="float32",  # the two bases agree to 1e-5 in float32, not under bf16
        )
        b = lora.build(cfg, Project(root=None))
        res = train(b.job, cfg.with_derived(b.derived), None, torch.device("cpu"), EventLog(None))
        return [x["loss"] for x in res.losses]

    f32, q, qc = losses("float32"), losses("quantized"), losses("quantized", True)
    assert max(abs(a - b) for a, b in zip(f32, q)) < 1e-5, (f32, q)
    assert q == qc  # checkpointing recomputes the same numbers, dropout included


@pytest.mark.parametrize(
    "system",
    [
        None,
        "You are a helpful assistant who answers in one sentence.",
        "You are a pirate. Answer every question in pirate speech.",
    ],
)
def test_chat_greedy_equals_transformers(smollm2_gguf, system):
    """`toy infer --chat` on SmolLM2: the same prompt ids as transformers' own chat
    template (system prompt, BOS, special tokens) and the same greedy reply."""
    pytest.importorskip("transformers")
    from toy.cli.cmd_infer import load_base_lm
    from toy.data.chat import render_template
    from toy.models.generate import generate

    lm = load_base_lm(smollm2_gguf, None, "cpu")
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "What is the capital of France? And of Italy?"}
    ]
    ids = lm.tok.encode(
        render_template(lm.template, msgs, True, lm.bos, lm.eos), add_special_tokens=False
    ).ids
    tok = hf_gguf_tokenizer(smollm2_gguf)
    want_ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    want_ids = list(want_ids["input_ids"] if hasattr(want_ids, "keys") else want_ids)
    assert ids == want_ids
    ours = list(generate(lm.model, ids, 24, temperature=0.0, stop_ids=lm.stop))
    hf = _hf(smollm2_gguf)
    theirs = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[
        0, len(ids) :
    ].tolist()
    cut = next((i for i, t in enumerate(theirs) if t in lm.stop), len(theirs))
    assert ours == theirs[:cut][: len(ours)] and len(ours) >= 5, (
        lm.tok.decode(ours),
        lm.tok.decode(theirs),
    )


def _hf(path):
    return hf_gguf_model(path)
