"""`toy list` lists model directories and adapter exports, not only GGUF files: the
transformers and MLX directories in data/ (a link to toy's cache, as `toy fetch --as`
puts them), and under runs/*/export/ a merged directory, a PEFT adapter, an mlx-lm
adapter and a LoRA adapter GGUF, each with its kind, architecture, parameters and size."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers.gguf_fixtures import gguf_name, tiny_model, write_llama_gguf  # noqa: E402


@pytest.fixture
def project(tmp_path, monkeypatch):
    from toy.data.prep import bundled_text_paths
    from toy.formats.dir_write import write_model_dir
    from toy.formats.gguf import read_gguf
    from toy.formats.gguf_write import write_lora_gguf
    from toy.formats.mlx_adapter import save_mlx_adapter
    from toy.formats.peft import save_peft_adapter
    from toy.lora import apply_lora, lora_state_dict
    from toy.tokenizer import train_bpe

    root = tmp_path / "proj"
    (root / "data").mkdir(parents=True)
    (root / "toy.toml").write_text("")
    text = bundled_text_paths()[0].read_text()[:20000]
    tok = train_bpe([text[i : i + 500] for i in range(0, len(text), 500)], vocab_size=280)
    model = tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True))
    qtypes = {gguf_name(n): "Q4_1" for n, p in model.named_parameters() if p.dim() == 2}
    gguf = write_llama_gguf(tmp_path / "base.gguf", model, tok, qtypes=qtypes)
    base = read_gguf(gguf, "quantized")
    cache = tmp_path / "cache"
    write_model_dir(base, cache / "tiny-transformers", "transformers")
    write_model_dir(base, cache / "tiny-mlx", "mlx")
    os.symlink(cache / "tiny-mlx", root / "data" / "tiny-mlx")  # as toy fetch --as links it
    os.symlink(cache / "tiny-transformers", root / "data" / "tiny-transformers")
    export = root / "runs" / "r1" / "export"
    write_model_dir(base, export / "r1-merged-transformers", "transformers")
    torch.manual_seed(0)
    apply_lora(model, ["q_proj", "v_proj"], 4, 8.0, 0.0, seed=0)
    sd = {k: torch.randn_like(v) for k, v in lora_state_dict(model).items()}
    save_peft_adapter(export / "r1-peft", sd, 4, 8.0, 0.0, ["q_proj", "v_proj"], str(gguf))
    # "model" as mlx_lm.lora writes it: the path it was given, from the project's folder
    save_mlx_adapter(export / "r1-mlx", sd, 4, 8.0, 0.0, n_layers=2, model="data/tiny-mlx")
    write_lora_gguf(export / "r1-lora-f32.gguf", sd, alpha=8.0, base=model.cfg)
    monkeypatch.chdir(root)
    return {"root": root, "n_params": sum(p.numel() for p in tiny_model().parameters())}


def test_list_shows_model_and_adapter_directories(project, toy_cli):
    code, out, err = toy_cli("list", "--json")
    assert code == 0, err
    rows = {Path(m["path"]).name: m for m in json.loads(out)["models"]}
    assert {n: rows[n].get("kind") for n in rows} == {
        "tiny-mlx": "mlx model",
        "tiny-transformers": "transformers model",
        "r1-merged-transformers": "transformers model",
        "r1-peft": "peft adapter",
        "r1-mlx": "mlx adapter",
        "r1-lora-f32.gguf": "lora adapter",
    }, rows
    for name in ("tiny-mlx", "tiny-transformers", "r1-merged-transformers"):
        assert rows[name]["arch"] == "llama" and rows[name]["n_layer"] == 2
        assert "error" not in rows[name] and "note" not in rows[name], rows[name]
    assert rows["tiny-mlx"]["file_size"] < rows["tiny-transformers"]["file_size"] / 3
    n_lora = 2 * 2 * 4 * (64 + 64) // 2 + 2 * 4 * (64 + 32)  # q: 64->64, v: 64->32, rank 4
    for name in ("r1-peft", "r1-mlx", "r1-lora-f32.gguf"):
        assert rows[name]["rank"] == 4 and rows[name]["alpha"] == 8.0, rows[name]
        assert rows[name]["n_params"] == n_lora, rows[name]
        # the architecture from what names the base (it was "?" for both directories)
        assert rows[name]["arch"] == "llama", rows[name]
    code, out, err = toy_cli("list")
    assert code == 0, err
    line = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  ")}
    assert line["data/tiny-mlx/"].split()[1:3] == ["llama", "mlx"]
    assert "peft adapter r4" in line["runs/r1/export/r1-peft/"]
    assert line["runs/r1/export/r1-peft/"].split()[1] == "llama"
    assert "mlx adapter r4" in line["runs/r1/export/r1-mlx/"]
