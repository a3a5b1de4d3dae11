"""Batched group sampling (models/sample.py), the generator of GRPO's completions: greedy rows
equal `generate`, the draws are a function of the seed, rows end at their own stop ids and
leave the batch, the batched logits are the single-row ones, and an unmerged LoRA adapter on
a quantized GGUF base samples as `generate` does on it. One sampler: `toy infer` (generate)
and sample_groups(n=1) give the same tokens for the same seed and prompt."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import model_dirs  # noqa: E402
from helpers.gguf_fixtures import tiny_model, write_llama_gguf  # noqa: E402

from toy.models import registry  # noqa: E402
from toy.models import sample as sample_mod  # noqa: E402
from toy.models.generate import generate  # noqa: E402
from toy.models.sample import Completion, sample_group, sample_groups  # noqa: E402

PROMPT = [5, 17, 42, 9, 81, 7]  # ids every tiny vocabulary has (gemma's is 96)


def family_model(name):
    """The registry's tiny model of a family, weights large enough that its logits are far
    from ties (Gemma's: soft-capped attention, local windows of 8 positions)."""
    fam = registry.family(name)
    torch.manual_seed(0)
    model = fam.model(fam.config(**fam.tiny))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    return model.eval()


def tiny_gemma():
    """The registry's tiny Gemma (soft-capped logits and attention, local/global layers)."""
    return family_model("gemma")


def greedy(model, prompt, max_new, stop_ids=frozenset()) -> list[int]:
    """generate's greedy tokens, plus the stop id when one ended them (as sample_group)."""
    got = list(generate(model, prompt, max_new, temperature=0.0, stop_ids=set(stop_ids)))
    if len(got) < max_new and stop_ids:
        nxt = list(generate(model, prompt + got, 1, temperature=0.0))
        if nxt and nxt[0] in stop_ids:
            got += nxt
    return got


def draw(model, seed=0, n=6, max_new=12, **kw) -> list[Completion]:
    kw = {"stop_ids": set(), "generator": torch.Generator().manual_seed(seed)} | kw
    return sample_group(model, PROMPT, n, max_new, **kw)


@pytest.mark.parametrize("make", [tiny_model, tiny_gemma], ids=["llama", "gemma"])
def test_greedy_rows_equal_generate(make):
    model = make()
    want = greedy(model, PROMPT, 12)
    assert len(want) == 12
    for temp, gen in ((0.0, None), (1e-6, torch.Generator().manual_seed(3))):
        rows = sample_group(model, PROMPT, 3, 12, temperature=temp, generator=gen, stop_ids=set())
        assert [r.ids for r in rows] == [want] * 3
        assert not any(r.stopped for r in rows)


def test_greedy_stop_is_kept_and_flagged():
    model = tiny_model()
    free = greedy(model, PROMPT, 12)
    stop = {free[4]}  # the 5th greedy token ends every row there
    end = free.index(free[4]) + 1
    rows = draw(model, temperature=0.0, generator=None, stop_ids=stop)
    assert [r.ids for r in rows] == [free[:end]] * 6 and all(r.stopped for r in rows)
    assert greedy(model, PROMPT, 12, stop) == free[:end]


def test_top_k_and_top_p_keep_each_rows_best_tokens(monkeypatch):
    """sample_next's rules per row: top_k=1 or a tiny top_p leave each row its argmax (the
    greedy rows); top_k=5 with top_p=0.5 draws from at most 5 tokens a row, top_p's mass."""
    model = tiny_model()
    want = greedy(model, PROMPT, 8)
    for opts in ({"top_k": 1}, {"top_p": 1e-6}):
        assert [r.ids for r in draw(model, 3, n=3, max_new=8, **opts)] == [want] * 3
    drawn = record_draws(monkeypatch)
    draw(model, 3, n=4, max_new=6, top_k=5, top_p=0.5)
    assert len(drawn) == 6  # one draw a step: the checks below ran on every one of them
    for probs in drawn:
        kept = (probs > 0).sum(-1)
        assert probs.shape[0] == 4 and (kept >= 1).all() and (kept <= 5).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(4))


def test_same_seed_same_completions_other_seed_others():
    model = tiny_model()
    a, b, c = draw(model, 0), draw(model, 0), draw(model, 1)
    assert [r.ids for r in a] == [r.ids for r in b]
    assert [r.ids for r in a] != [r.ids for r in c]
    assert len({tuple(r.ids) for r in a}) == len(a)  # the rows are not copies of each other
    # sample_groups: one generator through the prompts in order, the same per seed.
    prompts = [PROMPT, PROMPT[:3], [3, 1, 4, 1, 5]]

    def groups(seed):
        gen = torch.Generator().manual_seed(seed)
        out = sample_groups(model, prompts, 4, 8, generator=gen, stop_ids=set())
        return [[r.ids for r in g] for g in out]

    first = groups(7)
    assert first == groups(7) and len(first) == 3 and all(len(g) == 4 for g in first)
    assert first != groups(8)


def test_a_row_that_samples_a_stop_ends_and_the_others_go_on():
    model = tiny_model()
    stop = set(range(0, 300, 30))  # 10 of 300 ids: some rows of 24 steps stop, not all
    rows = draw(model, 1, n=12, max_new=24, stop_ids=stop)
    for r in rows:
        assert not any(t in stop for t in r.ids[:-1])  # nothing after a stop
        if r.stopped:
            assert r.ids[-1] in stop and 1 <= len(r.ids) <= 24
        else:
            assert len(r.ids) == 24 and r.ids[-1] not in stop
    lengths = sorted(len(r.ids) for r in rows if r.stopped)
    assert lengths and lengths[0] < 24 and any(not r.stopped for r in rows), lengths
    assert len(set(lengths)) > 1  # rows left the batch at different steps


def test_max_new_tokens_and_the_context_limit():
    model = tiny_model()  # a context of 64 positions
    rows = draw(model, 0, n=3, max_new=5)
    assert [len(r.ids) for r in rows] == [5, 5, 5]
    prompt = list(range(10, 70))  # 60 tokens: room for 4 more positions, and one last token
    want = list(generate(model, prompt, 20, temperature=0.0))
    rows = sample_group(model, prompt, 2, 20, temperature=0.0, generator=None, stop_ids=set())
    assert len(want) == 5 and [r.ids for r in rows] == [want] * 2
    assert not any(r.stopped for r in rows)
    with pytest.raises(ValueError, match="context"):
        sample_group(model, list(range(65)), 2, 4, generator=None, stop_ids=set(), temperature=0)
    with pytest.raises(ValueError, match="generator"):
        sample_group(model, PROMPT, 2, 4, generator=None, stop_ids=set())


def record_draws(monkeypatch) -> list[torch.Tensor]:
    """The probabilities (R, V) of every draw from now on, normalised as `draw` takes
    them: what each sampling step actually drew from."""
    seen, real = [], sample_mod.draw

    def spy(probs, generator):
        seen.append(probs / probs.sum(-1, keepdim=True))
        return real(probs, generator)

    monkeypatch.setattr(sample_mod, "draw", spy)
    return seen


def test_draw_follows_the_probabilities_and_never_takes_a_zero():
    """Inverse-CDF draws: each id's share over many rows is its probability (within 4
    standard errors), unnormalised rows are normalised, a zero-probability id never comes,
    and the same generator seed gives the same ids."""
    p = torch.tensor([0.1, 0.0, 0.45, 0.15, 0.3, 0.0]) * 7.0  # not normalised
    rows = 200_000
    ids = sample_mod.draw(p.expand(rows, -1), torch.Generator().manual_seed(0))
    share = torch.bincount(ids, minlength=6).double() / rows
    want = (p / p.sum()).double()
    assert (share[want == 0] == 0).all()
    assert ((share - want).abs() <= 4 * (want * (1 - want) / rows).sqrt() + 1e-12).all(), share
    again = sample_mod.draw(p.expand(rows, -1), torch.Generator().manual_seed(0))
    assert torch.equal(ids, again)
    # A row whose mass sits on its last id, and one on its first: both drawn exactly.
    edge = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]).repeat(500, 1)
    got = sample_mod.draw(edge, torch.Generator().manual_seed(1))
    assert got.tolist() == [2, 0] * 500


def teacher_forced_gap(model, prompt, rows, drawn) -> float:
    """The largest |batched - single-row| log-prob of a sampled token, at temperature 1.
    `drawn`: each step's probabilities (R, V); row j is in the batch at step s while it has
    more than s tokens (rows leave the batch in order)."""
    worst = 0.0
    for j, r in enumerate(rows):
        with torch.no_grad():
            full = model(torch.tensor([prompt + r.ids[:-1]]))[0, len(prompt) - 1 :]
        want = torch.log_softmax(full.float(), -1)[torch.arange(len(r.ids)), r.ids]
        for s, tok in enumerate(r.ids):
            at = [k for k, o in enumerate(rows) if len(o.ids) > s].index(j)
            worst = max(worst, abs(float(drawn[s][at, tok].log() - want[s])))
    return worst


@pytest.mark.parametrize("make", [tiny_model, tiny_gemma], ids=["llama", "gemma"])
def test_batched_logits_equal_single_row_logits(make, monkeypatch):
    """Teacher-forced log-probs of each row's sampled tokens (a plain forward over prompt +
    completion, Gemma's final soft-cap included) against the probabilities the batch drew
    them from, with rows dropped on the way: a row's cache kept out of order would show
    here (greedy rows, all alike, would not)."""
    model = make()
    drawn = record_draws(monkeypatch)
    rows = draw(model, 4, n=8, max_new=16, stop_ids=set(range(0, 96, 5)))
    assert any(r.stopped for r in rows) and len({len(r.ids) for r in rows}) > 1
    assert teacher_forced_gap(model, PROMPT, rows, drawn) < 1e-4


@pytest.fixture(scope="module")
def q8_base(tmp_path_factory) -> Path:
    """A tiny llama GGUF whose block matrices are Q8_0 (the embedding stays F32)."""
    from tokenizers import Tokenizer

    path = tmp_path_factory.mktemp("sample") / "q8.gguf"
    model = tiny_model(vocab_size=model_dirs.VOCAB, max_seq_len=64)
    tok = Tokenizer.from_str(model_dirs.tokenizer_json())
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    q8 = {f"blk.{i}.{n}.weight": "Q8_0" for i in range(2) for n in names}
    return write_llama_gguf(path, model, tok, qtypes=q8)


def test_lora_on_a_quantized_base_samples_as_generate(q8_base, monkeypatch):
    from toy.formats.gguf import read_gguf
    from toy.lora import LoRALinear, apply_lora, disable_adapter
    from toy.models.quant import QuantLinear

    base = read_gguf(q8_base, "quantized").build_model().eval()
    model = read_gguf(q8_base, "quantized").build_model()
    apply_lora(model, ["q_proj", "v_proj"], rank=4, alpha=8, dropout=0.1, seed=0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.5)
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    assert any(isinstance(m, LoRALinear) and m.spec is not None for m in model.modules())
    model.train()  # as a training loop leaves it: the sampler samples without dropout

    def rows(m):
        return [
            r.ids
            for r in sample_group(m, PROMPT, 3, 10, temperature=0.0, generator=None, stop_ids=set())
        ]

    model.eval()
    adapted = greedy(model, PROMPT, 10)
    model.train()
    assert rows(model) == [adapted] * 3 and model.training  # its mode given back
    with disable_adapter(model):
        assert rows(model) == [greedy(base, PROMPT, 10)] * 3
    assert adapted != greedy(base, PROMPT, 10)  # the adapter changes the text
    # Sampled rows: the batched logits are the single-row ones on this model too.
    drawn = record_draws(monkeypatch)
    got = draw(model, 1, n=4, max_new=8, stop_ids={1, 2, 3})
    model.eval()
    assert teacher_forced_gap(model, PROMPT, got, drawn) < 1e-4


def test_under_autocast_the_rows_follow_the_callers_dtype():
    """bf16 autocast (the caller's): the sampler runs inside it, forcing no dtype, and its
    greedy rows are generate's under the same autocast."""
    model = tiny_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = greedy(model, PROMPT, 8)
        rows = draw(model, n=2, max_new=8, temperature=0.0, generator=None)
        recorded = []
        hook = model.lm_head.register_forward_hook(lambda m, i, o: recorded.append(o))
        draw(model, n=2, max_new=2)
        hook.remove()
    assert [r.ids for r in rows] == [want] * 2
    assert recorded[0].dtype == torch.bfloat16
    assert math.isfinite(float(recorded[-1].float().sum()))


# Lengths 6, 3, 11 and 1: the shorter prompts' rows are left-padded by up to 10 slots, more
# than Gemma's local window of 8.
PROMPTS = [PROMPT, [3, 1, 4], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4], [11]]


@pytest.mark.parametrize("name", ["llama", "gemma", "gpt2", "phi3"])
def test_prompts_of_other_lengths_decode_as_one_batch(name, monkeypatch):
    """Rows of prompts of different lengths share one batch (left-padded, each at its own
    positions): greedy rows are each prompt's `generate`, and the probabilities every
    sampled token was drawn from are a plain forward's over that prompt + completion, with
    rows leaving the batch at their stops. The decode is one batch: one draw a step."""
    model = family_model(name)
    got = sample_groups(model, PROMPTS, 2, 10, temperature=0.0, generator=None, stop_ids=set())
    assert [[r.ids for r in g] for g in got] == [[greedy(model, p, 10)] * 2 for p in PROMPTS]
    drawn = record_draws(monkeypatch)
    gen = torch.Generator().manual_seed(2)
    stops = set(range(0, 96, 6))
    got = sample_groups(model, PROMPTS, 3, 12, generator=gen, stop_ids=stops)
    rows = [r for g in got for r in g]
    assert any(r.stopped for r in rows) and len({len(r.ids) for r in rows}) > 1
    assert len(drawn) == max(len(r.ids) for r in rows)  # one draw a step, every prompt in it
    assert drawn[0].shape[0] == len(rows)
    for j, (p, g) in enumerate(zip(PROMPTS, got)):
        # Each step's rows: the ones with more than s tokens, in batch order.
        for i, r in enumerate(g):
            row = j * 3 + i
            with torch.no_grad():
                full = model(torch.tensor([p + r.ids[:-1]]))[0, len(p) - 1 :]  # capped
            want = torch.log_softmax(full.float(), -1)[torch.arange(len(r.ids)), r.ids]
            for s, tok in enumerate(r.ids):
                at = [k for k, o in enumerate(rows) if len(o.ids) > s].index(row)
                assert abs(float(drawn[s][at, tok].log() - want[s])) < 1e-4, (name, j, i, s)


def test_batches_of_max_rows_and_each_rows_own_context():
    """More rows than max_rows: whole groups a batch, the same greedy rows. A long prompt
    stops at the context while a short one in the same batch goes on."""
    model = family_model("llama")  # a context of 64 positions
    want = [[greedy(model, p, 10)] * 4 for p in PROMPTS]
    kw = {"temperature": 0.0, "generator": None, "stop_ids": set()}
    for max_rows in (1, 8, 64):
        got = sample_groups(model, PROMPTS, 4, 10, max_rows=max_rows, **kw)
        assert [[r.ids for r in g] for g in got] == want
    long = list(range(10, 70))  # 60 tokens: room for 4 more positions, and one last token
    got = sample_groups(
        model, [long, PROMPT], 2, 20, temperature=0.0, generator=None, stop_ids=set()
    )
    assert [r.ids for r in got[0]] == [greedy(model, long, 20)] * 2 and len(got[0][0].ids) == 5
    assert [r.ids for r in got[1]] == [greedy(model, PROMPT, 20)] * 2 and len(got[1][0].ids) == 20
    # Sampled rows: the same seed, the same rows.
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    a = sample_groups(model, PROMPTS, 4, 8, generator=gen(), stop_ids=set())
    b = sample_groups(model, PROMPTS, 4, 8, generator=gen(), stop_ids=set())
    assert [[r.ids for r in g] for g in a] == [[r.ids for r in g] for g in b]


# ---------------------------------------------------------------- one sampler: infer and GRPO

# (temperature, top_k, top_p): top-k, top-p, both, plain temperature, greedy.
OPTIONS = [(0.8, 20, 1.0), (0.8, 0, 0.9), (1.2, 20, 0.8), (1.0, 0, 1.0), (0.0, 0, 1.0)]


def one_row(model, prompt, max_new, temperature, top_k, top_p, seed, stop_ids=frozenset()):
    """sample_groups(n=1)'s tokens, with a generator seeded as GRPO's (on the model's device),
    the stop id that ended them left off (generate does not yield it)."""
    gen = torch.Generator().manual_seed(seed)
    (row,) = sample_groups(
        model,
        [prompt],
        1,
        max_new,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=gen,
        stop_ids=set(stop_ids),
    )[0]
    return row.ids[:-1] if row.stopped else row.ids


@pytest.mark.parametrize("opts", OPTIONS, ids=["top_k", "top_p", "both", "plain", "greedy"])
def test_generate_draws_as_a_group_of_one(opts):
    """generate (toy infer's decode) and sample_groups at batch size 1: the same seed and
    prompt, the same tokens, and another seed other tokens where it samples."""
    model = tiny_model()
    for seed in (0, 5):
        got = list(generate(model, PROMPT, 24, *opts, seed=seed))
        assert len(got) == 24 and got == one_row(model, PROMPT, 24, *opts, seed)
    if opts[0] > 0:
        assert list(generate(model, PROMPT, 24, *opts, seed=0)) != one_row(
            model, PROMPT, 24, *opts, 1
        )


@pytest.fixture(scope="module")
def f32_base(tmp_path_factory) -> Path:
    """A tiny float32 llama GGUF with a byte-level BPE tokenizer and ChatML."""
    from tokenizers import Tokenizer

    path = tmp_path_factory.mktemp("sample") / "tiny.gguf"
    model = tiny_model(vocab_size=model_dirs.VOCAB, max_seq_len=128)
    tok = Tokenizer.from_str(model_dirs.tokenizer_json())
    return write_llama_gguf(path, model, tok)


@pytest.mark.parametrize("opts", OPTIONS, ids=["top_k", "top_p", "both", "plain", "greedy"])
def test_toy_infer_draws_as_a_grpo_group_of_one(f32_base, toy_cli, opts):
    """`toy infer --seed S` and sample_groups(n=1) with a generator seeded S (GRPO's path) on
    the same model and prompt: the same tokens, at every sampling option both support."""
    from toy.cli.cmd_infer import load_base_lm
    from toy.tokenizer import encode_prompt

    temperature, top_k, top_p = opts
    prompt, n, seed = "The quick brown fox", 20, 11
    code, out, err = toy_cli(
        "infer",
        "--model",
        f32_base,
        "--base-dtype",
        "float32",
        "--prompt",
        prompt,
        "--seed",
        seed,
        "--temperature",
        temperature,
        "--top-k",
        top_k,
        "--top-p",
        top_p,
        "--max-new-tokens",
        n,
        "--json",
    )
    assert code == 0, err
    report = json.loads(out)
    lm = load_base_lm(f32_base, None, "cpu", "float32")
    ids = one_row(lm.model, encode_prompt(lm.tok, prompt), n, *opts, seed, lm.stop)
    assert ids and report["tokens"] == len(ids)
    assert report["text"] == prompt + lm.tok.decode(ids)
