"""Distillation: a student taught by the model the user runs (--teacher: a GGUF file, a
transformers or an MLX directory), the teacher read as a LoRA base is: frozen, kept in its
quantized blocks (no float copy), run without gradients.

The student is a LoRA adapter on --model BASE (a smaller base with the teacher's
vocabulary), or a shrunk copy of the teacher (--keep-layers N: N of its blocks, evenly
spaced, the first and last kept; or a list of indices: DistilBERT's and Minitron's
start), all of whose weights train. Off-policy: at every supervised position of the data
(lora's forms: chat JSONL, prompt/completion, {"text"}, or a token corpus) the student's
next-token distribution is pulled toward the teacher's by the generalized JSD
(models/losses.py: generalized_jsd, TRL's GKD meaning of --beta) at --temperature,
computed in chunks of positions (distill_divergence: neither model's logits exist
whole), mixed with the data's own cross-entropy by --ce-weight.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from toy.errors import InputError, UsageError
from toy.formats.base import Base
from toy.formats.base_readers import base_kind, read_base
from toy.formats.hf_dir import base_fingerprint
from toy.formats.model_dir import save_model_dir
from toy.models.losses import distill_divergence, head_cross_entropy
from toy.models.quant import count_params, resident_bytes
from toy.recipes.adapter import (
    ADAPTER_DEFAULTS,
    adapter_flags,
    chat_data,
    check_adapter_opts,
    load_adapted,
    save_adapter,
    token_stream,
)
from toy.runs import Project, plural
from toy.train import dist
from toy.train.config import RunConfig
from toy.train.job import Built, Job
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
        "beta",
        0.5,
        "the generalized JSD's beta (TRL's meaning): 0 the forward KL(teacher || student), "
        "1 the reverse KL, 0.5 the JSD",
        float,
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
)
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
    if not cfg.data and not cfg.corpus:
        p.append("give --data chat.jsonl or --corpus tokens.bin")
    if cfg.data and cfg.corpus:
        p.append("--data and --corpus conflict: give one")
    if cfg.keep_layers is not None and cfg.model:
        p.append(
            "--keep-layers (a shrunk copy of the teacher) and --model (a LoRA adapter on "
            "another base) are two students: give one"
        )
    if cfg.keep_layers is None and not cfg.model:
        p.append(
            "give the student: --model BASE (a LoRA adapter on a smaller base with the "
            "teacher's vocabulary) or --keep-layers N (a shrunk copy of the teacher)"
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


def lora_student(cfg: RunConfig, project: Project) -> Student:
    a = load_adapted(cfg, project, "distill")
    return Student(a.model, a.base, a.seq_len, dict(a.config), a.notes, a)


def shrunk_student(cfg: RunConfig, teacher_path: Path) -> Student:
    """A float32 copy of the teacher's embedding, kept blocks, final norm and head, every
    weight trainable, its blocks renumbered 0..N-1."""
    base = read_base(teacher_path, "float32")
    n = base.config.n_layer
    keep = kept_blocks(cfg.keep_layers, n)
    sd = {}
    for name, t in base.state_dict.items():
        head, i, rest = (name.split(".", 2) + ["", ""])[:3]
        if head == "layers" and i.isdigit():  # a block's tensor (toy's names are HF's)
            if int(i) not in keep:
                continue
            name = f"layers.{keep.index(int(i))}.{rest}"
        sd[name] = t.clone()  # its own memory: the file's pages are never written
    config = dataclasses.replace(base.config, n_layer=len(keep))
    small = dataclasses.replace(base, config=config, state_dict=sd)
    torch.manual_seed(cfg.seed)
    model = small.build_model()
    for p in model.parameters():
        p.requires_grad_(True)
    seq_len = min(cfg.seq_len, base.config.max_seq_len)
    notes = [
        f"student: {base.path.name} shrunk to {len(keep)} of its {n} blocks "
        f"({', '.join(map(str, keep))}), {plural(count_params(model), 'parameter')}, all trained"
    ]
    record = {"student": "shrunk", "keep_layers": keep, "student_model": config.to_dict()}
    return Student(model, small, seq_len, record, notes)


# ------------------------------------------------------------------ the job


class DistillJob(Job):
    """Off-policy distillation: the data's batches (ids, targets) as lora makes them; the
    loss at every supervised position is (1 - A) x the generalized JSD to the teacher +
    A x the cross-entropy on the data, normalised by the supervised tokens of the step.
    Held out: the cross-entropy (val_loss), the divergence, the top-1 agreement with the
    teacher, and once the teacher's own cross-entropy."""

    def __init__(self, cfg: RunConfig, student: Student, teacher: torch.nn.Module, stream, config):
        super().__init__("distill", student.model, config)
        self.cfg, self.student, self.teacher, self.stream = cfg, student, teacher, stream
        self.sums = torch.zeros(3, dtype=torch.float64)  # divergence, agreeing, tokens: a step's
        self.held = torch.zeros(3, dtype=torch.float64)  # the same, an evaluation's
        self.teacher_ce: float | None = None  # its held-out cross-entropy, once known
        self.teacher_sum = 0.0  # its summed cross-entropy over the first evaluation

    def bind(self, device, precision) -> None:
        super().bind(device, precision)
        self.teacher.to(device)

    def micro_batch(self, k: int, live=None) -> dict[str, torch.Tensor]:
        return self.stream.micro_batch(k)

    def eval_batches(self) -> list[dict[str, torch.Tensor]]:
        return self.stream.evals

    def _positions(self, model, b) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states (N, C), targets (N,)) at the batch's supervised positions (the
        loop prepares every batch: Job.prepare's sup_idx)."""
        idx = b["sup_idx"]
        h = model.hidden(b["ids"]).flatten(0, 1).index_select(0, idx)
        return h, b["targets"].flatten().index_select(0, idx)

    def loss(self, model, b):
        cfg = self.cfg
        h, tgt = self._positions(model, b)
        with torch.no_grad():
            h_t, _ = self._positions(self.teacher, b)
        caps = (model.final_softcap, self.teacher.final_softcap)
        div, agree = distill_divergence(
            h, model.lm_head, h_t, self.teacher.lm_head, cfg.beta, cfg.temperature, caps
        )
        ce = head_cross_entropy(h, model.lm_head, tgt, model.final_softcap)
        seen = torch.stack([div.detach().double(), agree.double(), h.new_tensor(len(tgt)).double()])
        if model.training:
            self.sums += seen.cpu()
            total = (1 - cfg.ce_weight) * div + cfg.ce_weight * ce
        else:  # held out: the loss is the data's cross-entropy (val_loss)
            self.held += seen.cpu()
            if self.teacher_ce is None:  # the first evaluation: the teacher's own, once
                t_ce = head_cross_entropy(h_t, self.teacher.lm_head, tgt, caps[1])
                self.teacher_sum += float(t_ce)
            total = ce
        return total, torch.tensor(len(tgt))

    def _take(self, sums: torch.Tensor, across: bool) -> dict[str, float]:
        s = dist.all_sum(sums.to(self.device)).cpu() if across else sums
        if s[2] == 0:
            return {}
        return {"divergence": float(s[0] / s[2]), "agreement": float(s[1] / s[2])}

    def step_figures(self) -> dict[str, float]:
        sums, self.sums = self.sums, torch.zeros(3, dtype=torch.float64)
        return self._take(sums, across=True)

    @torch.no_grad()
    def eval_figures(self, model, batches) -> dict[str, float]:
        held, self.held = self.held, torch.zeros(3, dtype=torch.float64)
        out = self._take(held, across=False)
        if self.teacher_ce is None and held[2] > 0:  # from the same pass as the student's
            self.teacher_ce = self.teacher_sum / float(held[2])
            out["teacher_val_loss"] = self.teacher_ce
        return out

    def save_final(self, out: Path) -> None:
        s = self.student
        if s.adapted is not None:  # a LoRA student: its adapter, as lora's final/
            save_adapter(self.cfg, s.adapted, out)
            return
        extra = {"recipe": "distill", "train": self.config}
        save_model_dir(out, self.model, extra=extra, tokenizer=s.base.tokenizer)


def read_teacher(path: Path) -> tuple[Base, torch.nn.Module]:
    """The teacher, frozen, in its own quantized blocks (a float file: its own dtype)."""
    if not path.exists():
        raise InputError(f"--teacher {path}: no such file or directory; give a model to learn from")
    try:
        base_kind(path)
        base = read_base(path, "quantized")
    except (InputError, UsageError) as e:
        said = e.message.removeprefix(f"{path}: ").removeprefix(f"{path} ")
        raise InputError(f"--teacher {path}: {said}")
    model = base.build_model().requires_grad_(False).eval()
    del base.state_dict
    return base, model


def build(cfg: RunConfig, project: Project) -> Built:
    teacher_path = Path(cfg.teacher).resolve()
    t_base, teacher = read_teacher(teacher_path)
    if cfg.keep_layers is not None:
        student = shrunk_student(cfg, teacher_path)
        where = "the shrunk student"
    else:
        student = lora_student(cfg, project)
        where = f"--model {cfg.model}"
    rows = student.base.config.vocab_size
    if why := vocabulary_problem(t_base, student.base.tokenizer, rows, where):
        raise UsageError(why)
    notes = list(student.notes)
    notes.append(
        f"teacher {teacher_path.name}: {t_base.arch}, {t_base.config.n_layer} blocks, frozen "
        f"({resident_bytes(teacher) / 1e9:.2f} GB resident); generalized JSD beta "
        f"{cfg.beta:g} at temperature {cfg.temperature:g}"
        + (f", {cfg.ce_weight:g} x the data's cross-entropy" if cfg.ce_weight else "")
    )
    d = dist.info()
    if cfg.data:
        stream = chat_data(cfg, student.base, student.seq_len, notes)
        unit, per_step = "batches", d.world * cfg.grad_accum
    else:
        stream = token_stream(cfg, project, student.base.tokenizer, teacher_path, student.seq_len)
        unit, per_step = "rows", cfg.batch_size * d.world * cfg.grad_accum
    config = {
        **student.config,
        **stream.info,
        "recipe": "distill",
        "teacher": str(teacher_path),
        "teacher_sha256": base_fingerprint(teacher_path),
        "beta": cfg.beta,
        "temperature": cfg.temperature,
        "ce_weight": cfg.ce_weight,
        "seq_len": student.seq_len,
    }
    derived = {"seq_len": student.seq_len}
    epochs, note = cfg.epoch_steps(stream.n_batches, per_step, unit)
    derived.update(epochs)
    notes += [note] if note else []
    job = DistillJob(cfg, student, teacher, stream, config)
    n_train = sum(p.numel() for p in student.model.parameters() if p.requires_grad)
    notes.append(f"{plural(n_train, 'trainable parameter')}")
    arch = t_base.arch if student.adapted is None else student.base.arch
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
