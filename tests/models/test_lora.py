"""LoRA wrapping, merging, gradients, and the PEFT adapter format (against HF PEFT)."""

from __future__ import annotations

import json
import os

# No model hub, ever: PEFT/transformers would otherwise try to look up the base model's
# config online. Set before transformers/huggingface_hub are first imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn as nn

from toy.errors import InputError, UsageError
from toy.formats.peft import load_peft_adapter, save_peft_adapter
from toy.lora import (
    LoRALinear,
    apply_lora,
    load_lora_state_dict,
    lora_parameters,
    lora_state_dict,
    merge_lora,
)
from toy.models.llama import Llama, LlamaConfig

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_cfg() -> LlamaConfig:
    return LlamaConfig(vocab_size=128, n_layer=2, d_model=64, n_head=4, n_kv_head=2, max_seq_len=32)


def tiny_model(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(tiny_cfg())


def ids(seed: int = 1, B: int = 2, T: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (B, T), generator=g)


def perturb_b(model: nn.Module, seed: int = 3, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _name, m in model.named_modules():
            if isinstance(m, LoRALinear):
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * scale)


def test_init_output_equals_base_exactly():
    model = tiny_model()
    x = ids()
    base = model(x)
    names = apply_lora(model, ALL, rank=4, alpha=8, dropout=0.0, seed=0)
    assert len(names) == 2 * 7 and names[0] == "layers.0.self_attn.q_proj"
    assert torch.equal(model(x), base)


def test_merge_equals_unmerged():
    model = tiny_model()
    apply_lora(model, ALL, rank=4, alpha=8, dropout=0.1, seed=0)
    perturb_b(model)
    model.eval()  # dropout off: merged weights have no dropout
    x = ids()
    unmerged = model(x)
    merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert isinstance(model.layers[0].self_attn.q_proj, nn.Linear)
    assert (model(x) - unmerged).abs().max() < 1e-5
    # Plain keys again: the merged model saves like a base model.
    assert set(model.state_dict()) == set(tiny_model().state_dict())


def test_only_adapter_gets_gradients():
    model = tiny_model()
    apply_lora(model, ["q_proj", "v_proj", "down_proj"], rank=4, alpha=8, dropout=0.1, seed=0)
    perturb_b(model)  # with B = 0 exactly, A's gradient would be zero
    x = ids()
    logits = model(x[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, 128), x[:, 1:].reshape(-1))
    loss.backward()
    adapter = {id(p) for p in lora_parameters(model)}
    assert len(adapter) == 2 * 3 * 2
    for name, p in model.named_parameters():
        if id(p) in adapter:
            assert p.requires_grad and p.grad is not None, name
            assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
        else:
            assert not p.requires_grad and p.grad is None, name


def test_seeded_init():
    a1, a2, a3 = tiny_model(), tiny_model(), tiny_model()
    apply_lora(a1, ["q_proj", "v_proj"], rank=4, alpha=8, dropout=0.0, seed=7)
    # Order of wrapping does not matter: the seed is per (seed, module name).
    apply_lora(a2, ["v_proj", "q_proj"], rank=4, alpha=8, dropout=0.0, seed=7)
    apply_lora(a3, ["q_proj", "v_proj"], rank=4, alpha=8, dropout=0.0, seed=8)
    s1, s2, s3 = lora_state_dict(a1), lora_state_dict(a2), lora_state_dict(a3)
    assert set(s1) == set(s2) == set(s3)
    for k in s1:
        assert torch.equal(s1[k], s2[k])
        if k.endswith("lora_B"):
            assert torch.count_nonzero(s1[k]) == 0
        else:
            assert not torch.equal(s1[k], s3[k])
            bound = (
                1 / s1[k].shape[1] ** 0.5
            )  # kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in))
            assert s1[k].abs().max() <= bound
    # Different modules get different A.
    assert not torch.equal(
        s1["layers.0.self_attn.q_proj.lora_A"], s1["layers.1.self_attn.q_proj.lora_A"]
    )


def test_base_state_dict_loads_strict_into_wrapped_model():
    base_sd = tiny_model(seed=5).state_dict()
    model = tiny_model(seed=0)
    apply_lora(model, ALL, rank=2, alpha=4, dropout=0.0, seed=0)
    model.load_state_dict(base_sd, strict=True)
    for k, v in base_sd.items():
        assert torch.equal(model.state_dict()[k], v)
    # Unknown keys still fail loudly.
    with pytest.raises(RuntimeError):
        model.load_state_dict({**base_sd, "layers.0.bogus": torch.zeros(1)}, strict=True)
    # The tied head is untouched and still tied.
    assert model.lm_head.weight is model.embed_tokens.weight
    assert not isinstance(model.lm_head, LoRALinear)


def test_lora_state_dict_roundtrip_strict():
    src = tiny_model()
    apply_lora(src, ["q_proj"], rank=4, alpha=8, dropout=0.0, seed=0)
    perturb_b(src)
    sd = lora_state_dict(src)
    assert sorted(sd) == [
        "layers.0.self_attn.q_proj.lora_A",
        "layers.0.self_attn.q_proj.lora_B",
        "layers.1.self_attn.q_proj.lora_A",
        "layers.1.self_attn.q_proj.lora_B",
    ]
    dst = tiny_model()
    apply_lora(dst, ["q_proj"], rank=4, alpha=8, dropout=0.0, seed=1)
    load_lora_state_dict(dst, sd)
    x = ids()
    assert torch.equal(src(x), dst(x))
    with pytest.raises(InputError, match="missing"):
        load_lora_state_dict(dst, {k: v for k, v in sd.items() if "layers.1" not in k})
    with pytest.raises(InputError, match="wrong shape"):
        load_lora_state_dict(
            dst, {k: (v[:2] if k.endswith("lora_A") else v) for k, v in sd.items()}
        )
    with pytest.raises(InputError, match="unexpected"):
        load_lora_state_dict(
            dst, {**sd, "layers.0.self_attn.k_proj.lora_A": sd["layers.0.self_attn.q_proj.lora_A"]}
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=0), "--rank must be >= 1, got 0"),
        (
            dict(targets=["qq_proj"]),
            "--targets 'qq_proj' is not a valid target; choose from: q_proj",
        ),
        (dict(targets=["lm_head"]), "--targets lm_head is not allowed.*tied"),
        (dict(targets=[]), "--targets must be a non-empty list"),
        (dict(alpha=0), "--alpha must be > 0, got 0"),
        (dict(dropout=1.0), r"--dropout must be in \[0, 1\), got 1.0"),
    ],
)
def test_bad_args(kwargs, match):
    args = dict(targets=["q_proj"], rank=4, alpha=8.0, dropout=0.0, seed=0) | kwargs
    model = tiny_model()
    with pytest.raises(UsageError, match=match):
        apply_lora(model, **args)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())


def test_bad_args_reported_together():
    with pytest.raises(UsageError) as e:
        apply_lora(tiny_model(), ["lm_head"], rank=0, alpha=-1, dropout=0.0, seed=0)
    msg = str(e.value)
    assert "--targets lm_head" in msg and "--rank" in msg and "--alpha" in msg and "\n" not in msg


# --------------------------------------------------------------------------- PEFT


def hf_twin(model: Llama):
    """An HF LlamaForCausalLM with exactly the toy model's weights."""
    transformers = pytest.importorskip("transformers")
    c = model.cfg
    hf_cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        intermediate_size=c.d_ff,
        num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head,
        num_key_value_heads=c.n_kv_head,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_seq_len,
        rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    sd = {"model." + k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf


def test_peft_adapter_loads_in_hf_peft(tmp_path):
    peft = pytest.importorskip("peft")
    model = tiny_model().eval()
    hf = hf_twin(model)
    x = ids()
    with torch.no_grad():
        assert (hf(x).logits - model(x)).abs().max() < 1e-4  # same base first
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    apply_lora(model, targets, rank=4, alpha=16, dropout=0.05, seed=0)
    perturb_b(model, scale=0.2)
    model.eval()
    sd = lora_state_dict(model)
    out = save_peft_adapter(
        tmp_path / "adapter",
        sd,
        rank=4,
        alpha=16,
        dropout=0.05,
        targets=targets,
        base_model_name_or_path="toy/tiny",
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 16 and cfg["peft_type"] == "LORA"

    pm = peft.PeftModel.from_pretrained(hf, str(out)).eval()
    with torch.no_grad():
        toy_logits, hf_logits = model(x), pm(x).logits
    assert (toy_logits - hf_logits).abs().max() < 1e-4
    # ...and the adapter actually changes the output (the comparison is not vacuous).
    with torch.no_grad(), pm.disable_adapter():
        assert (pm(x).logits - toy_logits).abs().max() > 1e-3
    # PEFT's own state dict has exactly our tensors.
    got = peft.get_peft_model_state_dict(
        pm, save_embedding_layers=False
    )  # "auto" would look the base up on the hub
    assert len(got) == len(sd)

    sd2, cfg2 = load_peft_adapter(out)
    assert set(sd2) == set(sd) and all(torch.equal(sd2[k], sd[k]) for k in sd)
    assert cfg2["r"] == 4 and cfg2["target_modules"] == sorted(targets)


def test_peft_key_names(tmp_path):
    from safetensors import safe_open

    model = tiny_model()
    apply_lora(model, ["q_proj", "down_proj"], rank=2, alpha=4, dropout=0.0, seed=0)
    save_peft_adapter(tmp_path, lora_state_dict(model), 2, 4, 0.0, ["q_proj", "down_proj"], "base")
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as f:
        keys = sorted(f.keys())
        assert f.get_tensor(
            "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
        ).shape == (64, 2)
    assert keys[0] == "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    assert (
        "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight" in keys and len(keys) == 8
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left


def test_peft_load_errors(tmp_path):
    with pytest.raises(InputError, match="no such adapter directory"):
        load_peft_adapter(tmp_path / "nope")
    with pytest.raises(InputError, match="no adapter_config.json"):
        load_peft_adapter(tmp_path)
    model = tiny_model()
    apply_lora(model, ["v_proj"], rank=2, alpha=4, dropout=0.0, seed=0)
    save_peft_adapter(tmp_path, lora_state_dict(model), 2, 4, 0.0, ["v_proj"], "base")
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    # Wrong rank in the config vs the tensors.
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg | {"r": 3}))
    with pytest.raises(InputError, match="do not match r=3"):
        load_peft_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg | {"use_dora": True}))
    with pytest.raises(InputError, match="use_dora"):
        load_peft_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    from safetensors.torch import save_file

    save_file(
        {"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 64)},
        str(tmp_path / "adapter_model.safetensors"),
    )
    with pytest.raises(InputError, match="lm_head is the tied embedding"):
        load_peft_adapter(tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(InputError, match="not a readable safetensors"):
        load_peft_adapter(tmp_path)
    (tmp_path / "adapter_model.safetensors").unlink()
    with pytest.raises(InputError, match="no adapter_model.safetensors"):
        load_peft_adapter(tmp_path)
