"""A base held dequantized (`--base-dtype float32`, bfloat16) holds one copy of each weight:
no second float copy, no heap holes left by whole-weight transients, and the file's blocks
leave the process once read (base_readers.held_as). docs/performance.md has the figures."""

import mmap
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.quant import (  # noqa: E402
    T,
    quant_gguf,  # noqa: E402,F401
    random_blocks,
)

from toy.formats import gguf  # noqa: E402
from toy.formats.base import QuantTensor  # noqa: E402
from toy.formats.base_readers import held_as, read_base  # noqa: E402
from toy.models.quant import QuantSpec, dequantize_held, dequantize_weight  # noqa: E402

PAGE = mmap.PAGESIZE


def _present_pages(t: torch.Tensor) -> int | None:
    """How many of the pages wholly inside t are mapped in this process (/proc/self/pagemap:
    bit 63 of each page's entry); None where that cannot be read."""
    start = -(-t.data_ptr() // PAGE)
    end = (t.data_ptr() + t.numel() * t.element_size()) // PAGE
    try:
        with open("/proc/self/pagemap", "rb") as fh:
            fh.seek(8 * start)
            entries = np.frombuffer(fh.read(8 * (end - start)), dtype=np.uint64)
    except OSError:
        return None
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum())


@pytest.mark.parametrize(
    "qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K, T.F16], ids=lambda t: t.name
)
@pytest.mark.parametrize("qk_heads", [0, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_weight_made_in_pieces_is_the_whole_weight(qtype, qk_heads, dtype):
    """Pieces of 1, 3 (a short last piece), 2 heads' and all rows give dequantize_weight's
    bits, Q/K's rows un-interleaved head by head."""
    rows, cols = 32, 256
    if qtype == T.F16:
        raw = torch.randn(rows, cols, generator=torch.Generator().manual_seed(5)).half()
        raw = raw.view(torch.uint8)
    else:
        scales = np.array([0x3C00, 0x2E66, 0xB266], dtype=np.uint16)  # 1, 0.1, -0.2
        raw = torch.from_numpy(random_blocks(qtype, rows, cols, scales, 5))
    spec = QuantSpec(int(qtype), (rows, cols), qk_heads)
    want = dequantize_weight(raw, spec, dtype)
    for piece_bytes in (1, 3 * 4 * cols, 2 * (rows // 4) * 4 * cols, 1 << 20):
        got = dequantize_held(raw, spec, dtype, piece_bytes)
        assert got.dtype == dtype and got.is_contiguous()
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got.view(bits), want.view(bits)), piece_bytes


def test_the_float32_model_holds_each_weight_once(quant_gguf):
    """The model toy infer generates with from a GGUF in float32: its parameters' storages
    add up to the base's float32 size (the tied head shares the embedding's), and none of
    them is a view of the file's map."""
    probe = read_base(quant_gguf, "quantized")
    size = probe.float32_bytes()
    model = held_as(probe, Path(quant_gguf), "float32").build_model()
    storages = {p.untyped_storage().data_ptr(): p for p in model.parameters()}
    assert all(p.dtype == torch.float32 for p in storages.values())
    assert sum(p.untyped_storage().nbytes() for p in storages.values()) == size
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()


def test_held_as_drops_the_blocks_pages_and_keeps_their_bytes(quant_gguf):
    """Once dequantized, a block tensor's pages of the file's map are no longer in this
    process (Linux: /proc/self/pagemap); read again, they are the file's bytes unchanged."""
    probe = read_base(quant_gguf, "quantized")
    blocks = {n: t.parts[0] for n, t in probe.state_dict.items() if isinstance(t, QuantTensor)}
    big = max(blocks.values(), key=lambda b: b.numel())  # the embedding: several pages
    copies = {n: b.clone() for n, b in blocks.items()}  # reads every page into the process
    if _present_pages(big) in (None, 0):
        pytest.skip("this process's page map cannot be read here")
    held_as(probe, Path(quant_gguf), "float32")
    assert _present_pages(big) == 0
    for n, b in blocks.items():
        assert torch.equal(b, copies[n]), n


def test_dropping_pages_leaves_memory_outside_the_map_alone(quant_gguf):
    """The dropper touches only the file's own map: a tensor elsewhere (the heap, where
    MADV_DONTNEED would zero it) keeps its values."""
    probe = read_base(quant_gguf, "quantized")
    assert probe.drop_pages is not None
    t = torch.ones(64 * PAGE)  # 256 pages, not in the map
    probe.drop_pages(t)
    assert bool((t == 1).all())
    assert held_as(probe, Path(quant_gguf), "float32").drop_pages is None
    assert read_base(quant_gguf, "float32").drop_pages is None


def test_a_page_dropper_over_a_map_drops_what_lies_inside(tmp_path):
    path = tmp_path / "bytes.bin"
    data = np.arange(16 * PAGE, dtype=np.uint8)
    data.tofile(path)
    buf = np.memmap(path, dtype=np.uint8, mode="c")
    t = torch.from_numpy(buf[PAGE // 2 :])  # 15 whole pages inside, half a page before
    assert torch.equal(t, torch.from_numpy(data[PAGE // 2 :]))
    if _present_pages(t) in (None, 0):
        pytest.skip("this process's page map cannot be read here")
    gguf.page_dropper(buf)(t)
    assert _present_pages(t) == 0
    assert torch.equal(t, torch.from_numpy(data[PAGE // 2 :]))
