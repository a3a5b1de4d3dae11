"""A reply's tokens through a llama block in C (models/decode_native.py, decode_step.c): the
product on the codes in the step's layout against the dequantized matmul for every GGUF block
type (the AVX-512 loop and the portable one), the model's logits against the eager float32
ones token by token, what still takes the model's own path, and `toy infer` giving the
float32 text through it, on a tiny GGUF and on SmolLM2."""

from __future__ import annotations

import ctypes

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from helpers.gguf_fixtures import smollm2_gguf  # noqa: F401
from helpers.quant import BLOCK_TYPES, quant_gguf, random_blocks  # noqa: F401

from toy.models import decode, decode_native, native
from toy.models.quant import QuantLinear, QuantSpec, parts_of

MILD_F16 = __import__("numpy").array(
    [0x1800, 0x1C00, 0x2000, 0x2400, 0x9800, 0xA000, 0x1234, 0x2345, 0x0000], dtype="uint16"
)

pytestmark = pytest.mark.skipif(
    decode_native.library() is None, reason="decode_step.c does not build here"
)


def packed_linear(qtype, rows: int, cols: int, seed: int):
    """A packed QuantLinear over random blocks, and its float32 weight."""
    raw = torch.from_numpy(random_blocks(qtype, rows, cols, MILD_F16, seed))
    spec = QuantSpec(int(qtype), (rows, cols))
    w = spec.dequantize((raw,))
    lin = QuantLinear(raw, spec)
    assert decode.pack(lin) == 1
    return lin, w


def product(lib: dict, lin: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """W x from decode_step.c on the module's parts, put in the blocked order first."""
    decode_native.to_blocked([lin])
    assert lin.spec.blocked and lin.codes.dim() == 4
    p = decode_native.packed(lin.spec, parts_of(lin))
    y = torch.full((lin.spec.shape[0],), float("nan"))
    lib["toy_packed_matvec"](ctypes.byref(p), x.data_ptr(), y.data_ptr())
    return y


# decode_step.c's product loops: the AVX-512 one where -march=native has it (this CPU), the
# AVX2 one (FMA and F16C: most laptops), and the plain C one (x86-64's baseline: SSE2)
BUILDS = {"native": None, "avx2": ("-mavx2", "-mfma", "-mf16c"), "portable": ()}


def _built_with(monkeypatch, arch: tuple | None) -> dict:
    """decode_step.c built with these flags in place of -march=native (None: as toy builds it)."""
    if arch is None:
        return decode_native.library()
    monkeypatch.setattr(native, "ARCH", arch)
    saved = native._loaded.pop("decode_step", None)
    try:
        lib = decode_native.library()
    finally:  # the next caller gets this machine's build again
        native._loaded.pop("decode_step", None)
        if saved is not None:
            native._loaded["decode_step"] = saved
    assert lib is not None
    return lib


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_the_product_on_the_steps_layout_is_the_dequantized_matmul(qtype, build, monkeypatch):
    """Sums reordered and multiply-adds fused, nothing else: within 1e-5 of the largest output
    of a float64 product of the same float32 weight (1e-4, what decode.py's kernels were asked,
    built for x86-64's baseline: no FMA there, each product rounded on its own, and a type with
    offsets cancels s * sum(q x) against z * sum(x)); 72 rows are two blocks of 32 and one of
    8 padded to 32."""
    lib = _built_with(monkeypatch, BUILDS[build])
    cols = 512 if qtype in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K) else 160
    lin, w = packed_linear(qtype, 72, cols, seed=int(qtype))
    x = torch.randn(cols, generator=torch.Generator().manual_seed(1))
    ref = (w.double() @ x.double()).float()
    y = product(lib, lin, x)
    bound = (1e-4 if build == "portable" else 1e-5) * ref.abs().max()
    assert (y - ref).abs().max() <= bound, (y - ref).abs().max()


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_blocked_parts_give_the_files_weights_and_the_one_row_product(qtype):
    """In the blocked order, a prefill's dequantized weight and an embedding's rows are the
    file's to the bit (PackedSpec takes either order), and a one-row product (a head, or a
    token outside the blocks' step) runs in C, the same bits as the library's own call."""
    cols = 256 if qtype == T.Q6_K else 64
    lin, w = packed_linear(qtype, 40, cols, seed=4)  # a block of 32 and one of 8, padded
    decode_native.to_blocked([lin])
    assert lin.spec.blocked and lin.codes.shape[0] == 2
    assert torch.equal(lin.dequantized().view(torch.int32), w.view(torch.int32))
    idx = torch.tensor([[5, 0, 39, 33, 5]])
    assert torch.equal(lin.spec.gather(parts_of(lin), idx.view(-1), torch.float32), w[idx[0]])
    rows_of = (slice(3, 37), slice(32, 40), slice(0, 8), slice(35, 35), slice(32, 32))
    for rows in (*rows_of, slice(40, 40), slice(-8, None)):  # a head's chunks, empty ones
        got = lin.spec.dequantize(parts_of(lin), rows=rows)
        assert torch.equal(got.view(torch.int32), w[rows].view(torch.int32)), rows
    last = lin.spec.gather(parts_of(lin), torch.tensor([-1, -40]), torch.float32)
    assert torch.equal(last, w[[-1, -40]])  # negative rows as torch counts them
    x = torch.randn(1, 1, cols, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y = lin(x)
    assert torch.equal(y.view(-1), product(decode_native.library(), lin, x.view(-1)))


def test_scales_and_offsets_of_two_dtypes_are_blocked_as_float32():
    """decode._narrow keeps scales and offsets in float16 each where that holds them: one of
    each dtype is widened to float32 (exact), and the product and weight stay the file's."""
    lin, w = packed_linear(T.Q4_1, 64, 64, seed=5)
    lin.offsets = lin.offsets.float()  # as _narrow leaves a tensor float16 cannot hold
    assert lin.scales.dtype != lin.offsets.dtype and decode_native.blockable(lin)
    x = torch.randn(64, generator=torch.Generator().manual_seed(3))
    y = product(decode_native.library(), lin, x)
    assert lin.scales.dtype == lin.offsets.dtype == torch.float32
    assert torch.equal(lin.dequantized().view(torch.int32), w.view(torch.int32))
    ref = (w.double() @ x.double()).float()
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.fixture
def eager_kernels(monkeypatch):
    """decode.py's one-row kernel as its torch lines, not built (a cold build is seconds a
    shape): what a head or a token the C step does not take runs on here."""
    monkeypatch.setattr(
        decode,
        "_kernel",
        lambda four_bit, parts: (
            lambda args: ((decode._matvec4 if four_bit else decode._matvec8)(*args),)
        ),
    )


def _packed_model(quant_gguf, dtype: str, adapt=None):
    """The tiny GGUF held as `dtype`, `adapt(model)` run on it first (as `toy infer` merges an
    adapter before packing), packed where quantized."""
    from toy.formats import base_readers
    from toy.formats.base_readers import read_base

    probe = read_base(quant_gguf, "quantized")
    model = base_readers.held_as(probe, quant_gguf, dtype).build_model("cpu").eval()
    if adapt is not None:
        model = adapt(model)
    if dtype == "quantized":
        decode.pack(model)
    return model


def _greedy(model, ids: list[int], n: int, cache) -> torch.Tensor:
    logits = [model(torch.tensor([ids]), cache)[0, -1]]
    for _ in range(n):
        logits.append(model(logits[-1].argmax().view(1, 1), cache)[0, -1])
    return torch.stack(logits)


def test_a_replys_logits_are_the_float32_models(quant_gguf, monkeypatch, eager_kernels):
    """A tiny llama GGUF (Q4_0 MLP, Q4_1 attention, 4 query heads on 2 K/V heads), packed and
    stepped in C: every token's logits within float32 rounding of the float32 base's, through
    70 positions (the attention's 16-wide loops and their tails), greedy all the way; the C
    step ran for every token after the prompt."""
    calls = []
    lib = decode_native.library()
    real = lib["toy_llama_steps"]
    monkeypatch.setitem(lib, "toy_llama_steps", lambda *a: calls.append(a[-1]) or real(*a))
    with torch.no_grad():
        f32 = _packed_model(quant_gguf, "float32")
        want = _greedy(f32, [5, 9, 12, 7], 70, f32.new_cache(1, 128))
        model = _packed_model(quant_gguf, "quantized")
        assert decode_native.install(model)
        got = _greedy(model, [5, 9, 12, 7], 70, model.new_cache(1, 128))
    assert calls == list(range(4, 74))
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-4 * scale, (got - want).abs().max() / scale


def test_what_is_not_a_replys_token_takes_the_models_own_path(
    quant_gguf, monkeypatch, eager_kernels
):
    """Two rows, autocast, a gradient, a padded cache or a block that is not llama's plain one
    (a bias on a projection, qwen2's) never reach the C step."""
    calls = []
    lib = decode_native.library()
    monkeypatch.setitem(lib, "toy_llama_steps", lambda *a: calls.append(a))
    model = _packed_model(quant_gguf, "quantized")
    decode_native.install(model)
    tok = torch.tensor([[3]])
    with torch.no_grad():
        model(torch.tensor([[3], [4]]), model.new_cache(2, 8))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(tok, model.new_cache(1, 8))
        padded = model.new_cache(1, 8)
        padded.pad = torch.tensor([0])
        model(tok, padded)
    model(tok, model.new_cache(1, 8))  # grad enabled
    assert calls == []
    biased = _packed_model(quant_gguf, "quantized")
    q = biased.layers[1].self_attn.q_proj
    q.bias = torch.nn.Parameter(torch.zeros(q.spec.shape[0]), requires_grad=False)
    decode_native.install(biased)
    with torch.no_grad():
        biased(tok, biased.new_cache(1, 8))
    assert calls == [] and biased.hidden.blocks is False


def _adapted(model, seed: int = 7):
    """An adapter on q, v and down (B not zero), merged: those projections float32 rows."""
    from toy.lora import LoRALinear, apply_lora, merge_lora

    apply_lora(model, ["q_proj", "v_proj", "down_proj"], 4, 8.0, 0.0, seed)
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.lora_B.data = torch.randn(m.lora_B.shape, generator=g) * 0.05
    return merge_lora(model)


def test_an_adapter_merged_into_the_blocks_steps_in_c_too(quant_gguf, monkeypatch, eager_kernels):
    """`toy infer --adapter` merges the adapter into the projections it adapts (float32 rows
    there, the rest packed): those blocks step in C as well (one dot product a row), the
    logits within float32 rounding of the float32 base with the same adapter merged."""
    calls = _count_steps(monkeypatch)
    with torch.no_grad():
        f32 = _packed_model(quant_gguf, "float32", _adapted)
        want = _greedy(f32, [5, 9, 12, 7], 30, f32.new_cache(1, 64))
        model = _packed_model(quant_gguf, "quantized", _adapted)
        assert type(model.layers[0].self_attn.q_proj) is torch.nn.Linear
        assert decode_native.install(model)
        got = _greedy(model, [5, 9, 12, 7], 30, model.new_cache(1, 64))
    assert calls == list(range(4, 34))
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-4 * scale, (got - want).abs().max() / scale


def _count_steps(monkeypatch) -> list:
    calls = []
    lib = decode_native.library()
    real = lib["toy_llama_steps"]
    monkeypatch.setitem(lib, "toy_llama_steps", lambda *a: calls.append(a[-1]) or real(*a))
    return calls


def test_toy_infer_quantized_steps_in_c_and_gives_the_float32_text(
    quant_gguf, toy_cli, monkeypatch
):
    calls = _count_steps(monkeypatch)
    args = ["infer", "--model", quant_gguf, "--prompt", "ROMEO. What", "--temperature", "0"]
    code, f32, err = toy_cli(*args, "--max-new-tokens", "30", "--base-dtype", "float32")
    assert code == 0 and not calls, err
    code, q, err = toy_cli(*args, "--max-new-tokens", "30", "--base-dtype", "quantized")
    assert code == 0, err
    assert len(calls) >= 29  # every token after the prompt's (and warm_steps' scratch token)
    assert q == f32 and len(f32.strip()) > 20


@pytest.mark.slow
def test_smollm2_quantized_reply_in_c_is_the_float32_text(smollm2_gguf, toy_cli, monkeypatch):
    """SmolLM2-135M Q4_1 (30 blocks, 9 query heads on 3 K/V heads, a Q8_0 tied head): the
    packed reply stepped in C writes the float32 base's greedy text."""
    calls = _count_steps(monkeypatch)
    args = ["infer", "--model", smollm2_gguf, "--prompt", "Once upon a time, there was a"]
    args += ["--temperature", "0", "--max-new-tokens", "40"]
    code, f32, err = toy_cli(*args, "--base-dtype", "float32")
    assert code == 0, err
    code, q, err = toy_cli(*args, "--base-dtype", "quantized")
    assert code == 0, err
    assert len(calls) >= 39
    assert q == f32 and len(f32.strip()) > 40


def test_a_first_packed_reply_builds_nothing_and_imports_no_compiler(quant_gguf, tmp_path):
    """With the C step a llama model's packed reply needs no build: in a fresh process with a
    cold inductor cache, `--base-dtype quantized` says no compile note, never imports torch's
    compiler stack (torch._dynamo: 1.3 s of a reply), writes the float32 base's text and marks
    nothing as built; auto packs it on its first run (no build to wait for)."""
    import json
    import os
    import subprocess
    import sys

    args = ["infer", "--model", quant_gguf, "--prompt", "ROMEO. What", "--temperature", "0"]
    args += ["--max-new-tokens", "40"]
    # auto's weighing as for a model large enough to repay packing 40 tokens once its steps
    # are cached: it packs on this first run only if nothing is to be built
    tell = "import sys; from toy.cli import cmd_infer; "
    tell += "cmd_infer.pack_pays = lambda size, tokens, cached: cached and tokens >= 40; "
    tell += "from toy.cli.main import main; code = main(sys.argv[1:]); "
    tell += "print('dynamo imported:', 'torch._dynamo' in sys.modules, file=sys.stderr); "
    tell += "sys.exit(code)"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    out = {}
    for dtype in ("float32", "quantized", "auto"):
        r = subprocess.run(
            [sys.executable, "-c", tell, *args, "--base-dtype", dtype, "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert r.returncode == 0, r.stderr
        assert "dynamo imported: False" in r.stderr, r.stderr
        assert "note: compiling" not in r.stderr, r.stderr
        out[dtype] = json.loads(r.stdout)
    text = out["float32"]["text"]
    assert out["quantized"]["text"] == text and len(text.strip()) > 20
    assert out["auto"]["text"] == text
    assert out["auto"]["base_dtype"] == "quantized (packed)", out["auto"]
    # nothing built, and no marker saying decode.py's steps were (a later run without the C
    # step would count on them and wait for their build)
    assert not [p for p in (tmp_path / "inductor").rglob("*") if p.is_file()]


def _mixed_llama(seed: int = 0):
    """A tiny llama whose projections are random blocks of different types, as a Q4_K_M file
    mixes them (q, k Q4_K, v and down Q6_K: 16-long groups beside 32-long ones, 8-bit words
    beside nibbles), packed; and the float32 model of the same weights."""
    from toy.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=64, d_model=256, n_layer=2, n_head=4, n_kv_head=2, d_ff=512, max_seq_len=128
    )
    torch.manual_seed(seed)
    ref = Llama(cfg).eval()
    model = Llama(cfg).eval()
    model.load_state_dict(ref.state_dict())
    types = {
        "q_proj": T.Q4_K,
        "k_proj": T.Q4_K,
        "v_proj": T.Q6_K,
        "o_proj": T.F16,
        "gate_proj": T.Q4_1,
        "up_proj": T.Q8_0,
        "down_proj": T.Q6_K,
    }  # fmt: skip  (o_proj F16: a file's float tensor, left unpacked, taken as float rows)
    for i, (block, twin) in enumerate(zip(model.layers, ref.layers)):
        for part, twin_part in ((block.self_attn, twin.self_attn), (block.mlp, twin.mlp)):
            for name, qtype in types.items():
                if hasattr(part, name):
                    rows, cols = getattr(part, name).weight.shape
                    if qtype == T.F16:
                        w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(i))
                        raw = (w * 0.05).half().view(torch.uint8)
                    else:
                        raw = random_blocks(qtype, rows, cols, MILD_F16, 10 * i)
                        raw = torch.from_numpy(raw)
                    spec = QuantSpec(int(qtype), (rows, cols))
                    setattr(part, name, QuantLinear(raw, spec))
                    getattr(twin_part, name).weight.data = spec.dequantize((raw,))
    decode.pack(model)
    return model, ref


@pytest.mark.parametrize("build", ["native", "avx2"])
def test_a_block_of_mixed_types_steps_as_the_float32_one(build, monkeypatch, eager_kernels):
    """q, k and v (and gate and up) go through one parallel region each: a matrix's group sums
    (and the AVX2 loop's scaled x) are its own, not the first one's. This untrained model of
    random blocks carries float32 rounding further than a real one: the C step is held to
    twice what decode.py's own packed path (its kernels' torch lines) differs from float32
    by (1.6e-4 of the logits here), and the same greedy tokens."""
    lib = _built_with(monkeypatch, BUILDS[build])
    monkeypatch.setattr(decode_native, "library", lambda: lib)
    calls = []
    real = lib["toy_llama_steps"]
    monkeypatch.setitem(lib, "toy_llama_steps", lambda *a: calls.append(a[-1]) or real(*a))
    model, ref = _mixed_llama()
    with torch.no_grad():
        want = _greedy(ref, [5, 9, 12], 20, ref.new_cache(1, 32))
        eager = _greedy(_mixed_llama()[0], [5, 9, 12], 20, ref.new_cache(1, 32))
        assert decode_native.install(model)
        got = _greedy(model, [5, 9, 12], 20, model.new_cache(1, 32))
    assert calls == list(range(3, 23))
    bound = max(1e-4 * want.abs().max(), 2 * (eager - want).abs().max())
    assert (got - want).abs().max() <= bound, ((got - want).abs().max(), bound)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
