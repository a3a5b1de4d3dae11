"""Distillation: a student taught by the model the user runs (--teacher: a GGUF file, a
transformers or an MLX directory), the teacher read as a LoRA base is: frozen, kept in its
quantized blocks (no float copy), run without gradients.

The student is a LoRA adapter on --model BASE (a smaller base with the teacher's
vocabulary), or a shrunk copy of the teacher (--keep-layers N: N of its blocks, evenly
spaced, the first and last kept; or a list of indices: DistilBERT's and Minitron's
start), all of whose weights train, or a fresh llama of --preset's shape whose embedding
starts from the teacher's (--init donor|pca|scratch, as warm-start's from its donor).
Off-policy: at every supervised position of the data
(lora's forms: chat JSONL, prompt/completion, {"text"}, or a token corpus) the student's
next-token distribution is pulled toward the teacher's by the generalized JSD
(models/losses.py: generalized_jsd, TRL's GKD meaning of --beta; the forward KL by
default) at --temperature,
computed in chunks of positions (distill_divergence: neither model's logits exist
whole), mixed with the data's own cross-entropy by --ce-weight.

With --teacher-top-k K the teacher is kept as its K most likely tokens a position (and
the mass of the rest), made in one pass over --data before the first step, saved in the
run directory (formats/topk.py: checked on resume, made again where it does not match),
after which the teacher model is let go: the loss is the generalized JSD over those K + 1
buckets (models/losses.py: topk_divergence).

On-policy (TRL GKD's lmbda and seq_kd): with --prompts FILE (GRPO's prompt forms), a
--lmbda share of the micro-batches are the student's own completions of a batch of
prompts, graded by the teacher at every token; with --seq-kd the other micro-batches'
completions are the teacher's samples. Those are live batches (Job.live): sampled when
their step starts with the loop's generator seeded by (seed, global micro-batch), so a
killed run resumes to the same losses, on any number of processes. Which micro-batch is
sampled is a pure function of (seed, its global index).
"""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

import numpy as np
import torch

from toy.data.prompts import (
    PromptBatches,
    PromptEncoder,
    completion_targets,
    no_prompts,
    read_prompts,
)
from toy.data.streams import hold_out
from toy.errors import InputError, ToyError, UsageError
from toy.formats.base import Base, QuantTensor
from toy.formats.base_readers import base_kind, held_as, read_base
from toy.formats.hf_dir import base_fingerprint
from toy.formats.model_dir import GGUF_TOKENIZER, save_model_dir
from toy.formats.topk import TOPK_FILE, read_topk, write_topk
from toy.models import registry
from toy.models.losses import (
    IGNORE,
    distill_divergence,
    head_cross_entropy,
    teacher_topk,
    topk_divergence,
)
from toy.models.quant import count_params, resident_bytes
from toy.models.quant_types import BASE_DTYPES
from toy.models.sample import sample_groups
from toy.recipes.adapter import (
    ADAPTER_DEFAULTS,
    adapter_flags,
    base_dtype,
    chat_data,
    check_adapter_opts,
    load_adapted,
    save_adapter,
    text_side,
    token_stream,
)
from toy.recipes.donor import EMBED_LR_SCALE, INITS, fold, open_donor, start_embedding
from toy.recipes.lm import lm_shape
from toy.runs import Project, data_fingerprints, plural
from toy.train import dist
from toy.train.config import RunConfig
from toy.train.device import autocast
from toy.train.job import Built, Job, lm_prepare
from toy.train.recipe import Figure, Flag, Recipe

DATA_HELP = (
    "what the student learns the teacher on, as lora reads it: chat JSONL (the teacher's "
    'distribution at every assistant token), {"prompt", "completion"}, {"text"}, or a '
    "directory of train.jsonl and valid.jsonl; or --corpus tokens.bin (the teacher's "
    "tokenizer)"
)


def _unit(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1


FLAGS = (
    *adapter_flags(DATA_HELP),
    Flag(
        "teacher",
        None,
        "the model that teaches: a GGUF file, a transformers or an MLX directory (read frozen, "
        "in its quantized blocks)",
        metavar="PATH",
        shown=": none, required",
    ),
    Flag(
        "keep_layers",
        None,
        "the student as a shrunk copy of the teacher: N of its blocks, evenly spaced with the "
        "first and last kept, or their indices (0,2,4,...); every weight trains, final/ is a "
        "model of the teacher's family (instead of --model BASE's LoRA adapter)",
        metavar="N|I,J,...",
        shown=": none, the student is --model's adapter",
    ),
    Flag(
        "init",
        None,
        "the student as a fresh llama (--preset and the shape flags, as from-scratch) whose "
        "embedding starts from the teacher's: donor (its rows; through a trainable lens where "
        "the widths differ), pca (a lens on its top --d-model principal axes) or scratch "
        "(random: the baseline)",
        choices=INITS,
        shown=": none",
    ),
    Flag(
        "teacher_dtype",
        None,
        "how the teacher is held: quantized (its own blocks, dequantized at every use: the "
        "least memory), bfloat16 or float32 (dequantized once at load)",
        choices=BASE_DTYPES,
        shown=": as --base-dtype's auto, bfloat16 on a cpu training in bf16 where the copy "
        "takes at most 1 GB and a quarter of the free memory (and on cuda); quantized "
        "elsewhere",
    ),
    Flag(
        "beta",
        0.0,
        "the generalized JSD's beta (TRL's meaning): 0 the forward KL(teacher || student), "
        "classic distillation, which beat the data's own cross-entropy on SmolLM2 where the "
        "JSD did not (docs/results.md); 1 the reverse KL, 0.5 the JSD (TRL GKD's default)",
        float,
        shown="0",
        check=_unit,
        must="be in [0, 1]",
    ),
    Flag(
        "temperature",
        1.0,
        "both models' logits are divided by it before the divergence",
        float,
        check=lambda v: v > 0,
        must="be > 0",
    ),
    Flag(
        "ce_weight",
        0.0,
        "the share A of the data's own cross-entropy: (1 - A) x divergence + A x "
        "cross-entropy (1: the student trained on the data alone, the baseline)",
        float,
        shown="0",
        check=_unit,
        must="be in [0, 1]",
    ),
    Flag(
        "teacher_top_k",
        None,
        "keep the teacher as its K most likely tokens a position and the mass of the rest, "
        "made in one pass over --data and saved in the run; the teacher is then let go "
        "(K < its vocabulary)",
        int,
        metavar="K",
        shown=": none, the whole vocabulary at every step",
        check=lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
        must="be an integer >= 1",
    ),
    Flag(
        "prompts",
        None,
        'prompts for on-policy batches, in GRPO\'s forms ({"prompt": "..."} or a list of '
        "messages a line): read with --lmbda or --seq-kd",
        metavar="FILE",
        shown=": none",
    ),
    Flag(
        "lmbda",
        0.0,
        "the share of micro-batches whose completions the student samples from --prompts, "
        "graded by the teacher at every token (on-policy, TRL GKD's lmbda)",
        float,
        shown="0",
        check=_unit,
        must="be in [0, 1]",
    ),
    Flag(
        "seq_kd",
        False,
        "the other micro-batches' completions of --prompts sampled by the teacher "
        "(sequence-level KD, TRL GKD's seq_kd)",
        bool,
    ),
    Flag(
        "max_completion_length",
        128,
        "new tokens a sampled completion may have; it ends at its EOS before",
        int,
        check=lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
        must="be an integer >= 1",
        metavar="N",
    ),
)
DIVERGENCES = {0.0: " (the forward KL)", 0.5: " (the JSD)", 1.0: " (the reverse KL)"}
DEFAULTS = {**ADAPTER_DEFAULTS, "lr": 2e-4, "min_lr": 2e-5}
# The held-out agreement on the done line and in --json (the divergence and, at step 0,
# the teacher's own held-out cross-entropy beside it).
FIGURES = (
    Figure(
        "agreement",
        "held-out top-1 agreement with the teacher",
        final=True,
        json_key="val_agreements",
        every=True,
        bar="agree",
        plot=True,
        span=(0.0, 1.0),
    ),
)


def check(cfg: RunConfig) -> list[str]:
    p = []
    if not cfg.teacher:
        p.append("give --teacher MODEL (a GGUF file, a transformers or an MLX directory)")
    sampled = bool(cfg.lmbda) or bool(cfg.seq_kd)
    if sampled and not cfg.prompts:
        what = f"--lmbda {cfg.lmbda:g}" if cfg.lmbda else "--seq-kd"
        p.append(
            f"{what} samples completions of prompts: give --prompts FILE "
            '({"prompt": "..."} a line, as GRPO reads)'
        )
    if cfg.prompts and not sampled:
        p.append(
            "--prompts is read for on-policy batches only: give --lmbda L > 0 (the student "
            "samples) or --seq-kd (the teacher samples)"
        )
    all_sampled = cfg.prompts and (cfg.lmbda == 1 or cfg.seq_kd)
    if not cfg.data and not cfg.corpus and not all_sampled:
        p.append(
            "give --data chat.jsonl or --corpus tokens.bin"
            + (
                f" (--lmbda {cfg.lmbda:g} leaves the other batches to the data)"
                if cfg.prompts and sampled
                else ""
            )
        )
    if cfg.data and cfg.corpus:
        p.append("--data and --corpus conflict: give one")
    if cfg.teacher_top_k is not None and (cfg.corpus or sampled):
        why = (
            "--corpus's windows are drawn afresh each step"
            if cfg.corpus
            else ("on-policy batches are new each step")
        )
        p.append(
            f"--teacher-top-k keeps the teacher over --data's examples, and {why}: give "
            "--data chat.jsonl, or leave --teacher-top-k out"
        )
    kinds = [
        f
        for f, given in (
            ("--model", cfg.model),
            ("--keep-layers", cfg.keep_layers is not None),
            ("--init", cfg.init),
        )
        if given
    ]
    shaped = [k for k in ("preset", "n_layer", "d_model", "n_head", "n_kv_head") if getattr(cfg, k)]
    if shaped and not cfg.init:
        flags = ", ".join("--" + k.replace("_", "-") for k in shaped)
        p.append(
            f"{flags} shape a fresh student: add --init donor|pca|scratch, or drop {flags} (a "
            "shrunk or LoRA student has its model's own shape)"
        )
    if len(kinds) > 1:
        p.append(
            f"{' and '.join(kinds)} are {len(kinds)} students: give one (--model: a LoRA adapter "
            "on another base; --keep-layers: a shrunk copy of the teacher; --init: a fresh "
            "model)"
        )
    if not kinds:
        p.append(
            "give the student: --model BASE (a LoRA adapter on a smaller base with the "
            "teacher's vocabulary), --keep-layers N (a shrunk copy of the teacher) or --init "
            "donor (a fresh llama of --preset's shape, its embedding the teacher's)"
        )
    if cfg.keep_layers is not None:
        try:
            _layer_spec(cfg.keep_layers)
        except ValueError:
            p.append(
                f"--keep-layers {cfg.keep_layers!r}: give a count N or block indices "
                "I,J,... (e.g. --keep-layers 15 or --keep-layers 0,4,8,12)"
            )
    return p + (check_adapter_opts(cfg) if cfg.model else [])


def _layer_spec(spec: str) -> int | list[int]:
    parts = [x.strip() for x in str(spec).split(",") if x.strip()]
    if not parts:
        raise ValueError(spec)
    vals = [int(x) for x in parts]
    return vals[0] if len(vals) == 1 and "," not in str(spec) else vals


def kept_blocks(spec: str, n_layer: int) -> list[int]:
    """The teacher's block indices a shrunk student keeps: N evenly spaced with the first
    and last kept, or the indices given (checked against the teacher's depth)."""
    want = _layer_spec(spec)
    if isinstance(want, int):
        if not 1 <= want <= n_layer:
            raise UsageError(
                f"--keep-layers {want}: the teacher has {n_layer} blocks; keep 1 to {n_layer}"
            )
        if want == 1:
            return [0]
        return sorted({round(i * (n_layer - 1) / (want - 1)) for i in range(want)})
    bad = [i for i in want if not 0 <= i < n_layer]
    if bad or len(set(want)) != len(want) or want != sorted(want):
        raise UsageError(
            f"--keep-layers {spec}: give distinct block indices in order, each in 0..{n_layer - 1} "
            f"(the teacher has {n_layer} blocks)"
        )
    return want


def vocabulary_problem(teacher: Base, student_tok, student_rows: int, where: str) -> str | None:
    """Why the teacher's and the student's logits cannot be compared token by token: a
    different tokenizer (the first id where their tokens differ) or head width."""
    t = {i: tok for tok, i in teacher.tokenizer.get_vocab(with_added_tokens=True).items()}
    s = {i: tok for tok, i in student_tok.get_vocab(with_added_tokens=True).items()}
    for i in range(max(len(t), len(s))):
        if t.get(i) != s.get(i):
            return (
                f"--teacher {teacher.path} ({len(t):,} tokens) and {where} ({len(s):,} tokens) "
                f"have different vocabularies: id {i} is {_tok(t.get(i))} in the teacher and "
                f"{_tok(s.get(i))} in the student; distillation compares them token by token: "
                "give a student with the teacher's tokenizer"
            )
    rows = teacher.config.vocab_size
    if rows != student_rows:
        return (
            f"--teacher {teacher.path}'s head has {rows:,} rows and {where}'s {student_rows:,}; "
            "give a student with the teacher's vocabulary"
        )
    return None


def _tok(token: str | None) -> str:
    return repr(token) if token is not None else "no token"


# ------------------------------------------------------------------ the students


@dataclasses.dataclass
class Student:
    """What trains: its model, the base whose tokenizer and template the data takes, the
    sequence length, what run.json records of it and how final/ is written."""

    model: torch.nn.Module
    base: Base
    seq_len: int
    config: dict
    notes: list[str]
    adapted: object | None = None  # the LoRA student's Adapted (final/: its adapter)
    export: object | None = None  # the model final/ holds, where not `model` (a folded lens)
    embed_scale: float = 1.0  # the embedding's LR, x --lr


def lora_student(cfg: RunConfig, project: Project) -> Student:
    a = load_adapted(cfg, project, "distill")
    return Student(a.model, a.base, a.seq_len, dict(a.config), a.notes, a)


def shrink(base: Base, keep: list[int]) -> Base:
    """`base` with only the blocks `keep` (renumbered 0..N-1), each float tensor its own
    float32 copy (the file's pages are never written; a quantized one is kept as it is, to
    be dequantized into a tensor of its own)."""
    sd = {}
    for name, t in base.state_dict.items():
        head, i, rest = (name.split(".", 2) + ["", ""])[:3]
        if head == "layers" and i.isdigit():  # a block's tensor (toy's names are HF's)
            if int(i) not in keep:
                continue
            name = f"layers.{keep.index(int(i))}.{rest}"
        sd[name] = t if isinstance(t, QuantTensor) else t.to(torch.float32, copy=True)
    config = dataclasses.replace(base.config, n_layer=len(keep))
    return dataclasses.replace(base, config=config, state_dict=sd)


def shrunk_student(cfg: RunConfig, teacher_path: Path) -> Student:
    """A float32 copy of the teacher's embedding, kept blocks, final norm and head, every
    weight trainable, its blocks renumbered 0..N-1. A GGUF's kept blocks alone are
    dequantized (held_as): the whole teacher in float32 first left SmolLM2's 0.54 GB of
    freed heap behind; a kind held_as reads again is read whole and shrunk."""
    probe = read_base(teacher_path, "quantized")
    n = probe.config.n_layer
    keep = kept_blocks(cfg.keep_layers, n)
    small = held_as(shrink(probe, keep), teacher_path, "float32")
    del probe
    if small.config.n_layer != len(keep):
        small = shrink(small, keep)
    torch.manual_seed(cfg.seed)
    model = small.build_model()
    for p in model.parameters():
        p.requires_grad_(True)
    seq_len = min(cfg.seq_len, small.config.max_seq_len)
    notes = [
        f"student: {small.path.name} shrunk to {len(keep)} of its {n} blocks "
        f"({', '.join(map(str, keep))}), {plural(count_params(model), 'parameter')}, all trained"
    ]
    record = {"student": "shrunk", "keep_layers": keep, "student_model": small.config.to_dict()}
    return Student(model, small, seq_len, record, notes)


def sparse_tied_rows(model: torch.nn.Module) -> None:
    """A trained embedding that is also the head (tied) gets its lookup's gradient as the
    rows it looked up (nn.Embedding's sparse=True), added into the head's dense (V, C)
    gradient, which the loss makes first: not a zeroed (V, C) tensor with the rows added,
    then summed with the head's (SmolLM2's 113 MB three times over, ~35 ms a distill step
    on 2 cores). The parameter's .grad stays dense. One process only: DistributedDataParallel
    takes a sparse=True embedding's parameter for one whose gradient is sparse."""
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    if dist.info().world > 1 or head is None or not head.requires_grad:
        return
    for mod in model.modules():
        if isinstance(mod, torch.nn.Embedding) and mod.weight is head:
            mod.sparse = True


def fresh_student(cfg: RunConfig, teacher: Base, teacher_path: Path) -> Student:
    """A fresh llama of --preset's shape over the teacher's vocabulary, its embedding
    started from the teacher's as warm-start starts one from its donor (recipes/donor.py),
    the rest as from-scratch's with the same seed; final/ a plain llama."""
    donor = open_donor(teacher_path)
    vocab = teacher.config.vocab_size
    notes: list[str] = []
    mcfg, seq_len, problems = lm_shape(cfg, "llama", vocab, notes)
    if cfg.init == "pca" and mcfg.d_model > donor.width:
        problems.append(
            f"--init pca: --d-model {mcfg.d_model} exceeds the teacher's width {donor.width}; "
            "lower --d-model or give --init donor (a trainable lens)"
        )
    if donor.rows < vocab:
        problems.append(
            f"--teacher {teacher_path}: its embedding has {donor.rows:,} rows for {vocab:,} "
            "tokens; give --init scratch"
        )
    if problems:
        raise UsageError("; ".join(problems))
    torch.manual_seed(cfg.seed)
    model = registry.build_model(mcfg)
    lens, _, said = start_embedding(model, donor, cfg.init, mcfg.d_model, vocab, cfg.seed)
    notes += said
    notes.append(
        f"student: a fresh llama, {mcfg.n_layer} blocks of width {mcfg.d_model}, "
        f"{plural(count_params(model), 'parameter')}; its embedding trains at "
        f"{EMBED_LR_SCALE:g} x --lr"
    )
    record = {"student": "fresh", "init": cfg.init, "lens": lens, "student_model": mcfg.to_dict()}
    return Student(model, teacher, seq_len, record, notes, export=lambda: fold(model),
                   embed_scale=EMBED_LR_SCALE)  # fmt: skip


# ------------------------------------------------------------------ on-policy batches


class Sampled:
    """--prompts' batches whose completions a model samples: the student's own for a
    --lmbda share of the micro-batches (which ones: a pure function of the seed and the
    global micro-batch index), the teacher's for the rest with --seq-kd. A sampled batch is
    a next-token batch (completion_targets): the loss grades the completion's tokens."""

    def __init__(self, cfg: RunConfig, train: list, val: list, stops: set[int], pad: int):
        d = dist.info()
        self.cfg, self.val, self.stops, self.pad = cfg, val, stops, pad
        self.world, self.rank = d.world, d.rank
        self.batches = PromptBatches(train, cfg.batch_size, cfg.seed, d.world, d.rank)

    def who(self, k: int) -> str | None:
        """Who samples micro-batch k of this process ("student", "teacher"), or None (a
        data batch). The draw is the global micro-batch's, as the loop's live seeds are."""
        g = k * self.world + self.rank
        if (
            self.cfg.lmbda
            and np.random.default_rng([self.cfg.seed, g, 31]).random() < self.cfg.lmbda
        ):
            return "student"
        return "teacher" if self.cfg.seq_kd else None

    def rows(self, model, group: list, generator, temperature: float) -> dict[str, torch.Tensor]:
        """One completion of each prompt of `group` sampled from `model`, as a batch."""
        prompts = [ids for _, ids in group]
        comps = sample_groups(
            model, prompts, 1, self.cfg.max_completion_length, temperature=temperature,
            generator=generator, stop_ids=self.stops, max_rows=len(prompts),
        )  # fmt: skip
        b = completion_targets(prompts, [g[0] for g in comps], self.pad)
        b["fig.sampled"] = torch.tensor([len(g[0].ids) for g in comps], dtype=torch.float64)
        return b


# ------------------------------------------------------------------ the teacher's top K


class KeptTeacher:
    """The teacher as its top K at every supervised position of --data (--teacher-top-k):
    one pass over every training example (epoch 0's batches: each example once) and every
    held-out batch; each example's positions kept in order, so any later batch is its
    examples' rows joined (in the order lm_prepare's sup_idx takes them). Saved in the run
    directory with what it was made from, and on resume read back where that matches."""

    def __init__(self, cfg: RunConfig, stream, config: dict):
        self.k, self.temperature, self.stream = cfg.teacher_top_k, cfg.temperature, stream
        self.meta = {
            "k": self.k,
            "temperature": self.temperature,
            **{
                key: config.get(key)
                for key in ("teacher_sha256", "data_sha256", "val_data_sha256", "seq_len")
            },
            "examples": len(stream.chat.samples),
            "held_out_batches": len(stream.evals),
        }
        self.t: dict[str, torch.Tensor] = {}

    def load_or_make(self, path: Path | None, teacher, device, precision) -> None:
        """The kept file where it matches, else made and written: by the main process,
        which alone decides; the others read what it left (after a barrier every process
        passes, whatever it found)."""
        d = dist.info()
        t = None
        if d.is_main or path is None:
            t, _ = read_topk(path, self.meta) if path is not None else (None, "")
            if t is None:
                t = self.make(teacher, device, precision)
                if path is not None:
                    write_topk(path, t, self.meta)
        dist.barrier()
        if t is None:  # another process: the main one's file
            t, why = read_topk(path, self.meta)
            if t is None:
                raise ToyError(f"{path}: {why} (written by the main process a moment ago)")
        self.t = t

    @torch.no_grad()
    def make(self, teacher, device, precision) -> dict[str, torch.Tensor]:
        chat = self.stream.chat
        per: dict[int, tuple] = {}
        with autocast(device, precision):
            for members in chat.partition():
                parts, _ = self._pass(teacher, chat.make(members), device, ce=False)
                per.update(zip(members, parts))
            out = self._join([per[j] for j in range(len(chat.samples))], "train")
            evals, ce = [], []
            for b in self.stream.evals:
                parts, summed = self._pass(teacher, b, device)
                evals.append(tuple(torch.cat(x) for x in zip(*parts)))
                ce.append(summed)
        out.update(self._join(evals, "val"))
        out["val.ce"] = torch.tensor(ce, dtype=torch.float64)
        return out

    def _pass(self, teacher, b, device, ce: bool = True) -> tuple[list[tuple], float]:
        """The teacher's top K at batch b's supervised positions, split by row, and its
        summed cross-entropy on the batch's targets (the held-out figure)."""
        b = lm_prepare(b)
        on = {k: v.to(device) for k, v in b.items()}
        h = teacher.hidden(on["ids"]).flatten(0, 1).index_select(0, on["sup_idx"])
        ids, lp, rest = teacher_topk(h, teacher.lm_head, self.k, self.temperature,
                                     teacher.final_softcap)  # fmt: skip
        summed = 0.0
        if ce:
            tgt = on["targets"].flatten().index_select(0, on["sup_idx"])
            summed = float(head_cross_entropy(h, teacher.lm_head, tgt, teacher.final_softcap))
        rows = (b["targets"] != IGNORE).sum(1).tolist()
        cut = lambda x: torch.split(x.cpu(), rows)  # noqa: E731
        return list(zip(cut(ids), cut(lp), cut(rest))), summed

    @staticmethod
    def _join(parts: list[tuple], name: str) -> dict[str, torch.Tensor]:
        counts = torch.tensor([0] + [len(p[0]) for p in parts])
        out = {f"{name}.offsets": torch.cumsum(counts, 0)}
        for i, key in enumerate(("ids", "lp", "rest")):
            out[f"{name}.{key}"] = torch.cat([p[i] for p in parts])
        return out

    def _slices(self, name: str, which: list[int]) -> dict[str, torch.Tensor]:
        o = self.t[f"{name}.offsets"].tolist()
        pick = lambda key: torch.cat([self.t[f"{name}.{key}"][o[j] : o[j + 1]] for j in which])  # noqa: E731
        return {"t_ids": pick("ids"), "t_lp": pick("lp"), "t_rest": pick("rest")}

    def train_batch(self, members: list[int]) -> dict[str, torch.Tensor]:
        return {**self.stream.chat.make(members), **self._slices("train", members)}

    def evals(self) -> list[dict[str, torch.Tensor]]:
        ce = self.t["val.ce"]
        return [
            {**b, **self._slices("val", [i]), "t_ce": ce[i : i + 1]}
            for i, b in enumerate(self.stream.evals)
        ]


# ------------------------------------------------------------------ the job


class DistillJob(Job):
    """Off-policy distillation: the data's batches (ids, targets) as lora makes them; the
    loss at every supervised position is (1 - A) x the generalized JSD to the teacher +
    A x the cross-entropy on the data, normalised by the supervised tokens of the step.
    Held out: the cross-entropy (val_loss), the divergence, the top-1 agreement with the
    teacher, and once the teacher's own cross-entropy."""

    def __init__(self, cfg, student: Student, teacher, stream, sampled: Sampled | None, config):
        super().__init__("distill", student.model, config)
        self.cfg, self.student, self.teacher, self.stream = cfg, student, teacher, stream
        self.sampled = sampled
        self.kept = KeptTeacher(cfg, stream, config) if cfg.teacher_top_k else None
        self.live = sampled is not None  # sampled batches come from the models as they are
        self.lengths: list[float] = []  # the step's sampled completions' lengths
        self.evals: list | None = None
        self.sums = torch.zeros(3, dtype=torch.float64)  # divergence, agreeing, tokens: a step's
        self.held = torch.zeros(3, dtype=torch.float64)  # the same, an evaluation's
        self.teacher_ce: float | None = None  # its held-out cross-entropy, once known
        self.teacher_sum = 0.0  # its summed cross-entropy over the first evaluation

    def bind(self, device, precision, run_dir=None) -> None:
        super().bind(device, precision, run_dir)
        if self.kept is None:
            self.teacher.to(device)
            return
        path = run_dir / TOPK_FILE if run_dir is not None else None
        self.kept.load_or_make(path, self.teacher, device, precision)
        self.teacher = None  # kept as its top K: the model is let go
        gc.collect()

    def micro_batch(self, k: int, live=None) -> dict[str, torch.Tensor]:
        who = self.sampled.who(k) if self.sampled is not None else None
        if self.kept is not None:
            return self.kept.train_batch(self.stream.chat.members(k))
        if who is None:
            return self.stream.micro_batch(k)
        model = live.model if who == "student" else self.teacher
        b = self.sampled.rows(model, self.sampled.batches(k), live.generator, self.cfg.temperature)
        self.lengths += b.pop("fig.sampled").tolist()
        return b

    def eval_batches(self) -> list[dict[str, torch.Tensor]]:
        """The data's held-out batches; with prompts alone, the teacher's greedy completion
        of each held-out prompt, sampled once (the same batches every evaluation)."""
        if self.kept is not None:
            return self.kept.evals()
        if self.stream is not None:
            return self.stream.evals
        if self.evals is None:
            s = self.sampled
            self.evals = []
            with autocast(self.device, self.precision):
                for i in range(0, len(s.val), self.cfg.batch_size):
                    b = s.rows(self.teacher, s.val[i : i + self.cfg.batch_size], None, 0.0)
                    self.evals.append({k: v for k, v in b.items() if not k.startswith("fig.")})
        return self.evals

    def _positions(self, model, b) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states (N, C), targets (N,)) at the batch's supervised positions (the
        loop prepares every batch: Job.prepare's sup_idx)."""
        idx = b["sup_idx"]
        h = model.hidden(b["ids"]).flatten(0, 1).index_select(0, idx)
        return h, b["targets"].flatten().index_select(0, idx)

    def loss(self, model, b):
        cfg = self.cfg
        h, tgt = self._positions(model, b)
        # A term whose weight is 0 is not differentiated: the divergence is still the step's
        # figure (--ce-weight 1), the data's cross-entropy is not made at all (0, the
        # default); either pass with its gradient costs about as much as the other.
        with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.ce_weight < 1):
            if "t_ids" in b:  # the teacher kept as its top K
                div, agree = topk_divergence(
                    h, model.lm_head, b["t_ids"], b["t_lp"], b["t_rest"], cfg.beta,
                    cfg.temperature, model.final_softcap,
                )  # fmt: skip
                h_t = None
            else:
                with torch.no_grad():
                    h_t, _ = self._positions(self.teacher, b)
                caps = (model.final_softcap, self.teacher.final_softcap)
                div, agree = distill_divergence(
                    h, model.lm_head, h_t, self.teacher.lm_head, cfg.beta, cfg.temperature, caps
                )
        seen = torch.stack([div.detach().double(), agree.double(), h.new_tensor(len(tgt)).double()])
        if model.training:
            self.sums += seen.cpu()
            if cfg.ce_weight == 0:
                return div, torch.tensor(len(tgt))
            ce = head_cross_entropy(h, model.lm_head, tgt, model.final_softcap)
            total = ce if cfg.ce_weight == 1 else (1 - cfg.ce_weight) * div + cfg.ce_weight * ce
        else:  # held out: the loss is the data's cross-entropy (val_loss)
            ce = head_cross_entropy(h, model.lm_head, tgt, model.final_softcap)
            self.held += seen.cpu()
            if self.teacher_ce is None and h_t is not None:  # the teacher's own, once
                t_ce = head_cross_entropy(h_t, self.teacher.lm_head, tgt, caps[1])
                self.teacher_sum += float(t_ce)
            elif self.teacher_ce is None:  # from the pass that kept its top K
                self.teacher_sum += float(b["t_ce"].sum())
            total = ce
        return total, torch.tensor(len(tgt))

    def _take(self, sums: torch.Tensor, across: bool) -> dict[str, float]:
        s = dist.all_sum(sums.to(self.device)).cpu() if across else sums
        if s[2] == 0:
            return {}
        return {"divergence": float(s[0] / s[2]), "agreement": float(s[1] / s[2])}

    def step_figures(self) -> dict[str, float]:
        sums, self.sums = self.sums, torch.zeros(3, dtype=torch.float64)
        out = self._take(sums, across=True)
        if self.sampled is not None:  # the step's sampled completions' mean length
            n = torch.tensor([sum(self.lengths), len(self.lengths)], dtype=torch.float64)
            n = dist.all_sum(n.to(self.device)).cpu()
            self.lengths = []
            if n[1]:
                out["completion_length"] = float(n[0] / n[1])
        return out

    @torch.no_grad()
    def eval_figures(self, model, batches) -> dict[str, float]:
        held, self.held = self.held, torch.zeros(3, dtype=torch.float64)
        out = self._take(held, across=False)
        if self.teacher_ce is None and held[2] > 0:  # from the same pass as the student's
            self.teacher_ce = self.teacher_sum / float(held[2])
            out["teacher_val_loss"] = self.teacher_ce
        return out

    def lr_scale(self, name: str) -> float:
        return self.student.embed_scale if name.startswith("embed_tokens.") else 1.0

    def save_final(self, out: Path) -> None:
        s = self.student
        if s.adapted is not None:  # a LoRA student: its adapter, as lora's final/
            save_adapter(self.cfg, s.adapted, out)
            return
        extra = {"recipe": "distill", "train": self.config}
        if s.base.chat_template:  # the teacher's: `toy export` writes it
            extra["chat_template"] = s.base.chat_template
        sp = s.base.special
        extra["special"] = {"bos": sp.bos, "eos": sp.eos, "pad": sp.pad}
        model = s.export() if s.export is not None else self.model
        # A GGUF teacher's tokenizer keys as they are (its BOS rule, EOS, chat template):
        # the student's GGUF gets them whole.
        kv = {k: v for k, v in s.base.metadata.items() if k.startswith("tokenizer.")}
        files = {GGUF_TOKENIZER: kv} if s.base.kind == "gguf" and kv else {}
        save_model_dir(out, model, extra=extra, tokenizer=s.base.tokenizer, files=files)


def prompt_side(cfg: RunConfig, student: Student, held: bool, notes: list[str]) -> Sampled:
    """--prompts read and encoded as the student sees them (through its chat template),
    cut from the left to leave --max-completion-length; held out (5%, when there is no
    data to hold out from) for the teacher's greedy completions the evaluations grade."""
    path = Path(cfg.prompts)
    pf = read_prompts(path, strict=cfg.strict)
    if pf.skipped:
        notes.append(f"warning: {path}: {pf.summary()}")
    if not pf.prompts:
        raise no_prompts(path, pf)
    T = cfg.max_completion_length
    room = student.seq_len - T
    if room < 1:
        raise UsageError(
            f"--max-completion-length {T} leaves no room for a prompt in --max-seq-len "
            f"{student.seq_len}; give --max-completion-length below {student.seq_len}"
        )
    kind = "messages" if pf.conversational else "prompt"
    side = text_side(cfg, student.base, kind, notes)
    encode = PromptEncoder(side, room)
    items = [(p, encode(p)) for p in pf.prompts]
    train, val = hold_out(items, cfg.seed, notes, "prompt", "--prompts") if held else (items, [])
    if encode.cut:
        notes.append(f"{plural(encode.cut, 'prompt')} cut from the left to {room} tokens")
    stops = student.base.special.reply_stops()
    who = []
    if cfg.lmbda:
        who.append(
            "every micro-batch the student's"
            if cfg.lmbda == 1
            else f"a share of {cfg.lmbda:g} of the micro-batches the student's"
        )
    if cfg.seq_kd:
        who.append("the rest the teacher's" if cfg.lmbda else "every one the teacher's")
    notes.append(
        f"{path}: {plural(len(train), 'prompt')}, completions of up to {T} tokens at "
        f"temperature {cfg.temperature:g}: " + ", ".join(who)
    )
    val = val[: cfg.eval_batches * cfg.batch_size]
    return Sampled(cfg, train, val, stops, side.pad)


def read_teacher(cfg: RunConfig, path: Path) -> tuple[Base, torch.nn.Module, str, str]:
    """The teacher, frozen, held as --teacher-dtype asks: its own quantized blocks (a float
    file: its own dtype), or dequantized once (auto: as adapter.base_dtype decides for a
    LoRA base). Returns the base, the model, the dtype it is held in and auto's reason."""
    if not path.exists():
        raise InputError(f"--teacher {path}: no such file or directory; give a model to learn from")
    try:
        base_kind(path)
        base = read_base(path, "quantized")
    except (InputError, UsageError) as e:
        said = e.message.removeprefix(f"{path}: ").removeprefix(f"{path} ")
        raise InputError(f"--teacher {path}: {said}")
    blocks = any(t not in ("F32", "F16", "BF16") for t in base.tensor_types)
    dtype, why = base_dtype(cfg, base.float32_bytes() // 2 if blocks else None, "teacher_dtype")
    if dtype != "quantized" and blocks:
        base = held_as(base, path, dtype)
    model = base.build_model().requires_grad_(False).eval()
    del base.state_dict
    return base, model, dtype if blocks else "its own", why


def build(cfg: RunConfig, project: Project) -> Built:
    teacher_path = Path(cfg.teacher).resolve()
    t_base, teacher, t_dtype, held_why = read_teacher(cfg, teacher_path)
    if cfg.keep_layers is not None:
        student = shrunk_student(cfg, teacher_path)
        where = "the shrunk student"
    elif cfg.init:
        student = fresh_student(cfg, t_base, teacher_path)
        where = "the fresh student"
    else:
        student = lora_student(cfg, project)
        where = f"--model {cfg.model}"
    rows = student.base.config.vocab_size
    if why := vocabulary_problem(t_base, student.base.tokenizer, rows, where):
        raise UsageError(why)
    sparse_tied_rows(student.model)
    notes = list(student.notes) + ([held_why] if held_why else [])
    held = "its own dtype" if t_dtype == "its own" else t_dtype
    notes.append(
        f"teacher {teacher_path.name}: {t_base.arch}, {t_base.config.n_layer} blocks, frozen, "
        f"held {held} ({resident_bytes(teacher) / 1e9:.2f} GB resident); generalized JSD beta "
        f"{cfg.beta:g}{DIVERGENCES.get(cfg.beta, '')} at temperature {cfg.temperature:g}"
        + (f", {cfg.ce_weight:g} x the data's cross-entropy" if cfg.ce_weight else "")
    )
    d = dist.info()
    stream, info = None, {}
    if cfg.data:
        stream = chat_data(cfg, student.base, student.seq_len, notes)
        unit, per_step = "batches", d.world * cfg.grad_accum
    elif cfg.corpus:
        stream = token_stream(cfg, project, student.base.tokenizer, teacher_path, student.seq_len)
        unit, per_step = "rows", cfg.batch_size * d.world * cfg.grad_accum
    sampled = prompt_side(cfg, student, stream is None, notes) if cfg.prompts else None
    if stream is None:  # every batch sampled: an epoch is a pass over the prompts
        n_batches, unit, per_step = sampled.batches.n_batches, "batches of prompts", cfg.grad_accum
    else:
        n_batches, info = stream.n_batches, stream.info
    if sampled is not None:
        info = {
            **info,
            "prompts": str(cfg.prompts),
            **data_fingerprints("prompts", Path(cfg.prompts)),
            "lmbda": cfg.lmbda,
            "seq_kd": bool(cfg.seq_kd),
            "max_completion_length": cfg.max_completion_length,
        }
    config = {
        **student.config,
        **info,
        "recipe": "distill",
        "teacher": str(teacher_path),
        "teacher_sha256": base_fingerprint(teacher_path),
        "teacher_dtype": t_dtype,
        "beta": cfg.beta,
        "temperature": cfg.temperature,
        "ce_weight": cfg.ce_weight,
        "seq_len": student.seq_len,
    }
    derived = {"seq_len": student.seq_len}
    epochs, note = cfg.epoch_steps(n_batches, per_step, unit)
    derived.update(epochs)
    notes += [note] if note else []
    if cfg.teacher_top_k is not None:
        K, V = cfg.teacher_top_k, t_base.config.vocab_size
        if K >= V:
            raise UsageError(
                f"--teacher-top-k {K}: the teacher has {V:,} tokens; give K below that "
                "(16 or 64 keep most of a position's mass)"
            )
        mb = info["supervised_tokens"] * (8 * K + 4) / 1e6
        notes.append(
            f"the teacher kept as its top {K} at each of {info['supervised_tokens']:,} "
            f"supervised positions (about {mb:,.1f} MB, {TOPK_FILE} in the run), made before "
            "step 1; the teacher is then let go"
        )
    job = DistillJob(cfg, student, teacher, stream, sampled, config)
    n_train = sum(p.numel() for p in student.model.parameters() if p.requires_grad)
    notes.append(f"{plural(n_train, 'trainable parameter')}")
    arch = "llama" if cfg.init else t_base.arch if student.adapted is None else student.base.arch
    return Built(
        job=job, arch=arch, params=count_params(student.model), notes=notes, derived=derived
    )


RECIPE = Recipe(
    "distill",
    build,
    defaults=DEFAULTS,
    flags=FLAGS,
    check=check,
    batch_unit=lambda cfg: "batches" if cfg.data else "rows",
    figures=FIGURES,
)
