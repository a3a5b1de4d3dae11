"""toy reads every supported GGUF family as llama.cpp's own converter writes it, with the
family's exact math: logits equal the transformers model the file was converted from
(tiny random models, f32, inputs longer than the sliding window), greedy text equal,
and the quantized base equal to the float one on the same dequantized values."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_families import FAMILIES, SLIDING_WINDOW, tiny_family  # noqa: E402,F401

from toy.formats.gguf import read_gguf  # noqa: E402

pytestmark = pytest.mark.slow
TOY_CLASS = {
    "llama": "Llama",
    "mistral": "Llama",
    "qwen3": "Llama",
    "phi3": "Phi3",
    "gemma3": "Gemma",
    "gemma2": "Gemma",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(family, tiny_family):
    tf = tiny_family(family)
    m = read_gguf(tf.gguf).build_model()
    assert type(m).__name__ == TOY_CLASS[family]
    # The converter drops Mistral's window (llama.cpp never reads it), so past the window
    # the file is a different model from the HF one: compare within it.
    n = SLIDING_WINDOW if family == "mistral" else 40
    ids = tf.input_ids(n)
    with torch.no_grad():
        want = tf.hf_model()(ids).logits
        got = m(ids)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    # greedy continuation, token for token
    from toy.models.generate import generate

    hf = tf.hf_model()
    out = hf.generate(ids[:, :8], max_new_tokens=8, do_sample=False)[0, 8:].tolist()
    mine = list(generate(m, ids[0, :8].tolist(), max_new_tokens=8, temperature=0.0))
    assert mine == out[: len(mine)] and len(mine) == 8


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "gemma3"])
def test_quantized_base_equals_the_float_base(family, tiny_family):
    tf = tiny_family(family, "q8_0")
    a = read_gguf(tf.gguf, "float32").build_model()
    b = read_gguf(tf.gguf, "quantized").build_model()
    assert any(type(x).__name__ == "QuantLinear" for x in b.modules())
    ids = tf.input_ids()
    with torch.no_grad():
        torch.testing.assert_close(b(ids), a(ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "phi3", "gemma3", "gemma2", "mistral"])
def test_lora_trains_and_exports_in_the_files_own_architecture(family, tiny_family, tmp_path):
    """LoRA on each family's base: trains on a token stream, and its adapter comes back as
    files the other tools load: PEFT on the transformers model the GGUF came from gives
    toy's adapted logits, and the gguf-lora carries the file's own architecture and
    tensor names (llama.cpp loads it: tests/formats/test_llamacpp.py)."""
    import json

    from toy.cli.main import main
    from toy.data.prep import bundled_text_paths
    from toy.formats.gguf_header import read_gguf_header
    from toy.formats.peft import load_peft_adapter
    from toy.lora import apply_lora, load_lora_state_dict

    tf = tiny_family(family)
    assert (
        main(
            [
                "prep",
                str(bundled_text_paths()[2]),
                "--out",
                str(tmp_path / "c.bin"),
                "--tokenizer",
                str(tf.gguf),
            ]
        )
        == 0
    )
    targets = "qkv_proj,gate_up_proj" if family == "phi3" else "q_proj,k_proj,v_proj,up_proj"
    assert (
        main(
            [
                "train",
                "--recipe",
                "lora",
                "--model",
                str(tf.gguf),
                "--corpus",
                str(tmp_path / "c.bin"),
                "--steps",
                "3",
                "--seq-len",
                "48",
                "--batch-size",
                "2",
                "--lr",
                "5e-2",
                "--warmup",
                "0",
                "--targets",
                targets,
                "--out",
                str(tmp_path),
                "--run-id",
                "r",
                "--eval-batches",
                "1",
            ]
        )
        == 0
    )
    final = tmp_path / "r" / "final"
    sd, cfg = load_peft_adapter(final)
    assert set(cfg["target_modules"]) == set(targets.split(","))
    # PEFT on the HF model the file came from
    peft = pytest.importorskip("peft")
    hf = peft.PeftModel.from_pretrained(tf.hf_model(), str(final)).eval()
    model = read_gguf(tf.gguf).build_model()
    apply_lora(model, targets.split(","), cfg["r"], cfg["lora_alpha"], 0.0, seed=0)
    load_lora_state_dict(model, sd)
    n = SLIDING_WINDOW if family == "mistral" else 40
    ids = tf.input_ids(n)
    with torch.no_grad():
        ours, theirs, base = model.eval()(ids), hf(input_ids=ids).logits, tf.hf_model()(ids).logits
    assert float((ours - base).abs().max()) > 1e-3  # the adapter changes the model
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    # gguf-lora: the file's architecture, the base's tensor names
    assert (
        main(
            [
                "export",
                str(tmp_path / "r"),
                "--format",
                "gguf-lora",
                "--out",
                str(tmp_path / "a.gguf"),
            ]
        )
        == 0
    )
    h = read_gguf_header(tmp_path / "a.gguf")
    arch = json.loads((tmp_path / "r" / "run.json").read_text())["arch"]
    assert (
        h.metadata["general.architecture"]
        == arch
        == read_gguf_header(tf.gguf).metadata["general.architecture"]
    )
    base_names = set(read_gguf_header(tf.gguf).tensors)
    assert {n.rsplit(".", 1)[0] for n in h.tensors} <= base_names
    assert (tmp_path / "r" / "checkpoints").is_dir()


@pytest.mark.parametrize("family", ["gemma3", "phi3"])
def test_warm_start_takes_a_donor_of_any_family(family, tiny_family, tmp_path):
    """A donor's embedding table and tokenizer, whatever its family (Gemma's is a
    SentencePiece vocabulary): the warmed model starts from the donor's rows."""
    import json

    from toy.cli.main import main
    from toy.data.prep import bundled_text_paths
    from toy.formats.gguf import read_gguf_tensor

    tf = tiny_family(family)
    assert (
        main(
            [
                "prep",
                str(bundled_text_paths()[3]),
                "--out",
                str(tmp_path / "c.bin"),
                "--tokenizer",
                str(tf.gguf),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "train",
                "--recipe",
                "warm-start",
                "--donor",
                str(tf.gguf),
                "--corpus",
                str(tmp_path / "c.bin"),
                "--init",
                "donor",
                "--preset",
                "tiny",
                "--d-model",
                "64",
                "--n-head",
                "4",
                "--steps",
                "2",
                "--seq-len",
                "32",
                "--batch-size",
                "2",
                "--eval-batches",
                "1",
                "--lr",
                "1e-9",
                "--min-lr",
                "0",
                "--warmup",
                "0",
                "--out",
                str(tmp_path),
                "--run-id",
                "w",
                "--json",
            ]
        )
        == 0
    )
    from safetensors.torch import load_file

    emb = load_file(tmp_path / "w" / "final" / "model.safetensors")["embed_tokens.weight"]
    table = read_gguf_tensor(tf.gguf, "token_embd.weight")
    assert emb.shape == table.shape
    torch.testing.assert_close(
        emb, table, rtol=0, atol=1e-6
    )  # copied as they are (equal widths), lr ~0
    info = json.loads((tmp_path / "w" / "run.json").read_text())
    assert info["job"]["donor_arch"] == {"gemma3": "gemma3", "phi3": "phi3"}[family]
