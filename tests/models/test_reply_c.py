"""A reply's loop in C without torch (models/reply_c.py) and the file that keeps its model
(formats/reply_image.py): the draws are sample.py's, the tokens generate's on a tiny llama
GGUF (greedy and sampled), and a kept model reads back to the same tokens or not at all."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers.quant import quant_gguf  # noqa: F401

from toy.formats import reply_image
from toy.models import decode, decode_native, reply_c, sample
from toy.models.generate import generate

pytestmark = pytest.mark.skipif(
    reply_c.library() is None, reason="decode_step.c does not build here"
)


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**31 + 7, 2**32 + 5, 2**63 - 1])
def test_the_uniforms_are_torchs_generators(seed):
    g = sample.seeded("cpu", seed)
    want = [torch.rand(1, 1, generator=g, dtype=torch.float64).item() for _ in range(200)]
    u = reply_c.TorchUniforms(seed)
    assert [u() for _ in range(200)] == want


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(0.0, 0, 1.0), (0.8, 0, 1.0), (1.0, 40, 1.0), (0.7, 0, 0.9)]
)
def test_a_pick_is_sample_picks(temperature, top_k, top_p):
    """The same logits and seed give sample.pick's token, 100 draws a setting over logits of
    a spread like a model's (and ties for the argmax: the first)."""
    gen = torch.Generator().manual_seed(4)
    for trial in range(100):
        logits = torch.randn(1, 500, generator=gen) * 3
        if trial % 10 == 0:
            logits[0, 7] = logits[0, 300] = logits.max() + 1
        g = sample.seeded("cpu", trial) if temperature > 0 else None
        want = int(sample.pick(logits, temperature, top_k, top_p, g))
        u = reply_c.TorchUniforms(trial) if temperature > 0 else None
        assert reply_c.pick(logits[0].numpy(), temperature, top_k, top_p, u) == want


def _models(path):
    from toy.formats import base_readers
    from toy.formats.base_readers import read_base

    probe = read_base(path, "quantized")
    f32 = base_readers.held_as(probe, path, "float32").build_model("cpu").eval()
    q = base_readers.held_as(probe, path, "quantized").build_model("cpu").eval()
    decode.pack(q)
    assert decode_native.install(q)
    return f32, q


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_reply_is_generates_on_the_float32_model(quant_gguf, temperature):  # noqa: F811
    """The tiny llama GGUF (Q4_0 MLP, Q4_1 attention, Q8_0 tied embedding), packed and stepped
    in C from the prompt's first token: generate's tokens on the float32 base, 60 of them,
    greedy and sampled (the same seed's draws); the first logits within float32 rounding."""
    f32, q = _models(quant_gguf)
    ids = [5, 9, 12, 7]
    with torch.no_grad():
        want = list(generate(f32, ids, 60, temperature, 0, 1.0, 3))
        c = decode_native.reply_model(q)
        assert c is not None
        assert list(reply_c.reply(c, ids, 60, temperature, 0, 1.0, 3)) == want
        state = reply_c.State(c, 8)
        for t in ids[:-1]:
            assert state.step(t, logits=False) is None
        got = state.step(ids[-1], logits=True)
        ref = f32(torch.tensor([ids]))[0, -1].numpy()
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    # a stop id ends the reply before it; a short context ends it when full
    assert list(reply_c.reply(c, ids, 60, temperature, 0, 1.0, 3, {want[5]})) == want[:5]
    c.plan["limit"] = 10  # 4 prompt positions and 6 of the reply's: a 7th token from the last one
    assert list(reply_c.reply(c, ids, 60, temperature, 0, 1.0, 3)) == want[:7]


def test_a_kept_model_reads_back_to_the_same_reply_or_not_at_all(quant_gguf, tmp_path):  # noqa: F811
    _, q = _models(quant_gguf)
    c = decode_native.reply_model(q)
    path = tmp_path / "m.bin"
    assert reply_image.write(path, c.plan, c.arrays, {"limit": 512})
    plan, arrays, meta = reply_image.read(path)
    assert meta == {"limit": 512} and plan == c.plan
    for name, a in arrays.items():
        assert not a.flags.writeable and a.tobytes() == c.arrays[name].tobytes()
    ids = [5, 9, 12, 7]
    want = list(reply_c.reply(c, ids, 30, 0.9, 0, 1.0, 1))
    assert list(reply_c.reply(reply_c.Model(plan, arrays), ids, 30, 0.9, 0, 1.0, 1)) == want
    data = bytearray(path.read_bytes())
    data[-100] ^= 1  # one bit of the data: its sha256 fails
    path.write_bytes(bytes(data))
    assert reply_image.read(path) is None
    path.write_bytes(bytes(data[:-64]))  # cut short
    assert reply_image.read(path) is None
    path.write_bytes(b"TOYREPLY\xff")  # a header that is not one
    assert reply_image.read(path) is None
    for n in (2**40, 2**64 - 1):  # a length past the file's end, never read or allocated
        path.write_bytes(b"TOYREPLY" + n.to_bytes(8, "little") + b"{}")
        assert reply_image.read(path) is None
    # a number of the plan changed in the header (the data intact): its sha256 fails too
    assert reply_image.write(path, c.plan, c.arrays, {"limit": 512})
    raw = path.read_bytes()
    at = raw.index(b'"G": ')
    path.write_bytes(raw[:at] + b'"G": 9' + raw[at + 6 :])
    assert reply_image.read(path) is None
    # and a plan whose arrays do not fit it is refused before any C reads them
    plan = json.loads(json.dumps(c.plan))
    plan["blocks"][0]["q"]["G"] += 1
    with pytest.raises(ValueError, match="block 0 q"):
        reply_c.Model(plan, c.arrays)
