"""Long sums in fixed runs (models/ordered.py): a float32 adapter's gradients and a head's
gradients are the same bytes at any thread count (the busy-machine rule changes the count
within a run), and autograd's own bytes where a sum is a single run.

The shapes are ones whose plain products MKL split by thread count on Intel AMX (an
adapter's weight gradient over 3000 tokens, a head's input gradient over 8192 rows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from toy.lora import LoRALinear
from toy.models.losses import linear_cross_entropy, token_logprobs
from toy.models.ordered import SUM_RUN, ordered_mm


@pytest.fixture
def on_threads():
    """fn() run at 1, 2 and 3 threads: its three answers (the count restored after)."""
    was = torch.get_num_threads()

    def run(fn):
        out = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out.append(fn())
        return out

    yield run
    torch.set_num_threads(was)


def _same(answers) -> bool:
    first = answers[0]
    return all(all(torch.equal(a, b) for a, b in zip(first, other)) for other in answers[1:])


def test_one_run_is_the_plain_product_and_a_long_sum_is_its_value():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(40, SUM_RUN, generator=g), torch.randn(SUM_RUN, 24, generator=g)
    assert torch.equal(ordered_mm(a, b), a @ b)
    a, b = torch.randn(40, 3000, generator=g), torch.randn(3000, 24, generator=g)
    out = ordered_mm(a, b)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, (a.double() @ b.double()).float(), rtol=1e-5, atol=1e-4)


def _adapter(tokens: int):
    torch.manual_seed(0)
    m = LoRALinear.from_linear(nn.Linear(576, 576, bias=False), 8, 16, 0.0)
    with torch.no_grad():
        m.lora_B.normal_(0, 0.02)
    x = torch.randn(2, tokens // 2, 576, requires_grad=True)
    return m, x


def test_a_float32_adapters_gradients_do_not_depend_on_the_thread_count(on_threads):
    m, x = _adapter(3000)

    def grads():
        m.zero_grad(set_to_none=True)
        x.grad = None
        (m(x) ** 2).mean().backward()
        return m.lora_A.grad, m.lora_B.grad, x.grad

    assert _same(on_threads(grads))


def test_an_adapter_of_one_run_of_tokens_is_autograds_own_bytes():
    m, x = _adapter(2 * (SUM_RUN // 2))
    (m(x) ** 2).mean().backward()
    mine = m.lora_A.grad, m.lora_B.grad, x.grad
    a = m.lora_A.detach().requires_grad_()
    b = m.lora_B.detach().requires_grad_()
    x2 = x.detach().requires_grad_()
    y = F.linear(x2, m.weight) + F.linear(F.linear(x2, a), b) * m.scaling
    (y**2).mean().backward()
    assert all(torch.equal(p, q) for p, q in zip(mine, (a.grad, b.grad, x2.grad)))


def test_a_heads_gradients_do_not_depend_on_the_thread_count(on_threads):
    torch.manual_seed(0)
    h = torch.randn(600, 64, requires_grad=True)
    head = nn.Linear(64, 8192, bias=False).requires_grad_(False)
    targets = torch.randint(0, 8192, (600,))
    trained = nn.Parameter(head.weight.detach().clone())

    def grads():
        h.grad = trained.grad = None
        token_logprobs(h, head, targets).sum().backward()
        frozen = h.grad
        h.grad = None
        linear_cross_entropy(h, trained, targets).backward()
        return frozen, h.grad, trained.grad

    assert _same(on_threads(grads))
