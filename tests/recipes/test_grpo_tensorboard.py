"""GRPO's completions in TensorBoard (issue 58 item 1): with --report-to tensorboard the
rows completions.jsonl holds (each step's first completions, each evaluation's held-out
ones) are text summaries too, train/completions and eval/completions at their steps, read
back here with TensorBoard's own reader."""

from __future__ import annotations

import json

from helpers.common import run_toy
from helpers.gguf_fixtures import tiny_model, write_llama_gguf

from toy.data.arith import make_arith
from toy.data.prep import bundled_text_paths
from toy.tokenizer import train_bpe


def test_completions_reach_tensorboard_as_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    text = bundled_text_paths()[0].read_text()[:30000] + " 0 1 2 3 4 5 6 7 8 9 + - = ?"
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    base = write_llama_gguf(tmp_path / "b.gguf", tiny_model(vocab_size=402, max_seq_len=256), tok)
    make_arith(tmp_path / "arith", 40, 8, seed=0)
    r = run_toy("train", "--recipe", "grpo", "--model", base, "--data", tmp_path / "arith",
                "--reward", "length", "--num-generations", "4", "--max-completion-length", "8",
                "--seq-len", "96", "--steps", "2", "--eval-every", "2", "--eval-batches", "1",
                "--threads", "1", "--report-to", "tensorboard", "--out", tmp_path,
                "--run-id", "g")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "g"
    rows = [json.loads(x) for x in (run / "completions.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    tags = set(acc.Tags()["tensors"])  # torch names a text summary TAG/text_summary
    assert {"train/completions/text_summary", "eval/completions/text_summary"} <= tags
    for split, steps in (("train", [1, 2]), ("eval", [0, 2])):
        events = acc.Tensors(f"{split}/completions/text_summary")
        assert [e.step for e in events] == steps
        for e in events:
            table = e.tensor_proto.string_val[0].decode()
            assert table.splitlines()[0] == "| prompt | completion | reward | length |"
            mine = [x for x in rows if x["split"] == split and x["step"] == e.step]
            assert len(table.splitlines()) == 2 + len(mine)
            for x, line in zip(mine, table.splitlines()[2:]):
                assert line.startswith("| " + "<br>".join(x["prompt"].splitlines()) + " | ")
                assert f" | {json.dumps(x['reward'])} | " in line
                # the completion whole, its line breaks <br>, its | and \\ escaped (Markdown)
                c = x["completion"].replace("\\", "\\\\").replace("|", "\\|")
                assert f" | {'<br>'.join(c.splitlines())} | " in line
