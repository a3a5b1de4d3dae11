"""The preference recipes' answer log-probs with a pair's prompt run once (recipes/pairs.py
answer_sums, over scoring.shared_logps): the same sums and gradients as every row run
whole, the prompts through the blocks once a pair, and whole rows where an answer is not
one run of tokens after its prompt or the blocks compute in float32."""

from __future__ import annotations

import pytest
import torch
from helpers.gguf_fixtures import tiny_model  # noqa: E402

from toy.data.preference import Encoded, pair_batch
from toy.recipes import pairs, scoring


def pair(prompt: list[int], chosen: list[int], rejected: list[int]) -> Encoded:
    def row(answer):
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)

    return Encoded(row(chosen), row(rejected))


def batch(g: torch.Generator) -> dict[str, torch.Tensor]:
    """Three pairs: prompts of 4, 19 and 2 tokens, answers of 1 to 23 tokens."""

    def toks(n):
        return torch.randint(3, 290, (n,), generator=g).tolist()

    made = [pair(toks(4), toks(7), toks(1)), pair(toks(19), toks(23), toks(5)),
            pair(toks(2), toks(3), toks(12))]  # fmt: skip
    return pair_batch(list(enumerate(made)), 0)


@pytest.fixture
def model():
    m = tiny_model()
    m.lm_head.weight.requires_grad_(False)  # an adapter recipe's head: frozen
    return m


def run(model, b, fn, weights):
    model.zero_grad()
    s = fn(model, b)
    (s * weights).sum().backward()
    return s.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_a_pairs_prompt_runs_once_and_the_sums_are_every_row_runs(model, monkeypatch):
    g = torch.Generator().manual_seed(4)
    b = batch(g)
    weights = torch.randn(6, generator=g)
    seen = []
    real_hidden = model.hidden
    monkeypatch.setattr(
        model, "hidden", lambda ids, *a: seen.append(tuple(ids.shape)) or real_hidden(ids, *a)
    )
    whole, grads = run(model, b, lambda m, b: pairs.answer_logps(m, b)[0], weights)
    assert seen == [tuple(b["ids"].shape)]  # every row whole: 6 rows of 41 inputs
    seen.clear()
    shared, got = run(model, b, lambda m, b: pairs.answer_sums(m, b, share=True), weights)
    # the three prompts once, as one batch to the longest; then the six answers after them,
    # each to the longest answer but its last token
    assert seen == [(3, 19), (6, 22)]
    torch.testing.assert_close(shared, whole, atol=1e-5, rtol=1e-5)
    for a, w in zip(got, grads):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-4)


def test_an_answer_in_pieces_runs_every_row_whole(model, monkeypatch):
    """A chat whose answer mask has a gap (a later user turn between assistant turns): the
    tokens after the prompt are not all targets, so no prompt is shared."""
    p, a, c = [5, 6, 7], [8, 9], [10, 11, 12]
    gap = Encoded((p + a + c, [0, 0, 0, 1, 1, 0, 1, 1]), (p + c, [0, 0, 0, 1, 1, 1]))
    b = pair_batch([(0, gap)], 0)
    monkeypatch.setattr(scoring, "shared_logps", lambda *a: pytest.fail("shared"))
    monkeypatch.setattr(pairs, "shared_logps", lambda *a: pytest.fail("shared"))
    want = pairs.answer_logps(model, b)[0]
    assert torch.equal(pairs.answer_sums(model, b, share=True), want)


def test_pairs_share_by_default_under_bf16_only(model, monkeypatch):
    """float32 sums every row whole, to its old bytes (scripts/same_losses.py); under bf16
    autocast the prompts are shared, as near the float32 sums as whole rows under bf16;
    compiled blocks (--compile) run whole rows."""
    g = torch.Generator().manual_seed(6)
    b = batch(g)
    calls = []
    real = pairs.shared_logps
    monkeypatch.setattr(pairs, "shared_logps", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        f32 = pairs.answer_sums(model, b)
        assert calls == [] and torch.equal(f32, pairs.answer_logps(model, b)[0])
        with torch.autocast("cpu", torch.bfloat16):
            shared = pairs.answer_sums(model, b)
            assert calls == [1]
            whole = pairs.answer_logps(model, b)[0]
        model.layers[0].compile()  # --compile: whole rows (no build per pass's lengths)
        with torch.autocast("cpu", torch.bfloat16):
            pairs.answer_sums(model, b)
        assert calls == [1]
    err_whole, err_shared = (whole - f32).abs().max(), (shared - f32).abs().max()
    assert 0 < err_whole < 1.0  # bf16's own rounding of sums of ~-100
    assert err_shared <= 1.5 * err_whole + 1e-2, (err_shared, err_whole)
