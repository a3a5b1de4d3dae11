"""--eval-batches N for chat data (issue 23 item 8): every held-out batch was evaluated
whatever N was. Now at most N length-grouped batches, a fixed sample spread over the
validation set's lengths, the same every evaluation and every run."""

from __future__ import annotations

import pytest
import torch
from helpers.gguf_fixtures import tiny_model, write_llama_gguf  # noqa: E402

from toy.data.dialogue import conversations, write_jsonl  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from toy.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("chat-evals")
    text = bundled_text_paths()[0].read_text()[:40000]
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    model = tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True), max_seq_len=256)
    gguf = write_llama_gguf(d / "base.gguf", model, tok)
    convs = conversations(bundled_text_paths(), 60, seed=2, turns=(1, 2), max_chars=200)
    return {
        "gguf": gguf,
        "chat": write_jsonl(convs[:20], d / "chat.jsonl"),
        "val": write_jsonl(convs[20:], d / "val.jsonl"),
    }


def _evals(base, n: int) -> list[dict[str, torch.Tensor]]:
    from toy.recipes import lora
    from toy.runs import Project

    cfg = lora.RECIPE.config(
        model=str(base["gguf"]),
        data=str(base["chat"]),
        val_data=str(base["val"]),
        seq_len=128,
        batch_size=1,
        steps=1,
        eval_batches=n,
    )
    return lora.build(cfg, Project(root=None)).job.eval_batches()


def test_spread_sample_is_spread_and_deterministic():
    from toy.data.chat import spread_sample

    assert spread_sample(10, 1) == [5]
    assert spread_sample(10, 3) == [1, 5, 8]
    assert spread_sample(10, 10) == list(range(10)) and spread_sample(4, 9) == [0, 1, 2, 3]
    for n in range(1, 40):
        for k in range(1, n + 1):
            s = spread_sample(n, k)
            assert len(set(s)) == k and s == sorted(s) and 0 <= s[0] and s[-1] < n


def test_chat_eval_batches_honours_the_flag_with_a_spread_sample(base):
    every = _evals(base, 1000)
    assert len(every) > 6  # enough held-out batches for the flag to matter
    widths = sorted(b["ids"].shape[1] for b in every)
    for n in (1, 3):
        picked = _evals(base, n)
        assert len(picked) == n
        again = _evals(base, n)
        assert all(torch.equal(a["ids"], b["ids"]) for a, b in zip(picked, again))  # deterministic
        for b in picked:  # each is one of the held-out batches, whole
            assert any(
                torch.equal(b["ids"], e["ids"]) and torch.equal(b["targets"], e["targets"])
                for e in every
            )
    # Spread over the lengths: the sample of 3 has a shorter and a longer batch than the median.
    w = sorted(b["ids"].shape[1] for b in _evals(base, 3))
    median = widths[len(widths) // 2]
    assert w[0] <= median <= w[-1] and w[0] < w[-1]


def test_a_chat_run_evaluates_eval_batches_batches(base, toy_cli, tmp_path, monkeypatch):
    from toy.train import loop

    seen = []
    real = loop.evaluate

    def counting(job, batches, *a, **k):
        seen.append(len(batches))
        return real(job, batches, *a, **k)

    monkeypatch.setattr(loop, "evaluate", counting)
    code, _, err = toy_cli(
        "train",
        "--recipe",
        "lora",
        "--model",
        base["gguf"],
        "--data",
        base["chat"],
        "--val-data",
        base["val"],
        "--seq-len",
        "128",
        "--batch-size",
        "1",
        "--steps",
        "2",
        "--warmup",
        "0",
        "--eval-every",
        "1",
        "--eval-batches",
        "1",
        "--out",
        tmp_path,
        "--json",
    )
    assert code == 0, err
    assert seen == [1, 1, 1]  # before step 1, after steps 1 and 2
