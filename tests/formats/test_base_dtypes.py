"""Every base kind (GGUF, transformers directory, MLX directory) in every --base-dtype
(quantized, bfloat16, float32), through the command line: a LoRA run trains on it, infer
generates from the base and from the run, and the run exports (PEFT, and merged into the
base's own kind). bfloat16 on a directory used to end in `expected m1 and m2 to have the
same dtype` (a bf16 weight met float32 activations in F.linear without autocast)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from helpers import model_dirs  # noqa: E402
from helpers.gguf_fixtures import tiny_model, write_llama_gguf  # noqa: E402
from tokenizers import Tokenizer

from toy.data.dialogue import conversations, write_jsonl  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402
from toy.formats.base_readers import read_base  # noqa: E402
from toy.lora import LoRALinear, apply_lora  # noqa: E402

KINDS = ("gguf", "transformers", "mlx")
DTYPES = ("quantized", "bfloat16", "float32")
MERGED = {"gguf": ("gguf", "merged.gguf"), "transformers": ("transformers", "merged"),
          "mlx": ("mlx", "merged")}  # fmt: skip
TRAIN = ["--seq-len", "128", "--batch-size", "2", "--eval-batches", "1", "--steps", "2"]
TRAIN += ["--warmup", "0", "--lr", "1e-2", "--json"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("base-dtypes")
    model_dirs.set_root(root / "models")
    (root / "models").mkdir()
    return root


@pytest.fixture(scope="module")
def chat(work) -> Path:
    convs = conversations(bundled_text_paths(), 16, seed=3, turns=(1, 1), max_chars=60)
    return write_jsonl(convs, work / "chat.jsonl")


def base_of(kind: str, work: Path) -> Path:
    if kind == "transformers":
        return model_dirs.tiny_dir("qwen3")
    if kind == "mlx":
        if importlib.util.find_spec("mlx_lm") is None:
            pytest.skip("mlx-lm (a test-only dependency) makes the MLX directory")
        return model_dirs.mlx_dir("llama", 4, 32)
    path = work / "tiny.gguf"
    if not path.exists():
        # F16 matrices: what quantized keeps as they are (block types would have infer pack
        # and compile them, a minute's first compile that is not this test's business).
        model = tiny_model(vocab_size=model_dirs.VOCAB, max_seq_len=256)
        tok = Tokenizer.from_str(model_dirs.tokenizer_json())
        names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
        f16 = {f"blk.{i}.{n}.weight": "F16" for i in range(2) for n in names}
        write_llama_gguf(path, model, tok, qtypes=f16)
    return path


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_train_infer_export_in_every_base_dtype(kind, dtype, work, chat, toy_cli, tmp_path):
    base = base_of(kind, work)
    code, out, err = toy_cli(
        "train", "--recipe", "lora", "--model-path", base, "--base-dtype", dtype,
        "--data", chat, "--out", tmp_path, *TRAIN,
    )  # fmt: skip
    assert code == 0, err
    r = json.loads(out.strip().splitlines()[-1])
    assert all(torch.isfinite(torch.tensor(v["loss"])) for v in r["val_losses"])
    run = Path(r["run_dir"])
    assert json.loads((run / "run.json").read_text())["job"]["base_dtype"] == dtype

    gen = ["--prompt", "To be", "--max-new-tokens", "4", "--temperature", "0"]
    for source in (["--model", base], ["--run", run]):
        code, out, err = toy_cli("infer", *source, "--base-dtype", dtype, *gen)
        assert code == 0 and out.startswith("To be"), err
        assert "Traceback" not in err

    code, _, err = toy_cli("export", run, "--format", "peft", "--out", tmp_path / "peft")
    assert code == 0 and (tmp_path / "peft" / "adapter_model.safetensors").is_file(), err
    fmt, name = MERGED[kind]
    code, _, err = toy_cli("export", run, "--format", fmt, "--merge", "--out", tmp_path / name)
    assert code == 0 and (tmp_path / name).exists(), err


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_bfloat16_base_runs_with_autocast_on_or_off(kind, autocast, work):
    """The frozen bf16 weights are used in the activations' dtype (no float32 copy is
    kept), the norms and the LoRA A/B stay float32 master weights, and the logits are
    the float32 base's within bf16's rounding, with bf16 autocast on or off."""
    base = base_of(kind, work)
    ids = torch.randint(3, model_dirs.VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    ref = read_base(base, "float32")  # its matrices rounded to bf16: what bfloat16 holds
    for n, t in ref.state_dict.items():
        ref.state_dict[n] = t.bfloat16().float() if t.dim() == 2 else t
    with torch.no_grad():
        want = ref.build_model()(ids)
    model = read_base(base, "bfloat16").build_model()
    held = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]}
    assert all(t.dtype in (torch.float32, torch.uint8, torch.uint32) for t in held.values())
    assert any(n.endswith("norm.weight") and t.dtype == torch.float32 for n, t in held.items())
    bf16 = [n for n, t in held.items() if t.dtype == torch.uint8]  # BF16 rows: 2 bytes a weight
    assert bf16
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        err = (model(ids).float() - want).abs().max() / want.abs().max()
    assert err < (0.1 if autocast else 1e-5), err  # bf16 products under autocast
    apply_lora(model, ["q_proj", "v_proj"], 4, 8.0, 0.0, seed=0)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.lora_B.data.normal_(0, 0.01)  # a non-zero update, so B's gradient flows to A
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert lora and all(p.dtype == torch.float32 for p in lora)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora)


def test_auto_base_dtype_holds_a_small_base_in_bf16_where_training_is_bf16(monkeypatch):
    """--base-dtype auto (the default): bfloat16 on cuda; on a cpu under bf16 autocast a
    quantized base whose bf16 copy is small (at most 1 GB and a quarter of the available
    memory) in bf16, else its blocks; in float32, its blocks."""
    from toy.recipes import adapter, lora

    monkeypatch.setattr(adapter, "available_memory", lambda: 16 * 10**9)
    cfg = lora.RECIPE.config()
    cpu_bf16 = cfg.replace(device="cpu", precision="bf16")
    dtype, why = adapter.base_dtype(cpu_bf16, 270 * 10**6)
    assert dtype == "bfloat16" and "0.27 GB" in why, why
    dtype, why = adapter.base_dtype(cpu_bf16, 2 * 10**9)  # a 1B base keeps its blocks
    assert dtype == "quantized" and "2.00 GB" in why and "--base-dtype bfloat16" in why, why
    monkeypatch.setattr(adapter, "available_memory", lambda: 10**9)
    dtype, why = adapter.base_dtype(cpu_bf16, 270 * 10**6)  # over a quarter of what is free
    assert dtype == "quantized" and "25%" in why, why
    assert adapter.base_dtype(cpu_bf16.replace(precision="float32"), 10**6) == ("quantized", "")
    assert adapter.base_dtype(cpu_bf16.replace(device="metal"), 10**6) == ("quantized", "")
    assert adapter.base_dtype(cfg.replace(device="cuda"), None) == ("bfloat16", "")
    assert adapter.base_dtype(cpu_bf16.replace(base_dtype="float32"), 10**6) == ("float32", "")


@pytest.fixture(scope="module")
def q8_gguf(work) -> Path:
    path = work / "tiny-q8.gguf"
    model = tiny_model(vocab_size=model_dirs.VOCAB, max_seq_len=256)
    tok = Tokenizer.from_str(model_dirs.tokenizer_json())
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    q8 = {f"blk.{i}.{n}.weight": "Q8_0" for i in range(2) for n in names}
    q8["token_embd.weight"] = "Q8_0"  # every matrix in blocks, as in SmolLM2's and Gemma's files
    return write_llama_gguf(path, model, tok, qtypes=q8)


def test_the_default_base_dtype_follows_the_precision_with_the_same_losses(
    q8_gguf, chat, toy_cli, tmp_path
):
    """Through the command line on a Q8_0 GGUF: in float32 the default holds the blocks; in
    bf16 (a cpu with bf16 units) it holds a bf16 copy, says so, and trains to exactly the
    losses of the blocks dequantized to bf16 at every use (each block is dequantized in
    float32 and rounded to bf16 once, either way; a matrix stored in float32, such as an
    F32 embedding table, would be rounded in the copy and not in the blocks' run)."""
    from toy.train.device import cpu_bf16_units

    def train(name: str, *flags: str) -> tuple[list, str, str]:
        code, out, err = toy_cli(
            "train", "--recipe", "lora", "--model-path", q8_gguf, "--data", chat,
            "--out", tmp_path, "--run-id", name, *TRAIN[:-1], *flags,
        )  # fmt: skip
        assert code == 0, err
        run = tmp_path / name
        events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
        losses = [(e["event"], e["loss"]) for e in events if "loss" in e]
        return losses, json.loads((run / "run.json").read_text())["job"]["base_dtype"], out

    losses, dtype, _ = train("f32", "--precision", "float32")
    assert dtype == "quantized" and losses, losses
    if cpu_bf16_units() is None:
        pytest.skip("no bf16 units on this cpu: the default trains in float32 (checked above)")
    auto, dtype, out = train("auto")
    assert dtype == "bfloat16" and "--base-dtype auto: bfloat16" in out, out
    blocks, dtype, _ = train("blocks", "--base-dtype", "quantized")
    assert dtype == "quantized" and auto == blocks, (auto, blocks)
