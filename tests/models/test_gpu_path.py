"""The GPU path's costs, checked on CPU by counting what the dispatcher sees: casts
(`aten._to_copy`) under bf16 autocast, and reads of a tensor's value by the host
(`aten._local_scalar_dense`: .item(), bool(), int(); `aten.nonzero`: boolean masks).
On CUDA each cast is memory traffic and each read a host sync that stalls the queue;
the same calls happen, in the same places, on CPU."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from toy.data.chat import to_batch
from toy.lora import apply_lora
from toy.models import losses
from toy.models.llama import Llama, LlamaConfig
from toy.runs import EventLog
from toy.train.config import RunConfig
from toy.train.job import Job, lm_loss, lm_prepare
from toy.train.loop import Trainer
from toy.train.progress import Reporter

V, C = 96, 32
READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default)


class FnJob(Job):
    """A job of token batches made by `batches(k)`: the default LM loss."""

    def __init__(self, model, batches):
        super().__init__("t", model)
        self.batches = batches

    def micro_batch(self, k, live=None):
        return self.batches(k)


class Dispatch(TorchDispatchMode):
    """Counts casts per source tensor storage and host reads."""

    def __init__(self, ignore_reads_of=()):
        super().__init__()
        self.casts: Counter = Counter()  # data_ptr of the tensor cast -> times
        self.reads = 0
        self.ignore = {t.data_ptr() for t in ignore_reads_of}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            self.casts[args[0].data_ptr()] += 1
        elif func in READS and args[0].data_ptr() not in self.ignore:
            self.reads += 1
        return func(*args, **kwargs)


def tiny(seed=0) -> Llama:
    torch.manual_seed(seed)
    return Llama(
        LlamaConfig(
            vocab_size=V, d_model=C, n_layer=2, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=64
        )
    )


def batch(k=0, rows=4, T=32, prompt=5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    ids = torch.randint(0, V, (rows, T + 1), generator=g)
    targets = ids[:, 1:].clone()
    targets[:, :prompt] = -100  # a prompt: not every position is supervised
    return {"ids": ids[:, :-1], "targets": targets}


def small_chunks(monkeypatch):
    # 16 rows a chunk: the 4 x 27 supervised rows below take 7 chunks.
    monkeypatch.setattr(losses, "CHUNK_BYTES", 16 * 4 * V)
    assert losses.chunk_rows(V) == 16


def test_autocast_casts_the_trained_vocabulary_matrix_once_per_step(monkeypatch):
    small_chunks(monkeypatch)
    m = tiny()
    head = m.lm_head.weight  # tied to the embedding, trained
    b = lm_prepare(batch())
    with Dispatch() as d:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = lm_loss(m, b)
        loss.backward()
    assert d.casts[head.data_ptr()] <= 1, d.casts[head.data_ptr()]
    assert head.grad is not None and torch.isfinite(head.grad).all()


def test_autocast_cast_once_for_a_frozen_head_and_a_bf16_base_never_cast(monkeypatch):
    """LoRA as CUDA runs it: the base held in bf16 (--base-dtype bfloat16, cuda's
    default), adapters in float32, under bf16 autocast. The base weights are never
    cast (a float32 base would be cast again in every forward: autocast does not cache
    frozen tensors), and the frozen head at most once."""
    small_chunks(monkeypatch)
    m = tiny().to(torch.bfloat16)
    apply_lora(m, ["q_proj", "v_proj"], 4, 8.0, 0.0, 0)
    for n, p in m.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()
    base = [
        p
        for n, p in m.named_parameters()
        if not p.requires_grad and p.dim() == 2 and p is not m.lm_head.weight
    ]
    assert base
    b = lm_prepare(batch())
    with Dispatch() as d:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = lm_loss(m, b)
        loss.backward()
    assert sum(d.casts[p.data_ptr()] for p in base) == 0, "a bf16 base weight was cast"
    assert d.casts[m.lm_head.weight.data_ptr()] <= 1
    assert all(p.grad is not None for n, p in m.named_parameters() if "lora_" in n)


def test_the_cast_once_head_gives_autocasts_loss_and_gradients(monkeypatch):
    """Casting once, with autocast off inside, computes what autocast's per-chunk casts
    did: bf16 matmuls, float32 softmax and accumulation."""
    small_chunks(monkeypatch)
    g = torch.Generator().manual_seed(1)
    h0, w0 = torch.randn(100, C, generator=g), torch.randn(V, C, generator=g) * 0.2
    t = torch.randint(0, V, (100,), generator=g)
    t[::7] = -100
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = losses.linear_cross_entropy(h, w, t)
    loss.backward()
    hr, wr = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(
        (hr.bfloat16() @ wr.bfloat16().T).float(), t, reduction="sum"
    )
    ref.backward()
    torch.testing.assert_close(loss.float(), ref, rtol=1e-3, atol=0)
    torch.testing.assert_close(h.grad, hr.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad, wr.grad, rtol=2e-2, atol=2e-2)


def test_lm_loss_reads_nothing_back_from_the_device_for_a_prepared_batch():
    m = tiny()
    raw = batch()
    with Dispatch() as d:
        loss, _ = lm_loss(m, lm_prepare(raw))
        loss.backward()
    assert d.reads == 0
    # The check can fail: an unprepared batch with a prompt is masked on the device.
    with Dispatch() as d:
        lm_loss(m, raw)
    assert d.reads >= 1
    # ... and both give the same loss, bit for bit.
    torch.manual_seed(0)
    assert torch.equal(lm_loss(m, raw)[0], lm_loss(m, lm_prepare(raw))[0])


def test_a_training_step_reads_the_device_once(monkeypatch):
    """One optimizer step of 2 micro-batches: the loss and the gradient norm, read together
    at the end, are the only read of a tensor's value (AdamW's step counters are host
    tensors by design: not counted). Tensor.tolist reads without a dispatched op: counted
    here by hand."""
    m = tiny()
    job = FnJob(m, batch)
    tr = Trainer(
        job,
        RunConfig(steps=3, grad_accum=2, warmup=0),
        None,
        torch.device("cpu"),
        EventLog(None),
        Reporter(),
    )
    tr.step(1)
    steps = [s["step"] for s in tr.opt.state.values()]
    real = torch.Tensor.tolist

    def tolist(t):
        d.reads += 1
        return real(t)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    with Dispatch(ignore_reads_of=steps) as d:
        loss, items, lr, grad_norm = tr.step(2)
    assert d.reads == 1, d.reads
    assert items == 2 * 4 * 32 and loss > 0 and grad_norm > 0


def test_prefetch_never_changes_the_batches():
    """The next step's batches are made during the step before; they are the ones a
    fresh fetch gives (batches are a pure function of the step)."""
    m = tiny()
    seen = []

    def micro(k):
        seen.append(k)
        return batch(k)

    job = FnJob(m, micro)
    tr = Trainer(
        job,
        RunConfig(steps=3, grad_accum=2, warmup=0),
        None,
        torch.device("cpu"),
        EventLog(None),
        Reporter(),
    )
    tr.step(1)
    assert seen == [0, 1, 2, 3] and tr._next[0] == 2  # step 2's micro-batches 2, 3 already made
    got = tr._take_batches(2)
    for a, b in zip(got, [lm_prepare(batch(2)), lm_prepare(batch(3))]):
        assert all(torch.equal(a[k], b[k]) for k in b)


def test_compile_buckets_chat_lengths_to_a_few_shapes_without_changing_the_loss():
    m = tiny()
    g = torch.Generator().manual_seed(0)
    widths, losses_eq = set(), []
    for n in (7, 20, 33, 50, 63):
        samples = [
            (torch.randint(0, V, (n + j,), generator=g).tolist(), [0] * 3 + [1] * (n + j - 3))
            for j in range(3)
        ]
        plain, bucketed = to_batch(samples, 0), to_batch(samples, 0, bucket=16, seq_len=64)
        widths.add(bucketed["ids"].shape[1])
        assert (
            bucketed["ids"].shape[1] % 16 == 0 and bucketed["ids"].shape[1] >= plain["ids"].shape[1]
        )
        a, b = lm_loss(m, lm_prepare(plain))[0], lm_loss(m, lm_prepare(bucketed))[0]
        losses_eq.append(torch.allclose(a, b, rtol=1e-5))
    assert widths == {16, 32, 48, 64} and all(losses_eq)
    # Never wider than the model's context.
    long = [(list(range(60)), [1] * 60)]
    assert to_batch(long, 0, bucket=64, seq_len=62)["ids"].shape[1] == 62


def test_a_cuda_head_takes_few_large_chunks():
    """On CUDA a chunk costs launches and Python (GPT-2 124M's head took 198 chunks a step of
    16 MB and was CPU-bound on an H100); a CPU keeps cache-sized chunks."""
    v, rows = 50304, 16 * 1024  # GPT-2's vocabulary, B16 x T1024
    cpu, cuda = losses.chunk_rows(v), losses.chunk_rows(v, torch.device("cuda"))
    assert cpu * 4 * v <= losses.CHUNK_BYTES and -(-rows // cpu) > 100
    assert -(-rows // cuda) <= 8


# ---------------------------------------------------------------- a CPU with bf16 units
# toy's default there (issue 33): bf16 autocast, the same casts as on CUDA, and each one
# is memory traffic on the CPU too.


class ForwardCasts(TorchDispatchMode):
    """Forward only (tensors alive, so a storage is one tensor): casts per source, and
    the float32 tensors made, by element count."""

    def __init__(self):
        super().__init__()
        self.casts: Counter = Counter()
        self.made_f32: Counter = Counter()
        self.keep: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            self.casts[args[0].data_ptr()] += 1
            self.keep.append(args[0])  # alive: a freed chunk's address is not reused
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.made_f32[t.numel()] += 1
        return out


def test_cpu_bf16_forward_casts_each_tensor_once():
    """A norm's output feeds q, k and v (and gate, up): cast once in the norm, not once per
    consumer; the rotary tables once per forward, not per layer."""
    m = tiny()
    b = lm_prepare(batch())
    with ForwardCasts() as d:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lm_loss(m, b)
    assert d.casts and max(d.casts.values()) == 1, sorted(d.casts.values())


def test_cpu_bf16_quantized_base_is_dequantized_straight_to_bf16():
    """A LoRA layer over GGUF blocks under CPU bf16 autocast: no float32 weight is made
    (dequantized straight into bf16), its input is cast once for the base and the adapter,
    and the gradient still reaches the adapter."""
    import gguf

    from toy.lora import LoRALinear
    from toy.models.quant import QuantLinear, QuantSpec

    out_f, in_f = 48, 64
    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(0))
    for qtype in (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0):
        raw = torch.from_numpy(gguf.quants.quantize(w.numpy(), qtype))
        base = QuantLinear(raw, QuantSpec(int(qtype), (out_f, in_f)))
        layer = LoRALinear.from_linear(base, 4, 8.0, 0.0, torch.Generator().manual_seed(0))
        x = torch.randn(5, in_f)  # float32, as a residual stream is
        with ForwardCasts() as d:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = layer(x)
        assert y.dtype == torch.bfloat16
        assert d.made_f32[out_f * in_f] == 0, "a float32 copy of the weight was made"
        assert d.casts[x.data_ptr()] == 1, d.casts[x.data_ptr()]
        y.float().sum().backward()
        assert layer.lora_B.grad is not None and torch.isfinite(layer.lora_B.grad).all()
        # B starts at zero: the output is the base's, a bf16 matmul on the bf16 weight
        ref = torch.nn.functional.linear(x.bfloat16(), base.dequantized().bfloat16())
        assert torch.equal(y, ref)


class Matmuls(TorchDispatchMode):
    """The dtypes of every matmul's inputs."""

    def __init__(self):
        super().__init__()
        self.dtypes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (
            torch.ops.aten.mm,
            torch.ops.aten.addmm,
            torch.ops.aten.addmm_,
            torch.ops.aten.bmm,
        ):
            self.dtypes[args[-1].dtype] += 1
        return func(*args, **(kwargs or {}))


def test_cpu_bf16_every_matmul_of_a_step_runs_in_bf16(monkeypatch):
    """Forward and backward, the trained head's weight gradient included (a float32
    matmul there was a third of the head's work on a CPU with bf16 units)."""
    small_chunks(monkeypatch)
    m = tiny()
    b = lm_prepare(batch())
    with Matmuls() as d:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = lm_loss(m, b)
        loss.backward()
    assert d.dtypes[torch.bfloat16] > 0 and d.dtypes[torch.float32] == 0, d.dtypes
