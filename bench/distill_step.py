"""One benchmark child: a distillation training step on SmolLM2-135M-Instruct, toy against
TRL, in a process of its own so its load time and peak RSS are its alone.

    python bench/distill_step.py --make-data DIR [--hf HFDIR]
    python bench/distill_step.py --check-data DIR [--gguf GGUF] [--hf HFDIR]
    python bench/distill_step.py --impl toy|trl --data DIR [--gguf GGUF] [--hf HFDIR]
                                 [--steps 4] [--warm 2]

The teacher is SmolLM2-135M-Instruct (toy: the Q4_1 GGUF, read frozen in its quantized
blocks; TRL: the bf16 transformers directory scripts/get-smollm2-dirs.sh makes of that
GGUF, loaded in bf16 as stored). The student is the teacher shrunk to 15 of its 30 blocks
at the indices toy's distill.kept_blocks picks (evenly spaced, first and last kept), the
embedding (tied head), those blocks and the final norm all trained in float32: toy's own
(`--recipe distill --keep-layers 15`), and for TRL the teacher's directory loaded in
float32 with the other blocks dropped.
- toy: `--recipe distill`'s build and loop in this process (as dpo_step.py runs dpo),
  --beta 0.5 (the generalized JSD), --temperature 1, --lmbda 0 (off-policy), its other
  defaults;
- trl: TRL 1.16's GKDTrainer (trl.experimental.gkd; trl.DistillationTrainer is on-policy
  only, it always samples from the student), GKDConfig with lmbda 0 (off-policy: the
  data's own completions, no sampling), beta 0.5, temperature 1 (GKD's loss runs at 1
  whatever it is set to), seq_kd off, its default ChatML collator on the same
  conversations in TRL's conversational "messages" form, its defaults but for the sizes:
  batch 4, max_length 128, no gradient checkpointing.
Both: batch 4 conversations, lr 2e-4 (toy's default), precision bf16 autocast where the
CPU has bf16 units (toy's --precision auto resolves so on a CPU with amx_bf16 or
avx512_bf16; TRL's bf16=True), float32 elsewhere; torch's default thread count (toy's
loop is not told to follow the free cores here).

DIR (--make-data) holds train.jsonl, 64 one-exchange conversations (system, user,
assistant) from the bundled plays whose rendering through the chat template is 120-128
tokens, and valid.jsonl (8 more, so toy holds none of the 64 out). With lengths that close,
toy's length-grouped batches (a budget of 4 x 129 tokens) hold exactly 4 conversations,
and TRL's shuffled batches of 4 pad to about the same width. --check-data shows both sides
turn each conversation into the same token ids and which positions each supervises.

Timed: the steps after --warm untimed ones, each from the end of the previous step to its
own end (so the batch's making is inside, the collator's tokenizing on TRL's side).
Prints one JSON line: load_s (building the models, the data and the trainer; imports
excluded), s_per_step (median), tokens_per_s (tokens fed, padding included, over the timed
steps), rows (conversations a step), first_loss (step 1's divergence: a check that both
compute the same thing from the same start), peak_rss_mb, precision. Compare s_per_step:
tokens_per_s counts toy's inputs (a conversation's tokens but its last, which is only a
target) and TRL's (all of them), so it reads about 1% higher on TRL's side for the same work.

What still differs (--check-data): the token ids are the same, but TRL's collator also
supervises the "\n" after each answer's <|im_end|> (3,054 supervised tokens to toy's
2,990 on the 64); TRL draws its batches shuffled, toy by its length-grouped order (other
conversations a step, the same band of lengths); TRL tokenizes in its collator at every
step while toy's load_s holds its tokenizing (and its hashing of the teacher's file); the
teacher is Q4_1 blocks on toy's side, bf16 tensors dequantized from them on TRL's; toy's
lr warms up over 10 steps, TRL's does not (no bearing on speed).

A measurement (one process per impl, on a quiet machine):

    python bench/distill_step.py --make-data /tmp/distill-data
    python bench/distill_step.py --impl toy --data /tmp/distill-data --steps 8 --warm 3
    python bench/distill_step.py --impl trl --data /tmp/distill-data --steps 8 --warm 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

MODELS = Path.home() / ".cache" / "toy" / "models"
GGUF = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
HF = MODELS / "smollm2-135m-instruct-b179c9523d0e-hf-bf16"
SEQ, KEEP, BETA, TEMPERATURE, LR = 128, "15", 0.5, 1.0, 2e-4
LENGTHS = (120, 128)  # tokens a conversation takes through the chat template
N_TRAIN, N_VALID = 64, 8


def make_data(out: Path, hf: Path) -> None:
    from transformers import AutoTokenizer

    from toy.data.dialogue import conversations, write_jsonl
    from toy.data.prep import bundled_text_paths

    tok = AutoTokenizer.from_pretrained(hf)
    pool = conversations(bundled_text_paths(), 100_000, seed=0, turns=(1, 1), max_chars=400)
    lo, hi = LENGTHS
    fit = [
        c
        for c in pool
        if lo <= len(tok.apply_chat_template(c["messages"], tokenize=True, return_dict=False)) <= hi
    ]
    if len(fit) < N_TRAIN + N_VALID:
        raise SystemExit(f"only {len(fit)} conversations of {lo}-{hi} tokens")
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(fit[:N_TRAIN], out / "train.jsonl")
    write_jsonl(fit[N_TRAIN : N_TRAIN + N_VALID], out / "valid.jsonl")


def rows(data: Path) -> list[dict]:
    return [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]


def toy_config(a):
    from toy.recipes import distill

    return distill.RECIPE.config(
        teacher=str(a.gguf),
        keep_layers=KEEP,
        data=str(a.data),
        seed=0,
        seq_len=SEQ,
        batch_size=a.batch,
        eval_batches=1,
        beta=BETA,
        temperature=TEMPERATURE,
        lmbda=0.0,  # off-policy: the data's answers (toy's default, as TRL's lmbda 0 here)
        lr=LR,
        optimizer_state=a.optimizer_state,
    )


def check_data(a) -> dict:
    """toy's encoded conversations (ids, supervised mask) against TRL's collator's."""
    from transformers import AutoTokenizer
    from trl.experimental.utils import DataCollatorForChatML

    from toy.formats.base_readers import read_base
    from toy.recipes.adapter import chat_data

    base = read_base(a.gguf, "quantized")
    stream = chat_data(toy_config(a), base, SEQ, [])
    samples = stream.micro_batch.__self__.samples  # ChatBatches': (ids, mask), in file order
    collate = DataCollatorForChatML(tokenizer=AutoTokenizer.from_pretrained(a.hf), max_length=SEQ)
    same_ids = toy_sup = trl_sup = 0
    extra: set[str] = set()
    for (ids, mask), row in zip(samples, rows(a.data), strict=True):
        b = collate([row])
        t_ids, t_sup = b["input_ids"][0].tolist(), (b["labels"][0] != -100).tolist()
        same_ids += ids == t_ids
        toy_sup, trl_sup = toy_sup + sum(mask), trl_sup + sum(t_sup)
        extra |= {
            repr(base.tokenizer.decode([i])) for i, m, t in zip(ids, mask, t_sup) if t and not m
        }
    widths = sorted({tuple(stream.micro_batch(k)["ids"].shape) for k in range(stream.n_batches)})
    return {
        "conversations": len(samples),
        "same_ids": same_ids,
        "supervised_toy": toy_sup,
        "supervised_trl": trl_sup,
        "trl_only_supervises": sorted(extra),
        "toy_batches": [list(w) for w in widths],
    }


def run_toy(a) -> dict:
    from toy.recipes import distill
    from toy.runs import EventLog, Project
    from toy.train.device import resolve_precision
    from toy.train.loop import train
    from toy.train.run import with_optimizer_state

    cpu = torch.device("cpu")
    precision = resolve_precision("auto", cpu)
    # resolved before the build, as `toy train` does (train/run.py): the teacher's auto
    # dtype (--teacher-dtype) follows the precision
    opts = toy_config(a).replace(precision=precision.name)
    t0 = time.perf_counter()
    built = distill.build(opts, Project(root=None))
    load_s = time.perf_counter() - t0
    job = built.job
    # --optimizer-state resolved as `toy train` resolves it (auto: bf16 moments under bf16)
    opts = with_optimizer_state(opts, built, False)
    job.eval_batches = lambda: []  # time training only
    ends: list[float] = []
    shapes: list[tuple[int, int]] = []
    step_figures, micro_batch = job.step_figures, job.micro_batch

    def figures():  # called once a step, as it ends
        ends.append(time.perf_counter())
        return step_figures()

    def batch(k, live=None):
        b = micro_batch(k, live)
        shapes.append(tuple(b["ids"].shape))
        return b

    job.step_figures, job.micro_batch = figures, batch
    cfg = opts.replace(steps=a.warm + a.steps, eval_every=0, save_every=0)
    res = train(job, cfg, None, cpu, EventLog(None), precision=precision)
    return timed(a, ends, shapes, load_s, precision.name, res.losses[0]["loss"])


def trl_student(hf: Path, n_layer: int):
    """The teacher's directory in float32 with only the kept blocks, renumbered."""
    from transformers import AutoModelForCausalLM

    from toy.recipes.distill import kept_blocks

    keep = kept_blocks(KEEP, n_layer)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    blocks = model.model.layers
    model.model.layers = torch.nn.ModuleList(blocks[i] for i in keep)
    for j, block in enumerate(model.model.layers):
        block.self_attn.layer_idx = j
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]
    return model


def run_trl(a) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from toy.train.device import cpu_bf16_units

    ends: list[float] = []
    shapes: list[tuple[int, int]] = []

    losses: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(a.hf)
    teacher = AutoModelForCausalLM.from_pretrained(a.hf, dtype=torch.bfloat16)
    student = trl_student(a.hf, teacher.config.num_hidden_layers)
    bf16 = cpu_bf16_units() is not None
    with tempfile.TemporaryDirectory() as d:
        args = GKDConfig(
            output_dir=d,
            report_to=[],
            use_cpu=True,
            per_device_train_batch_size=a.batch,
            max_steps=a.warm + a.steps,
            max_length=SEQ,
            learning_rate=LR,
            lmbda=0.0,
            beta=BETA,
            temperature=TEMPERATURE,
            bf16=bf16,
            activation_checkpointing=False,  # transformers 5's name for gradient_checkpointing
            save_strategy="no",
            logging_steps=1,  # each step's loss (the first is shown)
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = GKDTrainer(
            model=student,
            teacher_model=teacher,
            args=args,
            train_dataset=Dataset.from_list(rows(a.data)),
            processing_class=tok,
            callbacks=[Clock()],
        )
        collate = trainer.data_collator

        def counted(examples):
            b = collate(examples)
            shapes.append(tuple(b["input_ids"].shape))
            return b

        trainer.data_collator = counted  # the same collator, its batches' shapes seen
        load_s = time.perf_counter() - t0
        assert not student.is_gradient_checkpointing
        trainer.train()
    return timed(a, ends, shapes, load_s, "bf16" if bf16 else "float32", losses[0])


def timed(a, ends, shapes, load_s: float, prec: str, loss: float) -> dict:
    """The figures of the steps after the warm-up ones: step k runs from end k-1 to end k."""
    n = a.warm + a.steps
    if len(ends) != n or len(shapes) < n:
        raise SystemExit(f"saw {len(ends)} step ends and {len(shapes)} batches for {n} steps")
    times = [t1 - t0 for t0, t1 in zip(ends[a.warm - 1 :], ends[a.warm :])]
    tokens = [r * t for r, t in shapes[a.warm : n]]
    return {
        "precision": prec,
        "load_s": load_s,
        "s_per_step": statistics.median(times),
        "tokens_per_s": sum(tokens) / sum(times),
        "rows": sorted({r for r, _ in shapes[:n]}),
        "first_loss": loss,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--make-data", type=Path, help="write the conversations to this directory")
    ap.add_argument("--check-data", type=Path, help="compare both sides' tokens of DIR")
    ap.add_argument("--impl", choices=("toy", "trl"))
    ap.add_argument("--gguf", type=Path, default=GGUF, help="toy's teacher (Q4_1 GGUF)")
    ap.add_argument("--hf", type=Path, default=HF, help="TRL's teacher (transformers dir)")
    ap.add_argument("--data", type=Path, help="a --make-data directory")
    ap.add_argument("--steps", type=int, default=4, help="timed steps")
    ap.add_argument("--warm", type=int, default=2, help="untimed first steps (>= 1)")
    ap.add_argument("--batch", type=int, default=4, help="conversations a step")
    ap.add_argument(
        "--optimizer-state",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="toy's --optimizer-state (auto: as `toy train`)",
    )
    a = ap.parse_args()
    if a.make_data:
        make_data(a.make_data, a.hf)
        print(json.dumps({"wrote": str(a.make_data)}))
        return
    if a.check_data:
        a.data = a.check_data
        print(json.dumps(check_data(a)))
        return
    if not (a.impl and a.data):
        ap.error("give --impl and --data (or --make-data DIR, or --check-data DIR)")
    if a.warm < 1 or a.steps < 1:
        ap.error("--warm and --steps must be >= 1 (a step is timed from the previous one's end)")
    torch.manual_seed(0)
    if a.impl == "toy":
        from toy.runs import tune_malloc

        tune_malloc()  # what `toy train` does at start
    r = run_trl(a) if a.impl == "trl" else run_toy(a)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
    print(json.dumps({"impl": a.impl, **out, "peak_rss_mb": round(rss, 1)}), flush=True)


if __name__ == "__main__":
    main()
