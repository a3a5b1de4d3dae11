"""`toy infer --model BASE --adapter FILE.gguf`: toy's own LoRA adapter GGUF (`toy export
--format gguf-lora`, llama.cpp's --lora layout) applies as the run's PEFT adapter does; an
adapter for another model shape, or a model GGUF given as --adapter, is one line, exit 2."""

from __future__ import annotations

import pytest
from helpers.gguf_fixtures import gguf_name, tiny_model, write_llama_gguf  # noqa: E402

PROMPT = "HAMLET. "


def _one_line_exit_2(code, err, *needles):
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    from toy.cli.main import main
    from toy.data.dialogue import conversations, write_jsonl
    from toy.data.prep import bundled_text_paths
    from toy.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("gguf-adapter")
    text = bundled_text_paths()[0].read_text()[:30000]
    tok = train_bpe([text[i : i + 500] for i in range(0, len(text), 500)], vocab_size=300)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    vocab = tok.get_vocab_size(with_added_tokens=True)

    def base(name, **shape):
        model = tiny_model(vocab_size=vocab, max_seq_len=256, **shape)
        qtypes = {gguf_name(n): "Q8_0" for n, p in model.named_parameters() if p.dim() == 2}
        return write_llama_gguf(d / name, model, tok, qtypes=qtypes)

    chat = write_jsonl(
        conversations(bundled_text_paths(), 12, seed=1, turns=(1, 1), max_chars=120), d / "c.jsonl"
    )
    b = base("base.gguf")
    flags = ["--steps", "3", "--seq-len", "128", "--batch-size", "2", "--eval-batches", "1"]
    flags += ["--lr", "3e-2", "--warmup", "0", "--targets", "q_proj,k_proj,v_proj", "--rank", "4"]
    argv = ["train", "--recipe", "lora", "--model", str(b), "--data", str(chat)]
    assert main([*argv, "--out", str(d / "runs"), "--run-id", "l", *flags]) == 0
    run = d / "runs" / "l"
    ad = d / "adapter.gguf"
    assert main(["export", str(run), "--format", "gguf-lora", "--out", str(ad)]) == 0
    return {"base": b, "run": run, "adapter": ad, "wide": base("wide.gguf", d_model=96)}


def _greedy(toy_cli, *flags):
    code, out, err = toy_cli(
        "infer", "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "16", *flags
    )
    return code, out, err


def test_a_gguf_adapter_applies_as_the_runs_own_adapter(lora, toy_cli):
    code, via_gguf, err = _greedy(toy_cli, "--model", lora["base"], "--adapter", lora["adapter"])
    assert code == 0, err
    code, via_peft, err = _greedy(toy_cli, "--model", lora["base"], "--adapter", lora["run"])
    assert code == 0, err
    code, plain, err = _greedy(toy_cli, "--model", lora["base"])
    assert code == 0, err
    assert via_gguf == via_peft
    assert via_gguf != plain  # the adapter changes the text: it was applied


def test_a_gguf_adapter_on_the_wrong_base_is_one_line(lora, toy_cli):
    code, _, err = _greedy(toy_cli, "--model", lora["wide"], "--adapter", lora["adapter"])
    _one_line_exit_2(code, err, f"--adapter {lora['adapter']}", "does not fit", str(lora["wide"]))
    code, _, err = _greedy(toy_cli, "--model", lora["base"], "--adapter", lora["wide"])
    _one_line_exit_2(code, err, "is a model GGUF, not a LoRA adapter", "--model")
