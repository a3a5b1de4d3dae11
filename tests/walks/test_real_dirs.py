"""The real SmolLM2-135M-Instruct as a transformers directory and as its MLX 4-bit twin
(scripts/get-smollm2-dirs.sh makes both from the GGUF, offline): toy's greedy text equals
each client's, a LoRA run on the MLX twin learns, and its adapter, loaded by mlx-lm itself,
gives toy's adapted text; the same from a GGUF base. Slow: real models, real clients."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.common import run_toy  # noqa: E402
from helpers.gguf_fixtures import smollm2_gguf  # noqa: E402,F401
from helpers.real_model import smol_dirs  # noqa: F401

QUESTION = "What is the capital of France? Answer in one sentence."
GREEDY = ["--temperature", "0", "--max-new-tokens", "20"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("mlx_lm") is None, reason="needs mlx-lm (test extra)"
    ),
]


# mlx-lm computes in the dtype of the model's float tensors: bfloat16 for the MLX twin (made
# from SmolLM2's bf16 weights), which mlx runs at ~0.8 s a token on this Linux CPU (44 s a
# greedy answer here) and whose rounding splits near ties ("Paris." / "Paris, France.") from
# toy's float32 by the thread count. The reference casts its float tensors (scales, biases,
# norms, the adapter; bf16 -> float32 is exact) to float32 after loading: the same files and
# the same codes, computed as toy computes them, 5 s a greedy answer.
def mlx_greedy(model_dir: Path, adapter: Path | None = None) -> str:
    """mlx_lm.generate's greedy answer to QUESTION, in a process of its own, computed in
    float32 (MLX_F32)."""
    code = (
        "import sys\nimport mlx.core as mx\nfrom mlx_lm import load, generate\n"
        "from mlx_lm.sample_utils import make_sampler\n"
        f"m, t = load({str(model_dir)!r}, adapter_path={str(adapter) if adapter else None!r})\n"
        "m.set_dtype(mx.float32)\n"
        "p = t.apply_chat_template("
        f"[{{'role': 'user', 'content': {QUESTION!r}}}], add_generation_prompt=True)\n"
        "print(generate(m, t, prompt=p, max_tokens=20, sampler=make_sampler(0.0)))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


_GREEDY: dict[tuple, str] = {}


def toy_greedy(toy_run, *argv) -> str:
    """`toy infer ... --chat QUESTION`'s greedy answer, once per argv in this process (the
    base's answer serves two tests); run by `toy_run`, in this process."""
    if argv not in _GREEDY:
        r = toy_run("infer", *argv, "--chat", QUESTION, *GREEDY)
        assert r.returncode == 0, r.stderr
        _GREEDY[argv] = r.stdout.strip()
    return _GREEDY[argv]


def test_greedy_text_equals_transformers_on_the_directory(smol_dirs, toy_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir, _ = smol_dirs
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=20, do_sample=False)
    want = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
    assert toy_greedy(toy_run, "--model", hf_dir) == want


def test_greedy_text_equals_mlx_lm_on_the_mlx_twin(smol_dirs, toy_run):
    _, mlx_dir = smol_dirs
    assert toy_greedy(toy_run, "--model", mlx_dir) == mlx_greedy(mlx_dir)


def _chat(tmp_path: Path) -> Path:
    from toy.data.dialogue import conversations, write_jsonl
    from toy.data.prep import bundled_text_paths

    d = tmp_path / "data"
    d.mkdir()
    convs = conversations(bundled_text_paths(), 120, seed=5, turns=(1, 2), max_chars=200)
    write_jsonl(convs[:108], d / "train.jsonl")
    write_jsonl(convs[108:], d / "valid.jsonl")
    return d


def _lora(base: Path, data: Path, out: Path, steps: int = 5, *extra) -> dict:
    r = run_toy(
        "train",
        "--recipe",
        "lora",
        "--model-path",
        base,
        "--data",
        data,
        "--out",
        out,
        "--run-id",
        "r",
        "--steps",
        steps,
        "--lr",
        "4e-3",
        "--warmup",
        "0",
        "--batch-size",
        "4",
        "--max-seq-len",
        "256",
        "--rank",
        "8",
        "--alpha",
        "16",
        "--json",
        *extra,
        timeout=1800,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_lora_on_the_mlx_twin_learns_and_mlx_lm_runs_its_adapter(smol_dirs, tmp_path, toy_run):
    """With mlx_lm.lora's default --num-layers 16 (issue 58 item 6): adapters on the last 16
    of the 30 blocks, the mlx export's num_layers 16, and mlx-lm's text toy's."""
    _, mlx_dir = smol_dirs
    res = _lora(mlx_dir, _chat(tmp_path), tmp_path / "runs", 5, "--num-layers", "16")
    val = [v["loss"] for v in res["val_losses"]]
    assert val[-1] < val[0] - 0.05, val  # the held-out loss falls
    run = tmp_path / "runs" / "r"
    r = toy_run("export", run, "--format", "mlx", "--out", tmp_path / "adapter")
    assert r.returncode == 0, r.stderr
    assert (
        json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["num_layers"] == 16
    )
    adapted = toy_greedy(toy_run, "--run", run)
    assert adapted != toy_greedy(toy_run, "--model", mlx_dir)  # the adapter changes the answer
    assert mlx_greedy(mlx_dir, tmp_path / "adapter") == adapted


def test_an_adapter_trained_on_the_gguf_runs_in_mlx_lm(smol_dirs, smollm2_gguf, tmp_path, toy_run):
    """The GGUF's weights, converted to MLX unquantized (float32, so mlx-lm computes as toy
    does), take the adapter a run on the GGUF made: mlx-lm's adapted text equals toy's on the
    same weights."""
    from mlx_lm import convert

    hf_dir, _ = smol_dirs
    mlx_f32 = tmp_path / "mlx-f32"
    fixed = tmp_path / "hf"
    shutil.copytree(hf_dir, fixed)
    cfg = json.loads(
        (fixed / "config.json").read_text()
    )  # mlx-lm reads rope_theta at the top level only
    cfg["rope_theta"] = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    (fixed / "config.json").write_text(json.dumps(cfg))
    convert(str(fixed), str(mlx_f32), dtype="float32")
    # an adapter, not learning: two steps move it off zero; its held-out loss is not read;
    # on the last 8 blocks (--num-layers 8): mlx-lm puts num_layers on the last ones too
    _lora(smollm2_gguf, _chat(tmp_path), tmp_path / "runs", 2, "--eval-batches", "1",
          "--num-layers", "8")  # fmt: skip
    run = tmp_path / "runs" / "r"
    assert toy_run("export", run, "--format", "mlx", "--out", tmp_path / "adapter").returncode == 0
    ours = toy_greedy(toy_run, "--model", mlx_f32, "--adapter", run)
    assert mlx_greedy(mlx_f32, tmp_path / "adapter") == ours


def test_an_adapter_mlx_lm_made_on_its_last_layers_runs_in_toy(smollm2_gguf, tmp_path, toy_run):
    """Issue 58 item 6: mlx_lm.lora adapts only the last --num-layers blocks (16 by default),
    and toy refused such an adapter ("missing 378 tensors" for this one). One made by
    mlx_lm.lora itself on the last 3 of the 30 blocks of SmolLM2's MLX directory (`toy
    fetch --as mlx`: the GGUF's 4-bit blocks as affine groups of 32; mlx_lm.lora trained on
    it in 18 s where the mlx_lm.convert twin took 100) is read by `toy infer --adapter` to
    mlx_lm.generate's greedy text."""
    r = toy_run("fetch", "smollm2", "--as", "mlx", "--out", tmp_path / "m")
    assert r.returncode == 0, r.stderr
    mlx_dir = Path(r.stdout.strip().splitlines()[-1])
    adapter = tmp_path / "mlx-adapter"
    r = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "lora", "--model", str(mlx_dir), "--train",
         "--data", str(_chat(tmp_path)), "--iters", "2", "--num-layers", "3",
         "--batch-size", "1", "--learning-rate", "2e-3", "--val-batches", "0",
         "--steps-per-eval", "1000", "--save-every", "1000", "--max-seq-length", "64",
         "--adapter-path", str(adapter)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((adapter / "adapter_config.json").read_text())["num_layers"] == 3
    from safetensors import safe_open

    with safe_open(str(adapter / "adapters.safetensors"), framework="pt") as f:
        blocks = {int(k.split(".")[2]) for k in f.keys()}
    assert blocks == {27, 28, 29}, blocks
    adapted = toy_greedy(toy_run, "--model", mlx_dir, "--adapter", adapter)
    assert adapted != toy_greedy(toy_run, "--model", mlx_dir)  # the adapter changes the answer
    assert mlx_greedy(mlx_dir, adapter) == adapted


def test_a_peft_adapter_on_some_layers_runs_in_toy(smol_dirs, tmp_path, toy_run):
    """Issue 58 item 6, PEFT's side: an adapter PEFT makes with `layers_to_transform` (three
    blocks of the 30, not a contiguous run) is read by `toy infer --adapter` to
    transformers + PEFT's greedy text on the same directory."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir, _ = smol_dirs
    ask = "Say one line about the sea."  # open: a changed model answers otherwise
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                          layers_to_transform=[2, 5, 29], init_lora_weights=False)  # fmt: skip
    adapted = peft.get_peft_model(model, cfg).eval()
    with torch.no_grad():  # a B of its own scale: the answer moves
        for name, w in adapted.named_parameters():
            if "lora_B" in name:
                w.normal_(0.0, 0.5)
    adapted.save_pretrained(tmp_path / "peft")
    ids = tok.apply_chat_template(
        [{"role": "user", "content": ask}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True,
    )["input_ids"]  # fmt: skip

    def answer(m) -> str:
        out = m.generate(ids, max_new_tokens=16, do_sample=False)
        return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()

    want = answer(adapted)
    with adapted.disable_adapter():
        assert answer(adapted) != want  # the adapter changes the answer
    r = toy_run("infer", "--model", hf_dir, "--adapter", tmp_path / "peft", "--chat", ask,
                "--temperature", "0", "--max-new-tokens", "16")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == want
