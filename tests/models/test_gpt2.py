"""The GPT-2 model: shapes, causality, gradients, KV cache, parity with transformers'
GPT2LMHeadModel, and `toy train --arch gpt2` -> `toy infer` end to end."""

import json
from pathlib import Path

import pytest
import torch
from helpers.common import assert_every_parameter_learns

from toy.models.gpt2 import GPT2, GPT2Config

V = 97


def tiny(**kw) -> GPT2:
    cfg = dict(vocab_size=V, n_layer=2, d_model=64, n_head=4, max_seq_len=32)
    cfg.update(kw)
    torch.manual_seed(0)
    return GPT2(GPT2Config(**cfg))


def test_shapes_tied_head_and_config():
    m = tiny()
    x = torch.randint(0, V, (3, 11))
    assert m(x).shape == (3, 11, V)
    assert m.lm_head.weight is m.wte.weight
    assert m.cfg.d_ff == 4 * 64 and m.cfg.to_dict()["arch"] == "gpt2"
    untied = tiny(tie_embeddings=False)
    assert untied.lm_head.weight is not untied.wte.weight
    nobias = tiny(bias=False)
    assert not any(n.endswith(".bias") for n, _ in nobias.named_parameters())
    assert nobias.num_params() < m.num_params()


def test_causal():
    m = tiny().eval()
    x = torch.randint(0, V, (2, 16))
    y = x.clone()
    y[:, 9] = (y[:, 9] + 1) % V
    with torch.no_grad():
        a, b = m(x), m(y)
    assert torch.equal(a[:, :9], b[:, :9])  # earlier positions unchanged, bit for bit
    assert not torch.allclose(a[:, 9:], b[:, 9:])


@pytest.mark.parametrize("bias", [True, False])
def test_every_parameter_gets_a_finite_gradient(bias):
    m = tiny(bias=bias)
    x = torch.randint(0, V, (2, 16))
    loss = torch.nn.functional.cross_entropy(m(x)[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    assert_every_parameter_learns(m)


def test_kv_cache_matches_full_forward():
    m = tiny().eval()
    x = torch.randint(0, V, (2, 20))
    with torch.no_grad():
        full = m(x)
        cache = m.new_cache(2, 32)
        parts = [m(x[:, :7], cache=cache), m(x[:, 7:12], cache=cache)]
        parts += [m(x[:, t : t + 1], cache=cache) for t in range(12, 20)]
    assert cache.pos == 20
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5)


def test_generate_stops_at_the_context():
    from toy.models.generate import generate

    m = tiny(max_seq_len=16).eval()
    out = list(generate(m, [1, 2, 3], max_new_tokens=100, temperature=0))
    assert (
        0 < len(out) <= 16 - 3 + 1
    )  # learned positions end at max_seq_len: generation must stop there


def test_residual_projections_have_scaled_init():
    m = tiny(n_layer=8, d_model=128, n_head=4)
    assert m.h[0].attn.c_proj.weight.std().item() == pytest.approx(
        0.02 / 4, rel=0.1
    )  # 0.02 / sqrt(2 * 8)
    assert m.h[0].mlp.c_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.1)
    assert m.h[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.1)


def to_hf_state(m: GPT2) -> dict[str, torch.Tensor]:
    """toy names -> GPT2LMHeadModel names. HF's Conv1D keeps weights as (in, out), the
    transpose of nn.Linear's (out, in)."""
    sd = {}
    for k, v in m.state_dict().items():
        if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            v = v.t().contiguous()
        sd[k if k.startswith("lm_head") else "transformer." + k] = v
    return sd


def test_parity_with_transformers_gpt2():
    transformers = pytest.importorskip("transformers")
    m = tiny().eval()
    with (
        torch.no_grad()
    ):  # random everything, biases and LayerNorms too: zeros/ones would hide a swap
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    cfg = m.cfg
    hc = transformers.GPT2Config(
        vocab_size=cfg.vocab_size,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_positions=cfg.max_seq_len,
        n_inner=cfg.d_ff,
        layer_norm_epsilon=cfg.norm_eps,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=True,
    )
    hf = transformers.GPT2LMHeadModel(hc).eval()
    res = hf.load_state_dict(to_hf_state(m), strict=False)
    assert not res.unexpected_keys
    assert not [k for k in res.missing_keys if not k.endswith(("attn.bias", "attn.masked_bias"))]
    x = torch.randint(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        diff = (m(x) - hf(x).logits).abs().max().item()
    assert diff < 1e-4


# ---------------------------------------------------------------- CLI end to end


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from toy.cli.main import main
    from toy.data.prep import bundled_text_paths

    d = tmp_path_factory.mktemp("corpus")
    assert (
        main(
            ["prep", str(bundled_text_paths()[0]), "--out", str(d / "c.bin"), "--vocab-size", "384"]
        )
        == 0
    )
    return d / "c.bin"


def test_train_gpt2_then_infer(corpus, toy_cli, tmp_path):
    code, out, err = toy_cli(
        "train",
        "--arch",
        "gpt2",
        "--preset",
        "tiny",
        "--corpus",
        corpus,
        "--out",
        tmp_path,
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--steps",
        "4",
        "--eval-batches",
        "1",
        "--run-id",
        "g",
        "--json",
    )
    assert code == 0, err
    r = json.loads(out)
    assert r["arch"] == "gpt2" and len(r["losses"]) == 4 and r["tokens_per_s"] > 0
    final = Path(r["run_dir"]) / "final"
    cfg = json.loads((final / "config.json").read_text())["model"]
    assert cfg["arch"] == "gpt2" and (cfg["n_layer"], cfg["d_model"], cfg["n_head"]) == (2, 64, 4)

    from toy.formats.model_dir import load_model_dir

    model, _, _ = load_model_dir(final)
    assert isinstance(model, GPT2) and model.lm_head.weight is model.wte.weight

    g = [
        toy_cli(
            "infer",
            "--run",
            r["run_dir"],
            "--prompt",
            "HAMLET.",
            "--max-new-tokens",
            "10",
            "--temperature",
            "0",
        )
        for _ in range(2)
    ]
    assert g[0][0] == 0, g[0][2]
    assert g[0][1].startswith("HAMLET.") and len(g[0][1]) > len("HAMLET.\n")
    assert g[0][1] == g[1][1]  # greedy is deterministic


def test_gpt2_unknown_preset_lists_its_presets(toy_cli, tmp_path):
    code, _, err = toy_cli("train", "--arch", "gpt2", "--preset", "smollm2-135m", "--out", tmp_path)
    assert code == 2 and "gpt2-124m" in err and len(err.strip().splitlines()) == 1
