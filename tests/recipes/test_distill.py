"""`toy train --recipe distill` (issue 56), through the command line on tiny llama GGUFs that
share a tokenizer: the loss equal to TRL's GKDTrainer.generalized_jsd_loss (values and
gradients, beta 0, 0.5, 1, temperature != 1), chunked; a shrunk copy of the teacher
trained, its figures shown, its final/ exported as a GGUF (llama.cpp loads it and gives
toy's greedy text); a LoRA student whose --ce-weight 1 run is lora's run byte for byte;
SIGKILL and --resume give the unbroken run's lines; bad input is one line, exit 2."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.common import run_toy
from helpers.gguf_fixtures import tiny_model, write_llama_gguf  # noqa: E402
from helpers.runs import step_lines, wait_for_checkpoint  # noqa: E402

from toy.data.dialogue import conversations, write_jsonl  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402
from toy.tokenizer import train_bpe  # noqa: E402

RUN = ["--data", None, "--seq-len", "96", "--batch-size", "2", "--threads", "1"]


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    d = tmp_path_factory.mktemp("distill")
    plays = bundled_text_paths()
    text = plays[0].read_text()[:40000]
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    V = tok.get_vocab_size(with_added_tokens=True)
    teacher = tiny_model(seed=1, vocab_size=V, n_layer=4, max_seq_len=256)
    other = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=380)
    write_jsonl(conversations(plays, 60, seed=1, turns=(1, 2), max_chars=150), d / "chat.jsonl")
    return {
        "teacher": write_llama_gguf(d / "teacher.gguf", teacher, tok),
        "student": write_llama_gguf(
            d / "student.gguf", tiny_model(seed=2, vocab_size=V, max_seq_len=256), tok
        ),
        "other": write_llama_gguf(
            d / "other.gguf", tiny_model(seed=2, vocab_size=other.get_vocab_size()), other
        ),
        "chat": d / "chat.jsonl",
    }


def distill(kit, out, run_id, *extra):
    args = [a if a is not None else kit["chat"] for a in RUN]
    return run_toy(
        "train", "--recipe", "distill", "--teacher", kit["teacher"], *args, "--out", out,
        "--run-id", run_id, *extra,
    )  # fmt: skip


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_loss_is_trls_generalized_jsd(beta, temperature):
    """distill_divergence over hidden states and two heads, in chunks, against TRL's
    GKDTrainer.generalized_jsd_loss on the whole logits: the summed divergence over N
    positions and its gradient wrt the student's hidden states and head, within 1e-5."""
    import torch.nn as nn
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    from toy.models import losses

    torch.manual_seed(0)
    N, C, V = 37, 16, 300
    head_s, head_t = nn.Linear(C, V, bias=False), nn.Linear(24, V, bias=False)
    head_t.requires_grad_(False)
    h = torch.randn(N, C, requires_grad=True)
    h_t = torch.randn(N, 24)
    old = losses.CHUNK_BYTES
    losses.CHUNK_BYTES = 4 * V * 16  # 16 rows a chunk: three chunks and a partial one
    try:
        div, agree = losses.distill_divergence(h, head_s, h_t, head_t, beta, temperature)
    finally:
        losses.CHUNK_BYTES = old
    (g_h, g_w) = torch.autograd.grad(div, (h, head_s.weight))
    s_logits, t_logits = (h @ head_s.weight.T)[None], (h_t @ head_t.weight.T)[None]
    ref = GKDTrainer.generalized_jsd_loss(
        s_logits, t_logits, beta=beta, temperature=temperature, num_items_in_batch=1
    )
    r_h, r_w = torch.autograd.grad(ref, (h, head_s.weight))
    torch.testing.assert_close(div, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_h, r_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_w, r_w, atol=1e-5, rtol=1e-5)
    want = int((s_logits.argmax(-1) == t_logits.argmax(-1)).sum())
    assert int(agree) == want


def test_a_shrunk_teacher_learns_and_runs_in_llamacpp_form(kit, tmp_path, toy_cli):
    r = distill(kit, tmp_path, "s", "--keep-layers", "2", "--steps", "12", "--eval-every", "6",
                "--lr", "3e-3", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    curve = res["val_agreements"]
    assert [c["step"] for c in curve] == [0, 6, 12]
    assert "teacher_val_loss" in curve[0] and "teacher_val_loss" not in curve[1]
    assert curve[-1]["divergence"] < curve[0]["divergence"], curve
    assert all("divergence" in s and "agreement" in s for s in res["losses"])
    run = Path(res["run_dir"])
    info = json.loads((run / "run.json").read_text())
    assert info["job"]["keep_layers"] == [0, 3] and info["job"]["student_model"]["n_layer"] == 2
    code, out, err = toy_cli("export", run, "--format", "gguf", "--out", tmp_path / "s.gguf")
    assert code == 0, err
    code, out, err = toy_cli("describe", tmp_path / "s.gguf")
    assert code == 0 and "2" in out, err


def test_a_lora_student_with_ce_weight_1_is_loras_run(kit, tmp_path):
    """--ce-weight 1: the data's cross-entropy alone, the baseline every distillation
    figure is held against: the same loss bytes as `--recipe lora` on the same base,
    data, seed and flags."""
    same = ["--model", kit["student"], "--steps", "4", "--precision", "float32", "--json"]
    a = distill(kit, tmp_path, "d", *same, "--ce-weight", "1")
    args = [a if a is not None else kit["chat"] for a in RUN]
    b = run_toy("train", "--recipe", "lora", *args, *same, "--out", tmp_path, "--run-id", "l")
    assert a.returncode == 0 and b.returncode == 0, (a.stderr[-2000:], b.stderr[-2000:])
    la = [x["loss"] for x in json.loads(a.stdout)["losses"]]
    lb = [x["loss"] for x in json.loads(b.stdout)["losses"]]
    assert la == lb
    assert json.loads(a.stdout)["val_losses"] == json.loads(b.stdout)["val_losses"]
    assert (tmp_path / "d" / "final" / "adapter_model.safetensors").is_file()


def test_sigkill_then_resume_gives_the_unbroken_lines(kit, tmp_path):
    steps = ["--keep-layers", "2", "--steps", "30", "--save-every", "3", "--lr", "1e-3"]
    ref = distill(kit, tmp_path, "ref", *steps)
    assert ref.returncode == 0, ref.stderr[-3000:]
    lines = step_lines(ref.stdout)
    args = [str(a if a is not None else kit["chat"]) for a in RUN]
    argv = [sys.executable, "-m", "toy", "train", "--recipe", "distill", "--teacher"]
    argv += [str(kit["teacher"]), *args, "--out", str(tmp_path), "--run-id", "k", *steps]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_checkpoint(tmp_path / "k", p)
    p.send_signal(signal.SIGKILL)
    before, _ = p.communicate()
    r = run_toy("train", "--resume", tmp_path / "k")
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = step_lines(r.stdout)
    first = int(resumed[0].split()[1])
    kept = [ln for ln in step_lines(before) if int(ln.split()[1]) < first]
    assert kept + resumed == lines


def test_bad_input_is_one_line_before_any_work(kit, tmp_path, toy_cli):
    cases = [
        (["--model", kit["other"]], ["different vocabularies", "id 380", "no token"]),
        (["--keep-layers", "9"], ["--keep-layers 9", "4 blocks"]),
        (["--keep-layers", "2,1"], ["--keep-layers 2,1", "in order"]),
        (["--keep-layers", "two"], ["--keep-layers 'two'"]),
        ([], ["--model BASE", "--keep-layers N"]),
        (["--keep-layers", "2", "--beta", "1.5"], ["--beta must be in [0, 1]"]),
        (["--keep-layers", "2", "--ce-weight", "2"], ["--ce-weight must be in [0, 1]"]),
    ]
    args = [a if a is not None else kit["chat"] for a in RUN]
    for extra, words in cases:  # in this process: each is refused before any work
        code, _, err = toy_cli("train", "--recipe", "distill", "--teacher", kit["teacher"],
                               *args, "--out", tmp_path / "runs", *extra)  # fmt: skip
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (extra, err[-2000:])
        assert all(w in lines[0] for w in words), (words, lines[0])
    r = run_toy("train", "--recipe", "distill", "--teacher", kit["chat"], "--keep-layers", "2",
                "--data", kit["chat"], "--out", tmp_path / "runs")  # fmt: skip
    assert r.returncode == 2 and r.stderr.startswith(f"toy train: error: --teacher {kit['chat']}")
    assert not (tmp_path / "runs").exists()


@pytest.mark.llamacpp
def test_the_shrunk_students_gguf_runs_in_llamacpp_to_toys_greedy_text(kit, tmp_path, toy_cli):
    """The student's GGUF (`toy export --format gguf` of final/) loads in llama.cpp, and
    its greedy continuation of a prompt is toy's, token for token, for 16 tokens."""
    pytest.importorskip("llama_cpp")
    from helpers.llamacpp import _cpp_greedy, _llama

    from toy.formats.base_readers import read_base
    from toy.models.sample import sample_groups
    from toy.tokenizer import encode_prompt

    r = distill(kit, tmp_path, "g", "--keep-layers", "0,2,3", "--steps", "4", "--lr", "3e-3")
    assert r.returncode == 0, r.stderr[-3000:]
    gguf = tmp_path / "student.gguf"
    code, _, err = toy_cli("export", tmp_path / "g", "--format", "gguf", "--out", gguf)
    assert code == 0, err
    base = read_base(gguf, "float32")
    assert base.config.n_layer == 3
    model = base.build_model()
    stops = set(base.special.stops)
    for prompt in ("ROMEO. What light", "Is this a dagger which I see"):
        ids = encode_prompt(base.tokenizer, prompt)
        with torch.no_grad():
            toy = sample_groups(model, [ids], 1, 16, temperature=0.0, generator=None,
                                stop_ids=stops)[0][0].ids  # fmt: skip
        toy = list(toy[:-1] if toy and toy[-1] in stops else toy)  # llama.cpp's stop: not kept
        cpp = _cpp_greedy(_llama(gguf), ids, 16, stops)
        assert cpp == toy and cpp, (prompt, cpp, toy)
