"""DDP over a memory-mapped quantized base: the frozen base is never broadcast, so no
rank gets a private copy of the GGUF's pages (the map is copy-on-write: one write, even
of the same bytes, makes a page private to the process). Measured per rank from
/proc/self/smaps: the Private_Dirty of the GGUF file's mappings before DDP wraps the
model, and after it wrapped it and after the last step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/smaps").exists(), reason="needs Linux /proc/self/smaps"
)

# Runs under torchrun: `toy train` as the CLI runs it, with the loop's DDP wrapping and its
# run watched. Each rank writes what it measured to $PROBE_OUT/rank-N.json.
PROBE = r'''
import json, os, sys
from toy.cli.main import main
from toy.train import loop

GGUF = os.path.realpath(os.environ["PROBE_GGUF"])


def dirty_kb():
    """Private_Dirty (kB) summed over this process's mappings of the GGUF file."""
    total, ours = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                ours = len(head) >= 6 and head[5] == GGUF
            elif ours and line.startswith("Private_Dirty:"):
                total += int(head[1])
    return total


seen = {}
wrap, run = loop.Trainer._wrap, loop.Trainer.run


def watched_wrap(self):
    seen["before"] = dirty_kb()
    out = wrap(self)
    seen["wrapped"] = dirty_kb()
    return out


def watched_run(self, *a, **k):
    out = run(self, *a, **k)
    seen["trained"] = dirty_kb()
    return out


loop.Trainer._wrap, loop.Trainer.run = watched_wrap, watched_run
code = main(sys.argv[1:])
rank = os.environ["RANK"]
with open(os.path.join(os.environ["PROBE_OUT"], f"rank-{rank}.json"), "w") as f:
    json.dump({"code": code, **seen}, f)
sys.exit(code)
'''


@pytest.fixture(scope="module")
def quant_base(tmp_path_factory):
    """A tiny llama GGUF of a few MB, every matrix quantized (Q8_0, the MLPs Q4_0), and a
    token corpus made with its tokenizer."""
    from helpers.gguf_fixtures import gguf_name, tiny_model, write_llama_gguf

    from toy.cli.main import main
    from toy.data.prep import bundled_text_paths
    from toy.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("ddpmem")
    text = bundled_text_paths()[0].read_text()[:40000]
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    model = tiny_model(
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        n_layer=4,
        d_model=256,
        n_head=4,
        n_kv_head=2,
        d_ff=768,
        max_seq_len=128,
    )
    qtypes = {
        gguf_name(n): ("Q4_0" if "mlp" in n else "Q8_0")
        for n, p in model.named_parameters()
        if p.dim() == 2
    }
    gguf = write_llama_gguf(d / "base.gguf", model, tok, qtypes=qtypes)
    assert (
        main(
            [
                "prep",
                str(bundled_text_paths()[1]),
                "--out",
                str(d / "t.bin"),
                "--tokenizer",
                str(gguf),
            ]
        )
        == 0
    )
    return {"gguf": gguf, "tokens": d / "t.bin", "dir": d}


def quantized_bytes(path: Path) -> int:
    from toy.formats.gguf_header import read_gguf_header

    h = read_gguf_header(path)
    return sum(
        ti.nbytes for ti in h.tensors.values() if ti.qtype.name not in ("F32", "F16", "BF16")
    )


def test_ddp_leaves_the_mapped_base_shared(quant_base, tmp_path):
    base = quantized_bytes(quant_base["gguf"])
    assert (
        base > 2_000_000
    )  # the effect measured is the base's size: make it stand out of the noise
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "ranks"
    out.mkdir()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOY_DIST_TIMEOUT": "240",
        "PROBE_GGUF": str(quant_base["gguf"]),
        "PROBE_OUT": str(out),
    }
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--standalone",
            str(probe),
            "train",
            "--recipe",
            "lora",
            "--model",
            quant_base["gguf"],
            "--base-dtype",
            "quantized",
            "--corpus",
            quant_base["tokens"],
            "--seq-len",
            "64",
            "--batch-size",
            "2",
            "--steps",
            "2",
            "--eval-batches",
            "1",
            "--warmup",
            "0",
            "--out",
            tmp_path / "runs",
            "--run-id",
            "m",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        seen = json.loads((out / f"rank-{rank}.json").read_text())
        assert seen["code"] == 0
        # Grown by a few pages at most, never by the base's size (it did by all of it:
        # DDP broadcast every buffer into the copy-on-write map at start-up).
        for when in ("wrapped", "trained"):
            grown = (seen[when] - seen["before"]) * 1024
            assert grown < 0.05 * base, (rank, when, grown, base, seen)


def test_ddp_losses_on_a_quantized_base_match_one_process(quant_base, tmp_path, toy_run):
    """The frozen base left out of DDP's start-up broadcast: 2 processes still train as 1
    on the same global batch."""

    args = [
        "train",
        "--recipe",
        "lora",
        "--model",
        quant_base["gguf"],
        "--base-dtype",
        "quantized",
        "--corpus",
        quant_base["tokens"],
        "--seq-len",
        "64",
        "--steps",
        "3",
        "--eval-batches",
        "1",
        "--warmup",
        "0",
        "--lr",
        "1e-2",
        "--precision",  # processes and one process agree to 1e-5 only in float32
        "float32",
        "--json",
        "--out",
        tmp_path,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOY_DIST_TIMEOUT": "240"}
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--standalone",
            "-m",
            "toy",
            *map(str, args),
            "--batch-size",
            "2",
            "--run-id",
            "two",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    one = toy_run(*args, "--batch-size", "4", "--run-id", "one")  # one process: this one
    assert one.returncode == 0, one.stderr[-3000:]
    a = [x["loss"] for x in json.loads(two.stdout.strip().splitlines()[-1])["losses"]]
    b = [x["loss"] for x in json.loads(one.stdout.strip().splitlines()[-1])["losses"]]
    assert len(a) == 3 and np.allclose(a, b, rtol=1e-5, atol=0), (a, b)
