"""`toy train --recipe distill` (issue 56), through the command line on tiny llama GGUFs that
share a tokenizer: the loss equal to TRL's GKDTrainer.generalized_jsd_loss (values and
gradients, beta 0, 0.5, 1, temperature != 1), chunked; a shrunk copy of the teacher
trained, its figures shown, its final/ exported as a GGUF (llama.cpp loads it and gives
toy's greedy text); a LoRA student whose --ce-weight 1 run is lora's run byte for byte;
SIGKILL and --resume give the unbroken run's lines; bad input is one line, exit 2."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.common import run_toy
from helpers.gguf_fixtures import gguf_name, tiny_model, write_llama_gguf  # noqa: E402
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
    chats = conversations(plays, 60, seed=1, turns=(1, 2), max_chars=150)
    write_jsonl(chats, d / "chat.jsonl")
    prompts = [{"prompt": [m for m in c["messages"][:-1] if m["role"] != "system"]} for c in chats]
    write_jsonl(prompts, d / "prompts.jsonl")
    return {
        "teacher": write_llama_gguf(d / "teacher.gguf", teacher, tok),
        "student": write_llama_gguf(
            d / "student.gguf", tiny_model(seed=2, vocab_size=V, max_seq_len=256), tok
        ),
        "other": write_llama_gguf(
            d / "other.gguf", tiny_model(seed=2, vocab_size=other.get_vocab_size()), other
        ),
        "chat": d / "chat.jsonl",
        "prompts": d / "prompts.jsonl",
        "tok": tok,
        "student_vocab": V,
    }


def distill(kit, out, run_id, *extra, run=run_toy):
    """A distillation run on the kit: in a process of its own (run_toy), or `run=toy_run`, in
    this one."""
    args = [a if a is not None else kit["chat"] for a in RUN]
    return run(
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


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_closed_form_gradients_are_autograds(beta, groups, monkeypatch):
    """The divergences' gradients are written in closed form (models/losses.py _jsd_terms):
    against autograd over the whole logits in float64, with a soft-cap and a temperature,
    for the whole vocabulary and for a teacher kept as its top K (K + 1 buckets). The head's
    weight gradient is one matmul over all chunks, or (groups 2: W_GRAD_BYTES holds 20 of
    the 29 rows) one a group, summed."""
    import torch.nn as nn

    from toy.models import losses

    torch.manual_seed(1)
    N, C, V, K, T, cap = 29, 8, 50, 6, 0.7, 4.0
    head_s = nn.Linear(C, V, bias=False).double()
    head_t = nn.Linear(12, V, bias=False).double().requires_grad_(False)
    h = torch.randn(N, C, dtype=torch.float64, requires_grad=True)
    h_t = torch.randn(N, 12, dtype=torch.float64)
    if groups == 2:
        monkeypatch.setattr(losses, "W_GRAD_BYTES", 8 * V * 20)
    old = losses.CHUNK_BYTES
    losses.CHUNK_BYTES = 4 * V * 16  # two chunks and a partial one
    try:
        div, _ = losses.distill_divergence(h, head_s, h_t, head_t, beta, T, caps=(cap, cap))
        ids, t_lp, t_rest = losses.teacher_topk(h_t, head_t, K, T, cap)
        top, _ = losses.topk_divergence(h, head_s, ids, t_lp, t_rest, beta, T, cap)
    finally:
        losses.CHUNK_BYTES = old

    def capped(x):
        return cap * torch.tanh(x / cap)

    z = capped(h @ head_s.weight.T) / T
    s = torch.log_softmax(z, -1)
    t = torch.log_softmax(capped(h_t @ head_t.weight.T) / T, -1)
    ref = losses.jsd_of_logprobs(s, t, beta).sum()  # autograd's gradient through the formula
    idx = ids.long()
    s_k = torch.cat([s.gather(-1, idx), torch.logsumexp(s.scatter(-1, idx, -torch.inf), -1,
                                                         keepdim=True)], -1)  # fmt: skip
    t_k = torch.cat([t_lp, t_rest[:, None]], -1).double()
    ref_top = losses.jsd_of_logprobs(s_k, t_k, beta).sum()
    for got, want in ((div, ref), (top, ref_top)):
        torch.testing.assert_close(got, want)
        g = torch.autograd.grad(got, (h, head_s.weight))
        r = torch.autograd.grad(want, (h, head_s.weight), retain_graph=True)
        torch.testing.assert_close(g, r)


def test_a_tied_students_lookup_gradient_is_the_rows_it_looked_up():
    """sparse_tied_rows: the student's tied embedding's lookup gradient comes as rows added
    into the head's (V, C) gradient, which stays dense, and equals the dense lookup's; an
    untied or frozen embedding is left as it was."""
    from toy.models import losses
    from toy.recipes.distill import sparse_tied_rows

    grads = []
    for sparse in (False, True):
        model = tiny_model(seed=3)
        teacher = tiny_model(seed=4).requires_grad_(False)
        if sparse:
            sparse_tied_rows(model)
            assert model.embed_tokens.sparse
        ids = torch.randint(0, 300, (3, 9), generator=torch.Generator().manual_seed(0))
        h_t = teacher.hidden(ids).flatten(0, 1)
        div, _ = losses.distill_divergence(
            model.hidden(ids).flatten(0, 1), model.lm_head, h_t, teacher.lm_head, 0.5
        )
        div.backward()
        g = model.embed_tokens.weight.grad
        assert g is not None and not g.is_sparse and g.layout == torch.strided
        grads.append(g)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-7)
    untied = tiny_model(seed=3, tie_embeddings=False)
    frozen = tiny_model(seed=3).requires_grad_(False)
    for m in (untied, frozen):
        sparse_tied_rows(m)
        assert not m.embed_tokens.sparse


def test_a_shrunk_teacher_learns_and_runs_in_llamacpp_form(kit, tmp_path, toy_cli, toy_run):
    r = distill(kit, tmp_path, "s", "--keep-layers", "2", "--steps", "12", "--eval-every", "6",
                "--lr", "3e-3", "--json", run=toy_run)  # fmt: skip
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


def test_a_lora_student_with_ce_weight_1_is_loras_run(kit, tmp_path, toy_run):
    """--ce-weight 1: the data's cross-entropy alone, the baseline every distillation
    figure is held against: the same loss bytes as `--recipe lora` on the same base,
    data, seed and flags."""
    same = ["--model", kit["student"], "--steps", "4", "--precision", "float32", "--json"]
    a = distill(kit, tmp_path, "d", *same, "--ce-weight", "1", run=toy_run)
    args = [a if a is not None else kit["chat"] for a in RUN]
    b = toy_run("train", "--recipe", "lora", *args, *same, "--out", tmp_path, "--run-id", "l")
    assert a.returncode == 0 and b.returncode == 0, (a.stderr[-2000:], b.stderr[-2000:])
    la = [x["loss"] for x in json.loads(a.stdout)["losses"]]
    lb = [x["loss"] for x in json.loads(b.stdout)["losses"]]
    assert la == lb
    assert json.loads(a.stdout)["val_losses"] == json.loads(b.stdout)["val_losses"]
    assert (tmp_path / "d" / "final" / "adapter_model.safetensors").is_file()


ON_POLICY = ["--lmbda", "1", "--max-completion-length", "12"]


@pytest.mark.parametrize("policy", ["off", "on"])
def test_sigkill_then_resume_gives_the_unbroken_lines(kit, tmp_path, policy, toy_run):
    steps = ["--keep-layers", "2", "--steps", "15", "--save-every", "3", "--lr", "1e-3"]
    if policy == "on":  # every batch the student's own completions of --prompts
        steps += ["--prompts", str(kit["prompts"]), *ON_POLICY]
    ref = distill(kit, tmp_path, "ref", *steps, run=toy_run)  # killed, resumed: own processes
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
        (["--keep-layers", "2", "--lmbda", "0.5"], ["--lmbda 0.5", "--prompts FILE"]),
        (["--keep-layers", "2", "--seq-kd"], ["--seq-kd", "--prompts FILE"]),
        (
            ["--keep-layers", "2", "--lmbda", "1.5", "--prompts", kit["prompts"]],
            ["--lmbda must be in [0, 1]"],
        ),
        (["--keep-layers", "2", "--prompts", kit["prompts"]], ["--lmbda L > 0", "--seq-kd"]),
        (
            [
                "--keep-layers",
                "2",
                "--teacher-top-k",
                "16",
                "--prompts",
                kit["prompts"],
                "--lmbda",
                "1",
            ],
            ["--teacher-top-k", "on-policy"],
        ),
        (["--keep-layers", "2", "--teacher-top-k", "402"], ["--teacher-top-k 402", "402 tokens"]),
        (["--keep-layers", "2", "--init", "donor"], ["--keep-layers and --init", "give one"]),
        (["--keep-layers", "2", "--n-layer", "3"], ["--n-layer shape a fresh student"]),
        (
            ["--init", "pca", "--preset", "tiny", "--d-model", "128", "--n-head", "2"],
            ["--init pca", "--d-model 128", "width 64"],
        ),
        (
            [
                "--keep-layers",
                "2",
                "--prompts",
                kit["prompts"],
                "--lmbda",
                "1",
                "--max-completion-length",
                "96",
            ],
            ["--max-completion-length 96", "below 96"],
        ),
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
def test_the_shrunk_students_gguf_runs_in_llamacpp_to_toys_greedy_text(
    kit, tmp_path, toy_cli, toy_run
):
    """The student's GGUF (`toy export --format gguf` of final/) carries the teacher GGUF's
    tokenizer keys whole, loads in llama.cpp, and its greedy continuation of a prompt is
    toy's, token for token, for 16 tokens."""
    pytest.importorskip("llama_cpp")
    from helpers.llamacpp import _cpp_greedy, _llama

    from toy.formats.base_readers import read_base
    from toy.models.sample import sample_groups
    from toy.tokenizer import encode_prompt

    r = distill(kit, tmp_path, "g", "--keep-layers", "0,2,3", "--steps", "4", "--lr", "3e-3",
                run=toy_run)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    gguf = tmp_path / "student.gguf"
    code, _, err = toy_cli("export", tmp_path / "g", "--format", "gguf", "--out", gguf)
    assert code == 0, err
    from toy.formats.gguf_header import read_gguf_header

    def tokenizer_keys(path):
        return {k: v for k, v in read_gguf_header(path).metadata.items() if k.startswith("tok")}

    assert tokenizer_keys(gguf) == tokenizer_keys(kit["teacher"])  # BOS rule, EOS, template
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


def test_on_policy_batches_are_the_students_or_the_teachers_samples(kit, tmp_path, toy_run):
    """--lmbda 1: every micro-batch is the student's own completion of its prompts, sampled
    from the live student with the loop's seeded generator; --seq-kd alone: the teacher's.
    The job's batch equals a completion sampled directly from that model with the same
    generator, its targets the completion's tokens only; a mixed run (--lmbda 0.5 --seq-kd
    with --data) shows the sampled completions' length on the step lines."""
    from toy.models.sample import sample_groups, seeded
    from toy.recipes.distill import RECIPE
    from toy.runs import Project
    from toy.train.job import Live, live_seed, lm_prepare

    base = dict(teacher=str(kit["teacher"]), keep_layers="2", seq_len=96,
                batch_size=2, prompts=str(kit["prompts"]), max_completion_length=12,
                steps=2)  # fmt: skip
    for extra, who in (({"lmbda": 1.0}, "student"), ({"seq_kd": True}, "teacher")):
        cfg = RECIPE.config(**base, **extra)
        job = RECIPE.build(cfg, Project(root=None)).job
        assert job.live and job.sampled.who(0) == who
        gen = seeded(torch.device("cpu"), live_seed(cfg.seed, 1))
        b = job.micro_batch(1, Live(job.model, gen, torch.device("cpu")))
        model = job.model if who == "student" else job.teacher
        group = job.sampled.batches(1)
        gen = seeded(torch.device("cpu"), live_seed(cfg.seed, 1))
        comps = sample_groups(model, [ids for _, ids in group], 1, 12, temperature=1.0,
                              generator=gen, stop_ids=job.sampled.stops, max_rows=2)  # fmt: skip
        for r, ((_, prompt), (c,)) in enumerate(zip(group, comps)):
            row = prompt + list(c.ids)
            assert b["ids"][r, : len(row) - 1].tolist() == row[:-1]
            tgt = b["targets"][r]
            assert tgt[tgt != -100].tolist() == list(c.ids)
            assert (tgt[: len(prompt) - 1] == -100).all()
        assert int(lm_prepare(b)["sup_idx"].numel()) == sum(len(c.ids) for (c,) in comps)
    r = distill(kit, tmp_path, "mix", "--keep-layers", "2", "--steps", "4", "--prompts",
                kit["prompts"], "--lmbda", "0.5", "--seq-kd", "--max-completion-length", "12",
                "--json", run=toy_run)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    steps = json.loads(r.stdout)["losses"]
    assert all(0 < s["completion_length"] <= 12 for s in steps), steps


@pytest.mark.parametrize("batches", ["mixed", "kept"])
def test_two_processes_give_one_process_steps(kit, tmp_path, batches, toy_run):
    """On-policy and data batches mixed (--lmbda 0.5): which micro-batch is sampled, its
    prompts and its generator follow the global micro-batch index, so one process
    accumulating two micro-batches and two processes of one each take the same steps,
    within float32's order. The teacher kept as its top K: the main process makes the
    file, the other reads it."""
    common = ["--keep-layers", "2", "--steps", "4", "--precision", "float32", "--lr", "1e-3"]
    if batches == "mixed":
        common += ["--prompts", str(kit["prompts"]), "--lmbda", "0.5",
                   "--max-completion-length", "12"]  # fmt: skip
    else:
        common += ["--teacher-top-k", "8"]
    one = distill(kit, tmp_path, "one", *common, "--grad-accum", "2", run=toy_run)
    two = distill(kit, tmp_path, "two", *common, "--nproc", "2")
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    rec = [
        [json.loads(x) for x in (tmp_path / n / "events.jsonl").read_text().splitlines()]
        for n in ("one", "two")
    ]
    a, b = ([e for e in r if e["event"] == "step"] for r in rec)
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "divergence", "agreement"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), (key, x, y)
        assert x.get("completion_length") == y.get("completion_length")


def test_teacher_top_k(kit, tmp_path, toy_run):
    """--teacher-top-k K: with K = V - 1 (the rest one token) the losses are the whole
    vocabulary's within float32 rounding; the kept file lies in the run with what it was
    made from; a run killed and resumed with its file damaged makes it again and gives
    the unbroken run's lines; the teacher model is let go once it is kept."""
    f32 = ["--keep-layers", "2", "--steps", "4", "--precision", "float32", "--json"]
    full = distill(kit, tmp_path, "full", *f32, run=toy_run)
    near = distill(kit, tmp_path, "near", *f32, "--teacher-top-k", "401", run=toy_run)
    assert full.returncode == 0 and near.returncode == 0, near.stderr[-3000:]
    a, b = json.loads(full.stdout), json.loads(near.stdout)
    for x, y in zip(a["losses"] + a["val_agreements"], b["losses"] + b["val_agreements"]):
        for key in ("divergence", "agreement", "loss"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-7), (key, x, y)
    assert a["val_agreements"][0]["teacher_val_loss"] == pytest.approx(
        b["val_agreements"][0]["teacher_val_loss"], rel=1e-6
    )
    kept = json.loads((tmp_path / "near" / "teacher_top_k.json").read_text())
    assert kept["made_from"]["k"] == 401 and len(kept["sha256"]) == 64

    steps = ["--keep-layers", "2", "--steps", "6", "--save-every", "3", "--teacher-top-k", "16"]
    ref = distill(kit, tmp_path, "ref", *steps, run=toy_run)
    assert ref.returncode == 0, ref.stderr[-3000:]
    shutil.copytree(tmp_path / "ref", tmp_path / "cut")  # as if killed after step 3
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step-000006")
    data = tmp_path / "cut" / "teacher_top_k.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-100:-90] = bytes(10)  # damaged where the tensors lie
    data.write_bytes(bytes(raw))
    r = toy_run("train", "--resume", tmp_path / "cut")
    assert r.returncode == 0, r.stderr[-3000:]
    assert step_lines(r.stdout) == step_lines(ref.stdout)[3:]
    assert data.read_bytes() == (tmp_path / "ref" / "teacher_top_k.safetensors").read_bytes()


def test_a_kept_teacher_is_let_go(kit, tmp_path):
    from toy.recipes.distill import RECIPE
    from toy.runs import Project

    cfg = RECIPE.config(teacher=str(kit["teacher"]), keep_layers="2", seq_len=96, batch_size=2,
                        data=str(kit["chat"]), teacher_top_k=8, steps=2)  # fmt: skip
    job = RECIPE.build(cfg, Project(root=None)).job
    job.bind(torch.device("cpu"), None, tmp_path)
    assert job.teacher is None and (tmp_path / "teacher_top_k.safetensors").is_file()
    b = job.micro_batch(0)
    assert b["t_ids"].shape == (int((b["targets"] != -100).sum()), 8)
    assert torch.all(b["t_lp"][:, :-1] >= b["t_lp"][:, 1:])  # highest first


def test_a_fresh_student_warm_started_from_the_teacher(kit, tmp_path, toy_cli, toy_run):
    """--init pca: a fresh llama of the shape flags whose embedding is a trainable lens over
    the teacher's centred table; it learns, and final/ is a plain llama (the lens folded
    into its embedding) that `toy export --format gguf` writes and reads back, its
    embedding the folded product."""
    r = distill(kit, tmp_path, "f", "--init", "pca", "--preset", "tiny", "--n-layer", "2",
                "--d-model", "32", "--n-head", "2", "--steps", "12", "--eval-every", "12",
                "--lr", "3e-3", "--json", run=toy_run)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    curve = res["val_agreements"]
    assert curve[-1]["divergence"] < curve[0]["divergence"], curve
    info = json.loads((tmp_path / "f" / "run.json").read_text())["job"]
    assert info["student"] == "fresh" and info["init"] == "pca" and info["lens"] is True
    assert info["student_model"]["n_layer"] == 2 and info["student_model"]["d_model"] == 32
    gguf = tmp_path / "f.gguf"
    code, _, err = toy_cli("export", tmp_path / "f", "--format", "gguf", "--out", gguf)
    assert code == 0, err
    from safetensors.torch import load_file

    from toy.formats.base_readers import read_base

    final = load_file(str(tmp_path / "f" / "final" / "model.safetensors"))
    assert final["embed_tokens.weight"].shape == (402, 32)
    model = read_base(gguf, "float32").build_model()
    ids = torch.tensor([[5, 17, 33, 90]])
    with torch.no_grad():
        emb = model.embed_tokens.weight
    torch.testing.assert_close(emb, final["embed_tokens.weight"], atol=1e-6, rtol=1e-5)
    assert model(ids).shape == (1, 4, 402)


def test_a_directory_teachers_student_is_written_as_a_directory(kit, tmp_path, toy_cli, toy_run):
    """A transformers-directory teacher (the tiny GGUF written as one): the shrunk student's
    run exports as a transformers directory that transformers loads to toy's logits, and as
    an MLX directory that mlx-lm loads to the same, the teacher's chat template and EOS
    with it."""
    import transformers

    from toy.formats.base_readers import read_base
    from toy.formats.dir_write import write_model_dir
    from toy.formats.model_dir import load_model_dir

    teacher = tmp_path / "teacher-hf"
    write_model_dir(read_base(kit["teacher"], "quantized"), teacher, "transformers")
    args = [a if a is not None else kit["chat"] for a in RUN]
    r = toy_run("train", "--recipe", "distill", "--teacher", teacher, *args, "--keep-layers",
                "2", "--steps", "3", "--out", tmp_path, "--run-id", "s")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    model, meta, _ = load_model_dir(tmp_path / "s" / "final")
    ids = [5, 17, 33, 90, 120]
    with torch.no_grad():
        want = model(torch.tensor([ids])).float()
    code, out, err = toy_cli("export", tmp_path / "s", "--format", "transformers", "--out",
                             tmp_path / "hf")  # fmt: skip
    assert code == 0 and "transformers model" in out, err
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        got = hf(torch.tensor([ids])).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["eos_token_id"] == meta["special"]["eos"]
    mx = pytest.importorskip("mlx.core")
    from mlx_lm import load

    code, out, err = toy_cli("export", tmp_path / "s", "--format", "mlx", "--out", tmp_path / "m")
    assert code == 0 and "mlx_lm.generate --model" in out, err
    m, _ = load(str(tmp_path / "m"))
    got = torch.from_numpy(__import__("numpy").array(m(mx.array([ids]))))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_quantized_teacher_is_held_in_bf16_where_it_is_small(kit, tmp_path):
    """--teacher-dtype: auto under bf16 on a cpu holds a quantized teacher as a bfloat16 copy
    (dequantized once, not at every use), says so, and records it; the losses are the ones
    the teacher held in its blocks gives (the same dequantized bits, the same bf16 matmuls)."""
    import numpy as np

    V = kit["student_vocab"]
    model = tiny_model(seed=1, vocab_size=V, n_layer=4, max_seq_len=256)
    qtypes = {gguf_name(n): "Q8_0" for n, p in model.named_parameters() if p.dim() == 2}
    teacher = write_llama_gguf(tmp_path / "q8.gguf", model, kit["tok"], qtypes=qtypes)
    common = ["--keep-layers", "2", "--steps", "3", "--precision", "bf16"]
    runs = {}
    for name, extra in (("auto", []), ("quantized", ["--teacher-dtype", "quantized"])):
        r = run_toy("train", "--recipe", "distill", "--teacher", teacher,
                    *[a if a is not None else kit["chat"] for a in RUN], *common, *extra,
                    "--out", tmp_path, "--run-id", name)  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        events = (tmp_path / name / "events.jsonl").read_text().splitlines()
        runs[name] = ([json.loads(x) for x in events], r.stdout + r.stderr)
        held = json.loads((tmp_path / name / "run.json").read_text())["job"]["teacher_dtype"]
        assert held == {"auto": "bfloat16", "quantized": "quantized"}[name]
    said = {k: runs[k][1] for k in runs}
    assert "--teacher-dtype auto: bfloat16 under bf16 autocast" in said["auto"], said["auto"][:3000]
    assert "held bfloat16" in said["auto"] and "held quantized" in said["quantized"]
    a, q = ([e["loss"] for e in runs[k][0] if e["event"] == "step"] for k in ("auto", "quantized"))
    assert len(a) == 3
    np.testing.assert_allclose(a, q, rtol=1e-3)
