"""`toy describe MODEL.gguf`: what a GGUF holds, from its header (nothing dequantized)."""

from __future__ import annotations

import json
from pathlib import Path

from toy.cli.args import human_size


def add_parser(sub) -> None:
    p = sub.add_parser("describe", help="show a GGUF model's architecture, size, tokenizer", description=__doc__)
    p.add_argument("model", metavar="MODEL.gguf")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from toy.formats.gguf import describe_gguf

    d = describe_gguf(Path(args.model))
    if args.json:
        print(json.dumps({"format": "toy/describe-v1", **d}))
        return 0
    hp = d["hyperparameters"]
    tok = d["tokenizer"]
    print(f"{d['path']}  ({human_size(d['file_size'])}, GGUF v{d['gguf_version']})")
    if d.get("name"):
        print(f"name          {d['name']}")
    print(f"architecture  {d['arch']}: {hp['n_layer']} layers, width {hp['d_model']}, "
          f"{hp['n_head']} heads / {hp['n_kv_head']} kv heads (head {hp['head_dim']}), ffn {hp['d_ff']}")
    print(f"              context {hp['context_length']}, rope theta {hp['rope_theta']:g}, "
          f"norm eps {hp['norm_eps']:g}, tied output: {'yes' if hp['tie_embeddings'] else 'no'}")
    print(f"parameters    {d['n_params']:,} in {d['n_tensors']} tensors")
    print("tensor types  " + ", ".join(f"{k} x{v}" for k, v in d["tensor_types"].items()))
    print(f"tokenizer     {tok['model']} (pre: {tok['pre']}), vocab {tok['vocab_size']:,}, {tok['n_merges']:,} merges")
    specials = ", ".join(f"{k}={v['token']!r} ({v['id']})" for k, v in tok["special_tokens"].items() if v)
    print(f"special       {specials or 'none'}")
    print(f"chat template {'yes' if d['chat_template'] else 'no'}")
    return 0
