"""Preference-tuning pieces: a tiny base (`base`), encoded pairs, toy's model beside PEFT's
(`toy_and_peft`), mlx-lm's greedy text and toy's adapted logits on a model directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import model_dirs  # noqa: E402
from helpers.gguf_fixtures import tiny_model, write_llama_gguf  # noqa: E402
from helpers.model_dirs import hf_model, tiny_dir  # noqa: E402  # noqa: E402  # noqa: E402
from toy.data.preference import encode_pair, parse_pair  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402
from toy.formats.base_readers import read_base  # noqa: E402
from toy.lora import apply_lora  # noqa: E402
from toy.tokenizer import train_bpe  # noqa: E402

LINES = [
    ln.strip() for ln in bundled_text_paths()[0].read_text()[:40000].splitlines() if len(ln) > 24
]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny llama GGUF with ChatML markers, and 60 pairs whose chosen answers open
    with "Verily," (the style a user would see)."""
    d = tmp_path_factory.mktemp("pref")
    text = bundled_text_paths()[0].read_text()[:40000]
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    model = tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True), max_seq_len=256)
    gguf = write_llama_gguf(d / "base.gguf", model, tok)
    pairs = d / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps(
                {"prompt": LINES[i], "chosen": "Verily, " + LINES[i + 1], "rejected": LINES[i + 1]}
            )
            + "\n"
            for i in range(0, 120, 2)
        )
    )
    return {"gguf": gguf, "pairs": pairs, "dir": d}


def toy_and_peft(seed: int = 0):
    """The same tiny transformers llama in toy and in transformers + PEFT, and a function
    that gives both the same non-zero adapter on q_proj and v_proj (called after TRL's
    trainer is made: given a PEFT model whose adapter is already trained, TRL keeps a copy
    of it as the reference; a fresh one (B = 0) is the base, as toy's reference)."""
    from peft import LoraConfig, get_peft_model

    d = tiny_dir("llama")
    b = read_base(d, "float32")
    model = b.build_model()
    apply_lora(model, ["q_proj", "v_proj"], 4, 8.0, 0.0, seed)
    peft = get_peft_model(
        hf_model(d), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )

    def same_adapter():
        g = torch.Generator().manual_seed(seed)
        theirs = dict(peft.named_parameters())
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
                    mod, ab = n.rsplit(".", 1)
                    theirs[f"base_model.model.model.{mod}.{ab}.default.weight"].copy_(p)

    return b, model.eval(), peft.eval(), same_adapter


def encoded_pairs(b):
    s = b.special
    objs = [
        {"prompt": LINES[i], "chosen": "Verily, " + LINES[i + 1], "rejected": LINES[i + 3]}
        for i in range(0, 9, 3)
    ]
    return [
        encode_pair(
            b.tokenizer,
            b.chat_template,
            parse_pair(o)[0],
            96,
            b.token(s.bos),
            b.token(s.eos),
            s.eos,
        )
        for o in objs
    ]


def mlx_greedy(base: Path, adapter: Path, message: str, n: int) -> str:
    """mlx-lm's greedy reply to one chat message with `adapter` loaded by mlx_lm.load, its
    tokens decoded as toy prints them (special tokens left out)."""
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tok = load(str(base), adapter_path=str(adapter))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True
    )
    ids = [
        r.token
        for r in stream_generate(model, tok, prompt, max_tokens=n, sampler=make_sampler(0.0))
    ]
    return tok._tokenizer.decode(ids, skip_special_tokens=True)


IDS = torch.randint(3, model_dirs.VOCAB, (1, 30), generator=torch.Generator().manual_seed(2))


def toy_adapted_logits(run: Path) -> torch.Tensor:
    """toy's own logits for IDS with the run's adapter on its base (float32)."""
    from toy.formats.base_readers import read_base
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
