"""GRPO: a LoRA adapter on a frozen base, trained from rewards (group relative policy
optimisation, as TRL's GRPOTrainer). Each step, every prompt of the batch gets
--num-generations completions sampled from the live policy (base + adapter, the adapter
applied unmerged inside the decode: models/sample.py), the reward functions score them
(data/rewards.py: TRL's signature), each completion's advantage is its reward against its
group's, and the clipped surrogate (models/losses.py: grpo_token_losses, grpo_loss_sum)
pushes the policy toward the better ones. With --beta > 0 a k3 KL term holds it near the
reference: the same base with the adapter switched off, no second model.

Batches come from the live model (Job.live): sampled when their step starts, with a
generator seeded by (seed, global micro-batch), so the same seed gives the same completions
on any number of processes and a killed run resumes to the same losses; with
--num-iterations MU a generation is reused for MU steps against the log-probs of the policy
that sampled it, and kept in each checkpoint (Job.state, every process's own) so a resume
between them reuses it too. Advantages are set once every micro-batch of the step is made
(Job.whole_step): --scale-rewards batch divides by the spread of all of the step's rewards.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from toy.data.prompts import (
    Prompt,
    PromptBatches,
    PromptEncoder,
    columns,
    completion_rows,
    no_prompts,
    read_prompts,
)
from toy.data.rewards import (
    BUILTINS,
    DEFAULT_FORMAT,
    DEFAULT_TARGET_LENGTH,
    Logs,
    State,
    check_columns,
    parse_reward,
    score,
)
from toy.data.streams import data_files, hold_out
from toy.errors import ToyError, UsageError
from toy.lora import disable_adapter
from toy.models.losses import (
    GRPO_LOSS_TYPES,
    GRPO_SCALES,
    group_advantages,
    grpo_loss_sum,
    grpo_token_losses,
)
from toy.models.sample import sample_groups
from toy.recipes.adapter import (
    ADAPTER_DEFAULTS,
    AdapterJob,
    adapter_flags,
    check_adapter_opts,
    load_adapted,
    text_side,
)
from toy.recipes.scoring import completion_logps
from toy.runs import Project, data_fingerprints, file_sha256, plural
from toy.train import dist
from toy.train.config import RunConfig
from toy.train.device import autocast
from toy.train.job import Built
from toy.train.recipe import Figure, Flag, Recipe

DATA_HELP = (
    'prompts, one JSON object a line (TRL\'s forms): {"prompt": "..."} (a user turn through '
    'the chat template where the model has one) or {"prompt": [{"role", "content"}, ...]}; '
    'every other key (e.g. "answer") is a column the reward functions get; or a directory '
    "holding train.jsonl and valid.jsonl (no default). --batch-size counts prompts"
)
REWARD_HELP = (
    f"a reward function, repeatable: a built-in ({', '.join(BUILTINS)}: the final answer "
    'against the "answer" column; --format-regex; the distance to --target-length tokens) or '
    "path/to/file.py:FUNCTION with TRL's signature fn(prompts, completions, **columns) -> "
    "list[float | None], each with an optional :WEIGHT (e.g. --reward accuracy:2)"
)


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


FLAGS = (
    *adapter_flags(DATA_HELP),
    Flag("reward", None, REWARD_HELP, str, many=True, metavar="SPEC", shown=": none, required"),
    Flag(
        "num_generations",
        8,
        "completions sampled for each prompt (the group its advantages are measured in)",
        int,
        check=lambda v: _positive_int(v) and v >= 2,
        must="be an integer >= 2",
        metavar="G",
    ),
    Flag(
        "temperature",
        1.0,
        "sampling temperature (the log-probs are taken at it too, as TRL's)",
        float,
        check=lambda v: v > 0,
        must="be > 0",
    ),
    Flag(
        "top_p",
        1.0,
        "nucleus sampling's mass",
        float,
        check=lambda v: 0 < v <= 1,
        must="be in (0, 1]",
    ),
    Flag(
        "max_completion_length",
        256,
        "new tokens a completion may have; it ends at its EOS before",
        int,
        check=_positive_int,
        must="be an integer >= 1",
        metavar="N",
    ),
    Flag(
        "scale_rewards",
        "group",
        "what a completion's advantage (its reward minus its group's mean) is divided by: the "
        "group's std, the batch's std, or nothing",
        choices=GRPO_SCALES,
    ),
    Flag(
        "epsilon",
        0.2,
        "the ratio's clip below and above 1",
        float,
        check=lambda v: 0 < v < 1,
        must="be in (0, 1)",
    ),
    Flag(
        "epsilon_high",
        None,
        "the ratio's clip above 1 (DAPO's clip-higher)",
        float,
        shown=": --epsilon",
        check=lambda v: v > 0,
        must="be > 0",
    ),
    Flag(
        "loss_type",
        "dapo",
        "how the token losses are averaged: grpo (each completion's mean), bnpo or dapo (over "
        "the tokens of the step), dr_grpo (over completions x --max-completion-length)",
        choices=GRPO_LOSS_TYPES,
    ),
    Flag(
        "beta",
        0.0,
        "weight of the k3 KL estimate to the reference (the base with the adapter off); 0: "
        "no reference pass",
        float,
        check=lambda v: v >= 0,
        must="be >= 0",
    ),
    Flag(
        "num_iterations",
        1,
        "optimizer steps each generation is used for (against the log-probs of the policy "
        "that sampled it)",
        int,
        check=_positive_int,
        must="be an integer >= 1",
        metavar="MU",
    ),
    Flag(
        "format_regex",
        None,
        "the format reward's pattern (a full match)",
        shown=f": {DEFAULT_FORMAT}",
    ),
    Flag(
        "target_length",
        DEFAULT_TARGET_LENGTH,
        "the length reward's target, in tokens",
        int,
        check=_positive_int,
        must="be an integer >= 1",
    ),
    Flag(
        "reward_changed",
        False,
        "with --resume: go on although a --reward file's code changed since the run started "
        "(a resume refuses that otherwise; run.json records the change)",
        bool,
    ),
)
# GRPO's step is most of all sampling: a few prompts a step, a gentler LR than SFT's (the
# updates follow noisy advantages), no warmup to speak of on a short run.
DEFAULTS = {**ADAPTER_DEFAULTS, "batch_size": 4, "lr": 5e-5, "min_lr": 5e-6, "warmup": 0}
# The reward on the done line and in --json's val_rewards (each function's beside it).
FIGURES = (
    Figure(
        "reward", "held-out mean reward", final=True, json_key="val_rewards", every=True, plot=True
    ),
)


def check(cfg: RunConfig) -> list[str]:
    p = [] if cfg.data else ["give --data prompts.jsonl (or a directory of train/valid.jsonl)"]
    if not cfg.reward:
        p.append(
            f"give --reward SPEC (a built-in: {', '.join(BUILTINS)}; or path/to/file.py:FUNCTION)"
        )
    if cfg.corpus:
        p.append("--corpus is a token file; grpo trains on --data prompts.jsonl")
    if cfg.seq_len is not None and cfg.max_completion_length is not None:
        if cfg.max_completion_length >= cfg.seq_len:
            p.append(
                f"--max-completion-length {cfg.max_completion_length} leaves no room for a "
                f"prompt in --max-seq-len {cfg.seq_len}; raise --max-seq-len or lower it"
            )
    return p + check_adapter_opts(cfg)


@dataclass
class StepStats:
    """A step's figures, gathered as its batches are made and its loss runs."""

    rewards: list = field(default_factory=list)  # total reward a completion (NaN: unscored)
    funcs: dict = field(default_factory=dict)  # function name -> its rewards
    lengths: list = field(default_factory=list)
    cut: list = field(default_factory=list)  # True: cut at --max-completion-length
    stats: list = field(default_factory=list)  # grpo_token_losses' stats a micro-batch
    metrics: dict = field(default_factory=dict)  # a reward's log_metric name -> its values

    def add_batch(self, b: dict[str, torch.Tensor], names: list[str]) -> None:
        """A micro-batch's completions: their rewards (each function's, `names` in order),
        lengths and cuts, as the batch carries them (fig.*)."""
        self.rewards += b["fig.reward"].tolist()
        for j, name in enumerate(names):
            self.funcs.setdefault(name, []).extend(b[f"fig.func{j}"].tolist())
        self.lengths += b["fig.length"].tolist()
        self.cut += b["fig.cut"].tolist()
        for k, v in b.items():
            if k.startswith(METRIC):
                self.metrics.setdefault(k.removeprefix(METRIC), []).extend(v.tolist())

    def add_loss(self, stats: dict[str, torch.Tensor]) -> None:
        """grpo_token_losses' statistics of a micro-batch (detached)."""
        self.stats.append(stats)

    def take(self) -> dict[str, float]:
        """The step's figures over every process's completions (a collective: every rank
        calls it after each step), then empty for the next step."""
        mine = (self.rewards, self.funcs, self.lengths, self.cut, self._token_sums(), self.metrics)
        self.__init__()
        rewards, funcs, lengths, cut, sums, metrics = [], {}, [], [], {}, {}
        for r, f, n, c, t, m in dist.all_gather(mine):
            rewards += r
            lengths += n
            cut += c
            for name, vals in f.items():
                funcs.setdefault(name, []).extend(vals)
            for name, vals in m.items():
                metrics.setdefault(name, []).extend(vals)
            for key, v in t.items():
                sums[key] = sums.get(key, 0.0) + v
        if not rewards:
            return {}
        r = np.array(rewards, dtype=np.float64)
        out = {
            "reward": _nanmean(r),
            "reward_std": float(np.nanstd(r)) if np.isfinite(r).any() else float("nan"),
        }
        for name, vals in funcs.items():
            out[name] = _nanmean(vals)
        n = np.array(lengths)
        out.update(
            completion_length=float(n.mean()),
            completion_length_min=float(n.min()),
            completion_length_max=float(n.max()),
            clipped_share=float(np.mean(cut)),
        )
        tokens = sums.get("tokens") or 1.0
        for key, name in (("clip_ratio/region", "clip_ratio"), ("kl", "kl")):
            if key in sums:
                out[name] = sums[key] / tokens
        for name, vals in metrics.items():  # what the reward functions' log_metric said
            out.setdefault(name, _nanmean(vals))
        return out

    def _token_sums(self) -> dict[str, float]:
        """The loss's statistics of this process, each summed over its tokens."""
        out: dict[str, float] = {}
        for st in self.stats:
            tokens = float(st["tokens"])
            out["tokens"] = out.get("tokens", 0.0) + tokens
            for key in ("clip_ratio/region", "kl"):
                if key in st:
                    out[key] = out.get(key, 0.0) + float(st[key]) * tokens
        return out


class Generations:
    """The generation a step's micro-batches were sampled in, kept for reuse while
    --num-iterations MU > 1: step s uses the batches sampled at step s - s % MU. What a
    checkpoint keeps of it (state) and what a resume restores (load_state) is every
    process's own."""

    def __init__(self, reuse: int):
        self.reuse = reuse  # MU
        self.batches: dict[int, dict[str, torch.Tensor]] = {}  # micro-batch m -> its batch
        self.step = -1  # the 0-based step that sampled them

    def of(self, s: int) -> int:
        """The 0-based step whose generation step s uses."""
        return s - s % self.reuse

    def get(self, s: int, m: int) -> dict[str, torch.Tensor] | None:
        """Micro-batch m of step s's generation where it is kept, else None."""
        if self.of(s) != self.step:
            self.batches.clear()
            self.step = self.of(s)
        return self.batches.get(m)

    def keep(self, m: int, b: dict[str, torch.Tensor]) -> None:
        if self.reuse > 1:
            self.batches[m] = b

    def state(self) -> dict[str, torch.Tensor]:
        if self.reuse == 1:
            return {}
        out = {"generation": torch.tensor([self.step])}
        for m, b in self.batches.items():
            out.update({f"{m}.{k}": v.contiguous() for k, v in b.items()})
        return out

    def load_state(self, saved: list[dict[str, torch.Tensor]], per_step: int, d) -> None:
        """The micro-batches this process needs from every saved process's: global
        micro-batch m * world + rank of a step is the same whatever the process count
        (prompts_of, the loop's live seeds), so a run resumed on another number of
        processes takes each from the rank that made it."""
        self.batches.clear()
        steps = {int(st["generation"]) for st in saved if "generation" in st}
        self.step = steps.pop() if len(steps) == 1 else -1
        if self.step < 0:
            return
        for m in range(per_step):
            g = m * d.world + d.rank
            src, was = saved[g % len(saved)], g // len(saved)
            mine = {k.split(".", 1)[1]: v for k, v in src.items() if k.startswith(f"{was}.")}
            if mine:
                self.batches[m] = mine


class GRPOJob(AdapterJob):
    """GRPO's run, in the order a step meets it: micro_batch samples the completions of a
    batch of prompts (or takes them from the kept generation), scores them and lays them
    out; whole_step sets their advantages once every micro-batch of every process is made;
    loss is the clipped surrogate over their tokens; step_figures the step's rewards and
    lengths; eval_figures each reward's mean over one greedy completion a held-out prompt."""

    items_name = "completion_tokens"
    live = True
    eval_loss = False

    def __init__(self, a, cfg, config, train, val, rewards, stops, side, state):
        super().__init__("grpo", a, cfg, config)
        self.units = "completion tokens" if cfg.loss_type in ("dapo", "bnpo") else "completions"
        self.train, self.val, self.rewards, self.stops = train, val, rewards, stops
        self.tok, self.pad = side.tok, side.pad
        self.reward_state = state  # what reward functions get as trainer_state
        self.group = cfg.num_generations
        self.length = cfg.max_completion_length
        self.per = cfg.batch_size  # prompts a micro-batch
        self.accum = cfg.grad_accum
        self.eps_high = cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
        self.d = dist.info()
        self.batches = PromptBatches(train, self.per, cfg.seed, self.d.world, self.d.rank)
        self.n_batches = self.batches.n_batches
        self.generations = Generations(cfg.num_iterations)
        self.stats = StepStats()
        self.completions = CompletionLog(None)
        self.shown: list[dict] = []  # the last sampled batch's completions, as rows
        self.done = 0  # the step of the latest batches made (0: none yet)

    # ------------------------------------------------------------ batches

    def prompts_of(self, j: int) -> list[tuple[Prompt, list[int]]]:
        """Global prompt batch j's share of this process: each epoch a fresh order."""
        return self.batches(j)

    def micro_batch(self, k: int, live=None) -> dict[str, torch.Tensor]:
        s, m = divmod(k, self.accum)  # optimizer step (0-based), micro-batch within it
        self.done = s + 1  # the step these batches are for (an evaluation after it: its)
        b = self.generations.get(s, m)
        if b is None:
            gen = self.generations.of(s) // self.generations.reuse  # the generation's number
            b = self.sample(self.prompts_of(gen * self.accum + m), live, s + 1)
            self.generations.keep(m, b)
            if m == 0:  # the first micro-batch's first few, a fresh generation's
                self.completions.write(s + 1, "train", self.shown[:SHOWN])
        self.stats.add_batch(b, [r.name for r in self.rewards])  # a reused one's again
        return b

    def sample(self, group: list[tuple[Prompt, list[int]]], live, step: int) -> dict:
        """Sample `group` completions a prompt, score them, and lay the batch out."""
        G = self.group
        groups = sample_groups(
            live.model,
            [ids for _, ids in group],
            G,
            self.length,
            temperature=self.cfg.temperature,
            top_p=self.cfg.top_p,
            generator=live.generator,
            stop_ids=self.stops,
            max_rows=len(group) * G,
        )  # every completion of the step in one batch
        comps = [c for g in groups for c in g]
        prompts = [p for p, _ in group for _ in range(G)]
        self.reward_state.global_step = step - 1
        cols = {
            k: [v for v in vs for _ in range(G)] for k, vs in columns([p for p, _ in group]).items()
        }
        logs = Logs()
        per_func, total, texts = self.score([p.value for p in prompts], comps, cols, step, logs)
        self.shown = shown_rows(prompts, texts, total, per_func, self.rewards, logs)
        b = completion_rows([ids for _, ids in group for _ in range(G)], comps, self.pad)
        for name, vals in logs.metrics.items():  # ride in the batch, as every figure does
            b[METRIC + name] = torch.tensor([float(v) for v in vals], dtype=torch.float64)
        # The figures ride in the batch: a reused generation (--num-iterations), kept in a
        # checkpoint, shows the same ones again after a resume.
        b["fig.reward"] = torch.tensor(total, dtype=torch.float32).double()
        b["fig.length"] = torch.tensor([len(c.ids) for c in comps])
        b["fig.cut"] = torch.tensor([not c.stopped for c in comps])
        for j, vals in enumerate(per_func):
            b[f"fig.func{j}"] = torch.tensor(vals, dtype=torch.float64)
        on = {k: v.to(live.device) for k, v in b.items()}
        if self.generations.reuse > 1:  # the sampling policy's log-probs, for later reuse
            b["old"] = self.logps(live.model, on).float().cpu()
        if self.cfg.beta > 0:  # the reference: the base with the adapter off
            with disable_adapter(live.model):
                b["ref"] = self.logps(live.model, on).float().cpu()
        _, b["count"] = grpo_loss_sum(
            torch.zeros_like(b["mask"]), b["mask"], self.cfg.loss_type, self.length
        )
        return b

    def score(self, prompts: list, comps: list, cols: dict, step: int, logs: Logs):
        """(each reward's values, the weighted total, the texts) of completions `comps`;
        what the reward functions log goes to `logs`."""
        texts = [self.tok.decode(c.ids, skip_special_tokens=True) for c in comps]
        try:
            per_func, total = score(
                self.rewards, prompts, texts, [c.ids for c in comps], cols,
                self.reward_state, logs,
            )  # fmt: skip
        except ToyError as e:  # a reward function's: say when it came
            e.step = step
            raise
        return per_func, total, texts

    def whole_step(self, batches: list[dict]) -> list[dict]:
        """The advantages of a step's new generation, once every micro-batch of every
        process is made: with --scale-rewards batch, divided by the spread of all of the
        step's rewards (a collective), so accumulation and the process count never change
        the objective. A reused generation (--num-iterations) keeps its own."""
        fresh = [b for b in batches if "adv" not in b]
        rewards = [b["fig.reward"].float() for b in fresh]
        every = None
        if self.cfg.scale_rewards == "batch":  # every process takes part, each step
            parts = [r for mine in dist.all_gather(rewards) for r in mine]
            every = torch.cat(parts) if parts else None
        for b, r in zip(fresh, rewards):
            b["adv"] = group_advantages(r, self.group, self.cfg.scale_rewards, every)
        return batches

    def prepare(self, batch):
        return batch

    def count(self, batch) -> int:
        return int(batch["count"])

    def n_items(self, batch) -> int:
        return int(batch["mask"].sum())

    # ------------------------------------------------------------ loss and figures

    def logps(self, model, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return completion_logps(model, b, self.cfg.temperature)

    def loss(self, model, b):
        cfg = self.cfg
        lp = self.logps(model, b)
        per_token, st = grpo_token_losses(
            lp, b.get("old"), b.get("ref"), b["adv"], b["mask"], cfg.epsilon, self.eps_high,
            cfg.beta,
        )  # fmt: skip
        self.stats.add_loss({k: v.detach() for k, v in st.items()})
        return grpo_loss_sum(per_token, b["mask"], cfg.loss_type, self.length)

    def step_figures(self) -> dict[str, float]:
        return self.stats.take()

    def eval_batches(self) -> list[dict[str, torch.Tensor]]:
        """The held-out prompts, by index: eval_figures samples their completions."""
        return [{"prompt": torch.arange(len(self.val))}] if self.val else []

    @torch.no_grad()
    def eval_figures(self, model, batches) -> dict[str, float]:
        """Each reward's mean on the held-out prompts: one greedy completion each."""
        val = [self.val[int(i)] for b in batches for i in b["prompt"]]
        with autocast(self.device, self.precision):
            groups = sample_groups(
                model, [ids for _, ids in val], 1, self.length, temperature=0.0,
                generator=None, stop_ids=self.stops,
            )  # fmt: skip
        comps = [g[0] for g in groups]
        cols = columns([p for p, _ in val])
        logs = Logs()
        prompts = [p for p, _ in val]
        per_func, total, texts = self.score(
            [p.value for p in prompts], comps, cols, self.step_now(), logs
        )
        self.completions.write(
            self.done,
            "eval",
            shown_rows(prompts, texts, total, per_func, self.rewards, logs),
        )  # every held-out prompt's greedy completion
        out = {"reward": _nanmean(total)}
        for r, vals in zip(self.rewards, per_func):
            out[r.name] = _nanmean(vals)
        for name, vals in logs.metrics.items():
            out.setdefault(name, _nanmean([float(v) for v in vals]))
        out["completion_length"] = float(np.mean([len(c.ids) for c in comps]))
        return out

    def bind(self, device, precision, run_dir=None) -> None:
        super().bind(device, precision, run_dir)
        if run_dir is not None and self.d.is_main:
            self.completions = CompletionLog(run_dir / COMPLETIONS, self.events)

    def step_now(self) -> int:
        return self.reward_state.global_step + 1

    # ------------------------------------------------------------ checkpoints

    def state(self) -> dict[str, torch.Tensor]:
        return self.generations.state()

    def load_state(self, states: list[dict[str, torch.Tensor]]) -> None:
        self.generations.load_state(states, self.accum, self.d)


METRIC = "fig.metric."  # a batch's values of a reward's log_metric(name, value)
COMPLETIONS = "completions.jsonl"
SHOWN = 4  # completions of each step written to completions.jsonl


def shown_rows(prompts, texts, total, per_func, rewards, logs) -> list[dict]:
    """Each completion as completions.jsonl shows it: its prompt, its text, its reward
    and each function's, and what the reward functions' log_extra gave it."""
    rows = []
    for i, (p, text) in enumerate(zip(prompts, texts)):
        row = {
            "prompt": p.value,
            "completion": text,
            "reward": _finite(total[i]),
            "rewards": {r.name: _finite(v[i]) for r, v in zip(rewards, per_func)},
        }
        extra = {k: v[i] for k, v in logs.extra.items() if len(v) == len(texts)}
        if extra:
            row["extra"] = extra
        rows.append(row)
    return rows


def _finite(v: float) -> float | None:
    return float(v) if math.isfinite(v) else None


class CompletionLog:
    """completions.jsonl in the run directory (the main process's): the first few
    completions of each step and every held-out prompt's greedy completion at each
    evaluation, with their rewards: what the policy writes, beside what it is paid."""

    def __init__(self, path: Path | None, events=None):
        self.path, self.events = path, events

    def write(self, step: int, split: str, rows: list[dict]) -> None:
        if self.path is None or not rows:
            return
        with open(self.path, "a", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps({"step": step, "split": split, **row}, default=str) + "\n")
        if self.events is not None:  # --report-to tensorboard: the same rows as text
            self.events.aside("completions", step=step, split=split, rows=rows)


def _nanmean(values) -> float:
    v = np.array(values, dtype=np.float64)
    return float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")


def build(cfg: RunConfig, project: Project) -> Built:
    """The job from the flags: the base and its adapters, the prompts (--data, held out
    or --val-data) encoded once, the reward functions; every input checked here."""
    a = load_adapted(cfg, project, "grpo")
    base, notes = a.base, a.notes
    data_path, val_path = data_files(cfg.data, cfg.val_data)

    def read(path):
        pf = read_prompts(path, strict=cfg.strict)
        if pf.skipped:
            notes.append(f"warning: {path}: {pf.summary()}")
        if not pf.prompts:
            raise no_prompts(path, pf)
        return pf

    train_pf = read(data_path)
    val_pf = read(val_path) if val_path is not None else None
    regex = cfg.format_regex or DEFAULT_FORMAT
    rewards = [parse_reward(s, regex, cfg.target_length) for s in cfg.reward]
    check_columns(rewards, list(columns(train_pf.prompts)), data_path)
    side = text_side(cfg, base, "messages" if train_pf.conversational else "prompt", notes)
    T = cfg.max_completion_length
    room = a.seq_len - T  # what a prompt may hold beside its completion
    if room < 1:  # the length checked is the one used: --seq-len lowered to the context
        cap = "the model's context" if a.seq_len < (cfg.seq_len or 0) else "--max-seq-len"
        raise UsageError(
            f"--max-completion-length {T} leaves no room for a prompt in {cap} of "
            f"{a.seq_len} tokens; give --max-completion-length below {a.seq_len}"
        )
    encode = PromptEncoder(side, room)
    train = [(p, encode(p)) for p in train_pf.prompts]
    val = [(p, encode(p)) for p in val_pf.prompts] if val_pf is not None else None
    if val is None:
        train, val = hold_out(train, cfg.seed, notes, "prompt")
    if encode.cut:
        notes.append(
            f"{plural(encode.cut, 'prompt')} cut from the left to {room} tokens (--max-seq-len "
            f"{a.seq_len} less --max-completion-length {T})"
        )
    val = val[: cfg.eval_batches * cfg.batch_size]
    stops = base.special.reply_stops()
    G, per, MU = cfg.num_generations, cfg.batch_size, cfg.num_iterations
    notes.append(
        f"{data_path}: {plural(len(train), 'prompt')}, {per} a micro-batch x {G} completions "
        f"of up to {T} tokens at temperature {cfg.temperature:g}; "
        f"{plural(len(val), 'held-out prompt')} (one greedy completion each at every "
        "evaluation); rewards: "
        + ", ".join(f"{r.name} x{r.weight:g}" for r in rewards)
        + ("; KL to the base with the adapter off" if cfg.beta > 0 else "")
    )
    info = {
        "data": str(cfg.data),
        **data_fingerprints("data", data_path),
        "prompts": len(train),
        "rewards": [r.spec for r in rewards],
        "num_generations": G,
        "max_completion_length": T,
        "temperature": cfg.temperature,
        "loss_type": cfg.loss_type,
        "scale_rewards": cfg.scale_rewards,
        "beta": cfg.beta,
        "num_iterations": MU,
    }
    if val_path is not None:  # a file given or found in a --data directory: checked alike
        info["val_data"] = str(val_path)
        info.update(data_fingerprints("val_data", val_path))
    # The code of each reward file, checked on resume as the data is (--reward-changed).
    info["reward_files"] = {str(r.file): file_sha256(r.file) for r in rewards if r.file}
    state = State(max_steps=cfg.steps or 0)
    job = GRPOJob(a, cfg, {**a.config, **info}, train, val, rewards, stops, side, state)
    derived = a.derived()
    # An epoch reaches every prompt: a generation takes grad_accum batches of prompts and
    # is used for MU steps.
    epochs, note = cfg.epoch_steps(job.n_batches, cfg.grad_accum, "batches of prompts", MU)
    derived.update(epochs)
    notes += [note] if note else []
    n_params, note = a.sizes()
    notes.append(note)
    return Built(
        job=job,
        arch=base.arch,
        params=n_params,
        notes=notes,
        derived=derived,
        may_change={"reward_files": "reward_changed"},
    )


RECIPE = Recipe(
    "grpo",
    build,
    defaults=DEFAULTS,
    flags=FLAGS,
    check=check,
    batch_unit=lambda cfg: "batches",
    figures=FIGURES,
    shape=False,
)
