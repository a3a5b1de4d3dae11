"""GGUF fixtures and writers shared by tests.

- `smollm2_gguf` (session): SmolLM2-135M-Instruct Q4_1 fetched by scripts/get-smollm2.sh
  (cached in ~/.cache/toy/models); skips with the reason when it cannot be fetched.
- `gemma3_gguf` (session): Gemma-3-270M Q4_K_M (SentencePiece-style vocabulary of 262,144
  tokens) fetched by scripts/get-gemma3.sh, cached and skipped the same way.
- `write_llama_gguf`: a toy Llama + tokenizer written the way llama.cpp's converter
  writes a HF llama (Q/K rows permuted for ggml's interleaved rope), for round trips.

Import a fixture into a test module with `from helpers.gguf_fixtures import smollm2_gguf`.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def _fetch(script: str, what: str, dest: Path) -> Path:
    """Run scripts/<script> DEST and return the path it prints; skip the test, with the
    script's last error line, when the model cannot be fetched (no network to PyPI)."""
    env = {**os.environ, "PYTHON": sys.executable}
    try:
        r = subprocess.run(
            ["bash", str(SCRIPTS / script), str(dest)],
            capture_output=True,
            text=True,
            timeout=900,
            env=env,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"{what} GGUF unavailable: scripts/{script} did not run ({e})")
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(
            f"{what} GGUF unavailable (no network to PyPI?): scripts/{script} failed: {why}"
        )
    path = Path(r.stdout.strip().splitlines()[-1])
    if not path.is_file():
        pytest.skip(
            f"{what} GGUF unavailable: scripts/{script} printed {path}, which is not a file"
        )
    return path


def fetch_smollm2(dest: Path) -> Path:
    """Run scripts/get-smollm2.sh into `dest`; pytest.skip (with the reason) when it cannot."""
    return _fetch("get-smollm2.sh", "SmolLM2", dest)


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory) -> Path:
    """Path to SmolLM2-135M-Instruct.Q4_1.gguf (a link into the user's cache)."""
    return fetch_smollm2(tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory) -> Path:
    """Path to gemma-3-270m.gguf, Q4_K_M (a link into the user's cache)."""
    return _fetch("get-gemma3.sh", "Gemma-3-270M", tmp_path_factory.mktemp("gemma3"))


# transformers' own loads of a real model's GGUF, kept for later runs (a SmolLM2 model load
# dequantizes 135M weights in Python, 15-50 s; Gemma-3's tokenizer rebuilds 262,144 pieces,
# half a minute; each paid by each xdist worker whose modules ask, and by every run):
# what transformers made, written by its own save_pretrained and read back by its own
# from_pretrained, keyed by the file's bytes and the transformers, tokenizers and torch
# versions, so a changed file or library makes it anew. Files under REFERENCE_MIN_BYTES
# (the tests' tiny GGUFs, written each run) are read from the GGUF each time, but the tiny
# families' (tests/helpers/tiny_families.py: the converter's output, kept by its inputs).
REFERENCES = Path.home() / ".cache" / "toy" / "test-references"
REFERENCE_MIN_BYTES = 32 << 20


def kept(name: str, make, note: str) -> Path:
    """REFERENCES/`name`, a folder made by `make(dest)` under a lock the first time (the
    other worker waits, then reads what this one made), in a temporary folder renamed into
    place once whole; `note` goes in its `done` marker."""
    import fcntl
    import shutil
    import tempfile

    dest = REFERENCES / name
    REFERENCES.mkdir(parents=True, exist_ok=True)
    with open(REFERENCES / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / "done").is_file():
            tmp = Path(tempfile.mkdtemp(dir=REFERENCES, prefix=f".{name}-"))
            try:
                make(tmp)
                (tmp / "done").write_text(note)
                shutil.rmtree(dest, ignore_errors=True)
                tmp.rename(dest)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _reference_dir(
    path: Path, what: str, make, min_bytes: int = REFERENCE_MIN_BYTES
) -> Path | None:
    """The folder holding transformers' `what` ("model" or "tokenizer", or a name that
    also says how it was loaded) of the GGUF at `path`, made by `make(dest)` the first time
    (`kept`); None for a file under `min_bytes`."""
    import hashlib

    import tokenizers
    import transformers

    path = Path(path).resolve()
    if path.stat().st_size < min_bytes:
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    versions = f"{transformers.__version__}-{tokenizers.__version__}-{torch.__version__}"
    key = hashlib.sha256(f"{h.hexdigest()}-{versions}".encode()).hexdigest()[:20]
    return kept(f"{what}-{key}", make, f"{path.name} {versions}\n")


def save_gguf_load(model, dest: Path) -> None:
    """Save transformers' float32 load of a GGUF with its own save_pretrained: its weights
    are float32 tensors already, but transformers marks a GGUF load quantized ("gguf") and
    refuses to save it as such."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(dest)


@functools.cache
def hf_gguf_model(path: Path):
    """transformers' own float32 load of a GGUF (eval mode), once per test process, from
    the reference kept for later runs where the file is a real model's. Shared: never
    modify it (wrap a copy.deepcopy, e.g. for PEFT)."""
    import transformers

    def load(src, **kw):
        return transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw)

    def make(dest: Path) -> None:
        save_gguf_load(load(str(path.parent), gguf_file=path.name), dest)

    folder = _reference_dir(path, "model", make)
    if folder is None:
        return load(str(path.parent), gguf_file=path.name).eval()
    return load(str(folder)).eval()


@functools.cache
def hf_gguf_tokenizer(path: Path):
    """transformers' tokenizer rebuilt from a GGUF's vocabulary, once per test process,
    from the reference kept for later runs where the file is a real model's."""
    import transformers

    def make(dest: Path) -> None:
        transformers.AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name
        ).save_pretrained(dest)

    folder = _reference_dir(path, "tokenizer", make)
    if folder is None:
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to HF Q/K rows: within each head, rows
    [0..D/2) and [D/2..D) are interleaved (0, D/2, 1, D/2+1, ...) for ggml's adjacent-pair
    rope. Written independently of toy's own permute/unpermute on purpose."""
    rows = w.shape[0]
    d = rows // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokenizer_fields(tok) -> dict:
    """tokens, merges and token types of an HF byte-level BPE, as a GGUF stores them."""
    j = json.loads(tok.to_str())
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "ids must be dense"
    merges = [m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]]
    special = {a["content"] for a in j["added_tokens"] if a["special"]}
    types = [3 if t in special else 1 for t in tokens]
    return {"tokens": tokens, "merges": merges, "types": types}


GGUF_NAMES = {  # toy suffix -> GGUF suffix (per layer)
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(toy_name: str) -> str:
    """toy parameter name -> GGUF tensor name, as llama.cpp's converter names them."""
    top = {
        "embed_tokens.weight": "token_embd.weight",
        "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if toy_name in top:
        return top[toy_name]
    _, i, rest = toy_name.split(".", 2)
    return f"blk.{i}.{GGUF_NAMES[rest]}"


CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def write_llama_gguf(
    path: Path,
    model,
    tok,
    *,
    arch: str = "llama",
    permute: bool = True,
    pre: str = "default",
    qtypes: dict[str, str] | None = None,
    drop: Iterable[str] = (),
    replace: dict[str, np.ndarray] | None = None,
    extra_kv: dict | None = None,
    chat_template: str = CHATML,
) -> Path:
    """Write a toy Llama (+ tokenizer) as llama.cpp would: llama Q/K rows permuted,
    `output.weight` only when untied. qtypes: GGUF tensor name -> quant type name
    (e.g. "Q8_0"); drop: GGUF tensor names to leave out; replace: GGUF tensor name ->
    array written instead (numpy/torch order); chat_template: written with the tokenizer;
    extra_kv: more keys (str, bool or uint32), which may replace the tokenizer's bos/eos
    ids and add_bos_token (default: both <|endoftext|>, add_bos_token false)."""
    import gguf

    cfg = model.cfg
    qtypes, replace, drop = qtypes or {}, replace or {}, set(drop)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("toy-test")
    w.add_block_count(cfg.n_layer)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_kv_head)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if tok is not None:
        f = tokenizer_fields(tok)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(f["tokens"])
        w.add_token_types(f["types"])
        w.add_token_merges(f["merges"])
        eos = tok.token_to_id("<|endoftext|>")
        extra = extra_kv or {}
        # extra_kv may set these itself (a BOS of its own, add_bos_token true).
        if "tokenizer.ggml.bos_token_id" not in extra:
            w.add_bos_token_id(eos)
        if "tokenizer.ggml.eos_token_id" not in extra:
            w.add_eos_token_id(eos)
        if "tokenizer.ggml.add_bos_token" not in extra:
            w.add_add_bos_token(False)
        w.add_chat_template(chat_template)
    for k, v in (extra_kv or {}).items():
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, bool):
            w.add_bool(k, v)
        else:
            w.add_uint32(k, v)

    sd = model.state_dict()
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight")
    for name, t in sd.items():
        g = gguf_name(name)
        if g in drop:
            continue
        a = t.detach().float().numpy().copy()
        if arch == "llama" and permute and ".attn_q." in g:
            a = converter_permute(a, cfg.n_head)
        elif arch == "llama" and permute and ".attn_k." in g:
            a = converter_permute(a, cfg.n_kv_head)
        a = np.ascontiguousarray(replace.get(g, a), dtype=np.float32)
        q = qtypes.get(g)
        if q is None:
            w.add_tensor(g, a)
        else:
            qt = gguf.GGMLQuantizationType[q]
            w.add_tensor(g, gguf.quants.quantize(a, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_model(seed: int = 0, **overrides):
    """The registry's `tiny` llama (2 layers, width 64, 4 heads / 2 kv heads), random
    weights with non-trivial norms and biases so every tensor matters."""
    from toy.models.llama import Llama, LlamaConfig

    fields = dict(vocab_size=300, n_layer=2, d_model=64, n_head=4, n_kv_head=2, max_seq_len=64)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = Llama(LlamaConfig(**fields))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif n.endswith(".bias"):
                p.normal_(0.0, 0.1)
            else:  # larger than the init so attention patterns (and so rope) really matter
                p.normal_(0.0, 0.15)
    return model.eval()
