"""Generation on packed codes (models/decode.py): the kernel against the dequantized float32
matmul for every GGUF block type, the packed weights against the file's bit for bit, and
`toy infer` on a quantized GGUF giving the float32 base's greedy text."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from helpers.common import drop_isa_caps, no_c_step  # noqa: E402
from helpers.quant import (  # noqa: E402
    BLOCK_TYPES,
    quant_gguf,  # noqa: F401
    random_blocks,
)

from toy.models import decode, registry
from toy.models.generate import next_logits
from toy.models.quant import QuantEmbedding, QuantLinear, QuantSpec, dequantize

pytestmark = pytest.mark.skipif(
    decode.compile_unavailable(torch.device("cpu")) is not None,
    reason=str(decode.compile_unavailable(torch.device("cpu"))),
)

MILD_F16 = np.array(
    [0x1800, 0x1C00, 0x2000, 0x2400, 0x9800, 0xA000, 0x1234, 0x2345, 0x0000], dtype=np.uint16
)


def linear(
    qtype, rows: int, cols: int, seed: int, qk_heads: int = 0
) -> tuple[QuantLinear, torch.Tensor]:
    """A QuantLinear over random blocks (scales between 2^-9 and 2^-6, some negative or
    zero) and its float32 weight as models/quant dequantizes it."""
    raw = torch.from_numpy(random_blocks(qtype, rows, cols, MILD_F16, seed))
    spec = QuantSpec(int(qtype), (rows, cols), qk_heads)
    return QuantLinear(raw, spec), spec.dequantize((raw,))


# The block types whose one-row kernel is built (a cold build is several seconds): both kinds of
# code (4- and 8-bit words), with and without offsets, groups of 32 and 16. The others run the
# kernel's torch lines eagerly, the code the build compiles.
BUILT = (T.Q4_0, T.Q4_K, T.Q8_0, T.Q6_K)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_one_row_on_the_codes_matches_the_dequantized_matmul(qtype, monkeypatch):
    """The packed kernel reorders the sums and nothing else: within 1e-5 of the largest
    output (the issue asks 1e-4), on a float64 reference of the same float32 weight."""
    if qtype not in BUILT:
        monkeypatch.setattr(
            decode,
            "_kernel",
            lambda four_bit, parts: (
                lambda args: ((decode._matvec4 if four_bit else decode._matvec8)(*args),)
            ),
        )
    cols = 512 if qtype in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K) else 96
    lin, w = linear(qtype, 40, cols, seed=int(qtype))
    x = torch.randn(1, 1, cols, generator=torch.Generator().manual_seed(1))
    ref = (x.double() @ w.double().t()).float()
    assert decode.pack(lin) == 1 and isinstance(lin.spec, decode.PackedSpec)
    with torch.no_grad():
        y = lin(x)
    assert y.shape == (1, 1, 40)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max(), (y - ref).abs().max()


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_packed_weights_are_the_files_bit_for_bit(qtype):
    """Unpacked again (a prompt's prefill, an embedding lookup), the packed codes give the
    weight models/quant gives, to the bit; Q/K rows in rotary's order (qk_heads)."""
    cols = 256 if qtype in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K) else 64
    lin, w = linear(qtype, 16, cols, seed=7, qk_heads=2)
    decode.pack(lin)
    got = lin.dequantized()
    assert torch.equal(got.view(torch.int32), w.view(torch.int32)) or torch.equal(got, w)
    emb_raw = torch.from_numpy(random_blocks(qtype, 32, cols, MILD_F16, 3))
    emb = QuantEmbedding(emb_raw, QuantSpec(int(qtype), (32, cols)))
    full = dequantize(emb_raw, int(qtype), cols)
    decode.pack(emb)
    idx = torch.tensor([[3, 0, 31, 3]])
    assert torch.equal(emb(idx), full[idx])


def test_many_rows_take_the_dequantized_weight():
    """A prompt (more than one row) multiplies by the unpacked weight: float32 matmul."""
    lin, w = linear(T.Q4_K, 24, 256, seed=5)
    decode.pack(lin)
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want = lin(x), x @ w.t()
        # float32 sums of 256 products in another order: off by a few ulps of the summed
        # magnitudes, not of the result (an output near 0 from terms near 100 moved ~5e-5,
        # past a flat 1e-5, with an unseeded x in some suite orders)
        bound = 1e-5 * (x.abs() @ w.abs().t()) + 1e-6
        assert ((got - want).abs() <= bound).all(), (got - want).abs().max()


def test_packing_keeps_the_blocks_and_shares_a_tied_head():
    """The file's blocks are paged out, never changed (a copy made before equals them
    after), and a head that reads the embedding's blocks reads its packed codes too."""
    raw = torch.from_numpy(random_blocks(T.Q8_0, 64, 64, MILD_F16, 9))
    before = raw.clone()
    spec = QuantSpec(int(T.Q8_0), (64, 64))
    model = torch.nn.Module()
    model.embed, model.head = QuantEmbedding(raw, spec), QuantLinear(raw, spec)
    assert decode.pack(model) == 1
    assert torch.equal(raw, before)
    assert model.embed.codes is model.head.codes and model.embed.spec is model.head.spec


def test_base_packed_bytes_says_what_packs():
    from toy.formats.base import QuantTensor

    raw = torch.zeros(8, 34, dtype=torch.uint8)
    q8 = QuantTensor((raw,), QuantSpec(int(T.Q8_0), (8, 32)))
    norm = torch.ones(32)
    got = decode.base_packed_bytes({"w": q8, "norm": norm}, torch.device("cpu"))
    assert got == decode.packed_bytes(q8.spec) + 32 * 4 == 8 * (32 + 8) + 128
    assert (
        decode.base_packed_bytes({"norm": norm}, torch.device("cpu")) is None
    )  # nothing quantized
    assert decode.base_packed_bytes({"w": q8}, torch.device("meta")) is None  # not the cpu


# ---------------------------------------------------------------- through the command line


def test_toy_infer_quantized_gives_the_float32_text(quant_gguf, toy_cli, monkeypatch):
    """`--base-dtype quantized` packs the base and greedy decoding gives the text the
    float32 base gives; auto packs where pack_pays says so (here: from 40 new tokens, so that
    the packed auto run reuses the step built for the same cache; its own measured costs never
    pack a model this small, tests/models/test_reply_time.py)."""
    from toy.cli import cmd_infer

    monkeypatch.setattr(cmd_infer, "pack_pays", lambda size, tokens, cached: tokens >= 40)
    packed, steps = [], []
    real, real_steps = decode.pack, decode.compile_steps
    monkeypatch.setattr(decode, "pack", lambda m, *a: packed.append(real(m, *a)) or packed[-1])
    monkeypatch.setattr(
        decode,
        "compile_steps",
        lambda m, note=None, **kw: steps.append(real_steps(m, note, **kw)) or steps[-1],
    )
    args = ["infer", "--model", quant_gguf, "--prompt", "ROMEO. What", "--temperature", "0"]
    code, f32, err = toy_cli(*args, "--max-new-tokens", "40", "--base-dtype", "float32")
    assert code == 0, err
    assert not packed
    code, q, err = toy_cli(*args, "--max-new-tokens", "40", "--base-dtype", "quantized")
    assert code == 0, err
    assert packed == [2 * 7 + 1]  # 7 matrices a layer, and the tied embedding
    assert steps == [2]  # both blocks take the compiled one-token step (built or loaded:
    # the note of a build, and a second process loading it: test_compile_note_comes_...)
    assert q == f32 and len(f32.strip()) > 20
    code, short, err = toy_cli(*args, "--max-new-tokens", "39")  # auto, short: float32
    assert code == 0 and len(packed) == 1, err
    assert f32.startswith(short.rstrip("\n"))
    code, long, err = toy_cli(*args, "--max-new-tokens", "40")  # auto, long: packed, from
    # the model the quantized run kept for the C loop (cli/reply_fast.py): nothing packed again
    assert code == 0 and len(packed) == 1 and long == f32, err


def test_a_long_budget_builds_only_the_first_span_before_the_reply(
    quant_gguf, tmp_path, monkeypatch, toy_run
):
    """Issue 58 item 4: `--max-new-tokens 1500` waited 41 s for a 10-token reply: every
    span the budget could reach (256, 512, 1024, the whole cache) was built before the first
    token. Now only the span the first new token reads is; a later one is built where the
    reply reaches it, without a note. SPAN_MIN lowered to 8: the prompt and 12 new tokens
    read spans 8 and 16 (built cold into this test's own toy-steps). The llama model's reply
    is stepped by decode.py here, as a family without decode_native's C step is (that path
    builds nothing: tests/models/test_decode_native.py)."""
    import sys

    no_c_step(monkeypatch)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(decode, "SPAN_MIN", 8)
    order = []
    real_compile = decode._compile
    monkeypatch.setattr(decode, "_compile", lambda *a: order.append("build") or real_compile(*a))
    write = sys.stdout.write

    def spy(text):
        if text.strip():
            order.append("text")
        return write(text)

    monkeypatch.setattr(sys.stdout, "write", spy)
    args = ["infer", "--model", quant_gguf, "--prompt", "ROMEO. What", "--temperature", "0"]
    r = toy_run(*args, "--max-new-tokens", "12", "--base-dtype", "quantized")
    assert r.returncode == 0, r.stderr
    first = order.index("text")
    # span 8's steps before the reply; span 16's where the reply reached it (before this
    # change: every build came before the first text)
    assert order[:first].count("build") >= 1 and "build" in order[first:], order
    assert r.stderr.count("note: compiling") == 1, r.stderr
    code_f32 = toy_run(*args, "--max-new-tokens", "12", "--base-dtype", "float32")
    assert r.stdout == code_f32.stdout  # the same text either way
    # Built once for every budget: the compiled path's cache spans the model's context
    # (resident only where written), so its strides, which the steps are built for, are
    # the same whatever --max-new-tokens is. A budget past the old 256-position chunk (a
    # cache of 512 positions before: other strides, every step built again, 22 s for
    # SmolLM2 at --max-new-tokens 1500) now loads what the first run built. Its reply is
    # cut to 3 tokens (within span 8) to keep the test short.
    import itertools

    from toy.models import generate as gen_module

    real_generate = gen_module.generate
    monkeypatch.setattr(
        gen_module, "generate", lambda *a, **kw: itertools.islice(real_generate(*a, **kw), 3)
    )
    order.clear()
    r = toy_run(*args, "--max-new-tokens", "300", "--base-dtype", "quantized")
    assert r.returncode == 0, r.stderr
    assert "text" in order and "build" not in order, order
    assert "note: compiling" not in r.stderr, r.stderr


def test_without_a_compiler_quantized_still_generates(quant_gguf, toy_cli, monkeypatch):
    """No C++ compiler: nothing is packed and the layers are dequantized per use, as before."""
    monkeypatch.setattr(decode, "compile_unavailable", lambda device: "no C++ compiler (test)")
    args = [
        "infer",
        "--model",
        quant_gguf,
        "--prompt",
        "ROMEO. What",
        "--temperature",
        "0",
        "--max-new-tokens",
        "30",
    ]
    code, q, err = toy_cli(*args, "--base-dtype", "quantized")
    assert code == 0, err
    code, f32, err = toy_cli(*args, "--base-dtype", "float32")
    assert code == 0 and q == f32, err


def _failing_compilers(d: Path, version_ok: bool) -> dict:
    """An environment whose C++ compilers fail: every name inductor or a user might call, first
    on PATH; `version_ok`: they answer --version (exit 0) and fail to build anything. A fresh
    inductor cache, so that no kernel built before hides the failure."""
    d.mkdir()
    body = 'case "$1" in --version) exit 0;; esac\n' if version_ok else ""
    for name in ("c++", "g++", "gcc", "cc", "clang++", "clang"):
        (d / name).write_text(f"#!/bin/sh\n{body}echo 'broken compiler' >&2\nexit 1\n")
        (d / name).chmod(0o755)
    import os

    env = {"PATH": f"{d}{os.pathsep}{os.environ['PATH']}"}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(d.parent / f"inductor-{d.name}")
    env["TOY_CACHE"] = str(d.parent / f"toy-cache-{d.name}")  # toy's C kernels unbuilt too
    env.pop("CXX", None)
    return env


@pytest.mark.parametrize("version_ok", [False, True], ids=["no-version", "builds-fail"])
def test_infer_with_failing_compilers_falls_back_to_eager(
    quant_gguf, tmp_path, version_ok, toy_run
):
    """Compiling is a speed lever, never a requirement (issue 32 item 8): with compilers that
    fail, `toy infer` on a quantized GGUF asked for packed codes gives the float32 text with
    one note line (and one that toy's C kernels did not build), exit 0, no traceback; auto,
    which packs no model this small (pack_pays), gives it with no note (auto choosing packed
    without a compiler: test_reply_time.py)."""
    from helpers.common import run_toy

    env = _failing_compilers(tmp_path / "bin", version_ok)
    args = ["infer", "--model", quant_gguf, "--prompt", "ROMEO. What", "--temperature", "0"]
    ref = toy_run(*args, "--max-new-tokens", "30", "--base-dtype", "float32")  # the text asked
    assert ref.returncode == 0, ref.stderr
    ref = ref.stdout.rstrip("\n")
    for extra in (["--base-dtype", "quantized"], ["--max-new-tokens", "300"]):  # asked; auto
        r = run_toy(*args, "--max-new-tokens", "30", *extra, env=env)
        assert r.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr and "InvalidCxxCompiler" not in r.stderr
        notes = [line for line in r.stderr.splitlines() if "without compiled kernels" in line]
        assert len(notes) == (1 if "quantized" in extra else 0), r.stderr
        assert all(line.startswith("note: ") for line in notes)
        others = [line for line in r.stderr.splitlines() if line not in notes]
        # besides: the note said before a compile is tried, the speed line, and one line
        # naming the C compiler that did not build toy's own kernels (the reply's C step)
        assert all(line.startswith(("note: compiling the one-token", "[")) for line in others[1:])
        assert others[0].startswith("toy: note: the C compiler") and "decode_step.c" in others[0]
        assert r.stdout.startswith(ref) and len(ref) > 20


def test_compile_note_comes_before_the_reply_not_inside_it(quant_gguf, tmp_path):
    """Issue 35 item 2: the compile note went out after the first token ("Ah" / note / "oy,
    matey!"). With stdout and stderr on one pipe, as on a terminal, every note is a whole line
    and comes before the text; the reply is the float32 one, and a last stderr line gives the
    time to the first token and the tokens/s. A second process (issue 33 item 3) loads the
    steps built by the first (no note, no compiler stack imported: torch._dynamo alone took
    1.3 s of a reply) and gives the same text. Run as on a machine without toy's C kernels
    (TOY_NATIVE=0), where the llama model's reply takes decode.py's compiled steps, as other
    families' do (with them it builds nothing: tests/models/test_decode_native.py)."""
    import os
    import subprocess

    args = ["infer", "--model", quant_gguf, "--prompt", "ROMEO. What", "--temperature", "0"]
    args += ["--max-new-tokens", "30"]
    tell = "import sys; from toy.cli.main import main; code = main(sys.argv[1:]); "
    tell += "print('dynamo imported:', 'torch._dynamo' in sys.modules); sys.exit(code)"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))  # a cold cache
    env["TOY_NATIVE"] = "0"
    merged = {}
    for run, dtype in (("f32", "float32"), ("cold", "quantized"), ("warm", "quantized")):
        r = subprocess.run(
            [sys.executable, "-c", tell, *args, "--base-dtype", dtype],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            timeout=600,
        )
        assert r.returncode == 0, r.stdout
        merged[run] = r.stdout.replace("dynamo imported: ", "[dynamo imported: ")
    assert "[dynamo imported: False" in merged["f32"]
    assert "[dynamo imported: False" in merged["warm"], merged
    assert "note:" not in merged["warm"], merged["warm"]
    out = merged["cold"]
    assert "note: compiling the one-token step" in out
    assert out.index("note: compiling") < out.index("ROMEO. What")
    for line in out.splitlines():
        assert "note:" not in line or line.startswith("note:"), line
    text = [line for line in out.splitlines() if not line.startswith(("note:", "["))]
    ref = [line for line in merged["f32"].splitlines() if not line.startswith(("note:", "["))]
    assert text == ref and len("".join(ref)) > 20
    warm = [line for line in merged["warm"].splitlines() if not line.startswith("[")]
    assert warm == ref
    speed = out.splitlines()[-2]  # the last: the dynamo line this test adds
    assert speed.startswith("[30 tokens: first after") and "tokens/s after it]" in speed


def test_packed_codes_are_kept_in_the_cache_and_checked_on_read(
    quant_gguf, toy_cli, monkeypatch, tmp_path
):
    """Issue 33 item 3: a GGUF is packed once; later runs read the packed codes from toy's
    cache (no block is packed again) and give the same text; a damaged cache file is packed
    again from the GGUF and rewritten, never used."""
    from toy.cli import cmd_infer
    from toy.formats import packed_cache

    monkeypatch.setenv("TOY_CACHE", str(tmp_path / "cache"))
    # every run through torch's path, which reads this cache (a later one would reply from
    # the model the first kept for the C loop: tests/cli/test_reply_fast.py)
    monkeypatch.setattr(cmd_infer, "load_kept", lambda args: None)
    calls = []
    real = decode.pack_parts
    monkeypatch.setattr(decode, "pack_parts", lambda *a, **k: calls.append(1) or real(*a, **k))
    args = ["infer", "--model", quant_gguf, "--prompt", "ROMEO. What", "--temperature", "0"]
    args += ["--max-new-tokens", "20", "--base-dtype", "quantized"]
    code, first, err = toy_cli(*args)
    assert code == 0, err
    path = packed_cache.path_for(Path(quant_gguf))
    assert path.is_file() and len(calls) == 2 * 7 + 1
    assert not list(path.parent.glob(".tmp-*"))  # written atomically: no leftovers
    code, again, err = toy_cli(*args)
    assert code == 0 and again == first, err
    assert len(calls) == 2 * 7 + 1  # read from the cache: nothing packed
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0xFF  # a flipped bit in the last tensor's data
    path.write_bytes(bytes(raw))
    code, damaged, err = toy_cli(*args)
    assert code == 0 and damaged == first, err
    assert len(calls) == 2 * (2 * 7 + 1)  # packed again from the file
    assert packed_cache.read(path) is not None  # and the cache rewritten whole


def test_infer_precision_flag(quant_gguf, toy_cli, monkeypatch):
    """Issue 33 item 1 (infer): --precision bf16 holds the dequantized base in bfloat16 where
    the cpu has bf16 units, exits 2 saying why where it has none or where --base-dtype
    float32 conflicts; auto keeps float32 on a cpu."""
    from toy.formats import base_readers
    from toy.train import device as device_mod

    held = []
    real = base_readers.held_as  # the probe, held as the generation asks
    monkeypatch.setattr(base_readers, "held_as", lambda p, m, d: held.append(d) or real(p, m, d))
    args = ["infer", "--model", quant_gguf, "--prompt", "ROMEO. What", "--temperature", "0"]
    args += ["--max-new-tokens", "10"]
    monkeypatch.setattr(device_mod, "cpu_bf16_units", lambda: "avx512_bf16")
    drop_isa_caps(monkeypatch)  # a cap would refuse bf16
    code, out, err = toy_cli(*args, "--precision", "bf16")
    assert code == 0 and held[-1] == "bfloat16" and len(out.strip()) > 11, err
    code, out, err = toy_cli(*args)  # auto
    assert code == 0 and held[-1] == "float32", err
    code, out, err = toy_cli(*args, "--precision", "bf16", "--base-dtype", "float32")
    assert code == 2 and "conflicts" in err and "Traceback" not in err
    monkeypatch.setattr(device_mod, "cpu_bf16_units", lambda: None)
    code, out, err = toy_cli(*args, "--precision", "bf16")
    assert code == 2 and "no bf16 units" in err and "Traceback" not in err


# ---------------------------------------------------------------- a block compiled for one token


def _greedy_logits(
    model, prompt: list[int], steps: int, max_len: int, grow_to: int
) -> torch.Tensor:
    """Greedy decoding's logits: the prompt's, then one token at a time; midway the cache grows
    (as a chat's does: new buffers, other strides)."""
    cache = model.new_cache(1, max_len)
    out = [next_logits(model, torch.tensor([prompt]), cache)]
    for i in range(steps):
        if i == steps // 2:
            cache.reserve(grow_to)
        out.append(next_logits(model, torch.tensor([[int(out[-1].argmax())]]), cache))
    return torch.stack(out)


@pytest.mark.parametrize("name", [n for n in sorted(registry.families()) if n != "vit"])
def test_a_compiled_step_gives_the_eager_logits(name, monkeypatch):
    """Every family's blocks compiled for one token (compile_steps): the eager blocks' logits
    within float32 rounding, past a sliding window with capped scores (gemma's tiny: a window
    of 8, local and global layers, which get steps of their own). llama's also through three
    spans (SPAN_MIN lowered to 8) and a cache that grows midway; the span logic is decode's,
    the same for every family, so the others run one span (each span is a cold build of
    several seconds: the suite's time)."""
    fam = registry.family(name)
    cfg = fam.config(**fam.tiny)
    torch.manual_seed(0)
    model = fam.model(cfg).eval()
    spanned = name == "llama"
    monkeypatch.setattr(decode, "SPAN_MIN", 8 if spanned else 32)
    grow_to = 64 if spanned else 20
    with torch.no_grad():
        eager = _greedy_logits(model, [1, 2, 3, 4, 5], 10, 20, grow_to)
        assert decode.compile_steps(model) == cfg.n_layer
        compiled = _greedy_logits(model, [1, 2, 3, 4, 5], 10, 20, grow_to)
    spans = {shape[:2] for block in model.blocks for shape in block.forward.spans}
    # (span, cache length): SPAN_MIN, then the whole cache (the next doubling reaches it), then
    # a cache grown to 64 (other strides) read over a doubled span; or the whole cache alone
    assert spans == ({(8, 20), (20, 20), (16, 64)} if spanned else {(20, 20)})
    assert torch.allclose(compiled, eager, rtol=1e-5, atol=1e-5), (compiled - eager).abs().max()
    with (
        torch.enable_grad()
    ):  # anything with a gradient (training): the eager forward, nothing compiled
        compiled_before = len(decode._STEPS)
        assert model.hidden(torch.tensor([[1]]), model.new_cache(1, 4)).requires_grad
        assert len(decode._STEPS) == compiled_before


def test_a_built_step_that_does_not_load_is_built_again(tmp_path, monkeypatch):
    """A library in toy-steps/built that is not one (damaged, or another machine's) is not
    loaded: _load_built says None and the step is built again in its place. Written with a
    temporary name and renamed, a half-written library is never seen."""
    bad = tmp_path / "step.so"
    monkeypatch.setattr(decode, "_built_path", lambda key: bad)
    assert decode._load_built(("k",)) is None  # none there
    bad.write_bytes(b"\x7fELF" + b"\0" * 60)  # an ELF header and nothing behind it
    assert decode._load_built(("k",)) is None
    bad.write_bytes(b"not a library")
    assert decode._load_built(("k",)) is None


def test_the_build_id_names_the_cpu_and_the_model_code(monkeypatch):
    """A library built under one instruction-set cap (or other model code) has another name:
    it is never loaded where it was not built for."""
    drop_isa_caps(monkeypatch)  # whatever the shell set
    monkeypatch.setattr(decode, "_BUILD_ID", None)
    plain = decode._built_path(("k",))
    monkeypatch.setattr(decode, "_BUILD_ID", None)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    capped = decode._built_path(("k",))
    monkeypatch.setattr(decode, "_BUILD_ID", None)
    assert plain != capped and plain.name == capped.name  # the same key in two builds' folders
    assert plain.parent.name == "built" and plain.parents[2].name == "toy-steps"
    assert plain.parents[1] != capped.parents[1]
    assert decode._built_path(("k", 1)) != decode._built_path(("k",))
    # The marker that tells auto a model's steps are built is the build's too: an upgraded
    # toy (other model code) or a capped shell never counts on libraries it cannot load.
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.setattr(decode, "_BUILD_ID", None)
    assert decode.steps_marker("m").parent == plain.parents[1]
    monkeypatch.setattr(decode, "_BUILD_ID", None)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert decode.steps_marker("m").parent == capped.parents[1]
    monkeypatch.setattr(decode, "_BUILD_ID", None)


def test_the_build_id_follows_traced_model_code_not_the_losses(tmp_path, monkeypatch):
    """Every toy/models file a step may trace names the build; models/losses.py (training
    only) does not: a change to it rebuilt every step for nothing."""
    import shutil

    src = Path(decode.__file__).parent
    fake = tmp_path / "models"
    shutil.copytree(src, fake, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(decode, "__file__", str(fake / "decode.py"))

    def build_id():
        monkeypatch.setattr(decode, "_BUILD_ID", None)
        return decode._build_id()

    first = build_id()
    (fake / "losses.py").write_text((fake / "losses.py").read_text() + "\n# changed\n")
    assert build_id() == first
    (fake / "layers.py").write_text((fake / "layers.py").read_text() + "\n# changed\n")
    assert build_id() != first
    monkeypatch.setattr(decode, "_BUILD_ID", None)


def test_old_builds_are_pruned_after_a_build(tmp_path, monkeypatch):
    """toy-steps keeps this build's folder and the two used last; older builds' folders and
    what an older toy left (a flat built/ folder, markers beside it) go."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    steps = tmp_path / "toy-steps"
    mine = decode._steps_root()
    (mine / "built").mkdir(parents=True)
    (mine / "marker").touch()
    old = []
    for age, name in enumerate(["a" * 16, "b" * 16, "c" * 16, "d" * 16]):
        (steps / name / "built").mkdir(parents=True)
        (steps / name / "built" / "x.so").write_bytes(b"lib")
        os.utime(steps / name, (1e9 - age, 1e9 - age))  # "a" used last, "d" first
        old.append(steps / name)
    (steps / "built").mkdir()
    (steps / "built" / "y.so").write_bytes(b"lib")
    (steps / "0137fb7f650755df0934f171-torch-2.13.0+cpu").touch()
    gone = decode.prune_builds()
    # toy-steps held only toy's names: toy marks it its own (a name it never wrote, or a
    # link, and nothing is removed: tests/models/test_step_builds.py)
    kept = [decode._HOME_MARK, mine.name, "a" * 16, "b" * 16]
    assert sorted(p.name for p in steps.iterdir()) == sorted(kept)
    assert (mine / "marker").is_file() and (mine / "built").is_dir()
    assert set(gone) == {
        old[2],
        old[3],
        steps / "built",
        steps / "0137fb7f650755df0934f171-torch-2.13.0+cpu",
    }
    assert decode.prune_builds() == []  # nothing more to take


def test_a_lazy_cache_of_the_whole_context_is_resident_only_where_written():
    """The compiled path's cache spans the model's context (cmd_infer.new_cache): one map
    for every layer, the OS's zeros, resident where written; the strides of a plain cache
    of the same length, which the built steps are keyed by."""
    import os

    from toy.models.layers import KVCache

    def rss() -> int:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    if not os.path.exists("/proc/self/statm"):
        pytest.skip("needs /proc/self/statm")
    before = rss()
    cpu = torch.device("cpu")
    cache = KVCache(4, 1, 4, 1 << 16, 64, cpu, torch.float32, lazy=True)  # 512 MiB mapped
    assert rss() - before < 32 << 20
    assert cache.k[3].shape == (1, 4, 1 << 16, 64) and cache.max_len == 1 << 16
    plain = KVCache(1, 1, 4, 64, 64, cpu, torch.float32).k[0]  # a contiguous buffer's
    assert plain.stride() == (4 * 64 * 64, 64 * 64, 64, 1)
    assert cache.k[3].stride() == cache.v[0].stride() == (4 * 65536 * 64, 65536 * 64, 64, 1)
    k, v = cache.update(2, torch.ones(1, 4, 3, 64), torch.full((1, 4, 3, 64), 2.0))
    assert k.shape == (1, 4, 3, 64) and float(v.sum()) == 2.0 * 4 * 3 * 64
    assert float(cache.k[2][:, :, 3:4096].abs().sum()) == 0.0  # read: zeros, not garbage
    assert float(cache.k[1][:, :, :4096].abs().sum()) == 0.0
    assert rss() - before < 32 << 20
    cache.reserve(100)  # within it: nothing to do
    assert cache.max_len == 1 << 16


def test_an_adapter_has_steps_of_its_own_kind():
    """Merged adapters make blocks of another kind (float32 projections among packed ones):
    their steps are marked apart from the base's, by what they adapt, not by their values."""
    from toy.cli.cmd_infer import _adapter_reach
    from toy.cli.cmd_infer import _adapter_shape as by_reach

    def _adapter_shape(sd):
        return by_reach(_adapter_reach(sd))

    a = {"layers.0.attn.q_proj.lora_A": torch.zeros(2, 4), "layers.1.attn.v_proj.lora_B": 0}
    same = {"layers.0.attn.q_proj.lora_A": torch.ones(2, 4), "layers.1.attn.v_proj.lora_B": 1}
    other_layers = {"layers.1.attn.q_proj.lora_A": 0, "layers.1.attn.v_proj.lora_B": 0}
    other_targets = {"layers.0.attn.k_proj.lora_A": 0, "layers.1.attn.v_proj.lora_B": 0}
    assert _adapter_shape(a) == _adapter_shape(same)
    assert len({_adapter_shape(x) for x in (a, other_layers, other_targets)}) == 3


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16"])
def test_batched_steps_give_the_eager_completions_and_logits(autocast, monkeypatch):
    """compile_steps(rows=True), GRPO's sampling path: a batch of rows of prompts of three
    lengths (left-padded rows), a LoRA adapter live on q and v (its weights are the graph's
    inputs: changed after the build, the step follows), rows ending at their own tokens. The
    compiled steps keep every row in the batch and draw from the live rows only; their logits
    are the eager blocks' within float32 rounding (one bf16 rounding under autocast), and
    greedy completions are the eager ones."""
    from toy.lora import apply_lora
    from toy.models.sample import last_logits, sample_groups

    monkeypatch.setattr(decode, "ROW_SPAN", 16)  # spans 16 and 32 of a 32-position cache
    fam = registry.family("llama")
    torch.manual_seed(0)
    model = fam.model(fam.config(**fam.tiny)).eval()
    apply_lora(model, ["q_proj", "v_proj"], rank=4, alpha=8.0, dropout=0.0, seed=0)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, 0, 0.5)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11]]
    stops: set[int] = set()

    def run():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            groups = sample_groups(
                model, prompts, 2, 20, temperature=0.0, generator=None, stop_ids=stops
            )
            cache = model.new_cache(6, 32)  # GRPO's batch: the same graphs
            cache.pad = torch.tensor([3, 3, 0, 0, 4, 4])
            ids = torch.tensor([[7], [8], [9], [10], [11], [12]])
            steps = []
            for pos in range(6, 32, 5):  # tokens in both spans, rows padded
                cache.pos = pos
                steps.append(last_logits(model, ids, cache).float())
        return [[c.ids for c in g] for g in groups], torch.stack(steps)

    first = run()[0]  # a stop: the first prompt's fifth token, where the others go on
    stops.add(next(t for t in first[0][0][4:] if t not in first[1][0][:8] + first[2][0][:8]))
    eager_ids, eager = run()
    assert decode.compile_steps(model, rows=True) == len(model.blocks)
    assert decode.row_steps(model)
    ids, compiled = run()
    tol = 3e-2 if autocast else 1e-5
    assert torch.allclose(compiled, eager, rtol=tol, atol=tol), (compiled - eager).abs().max()
    if not autocast:  # bf16's rounding may turn a greedy pick of a tiny random model
        assert ids == eager_ids
    assert len({len(c) for g in ids for c in g}) > 1  # rows ended apart
    shapes = {shape for block in model.blocks for shape in block.forward.spans}
    assert {s[:3] for s in shapes} == {(16, 32, 6), (32, 32, 6)}  # span, cache, rows
    with torch.no_grad():  # the adapter's new values are read: its weights are inputs
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(-1.0)
    _, flipped = run()
    assert not torch.allclose(flipped, compiled, rtol=tol, atol=tol)


def test_fewer_rows_halves_at_least_and_keeps_four():
    """A compiled batch goes on in the smallest power of two of rows that holds its live ones,
    once they fit in half of it, and never in fewer than FEWEST_ROWS (models/sample.py)."""
    from toy.models.sample import FEWEST_ROWS, _fewer_rows

    assert FEWEST_ROWS == 4
    cases = {(17, 32): 0, (16, 32): 16, (9, 32): 16, (8, 32): 8, (12, 16): 0, (8, 16): 8}
    cases |= {(5, 16): 8, (4, 16): 4, (1, 16): 4, (3, 4): 0, (1, 4): 0, (6, 24): 8, (12, 24): 0}
    assert {k: _fewer_rows(*k) for k in cases} == cases


def test_batched_steps_go_on_in_fewer_rows_as_rows_end():
    """Rows of four prompts whose completions end apart (each prompt's budget is what the
    model's context leaves it: 25, 21, 17, 13 tokens): the compiled batch of 16 rows goes on
    in 8, then 4 rows as they end, the head on the live rows only, and every completion is
    the eager sampler's, token for token (float32 steps: the same products within rounding,
    greedy picks with no near-tie in this model)."""
    from toy.lora import apply_lora
    from toy.models.sample import sample_groups

    fam = registry.family("llama")
    torch.manual_seed(0)
    model = fam.model(fam.config(**fam.tiny)).eval()  # a context of 64 positions
    apply_lora(model, ["q_proj", "v_proj"], rank=4, alpha=8.0, dropout=0.0, seed=0)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, 0, 0.5)
    prompts = [[1 + (7 * i + j) % 90 for j in range(n)] for i, n in enumerate((40, 44, 48, 52))]

    def run():
        with torch.no_grad():
            groups = sample_groups(
                model, prompts, 4, 25, temperature=0.0, generator=None, stop_ids=set()
            )
        return [[c.ids for c in g] for g in groups]

    eager = run()
    assert [len(g[0]) for g in eager] == [25, 21, 17, 13]
    assert decode.compile_steps(model, rows=True) == len(model.blocks)
    assert run() == eager
    shapes = {shape for block in model.blocks for shape in block.forward.spans}
    # (span, cache, rows): 16 rows over whole 64-position spans of a 128-position cache, then
    # 8 and 4 rows over powers of two (decode._row_span)
    assert {s[:3] for s in shapes} == {(64, 128, 16), (128, 128, 16), (128, 128, 8), (128, 128, 4)}


@pytest.mark.parametrize("pad", [False, True], ids=["no-pad", "padded"])
def test_grouped_one_token_attention_is_sdpas(pad):
    """The bf16 compiled step's attention (layers._grouped_one_token: each K/V head with its
    query heads, as products and sums) gives SDPA's float32 result with its heads repeated,
    under a (1, S) mask or a padded rows' (B, 1, 1, S) one."""
    import torch.nn.functional as F

    from toy.models.layers import _grouped_one_token

    g = torch.Generator().manual_seed(0)
    B, H, K, S, D = 5, 6, 2, 24, 16
    q = torch.randn(B, H, 1, D, generator=g).bfloat16()
    k, v = (torch.randn(B, K, S, D, generator=g) for _ in range(2))
    m = torch.arange(S)[None, :] <= 19  # (1, S): the keys up to the token
    if pad:
        m = m & (torch.arange(S)[None, :] >= torch.tensor([0, 3, 1, 7, 2])[:, None])[:, None, None]
    want = F.scaled_dot_product_attention(q.float(), k, v, attn_mask=m, enable_gqa=True)
    got = _grouped_one_token(q, k, v, m, None)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want.bfloat16().float(), rtol=1e-2, atol=1e-2)
    assert torch.allclose(_grouped_one_token(q.float(), k, v, m, None), want, rtol=1e-5, atol=1e-6)


def test_a_cache_held_in_the_autocast_dtype_gives_the_same_logits():
    """Under bf16 autocast a block writes its keys and values in bf16, so a cache held in
    bf16 (KVCache.hold_as: what the compiled batched sampler uses) keeps them exactly: the
    eager blocks give the float32 cache's logits bit for bit, prefill and padded decode."""
    from toy.models.sample import last_logits

    fam = registry.family("llama")
    torch.manual_seed(0)
    model = fam.model(fam.config(**fam.tiny)).eval()
    ids = torch.randint(0, 96, (3, 9), generator=torch.Generator().manual_seed(1))

    def run(held):
        out = []
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            cache = model.new_cache(3, 16)
            if held:
                cache.hold_as(torch.bfloat16)
            out.append(last_logits(model, ids, cache))
            cache.pad = torch.tensor([0, 2, 1])
            for t in range(4):
                out.append(last_logits(model, ids[:, t : t + 1], cache))
        assert cache.k[0].dtype == (torch.bfloat16 if held else torch.float32)
        return torch.stack(out)

    assert torch.equal(run(True), run(False))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "phi3"])
def test_a_traced_step_of_many_rows_takes_each_projection_as_one_product(arch, monkeypatch):
    """GRPO's sampling steps a batch of rows under bf16 autocast through the compiled steps
    (compile_steps(rows=True)). Their traced graph took the attention's output projection
    of (B, 1, H*D) rows as B products of one row each (aten.bmm): inductor turned that
    into a loop of dot products reading the weight once a row, 10 of a 32-row SmolLM2
    step's ~100 ms. Every projection is one matrix product now (aten.mm); training's
    losses are the same bytes (scripts/same_losses.py). The graphs are run eagerly here
    (no build): what is checked is what inductor is given."""
    from toy.models.phi3 import Phi3, Phi3Config
    from toy.models.sample import sample_groups

    graphs = []

    def keep(graph, inputs, key):  # decode._compile's place: the traced graph, run as is
        graphs.append(graph)
        return lambda ins: [graph(*ins)]  # a block's output: one tensor

    monkeypatch.setattr(decode, "_compile", keep)
    monkeypatch.setattr(decode, "_load_built", lambda key: None)
    monkeypatch.setattr(decode, "_STEPS", {})
    torch.manual_seed(0)
    if arch == "phi3":
        model = Phi3(Phi3Config(vocab_size=64, n_layer=1, d_model=64, n_head=4, n_kv_head=2,
                                head_dim=16, rope_dim=16, d_ff=128, max_seq_len=64))  # fmt: skip
    else:
        model = registry.build_model(registry.build_config(arch, "tiny", 64, n_layer=1))
    assert decode.compile_steps(model, check=False, rows=True) == 1
    with torch.autocast("cpu", torch.bfloat16):
        got = sample_groups(
            model, [[1, 2, 3], [4, 5]], 2, 3, generator=torch.Generator().manual_seed(0),
            stop_ids=set(),
        )  # fmt: skip
    assert [len(c.ids) for g in got for c in g] == [3] * 4 and graphs
    for graph in graphs:
        ops = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
        assert not any("bmm" in op for op in ops), ops
        assert sum(op.startswith(("aten.mm", "aten.addmm")) for op in ops) >= 2, ops
