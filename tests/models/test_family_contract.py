"""Every registered model family provides each part a family must (models/family.py):
a config, a module that keeps the model contract the loop, the loss, generation and the
exports use, a plan for every file architecture it reads whose names and shapes are the
module's own, LoRA targets the module has, and presets that build. A family file added
to models/ is found and held to all of it without touching any other file."""

import dataclasses

import pytest
import torch
import torch.nn as nn

from toy.models import registry
from toy.models.family import Keys

FAMILIES = sorted(registry.families())


def tiny(name):
    fam = registry.family(name)
    assert fam.tiny, f"{name}: FAMILY.tiny must give a tiny config for the tests"
    cfg = fam.config(**fam.tiny)
    torch.manual_seed(0)
    return fam, cfg, fam.model(cfg)


def test_every_family_file_is_found():
    assert {"llama", "phi3", "gemma", "gpt2", "vit"} <= set(FAMILIES)


@pytest.mark.parametrize("name", FAMILIES)
def test_config_round_trips_and_names_its_family(name):
    fam, cfg, _ = tiny(name)
    assert dataclasses.is_dataclass(cfg) and cfg.arch == name
    assert registry.config_from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("name", FAMILIES)
def test_module_keeps_the_model_contract(name):
    fam, cfg, model = tiny(name)
    assert isinstance(model, nn.Module) and model.cfg is cfg
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == cfg.n_layer
    assert model.checkpointing is False
    model.tie_weights()
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    if not fam.language_model:
        return
    ids = torch.randint(0, cfg.vocab_size, (2, 5))
    h = model.hidden(ids)
    assert h.shape == (2, 5, cfg.d_model)
    assert isinstance(model.final_softcap, float)
    logits = model(ids)
    assert logits.shape == (2, 5, cfg.vocab_size)
    # The cache continues a sequence: one step after a prefill equals the whole forward.
    cache = model.new_cache(2, 8)
    model(ids[:, :4], cache=cache)
    last = model(ids[:, 4:], cache=cache)
    torch.testing.assert_close(last[:, -1], logits[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_targets_are_linear_layers_of_the_module(name):
    fam, cfg, model = tiny(name)
    if not fam.targets:
        return
    have = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert set(fam.targets) <= have, set(fam.targets) - have
    assert set(fam.default_targets.split(",")) <= set(fam.targets)


@pytest.mark.parametrize("name, arch", [(f, a) for f in FAMILIES for a in registry.family(f).archs])
def test_gguf_plan_names_and_shapes_are_the_modules(name, arch):
    fam, cfg, model = tiny(name)
    plan = fam.archs[arch].plan(cfg)
    sd = {k: v for k, v in model.state_dict().items()}
    if getattr(cfg, "tie_embeddings", False):
        sd.pop("lm_head.weight")
    planned = {p.name: p.shape for p in plan.values()}
    assert planned == {k: tuple(v.shape) for k, v in sd.items()}
    # The config reader takes a header's keys back to the same shape.
    shapes = {g: p.shape for g, p in plan.items()}
    keys = {
        f"{arch}.{k}": v
        for k, v in dict(
            embedding_length=cfg.d_model,
            block_count=cfg.n_layer,
            feed_forward_length=cfg.d_ff,
            **{
                "attention.head_count": cfg.n_head,
                "attention.head_count_kv": cfg.n_kv_head,
                "attention.key_length": cfg.head_dim,
                "attention.sliding_window": getattr(cfg, "sliding_window", 0),
                "rope.dimension_count": getattr(cfg, "rope_dim", cfg.head_dim),
                "context_length": cfg.max_seq_len,
            },
        ).items()
    }
    read = fam.archs[arch].config(Keys(keys, shapes))
    assert (read.n_layer, read.d_model, read.n_head, read.vocab_size) == (
        cfg.n_layer,
        cfg.d_model,
        cfg.n_head,
        cfg.vocab_size,
    )


@pytest.mark.parametrize("name", [f for f in FAMILIES if registry.family(f).presets])
def test_presets_build(name):
    fam = registry.family(name)
    assert fam.default_preset in fam.presets
    for preset in fam.presets:
        if preset != "tiny":
            continue  # the big ones take seconds to build; their fields are checked below
        extra = {"n_classes": 3} if not fam.language_model else {}
        cfg = (
            registry.build_config(name, preset, 96, **extra)
            if fam.language_model
            else fam.config(**fam.presets[preset], **extra)
        )
        assert isinstance(fam.model(cfg), nn.Module)
    for preset, fields in fam.presets.items():
        assert set(fields) <= {f.name for f in dataclasses.fields(fam.config)}, (preset, fields)
