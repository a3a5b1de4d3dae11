"""The llama model: shapes, causality, gradients, KV cache, and parity with transformers."""

import pytest
import torch
from helpers.common import assert_every_parameter_learns

from toy.models.llama import Llama, LlamaConfig


def tiny(**kw):
    cfg = dict(vocab_size=97, n_layer=2, d_model=64, n_head=4, n_kv_head=2, max_seq_len=32)
    cfg.update(kw)
    torch.manual_seed(0)
    return Llama(LlamaConfig(**cfg))


def test_shapes_and_tied_head():
    m = tiny()
    x = torch.randint(0, 97, (3, 11))
    assert m(x).shape == (3, 11, 97)
    assert m.lm_head.weight is m.embed_tokens.weight
    untied = tiny(tie_embeddings=False)
    assert untied.lm_head.weight is not untied.embed_tokens.weight


def test_causal():
    m = tiny().eval()
    x = torch.randint(0, 97, (2, 16))
    y = x.clone()
    y[:, 9] = (y[:, 9] + 1) % 97  # change position t+1 = 9
    with torch.no_grad():
        a, b = m(x), m(y)
    assert torch.equal(a[:, :9], b[:, :9])  # positions <= t unchanged, bit for bit
    assert not torch.allclose(a[:, 9:], b[:, 9:])  # and the change does reach later positions


def test_every_parameter_gets_a_finite_gradient():
    m = tiny()
    x = torch.randint(0, 97, (2, 16))
    loss = torch.nn.functional.cross_entropy(m(x)[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    assert_every_parameter_learns(m)


def test_kv_cache_matches_full_forward():
    m = tiny().eval()
    x = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        full = m(x)
        cache = m.new_cache(2, 32)
        parts = [m(x[:, :7], cache=cache), m(x[:, 7:12], cache=cache)]
        parts += [m(x[:, t : t + 1], cache=cache) for t in range(12, 20)]
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5)


def test_residual_projections_have_scaled_init():
    m = tiny(n_layer=8, d_model=128, n_head=4, n_kv_head=4)
    std_o = m.layers[0].self_attn.o_proj.weight.std().item()
    std_q = m.layers[0].self_attn.q_proj.weight.std().item()
    assert std_o == pytest.approx(0.02 / 4, rel=0.1)  # 0.02 / sqrt(2 * 8)
    assert std_q == pytest.approx(0.02, rel=0.1)


def test_parity_with_transformers_llama():
    transformers = pytest.importorskip("transformers")
    m = tiny(n_kv_head=2).eval()
    cfg = m.cfg
    hc = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=True,
    )
    hf = transformers.LlamaForCausalLM(hc).eval()
    sd = {
        ("model." + k if not k.startswith("lm_head") else k): v for k, v in m.state_dict().items()
    }
    res = hf.load_state_dict(sd, strict=True)
    assert not res.missing_keys and not res.unexpected_keys
    x = torch.randint(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        diff = (m(x) - hf(x).logits).abs().max().item()
    assert diff < 1e-4
