"""How far the loss over the teacher's top K (--teacher-top-k K) lands from the loss over the
whole vocabulary, on the same positions: held-out text through SmolLM2 (the teacher, its Q4_1
GGUF kept quantized) and a student (a run's final/ model, or the teacher shrunk to 15 of its
30 blocks as `--keep-layers 15` starts it), the generalized JSD (beta 0.5) and the forward
KL (beta 0) summed over every position, whole and over K + 1 buckets, and the share of the
teacher's mass the top K hold.

    python bench/distill_topk_gap.py --teacher data/smollm2-135m.gguf --data DIR/valid.jsonl \\
        [--student RUN/final] [--k 16,64,256] [--rows 16]

DIR: bench/distill_learn.py's data ({"text"} lines). One JSON line a K, float32 throughout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from toy.formats.base_readers import read_base
from toy.formats.model_dir import load_model_dir
from toy.models.losses import distill_divergence, teacher_topk, topk_divergence
from toy.recipes.distill import kept_blocks, shrink
from toy.tokenizer import encode_prompt


def shrunk(path: Path, keep: str) -> torch.nn.Module:
    base = read_base(path, "float32")
    return shrink(base, kept_blocks(keep, base.config.n_layer)).build_model().eval()


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--student", type=Path)
    ap.add_argument("--k", default="16,64,256")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    a = ap.parse_args()
    tb = read_base(a.teacher, "quantized")
    teacher = tb.build_model().eval()
    student = load_model_dir(a.student)[0] if a.student else shrunk(a.teacher, "15")
    texts = [json.loads(x)["text"] for x in a.data.read_text().splitlines()][: a.rows]
    ids = [encode_prompt(tb.tokenizer, t)[: a.seq_len] for t in texts]
    hs, ht = [], []
    for row in ids:
        x = torch.tensor([row])
        hs.append(student.hidden(x)[0, :-1])
        ht.append(teacher.hidden(x)[0, :-1])
    hs, ht = torch.cat(hs), torch.cat(ht)
    n = len(hs)
    for beta in (0.5, 0.0):
        full, _ = distill_divergence(hs, student.lm_head, ht, teacher.lm_head, beta)
        for k in [int(v) for v in a.k.split(",")]:
            t_ids, t_lp, t_rest = teacher_topk(ht, teacher.lm_head, k)
            part, _ = topk_divergence(hs, student.lm_head, t_ids, t_lp, t_rest, beta)
            mass = float(t_lp.exp().sum(-1).mean())
            print(
                json.dumps(
                    {
                        "student": str(a.student or "SmolLM2 shrunk to 15/30 blocks, untrained"),
                        "beta": beta,
                        "k": k,
                        "positions": n,
                        "full": round(float(full) / n, 5),
                        "top_k": round(float(part) / n, 5),
                        "gap": round((float(full) - float(part)) / float(full), 4),
                        "teacher_mass_in_top_k": round(mass, 4),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
