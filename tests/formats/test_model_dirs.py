"""transformers and MLX model directories as bases: toy's logits against transformers'
(F32, BF16, sharded) and mlx-lm's (every bits / group size), the tokenizer, specials and
chat template a directory brings, and each bad directory's one-line error."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import model_dirs  # noqa: E402
from helpers.common import needs_mlx  # noqa: E402
from helpers.model_dirs import TYPES, hf_model, mlx_dir, mlx_logits, tiny_dir  # noqa: E402

from toy.errors import InputError  # noqa: E402
from toy.formats.base_readers import read_base  # noqa: E402

IDS = torch.randint(3, model_dirs.VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", autouse=True)
def _root(tmp_path_factory):
    model_dirs.set_root(tmp_path_factory.getbasetemp() / "model-dirs")
    (tmp_path_factory.getbasetemp() / "model-dirs").mkdir(exist_ok=True)


def hf_logits(d: Path) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(d)(IDS).logits.float()


def toy_logits(d: Path, base_dtype: str = "float32") -> torch.Tensor:
    with torch.no_grad():
        return read_base(d, base_dtype).build_model()(IDS)


@pytest.mark.parametrize("model_type", TYPES)
def test_float32_directory_equals_transformers(model_type):
    d = tiny_dir(model_type)
    want = hf_logits(d)
    for dtype in ("float32", "quantized"):  # quantized: the file's own values, dequantized per use
        torch.testing.assert_close(toy_logits(d, dtype), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2", "gemma3"])
def test_bfloat16_directory_stays_bfloat16_and_equals_transformers(model_type):
    d = tiny_dir(model_type, "bfloat16")
    base = read_base(d, "quantized")
    kept = [t for t in base.state_dict.values() if not isinstance(t, torch.Tensor)]
    assert kept and all(
        t.spec.name == "BF16" for t in kept
    )  # a BF16 base is not made float32 in memory
    assert base.tensor_types["BF16"] >= len(kept)
    torch.testing.assert_close(toy_logits(d, "quantized"), hf_logits(d), atol=2e-3, rtol=0)


def test_sharded_directory(tmp_path):
    d = tiny_dir("llama", shards=True)
    assert (
        len(list(d.glob("model-*.safetensors"))) > 1
        and (d / "model.safetensors.index.json").is_file()
    )
    torch.testing.assert_close(toy_logits(d), hf_logits(tiny_dir("llama")), atol=1e-4, rtol=0)


def test_tokenizer_specials_and_template_come_from_the_directory():
    base = read_base(tiny_dir("qwen3"))
    assert base.kind == "transformers" and base.arch == "qwen3" and base.family.name == "llama"
    tok = base.tokenizer
    assert base.special.bos == tok.token_to_id(
        "<|im_start|>"
    ) and base.special.eos == tok.token_to_id("<|im_end|>")
    assert base.special.stops >= {
        2,
        0,
        tok.token_to_id("<|im_end|>"),
    }  # generation_config's list, and EOS
    assert base.chat_template == model_dirs.CHATML and base.chat_format == "chatml"


@needs_mlx
@pytest.mark.parametrize(
    "bits, group_size", [(2, 64), (3, 32), (4, 32), (4, 64), (5, 128), (6, 64), (8, 128)]
)
def test_mlx_directory_equals_mlx_lm(bits, group_size):
    d = mlx_dir("llama", bits, group_size)
    base = read_base(d, "quantized")
    assert base.kind == "mlx" and base.tensor_types[f"MLX_Q{bits}_G{group_size}"] > 0
    torch.testing.assert_close(toy_logits(d, "quantized"), mlx_logits(d, IDS), atol=1e-3, rtol=0)


@needs_mlx
@pytest.mark.parametrize(
    "model_type", ["qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "gemma3"]
)
def test_mlx_families_equal_mlx_lm(model_type):
    d = mlx_dir(model_type, 4, 32)
    got = toy_logits(d, "quantized")
    if model_type == "gemma2":
        # mlx-lm's gemma2 attends to every position in every layer (no sliding window,
        # unlike transformers): compare within the window, where the two agree.
        got, want = got[:, :20], mlx_logits(d, IDS[:, :20])
    else:
        want = mlx_logits(d, IDS)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)


@needs_mlx
def test_mlx_quantized_embedding_and_tied_head_stay_quantized():
    base = read_base(mlx_dir("qwen3", 4, 32), "quantized")
    model = base.build_model()
    from toy.models.quant import QuantEmbedding, QuantLinear

    assert isinstance(model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()  # the same parts


# ------------------------------------------------------------------ bad directories


def test_an_unknown_model_type_names_it_and_the_supported(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "falcon"}))
    with pytest.raises(
        InputError, match=r"model_type 'falcon' is not supported; supported: gemma2, gemma3"
    ):
        read_base(d)


def test_a_missing_shard_is_named(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir("llama", shards=True), d)
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(InputError, match=f"{victim.name}: missing shard"):
        read_base(d)


def test_neither_kind_of_directory(tmp_path):
    with pytest.raises(InputError, match="not a model directory"):
        read_base(tmp_path)


@needs_mlx
def test_other_mlx_modes_are_refused_by_name(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(mlx_dir("llama", 4, 32), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization"]["mode"] = "mxfp4"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="mode 'mxfp4' is not supported"):
        read_base(d)


def test_a_truncated_safetensors_file(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir("qwen3"), d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(InputError, match="truncated or damaged"):
        read_base(d)


# ------------------------------------------------------------------ toy describe DIR


def test_describe_a_transformers_directory(toy_cli):
    code, out, err = toy_cli("describe", tiny_dir("gemma3", "bfloat16"))
    assert code == 0, err
    assert "transformers directory" in out and "gemma3 (toy's gemma): 6 layers, width 64" in out
    assert "BF16 x" in out and "resident as stored" in out and "chat template yes" in out
    assert "tensors of the vision tower left out" in out


@needs_mlx
def test_describe_an_mlx_directory_as_json(toy_cli, capsys):
    d = mlx_dir("llama", 4, 32)
    capsys.readouterr()  # what mlx_lm.convert printed, if it ran now
    code, out, err = toy_cli("describe", d, "--json")
    assert code == 0, err
    d = json.loads(out)
    assert (
        d["kind"] == "mlx"
        and d["family"] == "llama"
        and d["tensor_types"]["MLX_Q4_G32"] == 2 * 7 + 2
    )  # the blocks, the embedding, the untied head
    rb = d["resident_bytes"]
    assert rb["quantized"] < rb["bfloat16"] < rb["float32"]


def test_describe_a_directory_toy_cannot_load(toy_cli, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir("llama"), d)
    (d / "config.json").write_text(
        json.dumps({**json.loads((d / "config.json").read_text()), "model_type": "bert"})
    )
    code, out, err = toy_cli("describe", d)
    assert code == 2 and "model_type 'bert' is not supported" in err and "architecture  bert" in out


# ----------------------------------------------------------- a directory wherever a GGUF is taken


def test_prep_warm_start_and_infer_take_a_directory(toy_cli, tmp_path, capsys):
    from toy.data.prep import bundled_text_paths

    donor = tiny_dir("qwen3")
    txt = tmp_path / "t.txt"
    txt.write_text(bundled_text_paths()[0].read_text()[:20000])
    for i, d in enumerate(
        [donor] + ([mlx_dir("qwen3", 4, 32)] if importlib.util.find_spec("mlx_lm") else [])
    ):
        capsys.readouterr()
        # Each with its own tokenizer: mlx_lm.convert re-saves it (with tokens of its own).
        code, _, err = toy_cli("prep", txt, "--tokenizer", d, "--out", tmp_path / f"c{i}.bin")
        assert code == 0, err
        code, out, err = toy_cli(
            "train",
            "--recipe",
            "warm-start",
            "--donor",
            d,
            "--corpus",
            tmp_path / f"c{i}.bin",
            "--init",
            "pca",
            "--n-layer",
            "1",
            "--d-model",
            "32",
            "--n-head",
            "2",
            "--n-kv-head",
            "1",
            "--seq-len",
            "32",
            "--batch-size",
            "2",
            "--steps",
            "2",
            "--eval-batches",
            "1",
            "--out",
            tmp_path / "runs",
        )
        assert code == 0, err
        assert f"{d.name}'s token embedding" in out
    code, out, err = toy_cli(
        "infer",
        "--model",
        donor,
        "--prompt",
        "To be",
        "--max-new-tokens",
        "5",
        "--temperature",
        "0",
    )
    assert code == 0 and out.startswith("To be"), err
