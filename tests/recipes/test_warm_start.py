"""The warm-start recipe on a tiny donor GGUF written in-process: the donor's rows land
exactly, the lens has the right shape, gets gradients and folds into a plain llama, PCA
orders its components by variance (a rotation at full width), the embedding freeze holds
for N steps and survives resume, and every bad input exits 2 naming what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.donor import PAD_ROWS, TINY, donor  # noqa: F401
from helpers.gguf_fixtures import tiny_model, write_llama_gguf  # noqa: E402
from safetensors.torch import load_file

from toy.runs import Project  # noqa: E402


def pca_project(table: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Coordinates of the centred rows of `table` on its top-k principal axes (the
    recipe's principal_axes) and the variance along each: ((n, k), (k,)), float32."""
    from toy.recipes.donor import centre, principal_axes

    axes, var = principal_axes(table, k)
    return (centre(table).double() @ axes).float(), var


def opts_for(donor: dict, **kw):
    """The resolved config `toy train --recipe warm-start ...` would hand to build()."""
    from toy.recipes import warm_start

    o = {
        "preset": "tiny",
        "batch_size": 4,
        "seq_len": 32,
        "eval_batches": 2,
        "corpus": str(donor["corpus"]),
        "donor": str(donor["gguf"]),
    }
    o.update(kw)
    return warm_start.RECIPE.config(**o)


def build(donor: dict, **kw):
    from toy.recipes import warm_start

    return warm_start.build(opts_for(donor, **kw), Project(root=None))


def train(toy_cli, donor, out, *extra):
    return toy_cli(
        "train",
        "--recipe",
        "warm-start",
        "--donor",
        donor["gguf"],
        "--corpus",
        donor["corpus"],
        "--out",
        out,
        *TINY,
        *extra,
    )


# ---------------------------------------------------------------- init modes


def test_donor_rows_land_exactly_at_equal_width(donor):
    built = build(donor, init="donor")
    m = built.job.model
    V = donor["vocab"]
    assert m.cfg.vocab_size == V and m.cfg.d_model == 64
    assert torch.equal(m.embed_tokens.weight.detach(), donor["table"][:V])  # padding rows dropped
    assert m.lm_head.weight is m.embed_tokens.weight  # still tied
    assert built.job.config["init"] == "donor" and built.job.config["lens"] is False


def test_every_mode_shares_the_scratch_init_outside_the_embedding(donor):
    # The comparison is fair: same seed, same class, same blocks; only the embedding differs.
    models = {init: build(donor, init=init).job.model for init in ("scratch", "donor", "pca")}
    sd = {init: m.state_dict() for init, m in models.items()}
    for k, v in sd["scratch"].items():
        if k in ("embed_tokens.weight", "lm_head.weight"):
            for init in ("donor", "pca"):
                assert not torch.equal(v, models[init].embed_tokens.weight.detach())
        else:
            assert torch.equal(v, sd["donor"][k]) and torch.equal(v, sd["pca"][k]), k
    a, b = build(donor, init="scratch").job, build(donor, init="donor").job
    assert torch.equal(a.micro_batch(3)["ids"], b.micro_batch(3)["ids"])  # same data order


def test_lens_shape_gradients_and_fold(donor, tmp_path):
    from toy.formats.model_dir import load_model_dir
    from toy.recipes.donor import LensEmbedding

    built = build(donor, init="donor", d_model=32, n_head=4, n_kv_head=2)
    m, job = built.job.model, built.job
    emb = m.embed_tokens
    assert isinstance(emb, LensEmbedding)
    assert emb.lens.weight.shape == (32, 64)  # nn.Linear(donor width 64 -> d_model 32)
    assert "embed_tokens.table" not in dict(m.named_parameters())  # the donor table is frozen
    from toy.recipes.donor import centre

    assert torch.equal(
        emb.table, centre(donor["table"][: donor["vocab"]])
    )  # the rows minus their mean row
    assert torch.allclose(emb.weight, emb.table @ emb.lens.weight.T)
    assert job.config["lens"] is True
    batch = job.micro_batch(0)
    loss, n = job.loss(m, batch)
    (loss / n).backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert float(emb.lens.weight.grad.abs().sum()) > 0
    # final/ is a plain llama with the product folded in; same logits as the lens model.
    job.save_final(tmp_path / "final")
    plain, meta, tok = load_model_dir(tmp_path / "final")
    assert tok is not None and meta["recipe"] == "warm-start"
    with torch.no_grad():
        assert torch.allclose(plain.embed_tokens.weight, emb.weight, atol=1e-6)
        assert plain.lm_head.weight is plain.embed_tokens.weight
        m.eval()
        assert torch.allclose(plain(batch["ids"]), m(batch["ids"]), atol=1e-5)


def test_lens_starts_semi_orthogonal_at_the_init_scale():
    from toy.recipes.donor import INIT_STD, lens_init

    g = torch.Generator().manual_seed(0)
    for width, d in ((64, 32), (32, 64), (48, 48)):
        table = torch.randn(500, width, generator=g) * 0.13
        w = lens_init(table, d, seed=0).double()  # (d, width)
        assert w.shape == (d, width)
        gram = w @ w.T if width >= d else w.T @ w  # orthogonal rows (or columns), one common norm
        c = float(gram[0, 0])
        assert torch.allclose(
            gram, c * torch.eye(min(width, d), dtype=torch.float64), atol=1e-6 * c
        )
        rms = float((table.double() @ w.T).pow(2).mean().sqrt())
        assert abs(rms - INIT_STD) < 1e-6
    t = torch.randn(50, 64, generator=g)
    assert torch.equal(lens_init(t, 32, 1), lens_init(t, 32, 1))
    assert not torch.equal(lens_init(t, 32, 1), lens_init(t, 32, 2))


def test_pca_is_a_lens_on_the_centred_table_starting_at_its_principal_axes(donor):
    # A trained PCA table lost the donor's geometry within tens of steps (Adam moves
    # every row by about one LR per entry); a frozen centred table and a lens keep it.
    from toy.recipes.donor import INIT_STD, LensEmbedding

    V = donor["vocab"]
    built = build(donor, init="pca", d_model=32, n_head=4, n_kv_head=2)
    emb = built.job.model.embed_tokens
    assert isinstance(emb, LensEmbedding) and built.job.config["lens"] is True
    assert "embed_tokens.table" not in dict(built.job.model.named_parameters())
    table = donor["table"][:V].double()
    assert torch.allclose(emb.table.double(), table - table.mean(0), atol=1e-6)  # centred
    assert torch.allclose(
        emb.table.double().mean(0), torch.zeros(64, dtype=torch.float64), atol=1e-6
    )
    proj, _ = pca_project(donor["table"][:V], 32)
    start = emb.weight.detach()
    ref = proj.double() * (INIT_STD / proj.double().pow(2).mean().sqrt())
    assert torch.allclose(
        start.double(), ref, atol=1e-6
    )  # float32 rounding of a ~0.02-sized product
    assert any("principal axes" in n for n in built.notes)


def test_donor_lens_reads_the_centred_table(donor):
    built = build(donor, init="donor", d_model=32, n_head=4, n_kv_head=2)
    t = built.job.model.embed_tokens.table.double()
    ref = donor["table"][: donor["vocab"]].double()
    assert torch.allclose(t, ref - ref.mean(0), atol=1e-6)
    assert any("centred (frozen)" in n for n in built.notes)


@pytest.mark.parametrize("init,width", [("scratch", 64), ("donor", 64), ("donor", 32), ("pca", 32)])
def test_embedding_trains_at_embed_lr_scale_times_lr(donor, toy_cli, tmp_path, init, width):
    # The default (3) applies to every init, scratch included, so the baseline gets it too.
    from toy.recipes.donor import EMBED_LR_SCALE

    assert EMBED_LR_SCALE == 3.0
    shape = [] if width == 64 else ["--d-model", "32", "--n-head", "4", "--n-kv-head", "2"]
    code, _, err = train(
        toy_cli,
        donor,
        tmp_path,
        *shape,
        "--init",
        init,
        "--steps",
        "1",
        "--lr",
        "1e-2",
        "--warmup",
        "0",
        "--save-every",
        "1",
        "--keep-last",
        "0",
        "--run-id",
        "r",
    )
    assert code == 0, err
    state = json.loads((tmp_path / "r" / "checkpoints" / "step-000001" / "state.json").read_text())
    lr = {name: g["lr"] for g in state["optimizer"]["param_groups"] for name in g["params"]}
    key = "embed_tokens.lens.weight" if width == 32 or init == "pca" else "embed_tokens.weight"
    assert lr[key] == pytest.approx(3e-2)
    assert lr["layers.0.mlp.up_proj.weight"] == pytest.approx(1e-2)
    assert lr["norm.weight"] == pytest.approx(1e-2)
    assert all(v == pytest.approx(1e-2) for k, v in lr.items() if k != key), lr


def test_pca_orders_components_by_variance():

    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.5, 0.25])
    q, _ = torch.linalg.qr(torch.randn(8, 8, generator=g))
    table = (torch.randn(20000, 8, generator=g) * scales) @ q.T + 3.0  # a rotated, shifted cloud
    proj, var = pca_project(table, 4)
    assert proj.shape == (20000, 4)
    assert torch.all(var[:-1] >= var[1:])
    assert torch.allclose(proj.var(0, unbiased=False), var, rtol=1e-4)
    assert torch.allclose(var.sqrt(), scales[:4], rtol=0.03)  # the cloud's own axis scales
    assert torch.allclose(proj.mean(0), torch.zeros(4), atol=1e-3)  # centred


def test_pca_at_full_width_is_a_rotation(donor):

    V = donor["vocab"]
    table = donor["table"][:V]
    proj, var = pca_project(table, 64)
    assert torch.all(var[:-1] >= var[1:])
    d0 = torch.cdist(table.double(), table.double())
    assert torch.allclose(torch.cdist(proj.double(), proj.double()), d0, atol=1e-4)
    # Through the recipe: that rotation times one factor (RMS 0.02), components by variance.
    from toy.recipes.donor import INIT_STD

    emb = build(donor, init="pca").job.model.embed_tokens.weight.detach()
    assert abs(float(emb.pow(2).mean().sqrt()) - INIT_STD) < 1e-6
    d1 = torch.cdist(emb.double(), emb.double())
    c = float(d1.sum() / d0.sum())
    assert torch.allclose(d1, c * d0, atol=1e-6)
    cv = emb.var(0)
    assert torch.all(cv[:-1] >= cv[1:] - 1e-9)


# ---------------------------------------------------------------- freeze


@pytest.mark.parametrize("width", [64, 32], ids=["equal-width", "lens"])
def test_freeze_embed_steps_holds_then_releases(donor, toy_cli, tmp_path, width):
    shape = [] if width == 64 else ["--d-model", "32", "--n-head", "4", "--n-kv-head", "2"]
    code, out, err = train(
        toy_cli,
        donor,
        tmp_path,
        *shape,
        "--steps",
        "4",
        "--freeze-embed-steps",
        "2",
        "--save-every",
        "1",
        "--keep-last",
        "0",
        "--lr",
        "1e-2",
        "--warmup",
        "0",
        "--run-id",
        "f",
        "--json",
    )
    assert code == 0, err
    ck = {
        s: load_file(tmp_path / "f" / "checkpoints" / f"step-{s:06d}" / "model.safetensors")
        for s in (1, 2, 3, 4)
    }
    key = "embed_tokens.weight" if width == 64 else "embed_tokens.lens.weight"
    start = (
        donor["table"][: donor["vocab"]]
        if width == 64
        else build(
            donor, d_model=32, n_head=4, n_kv_head=2
        ).job.model.embed_tokens.lens.weight.detach()
    )
    # Weight decay is on (0.1): a zero gradient would still shrink it; a None one does not.
    assert torch.equal(ck[1][key], start) and torch.equal(ck[2][key], start)
    assert not torch.equal(ck[3][key], start) and not torch.equal(ck[4][key], ck[3][key])
    other = "layers.0.mlp.up_proj.weight"
    assert not torch.equal(ck[1][other], ck[2][other])  # the rest trained all along


def test_freeze_holds_under_ddp(donor, tmp_path):
    # DDP hands back an all-reduced zero gradient for a parameter whose grad was dropped
    # during backward; the loop drops frozen grads after the reduction, so decay cannot
    # move them. Two gloo processes on CPU.
    from helpers.common import run_toy

    r = run_toy(
        "train",
        "--nproc",
        "2",
        "--recipe",
        "warm-start",
        "--donor",
        donor["gguf"],
        "--corpus",
        donor["corpus"],
        "--out",
        tmp_path,
        *TINY,
        "--batch-size",
        "2",
        "--steps",
        "3",
        "--freeze-embed-steps",
        "2",
        "--save-every",
        "1",
        "--keep-last",
        "0",
        "--lr",
        "1e-2",
        "--warmup",
        "0",
        "--run-id",
        "ddp",
        "--json",
        env={"OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    start = donor["table"][: donor["vocab"]]
    ck = {
        s: load_file(tmp_path / "ddp" / "checkpoints" / f"step-{s:06d}" / "model.safetensors")
        for s in (1, 2, 3)
    }
    assert torch.equal(ck[1]["embed_tokens.weight"], start) and torch.equal(
        ck[2]["embed_tokens.weight"], start
    )
    assert not torch.equal(ck[3]["embed_tokens.weight"], start)


@pytest.mark.parametrize(
    "shape",
    [(), ("--init", "pca", "--d-model", "32", "--n-head", "4", "--n-kv-head", "2")],
    ids=["donor-equal-width", "pca-lens"],
)
def test_freeze_is_resume_safe(donor, toy_cli, tmp_path, shape):
    # Also resume with --embed-lr-scale's groups (3 x on the embedding or the lens): a
    # resumed run that lost the multiplier would train steps 2..4 differently.
    args = (
        "--steps",
        "4",
        "--freeze-embed-steps",
        "2",
        "--save-every",
        "1",
        "--keep-last",
        "0",
        "--json",
        *shape,
    )
    code, out, err = train(toy_cli, donor, tmp_path, *args, "--run-id", "full")
    assert code == 0, err
    full = json.loads(out)["losses"]
    cut = tmp_path / "cut"  # the same run stopped after step 1, still inside the freeze
    shutil.copytree(tmp_path / "full", cut)
    for s in (2, 3, 4):
        shutil.rmtree(cut / "checkpoints" / f"step-{s:06d}")
    shutil.rmtree(cut / "final")
    code, out, err = toy_cli("train", "--resume", cut, "--json")
    assert code == 0, err
    assert json.loads(out)["losses"] == full
    a = load_file(tmp_path / "full" / "checkpoints" / "step-000004" / "model.safetensors")
    b = load_file(cut / "checkpoints" / "step-000004" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- the read helper


def test_read_gguf_tensor_reads_one_tensor(donor):
    from toy.errors import InputError
    from toy.formats.gguf import read_gguf_tensor
    from toy.formats.gguf_header import read_gguf_header

    h = read_gguf_header(donor["gguf"])
    t = read_gguf_tensor(h, "token_embd.weight")
    assert t.dtype == torch.float32 and torch.equal(t, donor["table"])
    norm = read_gguf_tensor(donor["gguf"], "output_norm.weight")  # a path works as well as a header
    assert norm.shape == (64,) and torch.equal(norm, read_gguf_tensor(h, "output_norm.weight"))
    with pytest.raises(InputError, match="has no tensor 'nope'"):
        read_gguf_tensor(h, "nope")


def test_quantized_donor_is_dequantized(donor, tmp_path):
    from toy.recipes.donor import open_donor

    q = write_llama_gguf(
        tmp_path / "q8.gguf",
        tiny_model(seed=3, vocab_size=donor["vocab"] + PAD_ROWS),
        _donor_tok(donor),
        qtypes={"token_embd.weight": "Q8_0"},
    )
    d = open_donor(q)
    t = d.table(d.rows)
    assert t.shape == donor["table"].shape and d.table_type == "Q8_0"
    assert (t - donor["table"]).abs().max() < 0.01  # Q8_0: 8 bits a value
    assert d.tokenizer_hash == open_donor(donor["gguf"]).tokenizer_hash


def _donor_tok(donor):
    from toy.formats.gguf import read_gguf_tokenizer

    return read_gguf_tokenizer(donor["gguf"])


# ---------------------------------------------------------------- bad inputs


def _other_donor(donor, tmp_path, name, **kw):
    m = tiny_model(seed=3, vocab_size=donor["vocab"] + PAD_ROWS)
    return write_llama_gguf(tmp_path / name, m, _donor_tok(donor), **kw)


def test_tokenizer_mismatch_names_both_files(donor, toy_cli, tmp_path):
    code, _, err = toy_cli(
        "prep", donor["text"], "--out", tmp_path / "other.bin", "--vocab-size", "300"
    )
    assert code == 0, err
    code, _, err = toy_cli(
        "train",
        "--recipe",
        "warm-start",
        "--donor",
        donor["gguf"],
        "--corpus",
        tmp_path / "other.bin",
        "--out",
        tmp_path / "runs",
        *TINY,
    )
    assert code == 2
    assert "other.bin" in err and "donor.gguf" in err and "toy prep" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()


BAD = [
    ("non-llama", dict(arch="gpt2"), [], "not one toy reads"),
    ("no-embedding", dict(drop={"token_embd.weight"}), [], "has no tensor 'token_embd.weight'"),
    ("missing-file", None, ["--donor", "nope/missing.gguf"], "--donor nope/missing.gguf not found"),
    (
        "bogus-init",
        None,
        ["--init", "bogus"],
        "--init 'bogus' is unknown; valid: scratch, donor, pca",
    ),
    ("pca-too-wide", None, ["--init", "pca", "--d-model", "128"], "--d-model 128 exceeds"),
    (
        "negative-freeze",
        None,
        ["--freeze-embed-steps", "-1"],
        "--freeze-embed-steps must be an integer >= 0",
    ),
    ("zero-embed-lr", None, ["--embed-lr-scale", "0"], "--embed-lr-scale must be a number > 0"),
    ("gpt2-arch", None, ["--arch", "gpt2"], "warm-start builds a llama"),
    ("tokenizer-flag", None, ["--tokenizer", "x.json"], "--tokenizer conflicts with --donor"),
]


@pytest.mark.parametrize("kind,write,extra,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_exit_2_with_one_line(
    donor, toy_cli, tmp_path, monkeypatch, kind, write, extra, needle
):
    monkeypatch.chdir(tmp_path)
    gguf = (
        _other_donor(donor, tmp_path, f"{kind}.gguf", **write)
        if write is not None
        else donor["gguf"]
    )
    code, _, err = toy_cli(
        "train",
        "--recipe",
        "warm-start",
        "--donor",
        gguf,
        "--corpus",
        donor["corpus"],
        "--out",
        tmp_path / "runs",
        *TINY,
        *extra,
    )
    assert code == 2, err
    assert needle in err, err
    if write is not None:
        assert f"{kind}.gguf" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # nothing half-made


def test_donor_flag_and_corpus_are_required(donor, toy_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no project: no data/corpus.bin to fall back on
    code, _, err = toy_cli("train", "--recipe", "warm-start", "--corpus", donor["corpus"], *TINY)
    assert code == 2 and "--donor DONOR.gguf is required" in err
    code, _, err = toy_cli("train", "--recipe", "warm-start", "--donor", donor["gguf"], *TINY)
    assert code == 2 and "needs --corpus" in err and "--tokenizer" in err and "donor.gguf" in err
    assert not (tmp_path / "runs").exists()
