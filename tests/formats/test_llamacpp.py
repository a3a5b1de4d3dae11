"""The real client: files written by `toy export` loaded by llama.cpp (through
llama-cpp-python) must give toy's greedy text -- same tokenizer ids, same tokens
generated.

Needs `pip install -e .[llamacpp]` (llama-cpp-python builds llama.cpp from source, ~5
minutes on 2 cores, so it is not a test dependency; .ci/run installs it); skipped without
it. Run with `-s` to see the texts compared. The SmolLM2 tests are also `slow` (a LoRA
trained on the 135M base for 6 steps, ~3-7 minutes on 2 cores) and skip when SmolLM2
cannot be fetched.

What is asserted, and how strictly:
- f32 files (from-scratch llama and gpt2, SmolLM2 re-exported in f32 with toy's adapter
  as a gguf-lora, the merged model): llama.cpp's greedy tokens EQUAL toy's.
- lossy files (f16/q8_0 exports, the Q4_1 SmolLM2 base with the adapter, where
  llama.cpp also rounds the activations for its quantized dot products): every token
  llama.cpp chose is within a small logit margin of toy's best at that position
  ("teacher-forced agreement"); how many tokens match exactly is printed.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.gguf_fixtures import smollm2_gguf  # noqa: E402,F401
from helpers.llamacpp import _cpp_greedy, _llama, _teacher_forced_margin  # noqa: F401

from toy.cli.main import main  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402
from toy.formats.model_dir import load_model_dir  # noqa: E402
from toy.models.generate import generate  # noqa: E402

pytestmark = pytest.mark.llamacpp

N_NEW = 40
TEXTS = [
    "To be, or not to be: that is the question.",
    "  leading spaces,\ttabs\tand\n\nnewlines \n ",
    "Digits 1 22 333 4444 55555 and 3.14159; don't won't I'll we've they're",
    "Unicode: café naïve Æsir — “quotes” 日本語 emoji 🙂",
    "Punctuation!!! ??? ... ;;; (parens) [brackets] {braces} @#$%^&*",
    "trailing spaces   ",
]
ALL_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def _toy_greedy(model, prompt: list[int], n: int, stop: set[int]) -> list[int]:
    return list(generate(model, prompt, n, temperature=0.0, stop_ids=stop))


@torch.no_grad()
def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _show(label: str, tok, prompt, toy_ids, cpp_ids, margin=None) -> None:
    same = _common_prefix(toy_ids, cpp_ids)
    print(f"\n[{label}] prompt {tok.decode(prompt)[-60:]!r}")
    print(f"  toy      ({len(toy_ids)} tokens): {tok.decode(toy_ids)!r}")
    print(f"  llama.cpp({len(cpp_ids)} tokens): {tok.decode(cpp_ids)!r}")
    print(
        f"  identical tokens: {same}/{max(len(toy_ids), len(cpp_ids))}"
        + (f"; teacher-forced max logit gap {margin:.4f}" if margin is not None else "")
    )


# ------------------------------------------------------------------ from scratch


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """Tiny llama and gpt2 runs trained a little with the CLI, and a llama "run" whose
    final/ holds random high-variance weights (tests/helpers/gguf_fixtures.tiny_model: its
    greedy text is varied, so a wrong tensor cannot hide behind a repeated token); all
    exported with `toy export` in every dtype."""
    from helpers.gguf_fixtures import tiny_model

    from toy.formats.model_dir import save_model_dir

    d = tmp_path_factory.mktemp("lcpp-scratch")
    assert (
        main(
            ["prep", str(bundled_text_paths()[0]), "--out", str(d / "c.bin"), "--vocab-size", "512"]
        )
        == 0
    )
    runs = {}
    for arch in ("llama", "gpt2"):
        assert (
            main(
                [
                    "train",
                    "--corpus",
                    str(d / "c.bin"),
                    "--out",
                    str(d / "runs"),
                    "--run-id",
                    arch,
                    "--arch",
                    arch,
                    "--preset",
                    "tiny",
                    "--batch-size",
                    "8",
                    "--seq-len",
                    "64",
                    "--steps",
                    "80",
                    "--lr",
                    "1e-2",
                    "--warmup",
                    "5",
                    "--eval-batches",
                    "1",
                    "--eval-every",
                    "1000",
                ]
            )
            == 0
        )
        runs[arch] = d / "runs" / arch
    rnd = d / "runs" / "random"
    save_model_dir(rnd / "final", tiny_model(vocab_size=512), tokenizer=d / "c.tokenizer.json")
    runs["random"] = rnd
    for _name, run in runs.items():
        for dtype in ("f32", "f16", "q8_0"):
            assert main(["export", str(run), "--format", "gguf", "--dtype", dtype]) == 0
    return runs


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_from_scratch_tokenizer_ids_match(scratch, name):
    run = scratch[name]
    _, _, tok = load_model_dir(run / "final")
    llm = _llama(run / "export" / f"{name}-f32.gguf", n_ctx=128)
    for text in TEXTS:
        want = tok.encode(text).ids
        got = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert got == want, text
        assert llm.detokenize(got).decode("utf-8", errors="replace") == tok.decode(want)


# Teacher-forced logit gap allowed for the lossy files: llama.cpp rounds the activations
# too (to f16 for f16 weights, to 8 bits for q8_0), and the random model amplifies it.
MARGIN = {"f16": 0.05, "q8_0": 0.5}


@pytest.mark.parametrize("name", ["llama", "gpt2", "random"])
@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
def test_from_scratch_greedy_text_matches(scratch, name, dtype):
    run = scratch[name]
    model, _, tok = load_model_dir(run / "final")
    stop = {tok.token_to_id("<|endoftext|>")}
    # Learned positions (gpt2) and toy's cache stop at the context (64): stay inside it.
    n_new = 20 if name == "gpt2" else N_NEW
    llm = _llama(run / "export" / f"{name}-{dtype}.gguf", n_ctx=128)
    for text in ("ROSENCRANTZ. My lord", "HAMLET.\nTo be, or not"):
        prompt = tok.encode(text).ids
        want = _toy_greedy(model, prompt, n_new, stop)
        got = _cpp_greedy(llm, prompt, n_new, stop)
        margin = _teacher_forced_margin(model, prompt, got)
        _show(f"{name} {dtype}", tok, prompt, want, got, margin)
        if dtype == "f32":
            assert got == want
        else:
            assert margin < MARGIN[dtype]


@pytest.mark.parametrize("name", ["llama", "gpt2", "random"])
def test_from_scratch_f32_logits_match(scratch, name):
    """Every position's logits from llama.cpp against toy's, on a real passage."""
    run = scratch[name]
    model, _, tok = load_model_dir(run / "final")
    prompt = tok.encode(bundled_text_paths()[0].read_text()[3000:3400]).ids[:60]
    llm = _llama(run / "export" / f"{name}-f32.gguf", n_ctx=128, logits_all=True)
    llm.eval(prompt)
    got = torch.from_numpy(llm.scores[: len(prompt)].copy())
    with torch.no_grad():
        want = model(torch.tensor([prompt]))[0]
    diff = float((got - want).abs().max())
    print(
        f"\n[{name} f32 logits] {len(prompt)} positions: max |llama.cpp - toy| = {diff:.2e} "
        f"(logit std {float(want.std()):.2f})"
    )
    assert diff < 1e-3 * max(1.0, float(want.abs().max()))
    assert torch.equal(got.argmax(-1), want.argmax(-1))


# ------------------------------------------------------------------ SmolLM2 + LoRA


@pytest.fixture(scope="module")
def smol(tmp_path_factory, smollm2_gguf):
    """A LoRA trained on SmolLM2-135M-Instruct (Q4_1) for a few steps at a high rate, then
    exported as gguf-lora, as a merged f32 GGUF, and the base re-exported in f32."""
    from toy.data.dialogue import conversations, write_jsonl
    from toy.formats.gguf import read_gguf
    from toy.formats.gguf_write import write_llama_gguf

    d = tmp_path_factory.mktemp("lcpp-smol")
    chat = write_jsonl(
        conversations(bundled_text_paths(), 24, seed=3, turns=(1, 1), max_chars=200), d / "c.jsonl"
    )
    assert (
        main(
            [
                "train",
                "--recipe",
                "lora",
                "--model",
                str(smollm2_gguf),
                "--data",
                str(chat),
                "--out",
                str(d / "runs"),
                "--run-id",
                "smol",
                "--steps",
                "6",
                "--seq-len",
                "128",
                "--batch-size",
                "2",
                "--eval-batches",
                "1",
                "--lr",
                "4e-3",
                "--warmup",
                "0",
                "--precision",  # the adapter these near-tie text checks were written for
                "float32",
                "--targets",
                ALL_TARGETS,
            ]
        )
        == 0
    )
    run = d / "runs" / "smol"
    assert (
        main(["export", str(run), "--format", "gguf-lora", "--out", str(d / "adapter.gguf")]) == 0
    )
    assert (
        main(
            [
                "export",
                str(run),
                "--format",
                "gguf",
                "--merge",
                "--dtype",
                "f32",
                "--out",
                str(d / "merged.gguf"),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "export",
                str(run),
                "--format",
                "gguf",
                "--merge",
                "--out",
                str(d / "merged-keep.gguf"),
            ]
        )
        == 0
    )
    base = read_gguf(smollm2_gguf)
    write_llama_gguf(
        d / "base-f32.gguf",
        base.build_model(),
        tokenizer_kv={k: v for k, v in base.metadata.items() if k.startswith("tokenizer.")},
        name="SmolLM2-135M-Instruct (f32 from Q4_1)",
    )
    return {"run": run, "dir": d, "base": smollm2_gguf}


@pytest.fixture(scope="module")
def smol_toy(smol):
    """toy's SmolLM2 base + the run's adapter (unmerged), its tokenizer and a chat prompt."""
    from toy.cli.cmd_infer import load_base_lm
    from toy.data.chat import render_template
    from toy.formats.gguf import read_gguf
    from toy.formats.peft import load_peft_adapter
    from toy.lora import apply_lora, load_lora_state_dict

    lm = load_base_lm(smol["base"], None, "cpu")  # base only: toy's reader, tokenizer, stop ids
    sd, cfg = load_peft_adapter(smol["run"] / "final")
    adapted = read_gguf(smol["base"]).build_model()
    apply_lora(
        adapted,
        sorted({k.rsplit(".", 2)[-2] for k in sd}),
        cfg["r"],
        cfg["lora_alpha"],
        0.0,
        seed=0,
    )
    load_lora_state_dict(adapted, sd)
    text = render_template(
        lm.template,
        [{"role": "user", "content": "Who is there? Speak, and tell me your name."}],
        add_generation_prompt=True,
        bos_token=lm.bos,
        eos_token=lm.eos,
    )
    prompt = lm.tok.encode(text, add_special_tokens=False).ids
    adapted = adapted.eval()
    return {
        "base": lm.model,
        "adapted": adapted,
        "tok": lm.tok,
        "stop": lm.stop,
        "prompt": prompt,
        "text": text,
        # toy's greedy texts, once for the module's tests (each a 40-token decode)
        "base_greedy": _toy_greedy(lm.model, prompt, N_NEW, lm.stop),
        "want": _toy_greedy(adapted, prompt, N_NEW, lm.stop),
        "cpp_base": {},  # llama.cpp's greedy text on a base file, by path, once
    }


@pytest.mark.slow
def test_smollm2_tokenizer_ids_match(smol, smol_toy):
    llm = _llama(smol["dir"] / "merged.gguf", n_ctx=256)
    for text in TEXTS + [smol_toy["text"]]:
        assert (
            llm.tokenize(text.encode(), add_bos=False, special=True)
            == smol_toy["tok"].encode(text, add_special_tokens=False).ids
        ), text


@pytest.mark.slow
def test_smollm2_adapter_changes_toys_text(smol_toy):
    t = smol_toy
    base, adapted = t["base_greedy"], t["want"]
    _show("toy: SmolLM2 base vs base+adapter", t["tok"], t["prompt"], base, adapted)
    assert (
        base != adapted
    )  # otherwise the llama.cpp comparisons below prove nothing about the adapter


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", ["lora-on-f32-base", "merged-f32", "lora-on-q4_1-base", "merged-keep"]
)
def test_smollm2_with_adapter_greedy_text_matches(smol, smol_toy, case):
    """merged-keep is `toy export --merge`'s default: the Q4_1 base's untouched tensors
    as they are, the adapted ones f16 (the old default requantized them to Q4_1, and
    llama.cpp answered with the base model's text word for word)."""
    t = smol_toy
    d = smol["dir"]
    model_path, lora = {
        "lora-on-f32-base": (d / "base-f32.gguf", d / "adapter.gguf"),
        "merged-f32": (d / "merged.gguf", None),
        "lora-on-q4_1-base": (smol["base"], d / "adapter.gguf"),
        "merged-keep": (d / "merged-keep.gguf", None),
    }[case]
    llm = _llama(model_path, lora)
    want = t["want"]
    got = _cpp_greedy(llm, t["prompt"], N_NEW, t["stop"])
    margin = _teacher_forced_margin(t["adapted"], t["prompt"], got)
    _show(f"SmolLM2 + adapter, {case}", t["tok"], t["prompt"], want, got, margin)
    if case in ("lora-on-q4_1-base", "merged-keep"):
        # llama.cpp quantizes activations to 8 bits for Q4_1 dot products (f16 for f16
        # ones): toy's f32 math is not what it computes, so ask only that each of its
        # choices is (nearly) toy's.
        assert margin < 0.5
    else:
        assert got == want
    # The adapter is really applied: llama.cpp's text is not the base's.
    if case != "merged-f32":
        base = smol["base"] if case == "merged-keep" else model_path
        if base not in t["cpp_base"]:
            t["cpp_base"][base] = _cpp_greedy(_llama(base), t["prompt"], N_NEW, t["stop"])
        assert t["cpp_base"][base] != got


@pytest.mark.slow
def test_adapter_file_metadata_as_llamacpp_reads_it(smol):
    from toy.formats.gguf_header import read_gguf_header

    meta = read_gguf_header(smol["dir"] / "adapter.gguf").metadata
    assert (meta["general.type"], meta["adapter.type"], meta["general.architecture"]) == (
        "adapter",
        "lora",
        "llama",
    )
    cfg = json.loads((smol["run"] / "final" / "adapter_config.json").read_text())
    assert meta["adapter.lora.alpha"] == cfg["lora_alpha"]


# ------------------------------------------------------------------ Gemma-3-270M + LoRA

from helpers.gguf_fixtures import gemma3_gguf  # noqa: E402,F401


@pytest.fixture(scope="module")
def gem(tmp_path_factory, gemma3_gguf):
    """A LoRA trained on the real Gemma-3-270M (Q4_K_M, no chat template: toy's built-in
    Gemma template) at a high rate, then exported as gguf-lora (arch gemma3) and merged
    (f32, and in the base's own types)."""
    from toy.data.dialogue import conversations, write_jsonl

    d = tmp_path_factory.mktemp("lcpp-gemma")
    chat = write_jsonl(
        conversations(bundled_text_paths(), 24, seed=3, turns=(1, 1), max_chars=200), d / "c.jsonl"
    )
    assert (
        main(
            [
                "train",
                "--recipe",
                "lora",
                "--model",
                str(gemma3_gguf),
                "--data",
                str(chat),
                "--out",
                str(d / "runs"),
                "--run-id",
                "g",
                "--steps",
                "5",
                "--seq-len",
                "128",
                "--batch-size",
                "2",
                "--eval-batches",
                "1",
                "--lr",
                "4e-3",
                "--warmup",
                "0",
                "--precision",  # the adapter these near-tie text checks were written for
                "float32",
                "--targets",
                ALL_TARGETS,
            ]
        )
        == 0
    )
    run = d / "runs" / "g"
    assert (
        main(["export", str(run), "--format", "gguf-lora", "--out", str(d / "adapter.gguf")]) == 0
    )
    assert (
        main(
            [
                "export",
                str(run),
                "--format",
                "gguf",
                "--merge",
                "--dtype",
                "f32",
                "--out",
                str(d / "merged-f32.gguf"),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "export",
                str(run),
                "--format",
                "gguf",
                "--merge",
                "--dtype",
                "base",
                "--out",
                str(d / "merged-base.gguf"),
            ]
        )
        == 0
    )
    return {"run": run, "dir": d, "base": gemma3_gguf}


@pytest.fixture(scope="module")
def gem_toy(gem):
    from toy.cli.cmd_infer import load_base_lm
    from toy.data.chat import render_template
    from toy.formats.gguf import read_gguf
    from toy.formats.peft import load_peft_adapter
    from toy.lora import apply_lora, load_lora_state_dict

    lm = load_base_lm(gem["base"], None, torch.device("cpu"))
    sd, cfg = load_peft_adapter(gem["run"] / "final")
    adapted = read_gguf(gem["base"]).build_model()
    apply_lora(
        adapted,
        sorted({k.rsplit(".", 2)[-2] for k in sd}),
        cfg["r"],
        cfg["lora_alpha"],
        0.0,
        seed=0,
    )
    load_lora_state_dict(adapted, sd)
    text = render_template(
        lm.template,
        [{"role": "user", "content": "Who is there? Speak, and tell me your name."}],
        add_generation_prompt=True,
        bos_token=lm.bos,
        eos_token=lm.eos,
    )
    prompt = lm.tok.encode(text, add_special_tokens=False).ids
    adapted = adapted.eval()
    return {
        "base": lm.model,
        "adapted": adapted,
        "tok": lm.tok,
        "stop": lm.stop,
        "prompt": prompt,
        # toy's greedy texts, once for the module's three tests
        "base_greedy": _toy_greedy(lm.model, prompt, N_NEW, lm.stop),
        "want": _toy_greedy(adapted, prompt, N_NEW, lm.stop),
    }


@pytest.mark.slow
def test_gemma3_adapter_in_llamacpp_gives_toys_adapted_text(gem, gem_toy):
    """The gguf-lora (arch gemma3) applied by llama.cpp on the Q4_K_M base: each token
    llama.cpp chooses is toy's choice (llama.cpp rounds activations to 8 bits for its
    quantized dot products, so near-ties may go either way), and it is not the base's."""
    t = gem_toy
    want, base_want = t["want"], t["base_greedy"]
    assert want != base_want  # the adapter changes toy's text, so the comparison means something
    llm = _llama(gem["base"], gem["dir"] / "adapter.gguf")
    got = _cpp_greedy(llm, t["prompt"], N_NEW, t["stop"])
    margin = _teacher_forced_margin(t["adapted"], t["prompt"], got)
    _show("Gemma-3-270M + adapter (llama.cpp --lora)", t["tok"], t["prompt"], want, got, margin)
    assert margin < 0.5
    assert _common_prefix(want, got) >= 8
    assert _cpp_greedy(_llama(gem["base"]), t["prompt"], N_NEW, t["stop"]) != got


@pytest.mark.slow
@pytest.mark.parametrize("name", ["merged-f32", "merged-base"])
def test_gemma3_merged_gguf_runs_in_llamacpp(gem, gem_toy, name):
    t = gem_toy
    llm = _llama(gem["dir"] / f"{name}.gguf")
    got = _cpp_greedy(llm, t["prompt"], N_NEW, t["stop"])
    want = t["want"]
    margin = _teacher_forced_margin(t["adapted"], t["prompt"], got)
    _show(f"Gemma-3-270M {name} in llama.cpp", t["tok"], t["prompt"], want, got, margin)
    if name == "merged-f32":
        # Every weight f32: llama.cpp computes toy's function, up to float summation order.
        assert margin < 0.5 and _common_prefix(want, got) >= 16
    else:
        # The changed tensors requantized (Q5_0 kept, K-quants to q8_0): a lossy file, whose
        # text starts as the adapted model's and may drift later.
        assert len(got) > 0 and _common_prefix(want, got) >= 4
