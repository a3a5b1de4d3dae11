"""From-scratch decoder LM on a token file: random init, next-token loss on windows."""

from __future__ import annotations

import torch

from toy.models import registry
from toy.recipes.lm import WindowJob, lm_config, lm_derived, open_token_data
from toy.runs import Project, data_fingerprints
from toy.train.config import RunConfig
from toy.train.job import Built
from toy.train.recipe import Recipe


def build(cfg: RunConfig, project: Project) -> Built:
    data = open_token_data(cfg, project)
    notes: list[str] = []
    mcfg, seq_len = lm_config(cfg, cfg.arch, data.train, notes)
    torch.manual_seed(cfg.seed)
    model = registry.build_model(mcfg)
    config = {
        "recipe": "from-scratch",
        "arch": cfg.arch,
        "model": mcfg.to_dict(),
        "corpus": str(data.train.path),
        "corpus_tokens": len(data.train),
        **data_fingerprints("corpus", data.train.path),
        "seq_len": seq_len,
    }
    job = WindowJob("from-scratch", model, data, cfg, seq_len, config)
    return Built(
        job=job,
        arch=cfg.arch,
        params=model.num_params(),
        notes=notes,
        derived=lm_derived(cfg, data.train, seq_len, notes),
    )


RECIPE = Recipe("from-scratch", build)
