"""Make SmolLM2-135M-Instruct as a transformers directory and as its MLX 4-bit twin, from the GGUF.

    PYTHONPATH=src python scripts/make_smollm2_dirs.py [--gguf FILE] [--check]
    (or scripts/get-smollm2-dirs.sh [--check], which sets that up)

Real model directories for tests and benchmarks of transformers/MLX bases, made offline from the
Q4_1 GGUF that scripts/get-smollm2.sh fetches (no model hub):

1. transformers (BF16): `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` dequantizes the
   GGUF, but a GGUF-loaded model will not `save_pretrained` (it carries a GGUF quantization
   config), so its state dict is copied into a fresh model built from the same config (without
   that quantization config), cast to bfloat16 and saved with the GGUF's tokenizer, chat template
   and generation config (eos = <|im_end|>).
2. MLX: `mlx_lm.convert(hf_dir, quantize=True)`: affine, 4 bits, group size 64 (mlx-lm's
   defaults; --q-bits, --q-group-size for others), plus a top-level rope_theta in its config.json
   (see make_mlx). Beware: this 135M model, already 4-bit in the GGUF, does not survive a second
   4-bit rounding with groups of 64: mlx_lm's greedy answer turns to nonsense (groups of 32, or 6
   or 8 bits, answer well).

Both are kept in ${XDG_CACHE_HOME:-~/.cache}/toy/models/, named after the GGUF's sha256, and made
once: each is built in a temporary directory there and renamed into place when complete, so a
directory that exists is whole. The two paths are printed on stdout (transformers first).

--check loads them again and prints greedy answers to a chat prompt on stderr: transformers from
the directory must equal transformers from the GGUF loaded in the same dtype (bfloat16: the same
weights), else exit 1; the float32 GGUF's answer and mlx_lm.generate's on the MLX directory are
printed for comparison (a 4-bit requantization of a 4-bit model need not give the same text).
Also the weights: every saved tensor must equal the GGUF's, dequantized by transformers, in
bfloat16.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; never reach for the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

NAME = "smollm2-135m-instruct"
PROMPT = "What is the capital of France? Answer in one sentence."
MAX_NEW = 40


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def smollm2_gguf() -> tuple[Path, str]:
    """The cached SmolLM2 GGUF (fetched and sha256-checked by toy's fetch), and its sha256."""
    from toy.cli.cmd_fetch import MODELS, cache_dir, fetch

    known = MODELS["smollm2"]
    with (
        tempfile.TemporaryDirectory() as d
    ):  # fetch links the file into a dir; we want the cache copy
        fetch(known, Path(d))
    return cache_dir() / known.cached, known.sha256


def build_once(target: Path, make) -> bool:
    """Run make(tmp_dir) and rename tmp_dir to target, unless target exists. True if built."""
    if target.is_dir():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        make(tmp / "out")
        os.replace(tmp / "out", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


def load_gguf(gguf: Path, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    return model, tok


def make_hf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    src, tok = load_gguf(gguf, torch.float32)
    config = src.config.__class__.from_dict(src.config.to_dict())
    for key in ("quantization_config", "_model_name_or_path"):  # GGUF loading's, not the model's
        if hasattr(config, key):
            delattr(config, key)
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(src.state_dict())  # strict: every tensor of the GGUF has its place
    model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)  # tokenizer.json, tokenizer_config.json, chat_template.jinja


def make_mlx(hf_dir: Path, out: Path, bits: int, group_size: int) -> None:
    from mlx_lm import convert

    convert(
        str(hf_dir),
        mlx_path=str(out),
        quantize=True,
        q_bits=bits,
        q_group_size=group_size,
        q_mode="affine",
    )
    # transformers 5 nests rope_theta under rope_parameters; mlx-lm 0.32's llama reads only a
    # top-level rope_theta (default 10000, where SmolLM2 has 100000) and would give garbage.
    # convert copies the config as is, so add the top-level key, as a config written by
    # transformers 4 has it.
    path = out / "config.json"
    config = json.loads(path.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            config.setdefault("rope_scaling", rope)
        path.write_text(json.dumps(config, indent=4, sort_keys=True))


def greedy_transformers(model, tok) -> str:
    import torch

    ids = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=MAX_NEW, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def check(gguf: Path, hf_dir: Path, mlx_dir: Path) -> bool:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved = load_file(hf_dir / "model.safetensors")
    want = load_gguf(gguf, torch.float32)[0].state_dict()
    same = [k for k in saved if torch.equal(saved[k], want[k].to(torch.bfloat16))]
    log(
        f"weights: {len(same)} of {len(saved)} saved tensors equal the GGUF's "
        "(dequantized, rounded to bf16); "
        f"not saved (tied): {sorted(set(want) - set(saved))}"
    )
    if len(same) != len(saved):
        log("FAIL: the saved weights are not the GGUF's")
        return False

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    from_dir = greedy_transformers(
        AutoModelForCausalLM.from_pretrained(hf_dir), tok
    )  # bf16, as saved
    from_gguf = greedy_transformers(*load_gguf(gguf, torch.bfloat16))
    from_gguf32 = greedy_transformers(*load_gguf(gguf, torch.float32))
    log(f"prompt: {PROMPT!r} (chat template, greedy, {MAX_NEW} new tokens)")
    log(f"transformers, directory (bf16): {from_dir!r}")
    log(f"transformers, GGUF (bf16):      {from_gguf!r}")
    log(f"transformers, GGUF (float32):   {from_gguf32!r}")

    from mlx_lm import generate, load

    model, mtok = load(str(mlx_dir))
    prompt = mtok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True
    )
    answer = generate(model, mtok, prompt=prompt, max_tokens=MAX_NEW)
    log(f"mlx_lm, {mlx_dir.name[-17:]}:  {answer!r}")
    if from_dir != from_gguf:
        log("FAIL: the transformers directory does not give the GGUF's greedy text")
        return False
    return True


def main() -> int:
    from toy.cli.cmd_fetch import cache_dir, sha256

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--gguf",
        type=Path,
        help="SmolLM2 GGUF to start from (default: fetch the cached one, as "
        "scripts/get-smollm2.sh)",
    )
    p.add_argument(
        "--check", action="store_true", help="compare greedy text: directory against GGUF, and MLX"
    )
    p.add_argument(
        "--q-bits", type=int, default=4, choices=(2, 3, 4, 5, 6, 8), help="MLX bits (default 4)"
    )
    p.add_argument(
        "--q-group-size",
        type=int,
        default=64,
        choices=(32, 64, 128),
        help="MLX group size (default 64, mlx-lm's; 32 matches the GGUF's Q4_1 blocks)",
    )
    args = p.parse_args()
    if args.gguf is None:
        gguf, digest = smollm2_gguf()
    else:
        if not args.gguf.is_file():
            log(
                f"error: --gguf {args.gguf}: no such file; "
                "give the SmolLM2 GGUF (scripts/get-smollm2.sh)"
            )
            return 2
        gguf, digest = args.gguf.resolve(), sha256(args.gguf)

    stem = f"{NAME}-{digest[:12]}"
    hf_dir = cache_dir() / f"{stem}-hf-bf16"
    mlx_dir = cache_dir() / f"{stem}-mlx-affine-q{args.q_bits}-g{args.q_group_size}"
    if build_once(hf_dir, lambda out: make_hf(gguf, out)):
        log(f"made {hf_dir}")
    if build_once(mlx_dir, lambda out: make_mlx(hf_dir, out, args.q_bits, args.q_group_size)):
        log(f"made {mlx_dir}")
    print(hf_dir)
    print(mlx_dir)
    if args.check and not check(gguf, hf_dir, mlx_dir):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
