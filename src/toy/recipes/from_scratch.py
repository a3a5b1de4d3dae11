"""From-scratch decoder LM on a token file: random init, next-token loss on windows."""

from __future__ import annotations

import torch

from toy.models import registry
from toy.runs import Project
from toy.train.job import Built
# Shared with warm_start.py, so they live one layer down (a recipe never imports another).
from toy.train.lm import fingerprint, lm_config, lm_job, open_corpus, resolve_corpus  # noqa: F401


def build(opts: dict, project: Project) -> Built:
    train, val, tok_path = open_corpus(opts, project)
    arch = opts["arch"]
    cfg = lm_config(opts, arch, train)
    seq_len = opts["seq_len"]
    torch.manual_seed(opts["seed"])
    model = registry.build_model(cfg)
    config = {"recipe": "from-scratch", "arch": arch, "model": cfg.to_dict(), "corpus": str(train.path),
              "corpus_tokens": len(train), "corpus_sha256": fingerprint(train.path), "seq_len": seq_len}
    job = lm_job("from-scratch", model, train, val, opts, tok_path, config)
    return Built(job=job, arch=arch, params=model.num_params())
