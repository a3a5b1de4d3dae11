"""Tiny random models of each GGUF family, converted by llama.cpp's own converter.

For a family in FAMILIES this builds a tiny random transformers model (float32, fixed
seed), saves it with a tokenizer, and converts it with the real `convert_hf_to_gguf.py`
(fetched by scripts/get-llama-converter.sh), so a test sees exactly the layout llama.cpp's
converter writes: tensor names, fused tensors, Q/K row order, norm offsets, metadata keys.
The saved HF model is the reference for logits.

- `tiny_family` (session fixture): a function `(family, outtype="f32") -> TinyFamily`;
  each (family, outtype) is built once per session. Skips (with the reason) when the
  converter or, for the BPE families, SmolLM2's GGUF (its tokenizer) cannot be fetched.
- `TinyFamilies(work_dir, smollm2_gguf=...)`: the same cache, usable outside pytest.

Shapes: 2 layers (gemma3: 6, see FAMILY_NOTES), hidden 64, 4 heads, 2 kv heads, head_dim 16,
intermediate 128. Tokenizers: SmolLM2's byte-level BPE (vocab 49152) for llama, mistral,
qwen3, phi3; a SentencePiece model trained here (vocab 1024, Gemma's special tokens) for
gemma2/gemma3, whose converter requires or prefers a `tokenizer.model`.

Import into a test module with `from helpers.tiny_families import tiny_family`.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from helpers.gguf_fixtures import fetch_smollm2  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONVERTER_SCRIPT = ROOT / "scripts" / "get-llama-converter.sh"
CORPUS = ROOT / "src" / "toy" / "data" / "assets" / "shakespeare" / "hamlet.txt"

FAMILIES = ("llama", "mistral", "qwen3", "phi3", "gemma3", "gemma2")
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
SLIDING_WINDOW = 16  # small, so a SEQ_LEN input runs past it
SEQ_LEN = 40
SEED = 0
BPE_VOCAB = 49152  # SmolLM2's tokenizer
GEMMA_VOCAB = 1024  # the SentencePiece model trained here

# What each family's file does and does not carry (checked by tests/models/test_tiny_families.py).
FAMILY_NOTES = {
    "llama": "arch llama; Q/K rows permuted for ggml's interleaved rope; tied output",
    "mistral": "arch llama (MistralForCausalLM converts as llama): the sliding window is NOT "
    "written, so the file equals the HF model only up to SLIDING_WINDOW tokens (and equals the "
    "same weights with full attention at any length); untied output",
    "qwen3": "arch qwen3; q/k RMSNorm per head (attn_q_norm/attn_k_norm); Q/K not permuted; tied",
    "phi3": "arch phi3; fused attn_qkv and fused ffn_up (gate then up); "
    "sliding_window written as 0 (llama.cpp disables phi3 SWA anyway); untied",
    "gemma3": "arch gemma3; every norm weight stored +1; no layer-type list in the file: llama.cpp "
    "takes every 6th layer as global (i % 6 == 5), hence 6 layers here (5 local, 1 global); "
    "query_pre_attn_scalar not stored (llama.cpp uses head_dim, d_model / n_head for the 62-layer "
    "27B: tests/models/test_gemma_query_scale.py), so it is head_dim here",
    "gemma2": "arch gemma2; every norm weight stored +1; "
    "layers alternate local/global (even = local); soft-capping stored; "
    "query_pre_attn_scalar not stored (head_dim here, as llama.cpp for all but the 46-layer 27B)",
}


@dataclass(frozen=True)
class TinyFamily:
    family: str
    outtype: str
    gguf: Path  # the converted file
    hf_dir: Path  # config.json, model.safetensors, tokenizer files: the reference

    def hf_model(self):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.hf_dir, dtype=torch.float32).eval()

    def hf_config(self) -> dict:
        return json.loads((self.hf_dir / "config.json").read_text())

    def input_ids(self, n: int = SEQ_LEN, seed: int = SEED) -> torch.Tensor:
        """A fixed (1, n) batch of ordinary (non-special) token ids."""
        vocab = self.hf_config()["vocab_size"]
        g = torch.Generator().manual_seed(seed)
        return torch.randint(8, vocab, (1, n), generator=g)


# ------------------------------------------------------------------ converter


def converter_dir(dest: Path | None = None) -> Path:
    """The directory holding convert_hf_to_gguf.py (cached by scripts/get-llama-converter.sh);
    pytest.skip with the reason when it cannot be fetched."""
    env = {**os.environ, "PYTHON": sys.executable}
    args = ["bash", str(CONVERTER_SCRIPT)] + ([str(dest)] if dest else [])
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(
            f"llama.cpp converter unavailable: scripts/get-llama-converter.sh did not run ({e})"
        )
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(
            "llama.cpp converter unavailable (no network to PyPI?): "
            f"get-llama-converter.sh failed: {why}"
        )
    path = Path(r.stdout.strip().splitlines()[-1])
    if not (path / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp converter unavailable: {path} has no convert_hf_to_gguf.py")
    return path


def _converted_key(converter: Path, hf_dir: Path, outtype: str, name: str | None) -> str:
    """What a converted file's bytes depend on: the converter's own code (its script and its
    gguf-py), every file of the HF directory, the outtype and name, and the libraries the
    converter imports (it runs in this interpreter, with transformers and torch)."""
    import hashlib

    import transformers

    h = hashlib.sha256()
    code = [converter / "convert_hf_to_gguf.py", *sorted((converter / "gguf-py").rglob("*.py"))]
    for f in [*code, *sorted(p for p in Path(hf_dir).iterdir() if p.is_file())]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    for part in (outtype, name, sys.version, transformers.__version__, torch.__version__):
        h.update(repr(part).encode())
    return h.hexdigest()[:24]


def convert(
    converter: Path, hf_dir: Path, out: Path, outtype: str = "f32", name: str | None = None
) -> Path:
    """The real converter's file for `hf_dir`: its output kept in REFERENCES (`kept`, keyed by
    _converted_key, so a changed converter, model, outtype or library converts anew) and
    copied to `out`. A converter run is a fresh interpreter importing torch and
    transformers (~4 s), paid by each xdist worker whose modules ask, 20 a suite: now once a
    machine."""
    import shutil

    from helpers.gguf_fixtures import kept

    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r}: expected one of {OUTTYPES}")
    made = kept(
        f"converted-{_converted_key(converter, hf_dir, outtype, name)}",
        lambda dest: _run_converter(converter, hf_dir, dest / "model.gguf", outtype, name),
        f"{Path(hf_dir).name} {outtype}\n",
    )
    shutil.copyfile(made / "model.gguf", out)
    return out


def _run_converter(
    converter: Path, hf_dir: Path, out: Path, outtype: str, name: str | None
) -> Path:
    """Run the real converter in a subprocess with its own gguf-py first on PYTHONPATH (so
    neither it nor this process sees the other's `gguf` package). Raises on failure."""
    env = {k: v for k, v in os.environ.items() if k not in ("NO_LOCAL_GGUF", "PYTHONPATH")}
    env.update(PYTHONPATH=str(converter / "gguf-py"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [
        sys.executable,
        str(converter / "convert_hf_to_gguf.py"),
        str(hf_dir),
        "--outtype",
        outtype,
        "--outfile",
        str(out),
    ]
    if name:
        cmd += ["--model-name", name]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if r.returncode != 0 or not out.is_file():
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-25:])
        raise RuntimeError(
            f"convert_hf_to_gguf.py failed on {hf_dir} (exit {r.returncode}):\n{tail}"
        )
    return out


# ------------------------------------------------------------------ tokenizers


def save_smollm2_tokenizer(smollm2_gguf: Path, dest: Path) -> Path:
    """SmolLM2's byte-level BPE (49152 ids), as transformers rebuilds it from the GGUF and
    saves it. The converter recognises its pre-tokenizer (hash -> "smollm")."""
    from helpers.gguf_fixtures import hf_gguf_tokenizer

    hf_gguf_tokenizer(Path(smollm2_gguf)).save_pretrained(dest)
    return dest


GEMMA_SPECIALS = ["<mask>", "<start_of_turn>", "<end_of_turn>"]  # ids 4, 5, 6
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def save_gemma_tokenizer(dest: Path, vocab_size: int = GEMMA_VOCAB) -> Path:
    """A SentencePiece BPE model shaped like Gemma's (ids 0..3 = <pad> <eos> <bos> <unk>,
    byte fallback, digits split, no dummy prefix, whitespace kept), trained on the bundled
    Hamlet, plus the HF GemmaTokenizer files transformers writes for it. Both converter
    classes for gemma read `tokenizer.model`, as they do for real Gemma checkpoints."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    lines = [ln for ln in CORPUS.read_text(encoding="utf-8")[:200_000].splitlines() if ln.strip()]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        user_defined_symbols=GEMMA_SPECIALS,
        byte_fallback=True,
        split_digits=True,
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    src = dest.parent / (dest.name + "-spm")
    src.mkdir(parents=True, exist_ok=True)
    (src / "tokenizer.model").write_bytes(buf.getvalue())
    (src / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GemmaTokenizer", "add_bos_token": True})
    )
    tok = AutoTokenizer.from_pretrained(src)  # transformers converts the SentencePiece model
    assert len(tok) == vocab_size, (len(tok), vocab_size)
    tok.save_pretrained(dest)
    (dest / "tokenizer.model").write_bytes(buf.getvalue())  # the converter reads this file
    # As on the Hub's Gemma repos: every added token is special (the converter's SentencePiece
    # path learns that only from tokenizer_config.json's added_tokens_decoder, then types them
    # CONTROL), and there is a chat template.
    tj = json.loads((dest / "tokenizer.json").read_text(encoding="utf-8"))
    for t in tj["added_tokens"]:
        t["special"] = True
    (dest / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    tc = json.loads((dest / "tokenizer_config.json").read_text(encoding="utf-8"))
    for k in ("vocab_file", "is_local", "local_files_only"):
        tc.pop(k, None)
    tc["added_tokens_decoder"] = {
        str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in tj["added_tokens"]
    }
    tc["chat_template"] = GEMMA_CHAT_TEMPLATE
    (dest / "tokenizer_config.json").write_text(
        json.dumps(tc, indent=2, ensure_ascii=False), encoding="utf-8"
    )
    return dest


# ------------------------------------------------------------------ models

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
)
BPE_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2)  # SmolLM2: <|im_start|>, <|im_end|>
GEMMA_IDS = dict(pad_token_id=0, eos_token_id=1, bos_token_id=2)


def hf_config(family: str, vocab_size: int):
    """The transformers config of the tiny model of `family` (no rope scaling anywhere)."""
    import transformers as tf

    if family == "llama":
        return tf.LlamaConfig(
            **SHAPE,
            **BPE_IDS,
            vocab_size=vocab_size,
            head_dim=16,
            max_position_embeddings=2048,
            rope_theta=100_000.0,
            tie_word_embeddings=True,
        )
    if family == "mistral":
        return tf.MistralConfig(
            **SHAPE,
            **BPE_IDS,
            vocab_size=vocab_size,
            head_dim=16,
            max_position_embeddings=2048,
            rope_theta=1_000_000.0,
            sliding_window=SLIDING_WINDOW,
            tie_word_embeddings=False,
        )
    if family == "qwen3":
        return tf.Qwen3Config(
            **SHAPE,
            **BPE_IDS,
            vocab_size=vocab_size,
            head_dim=16,
            max_position_embeddings=2048,
            rope_theta=1_000_000.0,
            tie_word_embeddings=True,
            use_sliding_window=False,
        )
    if (
        family == "phi3"
    ):  # head_dim is hidden/heads = 16; sliding_window None: llama.cpp ignores phi3's
        return tf.Phi3Config(
            **SHAPE,
            **BPE_IDS,
            vocab_size=vocab_size,
            max_position_embeddings=4096,
            original_max_position_embeddings=4096,
            rope_theta=10_000.0,
            tie_word_embeddings=False,
            sliding_window=None,
        )
    if family == "gemma3":
        shape = {**SHAPE, "num_hidden_layers": 6, "rms_norm_eps": 1e-6}
        rope = {
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 20_000.0},
        }  # not the 10k default
        return tf.Gemma3TextConfig(
            **shape,
            **GEMMA_IDS,
            vocab_size=vocab_size,
            head_dim=16,
            max_position_embeddings=2048,
            sliding_window=SLIDING_WINDOW,
            query_pre_attn_scalar=16,
            rope_parameters=rope,
            final_logit_softcapping=3.0,
            attn_logit_softcapping=None,
            tie_word_embeddings=True,
            architectures=["Gemma3ForCausalLM"],
        )
    if family == "gemma2":
        return tf.Gemma2Config(
            **{**SHAPE, "rms_norm_eps": 1e-6},
            **GEMMA_IDS,
            vocab_size=vocab_size,
            head_dim=16,
            max_position_embeddings=2048,
            sliding_window=SLIDING_WINDOW,
            query_pre_attn_scalar=16,
            rope_theta=10_000.0,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=3.0,
            tie_word_embeddings=True,
        )
    raise ValueError(f"unknown family {family!r}: expected one of {FAMILIES}")


def build_hf_model(family: str, dest: Path, tokenizer_dir: Path, seed: int = SEED):
    """Save a tiny random `family` model (float32) and the tokenizer in `dest`."""
    import shutil

    from transformers import AutoModelForCausalLM

    vocab_size = GEMMA_VOCAB if family.startswith("gemma") else BPE_VOCAB
    cfg = hf_config(family, vocab_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, family, seed)
    model.eval().save_pretrained(dest)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, dest / f.name)
    if family == "phi3":
        # The phi3 converter reads a SentencePiece tokenizer.model unless tokenizer_config.json
        # names GPT2Tokenizer, as Phi-4-mini's (a byte-level BPE under arch phi3) does.
        cfg_path = dest / "tokenizer_config.json"
        tok_cfg = json.loads(cfg_path.read_text())
        tok_cfg["tokenizer_class"] = "GPT2Tokenizer"
        cfg_path.write_text(json.dumps(tok_cfg, indent=2))
    return model


def _randomize(model, family: str, seed: int) -> None:
    """Weights larger than HF's init (std 0.02), so attention patterns, rope, the sliding
    window and soft-capping all change the logits visibly; norms away from identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                if family.startswith("gemma"):  # Gemma's RMSNorm scales by (1 + weight)
                    p.normal_(0.0, 0.3, generator=g)
                else:
                    p.uniform_(0.5, 1.5, generator=g)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1, generator=g)
            else:
                p.normal_(0.0, 0.15, generator=g)


# ------------------------------------------------------------------ reading a file back


def gguf_read(path: Path) -> tuple[dict, dict]:
    """(metadata, tensors) of a GGUF file, read with gguf.GGUFReader: every metadata key
    except the tokenizer's long arrays, as Python values; tensor name -> (ggml type name,
    numpy array in torch's (out, in) order; quantized types as their raw blocks). Read once
    a file and size (GGUFReader walks every vocabulary string: ~5 s for 49,152); callers
    only read what it returns."""
    return _gguf_read(Path(path), Path(path).stat().st_size)


@functools.cache
def _shared_reader(path: str, size: int, make):
    return make(path)


@contextlib.contextmanager
def one_gguf_reader():
    """While open, gguf.GGUFReader(path) gives one reader a file and size: a transformers
    GGUF load makes three (its config twice, then the weights), each walking every
    vocabulary string again (~5 s for 49,152). A reader is read-only: sharing it changes
    nothing that is read."""
    import gguf

    real = gguf.GGUFReader

    def shared(path, mode="r"):
        if mode != "r":
            return real(path, mode)
        return _shared_reader(str(path), os.stat(path).st_size, real)

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = real


@functools.cache
def _gguf_read(path: Path, size: int) -> tuple[dict, dict]:
    import gguf
    import numpy as np

    r = gguf.GGUFReader(str(path))
    skip = {
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.scores",
    }
    meta = {
        k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.") and k not in skip
    }
    tensors = {t.name: (t.tensor_type.name, np.array(t.data)) for t in r.tensors}
    return meta, tensors


# ------------------------------------------------------------------ the cache


class TinyFamilies:
    """Builds and caches, under `work`, each family's HF model (once) and its GGUF per outtype."""

    def __init__(self, work: Path, smollm2_gguf=None, converter: Path | None = None):
        self.work = Path(work)
        self._smollm2 = (
            smollm2_gguf  # a Path, or a callable returning one (fetched only when needed)
        )
        self._converter = converter
        self._tokenizers: dict[str, Path] = {}
        self._hf: dict[str, Path] = {}
        self._built: dict[tuple[str, str], TinyFamily] = {}

    def converter(self) -> Path:
        if self._converter is None:
            self._converter = converter_dir()
        return self._converter

    def tokenizer_dir(self, kind: str) -> Path:
        if kind not in self._tokenizers:
            dest = self.work / f"tokenizer-{kind}"
            if kind == "gemma":
                save_gemma_tokenizer(dest)
            else:
                gguf_path = self._smollm2() if callable(self._smollm2) else self._smollm2
                if gguf_path is None:
                    raise ValueError("the BPE families need SmolLM2's GGUF (smollm2_gguf=...)")
                save_smollm2_tokenizer(Path(gguf_path), dest)
            self._tokenizers[kind] = dest
        return self._tokenizers[kind]

    def hf_dir(self, family: str) -> Path:
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}: expected one of {FAMILIES}")
        if family not in self._hf:
            tok = self.tokenizer_dir("gemma" if family.startswith("gemma") else "bpe")
            dest = self.work / f"tiny-{family}"
            build_hf_model(family, dest, tok)
            self._hf[family] = dest
        return self._hf[family]

    def get(self, family: str, outtype: str = "f32") -> TinyFamily:
        key = (family, outtype)
        if key not in self._built:
            converter = self.converter()  # first: skip before building anything when it is missing
            hf = self.hf_dir(family)
            out = convert(
                converter,
                hf,
                self.work / f"tiny-{family}-{outtype}.gguf",
                outtype,
                name=f"tiny-{family}",
            )
            self._built[key] = TinyFamily(family, outtype, out, hf)
        return self._built[key]


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """`tiny_family(family, outtype="f32") -> TinyFamily`, built once per session."""
    work = tmp_path_factory.mktemp("tiny-families")
    cache = TinyFamilies(
        work, smollm2_gguf=lambda: fetch_smollm2(tmp_path_factory.mktemp("smollm2"))
    )
    return cache.get
