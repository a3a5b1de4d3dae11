"""One benchmark child: from-scratch training steps at a fixed shape, toy vs transformers.

    python bench/scratch_step.py --impl toy|hf|nanogpt --arch llama|gpt2 [--steps 6] [--compile]
        [--precision float32|bf16] [--peer-dir DIR (nanogpt)] [--tune-malloc (peers)]
    python bench/scratch_step.py --write-corpus PATH   (the synthetic corpus, for `toy train`)
Shape (issue 8): 6 layers, 384 wide, 6 heads, sequence 256, batch 8, vocab 8192;
--precision float32 (default) or bf16 (toy's --precision bf16; the peer under CPU autocast).
toy runs its real recipe and loop on a synthetic token file; the peer is transformers'
LlamaForCausalLM / GPT2LMHeadModel (SDPA) with torch.optim.AdamW on the same windows.
Prints one JSON line: tokens_per_s, params, flops_per_token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

L, D, H, T, B, V = 6, 384, 6, 256, 8, 8192


def corpus(p: Path) -> Path:
    from toy.data.tokens import write_tokens

    p.parent.mkdir(parents=True, exist_ok=True)
    write_tokens(p, np.random.default_rng(0).integers(0, V, size=400_000), V)
    return p


def flops_per_token(n_params_no_embed: int, n_embed: int) -> float:
    # 6N for the matmuls (forward + backward; the tied head counts once as a matmul)
    # plus attention: 12 * L * T * D per token (QK^T and AV, forward and backward), causal
    # halving ignored as PaLM's MFU convention does.
    return 6 * (n_params_no_embed + n_embed) + 12 * L * T * D


def run_toy(a, path: Path) -> dict:
    from toy.recipes import from_scratch, load_recipe
    from toy.runs import EventLog, Project
    from toy.train.config import RunConfig
    from toy.train.loop import train

    opts = load_recipe("from-scratch").config(
        corpus=str(path),
        arch=a.arch,
        preset="small",
        n_layer=L,
        d_model=D,
        n_head=H,
        n_kv_head=H if a.arch == "llama" else None,
        seq_len=T,
        batch_size=B,
        seed=0,
        eval_batches=1,
    )
    built = from_scratch.build(opts, Project(root=None))
    built.job.eval_batches = lambda: []
    cfg = RunConfig(
        steps=3 + a.steps,
        batch_size=B,
        lr=1e-3,
        warmup=0,
        compile=a.compile,
        precision=a.precision,
    )
    res = train(built.job, cfg, None, torch.device("cpu"), EventLog(None))
    m = built.job.model
    emb = m.embed_tokens.weight.numel() if hasattr(m, "embed_tokens") else m.wte.weight.numel()
    n = sum(p.numel() for p in m.parameters())
    return {
        "tokens_per_s": res.items_per_s,
        "params": n,
        "flops_per_token": flops_per_token(n - emb, emb),
    }


def peer(arch: str, path: Path):
    """transformers' model of this shape, and its training step: step(k) -> tokens."""
    import transformers

    from toy.data.tokens import Windows, read_tokens

    torch.manual_seed(0)
    if arch == "llama":
        from toy.models.llama import LlamaConfig

        d_ff = LlamaConfig(d_model=D, n_head=H).d_ff  # the same SwiGLU width toy uses
        cfg = transformers.LlamaConfig(
            vocab_size=V,
            hidden_size=D,
            intermediate_size=d_ff,
            num_hidden_layers=L,
            num_attention_heads=H,
            num_key_value_heads=H,
            max_position_embeddings=T,
            tie_word_embeddings=True,
        )
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    else:
        cfg = transformers.GPT2Config(
            vocab_size=V,
            n_embd=D,
            n_layer=L,
            n_head=H,
            n_positions=T,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        model = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")
    model.train()
    win = Windows(read_tokens(path), T, B, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def step(k: int) -> int:
        b = win.batch(k)
        logits = model(input_ids=b["ids"], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), b["targets"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        return B * T

    return model, step


def nanogpt_peer(path: Path, peer_dir: Path):
    """nano_gpt's GPT (PyPI `nano-gpt`: Karpathy's build-nanogpt model, packaged by A. Porter),
    fetched by bench/run.py into build/ at bench time and never committed; the gpt2 shape with
    its own loss (whole logits + F.cross_entropy) and torch AdamW, as its trainer steps."""
    import sys
    import types

    from toy.data.tokens import Windows, read_tokens

    sys.path.insert(0, str(peer_dir))
    sys.modules.setdefault("tiktoken", types.ModuleType("tiktoken"))  # only its tokenizer uses it
    from nano_gpt.config import GPTConfig
    from nano_gpt.model import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=T, vocab_size=V, n_layer=L, n_head=H, n_embd=D), None)
    model.train()
    win = Windows(read_tokens(path), T, B, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def step(k: int) -> int:
        b = win.batch(k)
        _, loss = model(b["ids"].contiguous(), b["targets"].contiguous())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        return B * T

    return model, step


def autocast_step(step, precision: str):
    """The peer's step as its user would write it: under CPU bf16 autocast for bf16."""
    if precision != "bf16":
        return step

    def bf16_step(k: int) -> int:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return step(k)

    return bf16_step


def run_hf(a, path: Path) -> dict:
    if a.impl == "nanogpt":
        model, step = nanogpt_peer(path, a.peer_dir)
    else:
        model, step = peer(a.arch, path)
    step = autocast_step(step, a.precision)
    times = []
    for k in range(3 + a.steps):
        t = time.perf_counter()
        step(k)
        if k >= 3:
            times.append(time.perf_counter() - t)
    n = sum(p.numel() for p in model.parameters())
    emb = (
        model.transformer.wte.weight.numel()
        if a.impl == "nanogpt"
        else model.get_input_embeddings().weight.numel()
    )
    return {
        "tokens_per_s": B * T / statistics.mean(times),
        "params": n,
        "flops_per_token": flops_per_token(n - emb, emb),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("toy", "hf", "nanogpt"))
    ap.add_argument("--peer-dir", type=Path, help="nanogpt: where nano_gpt/ was unpacked")
    ap.add_argument("--write-corpus", type=Path, metavar="PATH")
    ap.add_argument(
        "--compile", action="store_true", help="toy: --compile (torch.compile each block)"
    )
    ap.add_argument("--arch", choices=("llama", "gpt2"), default="llama")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument(
        "--tune-malloc",
        action="store_true",
        help="hf, nanogpt: with toy's allocator setting (runs.tune_malloc)",
    )
    ap.add_argument(
        "--precision",
        choices=("float32", "bf16"),
        default="float32",
        help="toy: --precision; the peer: its step under torch.autocast('cpu', bfloat16) "
        "(the one line a user adds)",
    )
    a = ap.parse_args()
    if a.write_corpus:
        print(json.dumps({"corpus": str(corpus(a.write_corpus))}))
        return
    if not a.impl:
        ap.error("give --impl or --write-corpus")
    if a.impl == "toy" or a.tune_malloc:
        from toy.runs import tune_malloc

        tune_malloc()  # what `toy train` does at start
    with tempfile.TemporaryDirectory() as d:
        path = corpus(Path(d) / "synthetic.bin")
        out = (run_toy if a.impl == "toy" else run_hf)(a, path)
    print(
        json.dumps(
            {
                "impl": a.impl,
                "arch": a.arch,
                "precision": a.precision,
                **{k: round(v, 1) for k, v in out.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
