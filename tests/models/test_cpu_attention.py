"""models/cpu_attention.py: a bf16 training step's causal attention on a CPU by matmuls in
chunks of queries (issue 46 item 2). Its output and gradients must match float32 attention
as closely as torch's own bf16 flash kernel does, in one chunk or many, with grouped-query
heads; it keeps no (T, T) tensor for backward; and every whole-sequence bf16 pass on a
CPU takes it, to the same bits with or without gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from toy.models import cpu_attention, layers


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run(fn, q, k, v, go):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(go.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize(
    "shape,chunk_bytes",
    [
        ((2, 6, 2, 40, 16), 16 << 20),  # one chunk, grouped-query heads (3 per K/V head)
        ((2, 6, 2, 40, 16), 16 * 1024),  # several chunks of queries, the last one shorter
        ((1, 4, 4, 70, 32), 24 * 1024),  # plain multi-head, T not a multiple of the chunk
    ],
)
def test_matches_float32_attention_as_closely_as_the_flash_kernel(monkeypatch, shape, chunk_bytes):
    monkeypatch.setattr(cpu_attention, "CHUNK_BYTES", chunk_bytes)
    B, H, K, T, D = shape
    chunks = cpu_attention._chunks(B, K, H // K, T)
    assert (len(chunks) > 1) == (chunk_bytes < 16 << 20)
    assert chunks[0][0] == 0 and chunks[-1][1] == T
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))  # no query twice or missed
    torch.manual_seed(0)
    q, k, v = torch.randn(B, H, T, D) * 2, torch.randn(B, K, T, D) * 2, torch.randn(B, K, T, D)
    go = torch.randn(B, H, T, D)
    gqa = H != K

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    ref = run(sdpa, q, k, v, go)
    bf = [t.bfloat16() for t in (q, k, v)]
    flash = run(sdpa, *bf, go)
    mine = run(cpu_attention.causal_attention, *bf, go)
    assert mine[0].dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in mine[1:])
    for name, m, f, r in zip(("out", "dq", "dk", "dv"), mine, flash, ref):
        # bf16 rounding of inputs, scores and probabilities: within 2% of the float32 result,
        # and never much worse than the kernel it replaces
        assert rel(m, r) < 2e-2, (name, rel(m, r), rel(f, r))
        assert rel(m, r) < 2 * rel(f, r) + 2e-3, (name, rel(m, r), rel(f, r))


def saved_by(q, k, v) -> list[torch.Tensor]:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        cpu_attention.causal_attention(q, k, v)
    return saved


def test_keeps_no_square_of_the_sequence_for_backward_above_the_limit(monkeypatch):
    B, H, K, T, D = 1, 4, 2, 64, 8
    q = torch.randn(B, H, T, D, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, K, T, D, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, K, T, D, dtype=torch.bfloat16, requires_grad=True)
    probs = 2 * B * H * T * T  # bf16 bytes, one chunk
    monkeypatch.setattr(cpu_attention, "KEEP_BYTES", probs - 1)
    saved = saved_by(q, k, v)
    assert len(saved) == 4 and max(t.numel() for t in saved) <= B * H * T * D  # q, k, v, out
    monkeypatch.setattr(cpu_attention, "KEEP_BYTES", probs)
    saved = saved_by(q, k, v)  # small enough: the probabilities too, (B, K, G, T, T) bf16
    assert len(saved) == 5 and saved[4].shape == (B, K, H // K, T, T)
    assert saved[4].dtype == torch.bfloat16


@pytest.mark.parametrize("chunk_bytes", [16 << 20, 16 * 1024])
def test_kept_and_recomputed_probabilities_give_the_same_bits(monkeypatch, chunk_bytes):
    """Backward takes the probabilities the forward kept or makes them again from the
    scores: the output and every gradient are the same bits either way, in one chunk or
    several, so the memory limit never changes a run's numbers."""
    monkeypatch.setattr(cpu_attention, "CHUNK_BYTES", chunk_bytes)
    torch.manual_seed(1)
    B, H, K, T, D = 2, 6, 2, 40, 16
    q, k, v = torch.randn(B, H, T, D) * 2, torch.randn(B, K, T, D) * 2, torch.randn(B, K, T, D)
    go = torch.randn(B, H, T, D)
    bf = [t.bfloat16() for t in (q, k, v)]
    monkeypatch.setattr(cpu_attention, "KEEP_BYTES", 1 << 30)
    kept = run(cpu_attention.causal_attention, *bf, go)
    monkeypatch.setattr(cpu_attention, "KEEP_BYTES", 0)
    made = run(cpu_attention.causal_attention, *bf, go)
    for a, b in zip(kept, made):
        assert torch.equal(a, b)


def test_every_bf16_whole_sequence_pass_on_a_cpu_takes_it_to_the_same_bits(monkeypatch):
    """With or without gradients (a DPO reference, GRPO's old policy and the policy must
    score a sequence alike: step 0's DPO loss is exactly log 2); float32 keeps torch's
    kernel and its bits; a pass with a KV cache (generation) keeps it too."""
    calls = []
    real = cpu_attention.causal_attention
    monkeypatch.setattr(
        cpu_attention, "causal_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    torch.manual_seed(0)
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    layers.attend(q, k, v)  # float32
    cache = layers.KVCache(1, 1, 2, 8, 4, torch.device("cpu"), torch.bfloat16)
    with torch.no_grad():
        layers.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), cache=cache)
    assert calls == []
    trained = layers.attend(q.bfloat16(), k.bfloat16(), v.bfloat16())
    with torch.no_grad():
        scored = layers.attend(q.bfloat16(), k.bfloat16(), v.bfloat16())
    with torch.inference_mode():
        inferred = layers.attend(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert calls == [1, 1, 1] and trained.dtype == torch.bfloat16
    assert torch.equal(trained.detach(), scored) and torch.equal(scored, inferred)


def test_a_long_sequence_never_allocates_its_square(monkeypatch):
    """Scores, mask and probabilities exist a chunk of queries at a time: T=2048 with
    256 KiB chunks allocates nothing near T x T float32 (16 MiB) in forward or backward."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(cpu_attention, "CHUNK_BYTES", 256 << 10)
    T = 2048
    q = torch.randn(1, 2, T, 8, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 1, T, 8, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 1, T, 8, dtype=torch.bfloat16, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        cpu_attention.causal_attention(q, k, v).sum().backward()
    biggest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < biggest <= 2 << 20, biggest  # a chunk's float32 scores, not 16 MiB


@pytest.mark.parametrize("chunk_bytes", [16 << 20, 8 * 1024])
def test_queries_after_a_padded_prefix_match_float32_attention(monkeypatch, chunk_bytes):
    """causal_attention with `past` and `pad` (GRPO's completions over their prompt's kept
    keys, PrefixKV): the queries sit after `past` key slots, each row sees none before its
    own left padding.
    Output and gradients are as near the float32 masked attention as torch's bf16 kernel
    with the same mask, in one chunk of queries or several; a padded slot gets no gradient."""
    monkeypatch.setattr(cpu_attention, "CHUNK_BYTES", chunk_bytes)
    torch.manual_seed(2)
    B, H, K, past, T, D = 3, 6, 2, 11, 30, 16
    assert (len(cpu_attention._chunks(B, K, H // K, T, past)) > 1) == (chunk_bytes < 16 << 20)
    pad = torch.tensor([0, 4, 9])
    q = torch.randn(B, H, T, D) * 2
    k, v = torch.randn(B, K, past + T, D) * 2, torch.randn(B, K, past + T, D)
    go = torch.randn(B, H, T, D)
    kpos, qpos = torch.arange(past + T), past + torch.arange(T)[:, None]
    mask = (kpos <= qpos) & (kpos >= pad[:, None, None, None])  # (B, 1, T, S)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    ref = run(sdpa, q, k, v, go)
    bf = [t.bfloat16() for t in (q, k, v)]
    flash = run(sdpa, *bf, go)
    mine = run(lambda q, k, v: cpu_attention.causal_attention(q, k, v, None, past, pad), *bf, go)
    for name, m, f, r in zip(("out", "dq", "dk", "dv"), mine, flash, ref):
        assert rel(m, r) < 2e-2, (name, rel(m, r), rel(f, r))
        assert rel(m, r) < 2 * rel(f, r) + 2e-3, (name, rel(m, r), rel(f, r))
    for g in mine[2:]:  # dk, dv: nothing reaches a row's padded slots
        assert all(not g[b, :, : int(pad[b])].any() for b in range(B))
