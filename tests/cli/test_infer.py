"""`toy infer` and the text-to-ids paths (issue 23): the KV cache sized to the generation,
the memory check with a container's limit, --run with flags it already brings, BOS/EOS as
the GGUF asks, a LoRA run's base found from any folder, and a cut reply that says so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers.gguf_fixtures import CHATML, gemma3_gguf, tiny_model, write_llama_gguf  # noqa: E402,F401

from toy.data.dialogue import conversations, write_jsonl  # noqa: E402
from toy.data.prep import bundled_text_paths  # noqa: E402
from toy.tokenizer import train_bpe  # noqa: E402

GIB = 1 << 30
LORA = ["--seq-len", "200", "--batch-size", "2", "--eval-batches", "1", "--warmup", "0"]


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """Tiny llama GGUFs sharing one ChatML tokenizer with <s>/</s>: one without BOS rules
    (as SmolLM2), one asking for BOS (as Gemma), one for BOS and EOS, one whose template
    writes bos_token itself, one whose header claims a 1M-token context; and chat data."""
    d = tmp_path_factory.mktemp("infer-fixes")
    text = bundled_text_paths()[0].read_text()[:40000]
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<s>", "</s>"])
    n = tok.get_vocab_size(with_added_tokens=True)
    model = tiny_model(vocab_size=n, max_seq_len=256)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    asks_bos = {"tokenizer.ggml.bos_token_id": bos, "tokenizer.ggml.add_bos_token": True}
    chatml = CHATML + "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    k = {
        "dir": d,
        "tok": tok,
        "bos": bos,
        "eos": eos,
        "plain": write_llama_gguf(d / "plain.gguf", model, tok, chat_template=chatml),
        "bos_gguf": write_llama_gguf(
            d / "bos.gguf", model, tok, extra_kv=asks_bos, chat_template=chatml
        ),
        "bos_eos": write_llama_gguf(
            d / "boseos.gguf",
            model,
            tok,
            chat_template=chatml,
            extra_kv={
                **asks_bos,
                "tokenizer.ggml.eos_token_id": eos,
                "tokenizer.ggml.add_eos_token": True,
            },
        ),
        "bos_tmpl": write_llama_gguf(
            d / "bostmpl.gguf",
            model,
            tok,
            extra_kv=asks_bos,
            chat_template="{{ bos_token }}" + chatml,
        ),
        "long": write_llama_gguf(
            d / "long.gguf",
            tiny_model(vocab_size=n, max_seq_len=1 << 20),
            tok,
            chat_template=chatml,
        ),
    }
    k["chat"] = write_jsonl(
        conversations(bundled_text_paths(), 30, seed=1, turns=(1, 2), max_chars=120),
        d / "chat.jsonl",
    )
    return k


class Spy:
    """Records the prompt ids every generate() call gets, and the KV caches made."""

    def __init__(self, monkeypatch):
        from toy.models import generate as gen_module
        from toy.models import layers

        self.prompts: list[list[int]] = []
        self.caches: list = []
        real_generate, real_init = gen_module.generate, layers.KVCache.__init__

        def generate(model, prompt_ids, *a, **kw):
            self.prompts.append(list(prompt_ids))
            return real_generate(model, prompt_ids, *a, **kw)

        def init(cache, *a, **kw):
            real_init(cache, *a, **kw)
            self.caches.append(cache)

        monkeypatch.setattr(gen_module, "generate", generate)  # stream imports it at its call
        monkeypatch.setattr(layers.KVCache, "__init__", init)


# ---------------------------------------------------------------- KV cache sized to the generation


def test_new_cache_holds_the_prompt_plus_max_new_tokens_not_the_context():
    from toy.models.generate import generate

    model = tiny_model(vocab_size=64, max_seq_len=4096)
    made = []
    real = model.new_cache
    model.new_cache = lambda b, n: made.append(real(b, n)) or made[-1]
    out = list(generate(model, [1, 2, 3, 4, 5], 7, temperature=0.0))
    assert len(out) == 7
    assert [c.max_len for c in made] == [12]  # 5 + 7, not the 4096 of the context
    assert made[0].k[0].shape[2] == 12
    # Never past the context: a prompt longer than it keeps its last tokens, as before.
    small = tiny_model(vocab_size=64, max_seq_len=16)
    made.clear()
    real = small.new_cache
    small.new_cache = lambda b, n: made.append(real(b, n)) or made[-1]
    assert (
        len(list(generate(small, list(range(1, 13)), 50, temperature=0.0))) == 5
    )  # the last from position 15
    assert [c.max_len for c in made] == [16]


def test_cache_grows_in_chunks_and_gives_the_same_text():
    from toy.models.generate import generate

    model = tiny_model(vocab_size=64, max_seq_len=512)
    prompt = [5, 9, 2, 7, 1, 3]
    fresh = list(generate(model, prompt, 20, temperature=0.0))
    cache = model.new_cache(1, 4)  # far too small: it grows as the tokens come
    grown = list(generate(model, prompt, 20, temperature=0.0, cache=cache))
    assert grown == fresh
    assert cache.max_len >= 26 and cache.pos == 26


def test_a_1m_context_gguf_allocates_only_what_the_generation_needs(kit, toy_cli, monkeypatch):
    spy = Spy(monkeypatch)
    code, out, err = toy_cli(
        "infer",
        "--model",
        kit["long"],
        "--prompt",
        "ROMEO.",
        "--max-new-tokens",
        "5",
        "--temperature",
        "0",
    )
    assert code == 0, err
    n_prompt = len(kit["tok"].encode("ROMEO.", add_special_tokens=False).ids)
    assert [c.max_len for c in spy.caches] == [n_prompt + 5]


def test_auto_counts_the_kv_cache_in_its_memory_check(kit, toy_cli, monkeypatch):
    """float32 weights that fit in 80% of memory, but not with the cache the generation
    needs: auto holds the model quantized and says why."""
    from toy.cli import cmd_infer
    from toy.formats.gguf_describe import resident_size
    from toy.formats.gguf_header import read_gguf_header

    weights = resident_size(read_gguf_header(kit["long"]), "float32")
    new = 300
    tokens = len(kit["tok"].encode("ROMEO.", add_special_tokens=False).ids) + new
    cache = 2 * 2 * 2 * 16 * 4 * tokens  # (k, v) x 2 layers x 2 kv heads x head dim 16 x float32
    monkeypatch.setattr(
        cmd_infer, "available_memory", lambda: int((weights + cache / 2) / cmd_infer.FIT)
    )
    spy = Spy(monkeypatch)
    code, out, err = toy_cli(
        "infer",
        "--model",
        kit["long"],
        "--prompt",
        "ROMEO.",
        "--max-new-tokens",
        str(new),
        "--temperature",
        "0",
    )
    assert code == 0, err
    assert "holding the model quantized" in err and "KV cache" in err
    assert spy.caches[0].max_len == tokens
    # With room for both, float32 and no note.
    monkeypatch.setattr(
        cmd_infer, "available_memory", lambda: int((weights + 2 * cache) / cmd_infer.FIT)
    )
    code, out, err = toy_cli(
        "infer",
        "--model",
        kit["long"],
        "--prompt",
        "ROMEO.",
        "--max-new-tokens",
        "4",
        "--temperature",
        "0",
    )
    assert code == 0 and "quantized" not in err, err


def _chat_session(toy_cli, monkeypatch, gguf, lines, *extra):
    """Run an interactive chat on `lines`; returns (exit code, stderr, [(messages, reply)])."""
    from toy.cli import cmd_infer

    turns = []
    real = cmd_infer.chat_turn

    def chat_turn(lm, args, messages, *a, **kw):
        reply = real(lm, args, messages, *a, **kw)
        turns.append(([dict(m) for m in messages], reply))
        return reply

    monkeypatch.setattr(cmd_infer, "chat_turn", chat_turn)
    feed = iter(lines)
    monkeypatch.setattr("builtins.input", lambda prompt="": next(feed))
    code, out, err = toy_cli("infer", "--model", gguf, "--temperature", "0", *extra)
    return code, err, turns


def test_interactive_chat_grows_its_cache_and_matches_a_fresh_generation(kit, toy_cli, monkeypatch):
    from toy.cli import cmd_infer
    from toy.data.chat import render_template
    from toy.models.generate import generate

    monkeypatch.setattr(cmd_infer, "CACHE_CHUNK", 16)
    spy = Spy(monkeypatch)
    code, err, turns = _chat_session(
        toy_cli,
        monkeypatch,
        kit["plain"],
        ["Who is there?", "Nay, answer me: stand, and unfold yourself.", ""],
        "--max-new-tokens",
        "12",
    )
    assert code == 0, err
    assert len(turns) == 2
    # One cache for the whole chat, grown in chunks of 16 as the conversation got longer.
    assert len(spy.caches) == 1
    cache = spy.caches[0]
    assert cache.max_len % 16 == 0 and cache.max_len > 16
    lm = cmd_infer.load_base_lm(Path(kit["plain"]), None, "cpu", "float32")
    full = []
    for messages, reply in turns:
        text = render_template(
            lm.template, messages, add_generation_prompt=True, bos_token=lm.bos, eos_token=lm.eos
        )
        ids = lm.tok.encode(text, add_special_tokens=False).ids
        full.append(ids)
        fresh = list(generate(lm.model, ids, 12, temperature=0.0, stop_ids=lm.stop))
        assert lm.tok.decode(fresh) == reply
    # The second turn fed only what the cache did not hold yet: the end of its prompt.
    assert spy.prompts[0] == full[0]
    fed = spy.prompts[1]
    assert 0 < len(fed) <= len(full[1]) - len(full[0]) and full[1][-len(fed) :] == fed


def test_a_reply_cut_at_max_new_tokens_says_so(kit, toy_cli, monkeypatch):
    code, err, turns = _chat_session(
        toy_cli, monkeypatch, kit["plain"], ["Who is there?", ""], "--max-new-tokens", "3"
    )
    assert code == 0, err
    assert "[reply cut at --max-new-tokens 3]" in err


# ---------------------------------------------------------------- memory check with cgroups


def _meminfo(tmp_path, gb: float) -> Path:
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {int(gb * GIB / 1024)} kB\n")
    return p


def _files(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return root


@pytest.mark.parametrize(
    "tree, self_cgroup, want_gb",
    [
        (
            {"memory.max": str(4 * GIB), "memory.current": str(GIB)},
            "0::/\n",
            3,
        ),  # v2: limit minus usage
        ({"memory.max": "max", "memory.current": str(GIB)}, "0::/\n", 16),  # v2, no limit
        (
            {
                "memory/memory.limit_in_bytes": str(2 * GIB),
                "memory/memory.usage_in_bytes": str(GIB // 2),
            },
            "4:memory:/\n",
            1.5,
        ),  # v1
        (
            {
                "memory/memory.limit_in_bytes": "9223372036854771712",
                "memory/memory.usage_in_bytes": "1",
            },
            "4:memory:/\n",
            16,
        ),  # v1, no limit (the largest page count)
        ({}, "0::/\n", 16),  # no cgroup files at all
        ({"memory.max": str(4 * GIB)}, "0::/\n", 16),  # no usage file: unreadable, ignored
        (
            {
                "a/memory.max": str(GIB),
                "a/memory.current": "0",
                "a/b/memory.max": "max",
                "a/b/memory.current": "0",
            },
            "0::/a/b\n",
            1,
        ),  # the limit sits on an ancestor of the process's cgroup
        (
            {"memory/memory.limit_in_bytes": str(GIB), "memory/memory.usage_in_bytes": "0"},
            "4:memory:/docker/abc\n",
            1,
        ),  # v1 mounted at the container's own cgroup
        (
            {"memory.max": str(64 * GIB), "memory.current": "0"},
            "0::/\n",
            16,
        ),  # a limit above MemAvailable
    ],
)
def test_available_memory_takes_the_container_limit(tmp_path, tree, self_cgroup, want_gb):
    from toy.train.memory import available_memory

    root = _files(tmp_path / "cgroup", tree)
    root.mkdir(exist_ok=True)
    (tmp_path / "self").write_text(self_cgroup)
    got = available_memory(
        cgroup_root=root, self_cgroup=tmp_path / "self", meminfo=_meminfo(tmp_path, 16)
    )
    assert got == int(want_gb * GIB)


def test_auto_holds_quantized_inside_a_small_container(kit, toy_cli, monkeypatch, tmp_path):
    from toy.train import memory

    root = _files(tmp_path / "cgroup", {"memory.max": str(GIB), "memory.current": str(GIB - 1000)})
    (tmp_path / "self").write_text("0::/\n")
    monkeypatch.setattr(memory, "CGROUP_ROOT", root)
    monkeypatch.setattr(memory, "SELF_CGROUP", tmp_path / "self")
    code, out, err = toy_cli(
        "infer",
        "--model",
        kit["plain"],
        "--prompt",
        "ROMEO.",
        "--max-new-tokens",
        "2",
        "--temperature",
        "0",
    )
    assert code == 0 and "holding the model quantized" in err, err


# ---------------------------------------------------------------- --run brings its own model


@pytest.fixture(scope="module")
def runs(kit, tmp_path_factory):
    """A finished full-model run and a finished LoRA run (trained in a project, on a base
    named by a relative path)."""
    import os

    from toy.cli.main import main

    d = tmp_path_factory.mktemp("runs")
    (d / "proj" / "data").mkdir(parents=True)
    (d / "proj" / "toy.toml").write_text("")
    shutil.copyfile(kit["plain"], d / "proj" / "data" / "base.gguf")
    assert (
        main(
            ["prep", str(bundled_text_paths()[1]), "--out", str(d / "c.bin"), "--vocab-size", "300"]
        )
        == 0
    )
    assert (
        main(
            [
                "train",
                "--corpus",
                str(d / "c.bin"),
                "--out",
                str(d),
                "--preset",
                "tiny",
                "--batch-size",
                "2",
                "--seq-len",
                "16",
                "--eval-batches",
                "1",
                "--steps",
                "2",
                "--run-id",
                "full",
            ]
        )
        == 0
    )
    cwd = os.getcwd()
    os.chdir(d / "proj")
    try:
        assert (
            main(
                [
                    "train",
                    "--recipe",
                    "lora",
                    "--model",
                    "data/base.gguf",
                    "--data",
                    str(kit["chat"]),
                    "--out",
                    "runs",
                    "--run-id",
                    "lora",
                    "--steps",
                    "2",
                    *LORA,
                ]
            )
            == 0
        )
    finally:
        os.chdir(cwd)
    return {
        "full": d / "full",
        "lora": d / "proj" / "runs" / "lora",
        "base": d / "proj" / "data" / "base.gguf",
        "dir": d,
    }


def _one_line_2(code, err, *parts):
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for p in parts:
        assert p in err, err


def test_run_refuses_what_it_already_brings(kit, runs, toy_cli):
    code, _, err = toy_cli("infer", "--run", runs["full"], "--model", kit["plain"], "--prompt", "x")
    _one_line_2(code, err, "--run", "--model", "its own weights")
    code, _, err = toy_cli(
        "infer", "--run", runs["full"], "--adapter", runs["lora"], "--prompt", "x"
    )
    _one_line_2(code, err, "--run", "--adapter")
    code, _, err = toy_cli(
        "infer", "--run", runs["lora"], "--adapter", runs["lora"], "--prompt", "x"
    )
    _one_line_2(code, err, "--run", "--adapter", "brings its adapter")
    # A LoRA run's base may still be overridden with --model, as its help says.
    code, out, err = toy_cli(
        "infer",
        "--run",
        runs["lora"],
        "--model",
        runs["base"],
        "--prompt",
        "ROMEO.",
        "--max-new-tokens",
        "2",
        "--temperature",
        "0",
    )
    assert code == 0 and out.startswith("ROMEO."), err


# ---------------------------------------------------------------- a LoRA run's base from anywhere


def test_a_lora_run_records_its_base_absolutely_and_infers_from_another_folder(
    runs, toy_cli, monkeypatch, tmp_path
):
    cfg = json.loads((runs["lora"] / "final" / "adapter_config.json").read_text())
    job = json.loads((runs["lora"] / "run.json").read_text())["job"]
    assert cfg["base_model_name_or_path"] == str(runs["base"].resolve())
    assert job["model"] == str(runs["base"].resolve())
    monkeypatch.chdir(tmp_path)
    code, out, err = toy_cli(
        "infer",
        "--run",
        runs["lora"],
        "--prompt",
        "ROMEO.",
        "--max-new-tokens",
        "2",
        "--temperature",
        "0",
    )
    assert code == 0 and out.startswith("ROMEO."), err


def _copy_run(runs, dest: Path, base: str | None) -> Path:
    """The LoRA run copied into the same project, its adapter_config.json naming `base`."""
    run = runs["base"].parent.parent / "runs" / dest.name
    if run.exists():
        shutil.rmtree(run)
    shutil.copytree(runs["lora"], run)
    p = run / "final" / "adapter_config.json"
    cfg = json.loads(p.read_text())
    cfg["base_model_name_or_path"] = base
    p.write_text(json.dumps(cfg))
    return run


def test_an_older_run_with_a_relative_base_resolves_as_export_does(
    runs, toy_cli, monkeypatch, tmp_path
):
    run = _copy_run(runs, tmp_path / "old", "data/base.gguf")  # as runs recorded it before
    monkeypatch.chdir(tmp_path)  # outside the project: found against the project root
    code, out, err = toy_cli(
        "infer", "--run", run, "--prompt", "ROMEO.", "--max-new-tokens", "2", "--temperature", "0"
    )
    assert code == 0 and out.startswith("ROMEO."), err
    code, out, err = toy_cli("export", run, "--format", "gguf-lora", "--out", tmp_path / "a.gguf")
    assert code == 0, err


def test_a_missing_or_changed_base_is_one_clear_error(runs, toy_cli, monkeypatch, tmp_path):
    run = _copy_run(runs, tmp_path / "gone", str(tmp_path / "gone.gguf"))
    monkeypatch.chdir(tmp_path)
    code, _, err = toy_cli("infer", "--run", run, "--prompt", "x")
    _one_line_2(code, err, "gone.gguf", "adapter_config.json", "--model")
    assert "smollm2" not in err.lower()
    # A base whose bytes changed since the run trained on it: refused unless --model names it.
    other = tmp_path / "other.gguf"
    other.write_bytes(runs["base"].read_bytes()[:-4] + b"\0\0\0\1")
    run = _copy_run(runs, tmp_path / "changed", str(other))
    code, _, err = toy_cli("infer", "--run", run, "--prompt", "x")
    _one_line_2(code, err, "changed since the run trained")
    code, out, err = toy_cli(
        "infer", "--run", run, "--model", other, "--prompt", "ROMEO.", "--max-new-tokens", "2"
    )
    assert code == 0 and "not the file the adapter was trained on" in err, err


def test_an_older_lora_run_with_a_relative_model_still_resumes(kit, toy_cli, monkeypatch, tmp_path):
    (tmp_path / "data").mkdir()
    shutil.copyfile(kit["plain"], tmp_path / "data" / "base.gguf")
    monkeypatch.chdir(tmp_path)
    code, _, err = toy_cli(
        "train",
        "--recipe",
        "lora",
        "--model",
        "data/base.gguf",
        "--data",
        kit["chat"],
        "--out",
        "runs",
        "--run-id",
        "r",
        "--steps",
        "4",
        "--save-every",
        "2",
        *LORA,
    )
    assert code == 0, err
    run = tmp_path / "runs" / "r"
    info = json.loads((run / "run.json").read_text())
    info["job"]["model"] = "data/base.gguf"  # what a run made before recorded
    (run / "run.json").write_text(json.dumps(info))
    shutil.rmtree(run / "checkpoints" / "step-000004")
    shutil.rmtree(run / "final")
    code, _, err = toy_cli("train", "--resume", run)
    assert code == 0, err


# ---------------------------------------------------------------- BOS / EOS as the file asks


def test_prompt_gets_the_files_bos(kit, toy_cli, monkeypatch):
    plain_ids = kit["tok"].encode("ROMEO.", add_special_tokens=False).ids
    for gguf, want in (
        (kit["plain"], plain_ids),
        (kit["bos_gguf"], [kit["bos"], *plain_ids]),
        (kit["bos_eos"], [kit["bos"], *plain_ids]),
    ):  # a prompt to continue never ends in EOS
        spy = Spy(monkeypatch)
        code, out, err = toy_cli(
            "infer",
            "--model",
            gguf,
            "--prompt",
            "ROMEO.",
            "--max-new-tokens",
            "2",
            "--temperature",
            "0",
        )
        assert code == 0, err
        assert spy.prompts[0] == want, gguf.name
    # A prompt that already starts with the BOS text gets no second one; an empty one is BOS alone.
    spy = Spy(monkeypatch)
    for prompt in ("<s>ROMEO.", ""):
        code, out, err = toy_cli(
            "infer",
            "--model",
            kit["bos_gguf"],
            "--prompt",
            prompt,
            "--max-new-tokens",
            "2",
            "--temperature",
            "0",
        )
        assert code == 0, err
    assert spy.prompts == [[kit["bos"], *plain_ids], [kit["bos"]]]


def test_chat_gets_one_bos(kit, toy_cli, monkeypatch):
    for gguf in ("plain", "bos_gguf", "bos_tmpl"):
        spy = Spy(monkeypatch)
        code, out, err = toy_cli(
            "infer",
            "--model",
            kit[gguf],
            "--chat",
            "Who is there?",
            "--max-new-tokens",
            "2",
            "--temperature",
            "0",
        )
        assert code == 0, err
        ids = spy.prompts[0]
        assert ids.count(kit["bos"]) == (0 if gguf == "plain" else 1) and (
            gguf == "plain" or ids[0] == kit["bos"]
        )


def test_chat_training_gets_the_bos_inference_gives(kit):
    from toy.data.chat import encode_chat
    from toy.formats.gguf import read_gguf_tokenizer

    msgs = [
        {"role": "user", "content": "Who is there?"},
        {"role": "assistant", "content": "Nay, answer me."},
    ]
    tmpl = CHATML
    for gguf, bos in (("plain", 0), ("bos_gguf", 1)):
        tok = read_gguf_tokenizer(kit[gguf])
        ids, mask = encode_chat(tok, tmpl, msgs, 200, "<s>", "</s>")
        assert ids.count(kit["bos"]) == bos and (not bos or (ids[0] == kit["bos"] and mask[0] == 0))
    ids, _ = encode_chat(
        read_gguf_tokenizer(kit["bos_gguf"]), "{{ bos_token }}" + tmpl, msgs, 200, "<s>", "</s>"
    )
    assert ids.count(kit["bos"]) == 1


def test_prep_with_a_gguf_marks_each_document_as_the_file_asks(kit, toy_cli, tmp_path):
    from toy import tokenizer as toktools
    from toy.data.tokens import read_tokens
    from toy.formats.gguf import read_gguf_tokenizer

    docs = tmp_path / "docs.jsonl"
    texts = [f"ROMEO. speech number {i} of the play" for i in range(6)]
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = kit["tok"]
    plain = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    end = tok.token_to_id("<|endoftext|>")
    for gguf, want in (
        ("plain", [i for p in plain for i in (*p, end)]),  # as before: the end-of-text separator
        ("bos_gguf", [i for p in plain for i in (kit["bos"], *p, end)]),
        ("bos_eos", [i for p in plain for i in (kit["bos"], *p, kit["eos"])]),
    ):
        out = tmp_path / f"{gguf}.bin"
        code, _, err = toy_cli(
            "prep", docs, "--out", out, "--tokenizer", kit[gguf], "--val-fraction", "0"
        )
        assert code == 0, err
        tf = read_tokens(out)
        assert np.asarray(tf.tokens).tolist() == want, gguf
        assert toktools.hash_matches(read_gguf_tokenizer(kit[gguf]), tf.tokenizer_hash)


def test_token_stream_lora_trains_on_a_bos_corpus(kit, toy_cli, tmp_path):
    code, _, err = toy_cli(
        "prep", bundled_text_paths()[1], "--out", tmp_path / "c.bin", "--tokenizer", kit["bos_gguf"]
    )
    assert code == 0, err
    from toy.data.tokens import read_tokens

    assert int(np.asarray(read_tokens(tmp_path / "c.bin").tokens)[0]) == kit["bos"]
    code, _, err = toy_cli(
        "train",
        "--recipe",
        "lora",
        "--model",
        kit["bos_gguf"],
        "--corpus",
        tmp_path / "c.bin",
        "--out",
        tmp_path,
        "--steps",
        "1",
        *LORA,
    )
    assert code == 0, err


@pytest.mark.slow
def test_gemma3_prompt_continues_sanely_with_its_bos(gemma3_gguf, toy_run):
    """Without <bos> Gemma-3-270M continues "The capital of France is" with "France. The
    The The ..."; with it (as transformers and llama.cpp encode) it stays on topic."""
    r = toy_run(
        "infer",
        "--model",
        gemma3_gguf,
        "--prompt",
        "The capital of France is",
        "--temperature",
        "0",
        "--max-new-tokens",
        "12",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is")
    tail = r.stdout[len("The capital of France is") :]
    assert "the capital of the country of France" in tail, tail
    assert "The The" not in tail


# ---------------------------------------------------------------- toy fetch --list


def test_fetch_list_says_gemma3_270m_is_a_base_model(toy_cli):
    code, out, err = toy_cli("fetch", "--list", "--json")
    assert code == 0, err
    title = {m["name"]: m["title"] for m in json.loads(out)["models"]}["gemma3-270m"]
    assert "base model" in title and "not instruction-tuned" in title
