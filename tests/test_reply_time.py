"""The time to a whole reply (issue 33 item 3, issue 35 item 3): one token's attention runs
on one thread, `auto` picks float32 or packed by the expected work, and `toy infer`
reports the time to its first token and its tokens/s."""

import torch

from toy.models import layers


def test_one_tokens_attention_runs_on_one_thread_and_restores_the_count(monkeypatch):
    seen = []
    sdpa = layers.F.scaled_dot_product_attention

    def spy(*a, **k):
        seen.append(torch.get_num_threads())
        return sdpa(*a, **k)

    monkeypatch.setattr(layers.F, "scaled_dot_product_attention", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(0)
        cache = layers.KVCache(1, 1, 2, 16, 8, torch.device("cpu"), torch.float32)
        q, k, v = (torch.randn(1, n, 5, 8, generator=g) for n in (4, 2, 2))
        layers.attend(q, k, v, cache)  # a prompt: every thread
        cache.pos = 5  # the model advances it after every layer has written
        q1, k1, v1 = (torch.randn(1, n, 1, 8, generator=g) for n in (4, 2, 2))
        got = layers.attend(q1, k1, v1, cache)  # one token: one thread
        assert seen == [2, 1]
        assert torch.get_num_threads() == 2
        keys, values = cache.k[0][:, :, :6], cache.v[0][:, :, :6]
        want = sdpa(q1, keys, values, enable_gqa=True)
        assert torch.equal(got, want)
    finally:
        torch.set_num_threads(before)
