"""The real Gemma-3-270M (Q4_K_M, a mixed Q5_0/Q4_K/Q6_K/Q8_0/F32 file with a 262,144-token
SentencePiece vocabulary and no chat template), end to end (slow): logits and greedy text
equal transformers' GGUF load; `toy infer --chat` answers with the built-in Gemma
template; a LoRA chat run on dialogue from the plays lowers the held-out loss, held in
the file's own blocks; and PEFT loads its adapter on transformers' gemma3 with toy's
logits. llama.cpp's side is in tests/formats/test_llamacpp.py."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.gguf_fixtures import gemma3_gguf, hf_gguf_model  # noqa: E402,F401

from toy.data.dialogue import conversations, write_jsonl  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def hf_gemma(gemma3_gguf):
    pytest.importorskip("transformers")
    return hf_gguf_model.__wrapped__(gemma3_gguf)  # its own: PEFT wraps it in place below


@pytest.fixture(scope="module")
def toy_gemma(gemma3_gguf):
    from toy.formats.gguf import read_gguf
    from toy.tokenizer import from_gguf_metadata

    g = read_gguf(gemma3_gguf, "quantized")
    return g.build_model(), from_gguf_metadata(g.metadata), g


def test_logits_and_greedy_text_equal_transformers(toy_gemma, hf_gemma, record_property):
    from toy.models.generate import generate

    model, tok, g = toy_gemma
    assert g.arch == "gemma3" and g.config.n_layer == 18 and g.config.vocab_size == 262144
    assert set(g.tensor_types) == {"F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"}  # a mixed file
    ids = tok.encode(PROMPT, add_special_tokens=True).ids
    assert ids[0] == 2  # <bos>: the file asks for it
    x = torch.tensor(
        [ids + tok.encode(" Paris, and the capital of Germany is", add_special_tokens=False).ids]
    )
    with torch.no_grad():
        diff = float((model(x) - hf_gemma(x).logits).abs().max())
    record_property("max_abs_logit_diff", diff)
    assert diff < 2e-3
    ours = list(generate(model, ids, 12, temperature=0.0))
    theirs = hf_gemma.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[
        0, len(ids) :
    ].tolist()
    assert ours == theirs[: len(ours)] and len(ours) >= 8, (tok.decode(ours), tok.decode(theirs))


def test_infer_chat_answers_with_the_builtin_gemma_template(gemma3_gguf, toy_run):
    r = toy_run(
        "infer",
        "--model",
        gemma3_gguf,
        "--chat",
        "Say hello.",
        "--temperature",
        "0",
        "--max-new-tokens",
        "12",
    )
    assert r.returncode == 0, r.stderr
    assert "built-in gemma template" in r.stderr
    assert r.stdout.strip()  # it answers


@pytest.fixture(scope="module")
def lora_run(gemma3_gguf, tmp_path_factory):
    from toy.cli.main import main

    d = tmp_path_factory.mktemp("gemma-lora")
    convs = conversations(bundled_text_paths(), 72, seed=5, turns=(1, 2), max_chars=200)
    write_jsonl(convs[:60], d / "train.jsonl")
    write_jsonl(convs[60:], d / "val.jsonl")
    code = main(
        [
            "train",
            "--recipe",
            "lora",
            "--model",
            str(gemma3_gguf),
            "--data",
            str(d / "train.jsonl"),
            "--val-data",
            str(d / "val.jsonl"),
            "--steps",
            "3",
            "--seq-len",
            "160",
            "--batch-size",
            "4",
            "--lr",
            "1e-3",
            "--warmup",
            "1",
            "--out",
            str(d),
            "--run-id",
            "g",
            "--json",
        ]
    )
    assert code == 0
    events = [json.loads(x) for x in (d / "g" / "events.jsonl").read_text().splitlines()]
    return d / "g", [e for e in events if e["event"] == "eval"]


def test_lora_chat_lowers_the_held_out_loss(lora_run, record_property):
    run, evals = lora_run
    info = json.loads((run / "run.json").read_text())
    assert info["arch"] == "gemma3"
    if info["precision"]["name"] == "bf16":  # auto holds the 0.54 GB bf16 copy: faster
        assert info["job"]["base_dtype"] == "bfloat16", info["job"]
        assert info["job"]["base_resident_bytes"] < 600e6
    else:  # the blocks, not 1 GB of float32
        assert info["job"]["base_dtype"] == "quantized", info["job"]
        assert info["job"]["base_resident_bytes"] < 300e6
    first, last = evals[0]["val_loss"], evals[-1]["val_loss"]
    record_property("val_loss_before", first)
    record_property("val_loss_after", last)
    assert last < first - 0.1, (first, last)


def test_peft_loads_the_adapter_on_transformers_gemma3_with_toys_logits(
    lora_run, toy_gemma, hf_gemma
):
    peft = pytest.importorskip("peft")
    from toy.formats.peft import load_peft_adapter
    from toy.lora import apply_lora, load_lora_state_dict, lora_state_dict

    run, _ = lora_run
    sd, cfg = load_peft_adapter(run / "final")
    assert any(float(v.abs().max()) > 0 for k, v in sd.items() if k.endswith("lora_B"))
    _, tok, g = toy_gemma
    model = g.build_model() if g.state_dict else None
    if model is None:
        from toy.formats.gguf import read_gguf

        model = read_gguf(g.path, "quantized").build_model()
    apply_lora(model, cfg["target_modules"], cfg["r"], cfg["lora_alpha"], 0.0, seed=0)
    load_lora_state_dict(model, sd)
    hf = peft.PeftModel.from_pretrained(hf_gemma, str(run / "final")).eval()
    ids = torch.tensor(
        [
            tok.encode(
                "<start_of_turn>user\nWho is there?<end_of_turn>\n<start_of_turn>model\n",
                add_special_tokens=True,
            ).ids
        ]
    )
    with torch.no_grad():
        ours = model.eval()(ids)
        theirs = hf(input_ids=ids).logits
    assert float((ours - theirs).abs().max()) < 1e-3
    assert set(lora_state_dict(model)) == set(sd)
