"""Tiny model directories of every transformers model_type toy reads, made here: random
weights saved by transformers' own `save_pretrained` (the reference for logits), a small
byte-level BPE with ChatML's markers, a chat template and a generation config; and their
MLX twins, made by mlx-lm's own `convert` (the reference for MLX logits).

    d = tiny_dir("qwen3")                          # transformers, float32
    d = tiny_dir("gemma2", dtype="bfloat16")
    d = tiny_dir("llama", shards=True)             # sharded, with model.safetensors.index.json
    m = mlx_dir("llama", bits=4, group_size=32)    # mlx_lm.convert -q

Import into a test module with `from model_dirs import tiny_dir, mlx_dir` (session-cached).
"""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import torch

TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "gemma3")
VOCAB = 320  # byte-level BPE: 256 bytes, 3 specials, the rest merges
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_ROOT: list[Path] = []


def set_root(path: Path) -> None:
    _ROOT[:] = [Path(path)]


def _root() -> Path:
    if not _ROOT:
        import tempfile

        _ROOT.append(Path(tempfile.mkdtemp(prefix="toy-model-dirs-")))
    return _ROOT[0]


@cache
def tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from toy.data.prep import bundled_text_paths

    text = bundled_text_paths()[0].read_text()[:20000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([text[i : i + 300] for i in range(0, len(text), 300)], trainer=trainer)
    return tok.to_str()


def _model(model_type: str):
    import transformers as T

    c = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    rope = dict(rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    six = {**c, "num_hidden_layers": 6}  # mlx-lm's gemma3 needs a whole sliding pattern
    if model_type == "llama":
        return T.LlamaForCausalLM(
            T.LlamaConfig(**c, head_dim=16, tie_word_embeddings=False, **rope)
        )
    if model_type == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(**c, head_dim=16, sliding_window=24, **rope))
    if model_type == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**c, tie_word_embeddings=True, **rope))
    if model_type == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(**c, head_dim=32, tie_word_embeddings=True, **rope))
    if model_type == "phi3":
        return T.Phi3ForCausalLM(T.Phi3Config(**c))
    if model_type == "gemma2":
        return T.Gemma2ForCausalLM(
            T.Gemma2Config(**c, head_dim=16, query_pre_attn_scalar=24, sliding_window=24)
        )
    if model_type == "gemma3_text":
        return T.Gemma3ForCausalLM(
            T.Gemma3TextConfig(**six, head_dim=16, query_pre_attn_scalar=24, sliding_window=6)
        )
    if model_type == "gemma3":
        text = {**six, "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 6}
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        )
        return T.Gemma3ForConditionalGeneration(
            T.Gemma3Config(
                text_config=text,
                vision_config=vision,
                mm_tokens_per_image=4,
                image_token_index=VOCAB - 1,
                boi_token_index=VOCAB - 3,
                eoi_token_index=VOCAB - 2,
            )
        )
    raise ValueError(f"unknown model_type {model_type!r}; valid: {', '.join(TYPES)}")


@cache
def tiny_dir(model_type: str, dtype: str = "float32", shards: bool = False) -> Path:
    """A transformers directory of a tiny random `model_type` model (2 layers, width 64;
    Gemma 3: 6), with norms and biases off their init so every tensor matters."""
    out = _root() / f"{model_type}-{dtype}{'-shards' if shards else ''}"
    if out.exists():
        return out
    torch.manual_seed(0)
    model = _model(model_type)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:  # Gemma stores w of x * (1 + w): around 0; the others around 1
                p.normal_(0.0 if model_type.startswith("gemma") else 1.0, 0.2)
            elif n.endswith(".bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.1)
    model = model.to(getattr(torch, dtype)).eval()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, **({"max_shard_size": "60KB"} if shards else {}))
    (tmp / "tokenizer.json").write_text(tokenizer_json())
    (tmp / "chat_template.jinja").write_text(CHATML)
    (tmp / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        )
    )
    (tmp / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1})
    )
    tmp.rename(out)
    return out


def hf_model(d: Path):
    """transformers' own model of a directory, float32, eval mode."""
    import transformers as T

    cls = (
        T.Gemma3ForConditionalGeneration
        if json.loads((d / "config.json").read_text())["model_type"] == "gemma3"
        else T.AutoModelForCausalLM
    )
    return cls.from_pretrained(d, dtype=torch.float32).eval()


@cache
def mlx_dir(model_type: str, bits: int = 4, group_size: int = 32, dtype: str = "float32") -> Path:
    """`mlx_lm.convert -q` of tiny_dir(model_type, dtype). mlx-lm reads rope_theta (and
    Gemma 3's vocab_size) at the top level only, where transformers 5 no longer writes
    them: they are copied there first (what a user's MLX directory, converted from a 4.x
    checkpoint, has)."""
    from mlx_lm import convert

    src = tiny_dir(model_type, dtype)
    fixed = _root() / f"{model_type}-{dtype}-for-mlx"
    if not fixed.exists():
        shutil.copytree(src, fixed)
        cfg = json.loads((fixed / "config.json").read_text())
        for c in (cfg, cfg.get("text_config") or {}):
            rp = c.get("rope_parameters") or {}
            if isinstance(rp.get("rope_theta"), (int, float)):
                c["rope_theta"] = rp["rope_theta"]
            for kind, key in (
                ("full_attention", "rope_theta"),
                ("sliding_attention", "rope_local_base_freq"),
            ):
                if isinstance(rp.get(kind), dict):
                    c[key] = rp[kind]["rope_theta"]
        if "text_config" in cfg:
            cfg["vocab_size"] = cfg["text_config"]["vocab_size"]
        (fixed / "config.json").write_text(json.dumps(cfg))
    out = _root() / f"mlx-{model_type}-{dtype}-q{bits}-g{group_size}"
    if not out.exists():
        convert(str(fixed), str(out), quantize=True, q_bits=bits, q_group_size=group_size)
    return out


def mlx_logits(d: Path, ids: torch.Tensor) -> torch.Tensor:
    """mlx-lm's own logits for token ids (B, T), float32."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(d))
    return torch.from_numpy(np.array(model(mx.array(ids.numpy())).astype(mx.float32)))
