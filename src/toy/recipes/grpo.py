"""GRPO: a LoRA adapter on a frozen base, trained from rewards (group relative policy
optimisation, as TRL's GRPOTrainer). Each step, every prompt of the batch gets
--num-generations completions sampled from the live policy (base + adapter, the adapter
applied unmerged inside the decode: models/sample.py), the reward functions score them
(data/rewards.py: TRL's signature), each completion's advantage is its reward against its
group's, and the clipped surrogate (models/losses.py: grpo_token_losses, grpo_loss_sum)
pushes the policy toward the better ones. With --beta > 0 a k3 KL term holds it near the
reference: the same base with the adapter switched off, no second model.

Batches come from the live model (Job.live): sampled when their step starts, with a
generator seeded by (seed, micro-batch, rank), so the same seed gives the same completions
and a killed run resumes to the same losses; with --num-iterations MU a generation is
reused for MU steps against the log-probs of the policy that sampled it, and kept in each
checkpoint (Job.state) so a resume between them reuses it too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from toy.data.chat import render_template
from toy.data.prompts import Prompt, columns, no_prompts, read_prompts
from toy.data.rewards import (
    BUILTINS,
    DEFAULT_FORMAT,
    DEFAULT_TARGET_LENGTH,
    Logs,
    RewardError,
    State,
    check_columns,
    parse_reward,
    score,
)
from toy.data.streams import data_files, hold_out
from toy.lora import disable_adapter
from toy.models.losses import (
    GRPO_LOSS_TYPES,
    GRPO_SCALES,
    IGNORE,
    group_advantages,
    grpo_loss_sum,
    grpo_token_losses,
    token_logprobs,
)
from toy.models.sample import sample_groups
from toy.recipes.adapter import (
    ADAPTER_DEFAULTS,
    adapter_flags,
    adapter_saver,
    check_adapter_opts,
    load_adapted,
    text_side,
)
from toy.runs import Project, data_fingerprints, plural
from toy.tokenizer import encode_prompt
from toy.train import dist
from toy.train.config import RunConfig
from toy.train.device import autocast, resolve_device, resolve_precision
from toy.train.job import Built, Job, Live
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
)
# GRPO's step is most of all sampling: a few prompts a step, a gentler LR than SFT's (the
# updates follow noisy advantages), no warmup to speak of on a short run.
# Rows a chunk of the log-prob forward and backward (token_logps): on SmolLM2's 32-row
# batches on a 2-core Zen 4 (bf16), a step took 12.8 s as one chunk, 10.1 s in chunks of 8,
# 10.3 s in chunks of 4.
CHUNK = 8
DEFAULTS = {**ADAPTER_DEFAULTS, "batch_size": 4, "lr": 5e-5, "min_lr": 5e-6, "warmup": 0}
# The reward on the done line and in --json's val_rewards (each function's beside it).
FIGURES = (
    Figure("reward", "held-out mean reward", final=True, json_key="val_rewards", every=True),
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
class Figures:
    """A step's figures, gathered as its batches are made and its loss runs."""

    rewards: list = field(default_factory=list)  # total reward a completion (NaN: unscored)
    funcs: dict = field(default_factory=dict)  # function name -> its rewards
    lengths: list = field(default_factory=list)
    cut: list = field(default_factory=list)  # True: cut at --max-completion-length
    stats: list = field(default_factory=list)  # grpo_token_losses' stats a micro-batch

    def take(self) -> dict[str, float]:
        if not self.rewards:
            return {}
        r = np.array(self.rewards, dtype=np.float64)
        out = {
            "reward": float(np.nanmean(r)) if np.isfinite(r).any() else float("nan"),
            "reward_std": float(np.nanstd(r)) if np.isfinite(r).any() else float("nan"),
        }
        for name, vals in self.funcs.items():
            v = np.array(vals, dtype=np.float64)
            out[name] = float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")
        n = np.array(self.lengths)
        out.update(
            completion_length=float(n.mean()),
            completion_length_min=float(n.min()),
            completion_length_max=float(n.max()),
            clipped_share=float(np.mean(self.cut)),
        )
        tokens = sum(float(s["tokens"]) for s in self.stats) or 1.0
        for key, name in (("clip_ratio/region", "clip_ratio"), ("kl", "kl")):
            if self.stats and key in self.stats[0]:
                out[name] = sum(float(s[key]) * float(s["tokens"]) for s in self.stats) / tokens
        self.__init__()
        return out


def completion_logps(
    m, b: dict[str, torch.Tensor], temp: float, chunk: int = CHUNK
) -> torch.Tensor:
    """(N, T) log-probs of each completion token of batch b at temperature temp (0 where
    padded): b's "ids" (N, L) right-padded prompt + completion rows, "pos" (N, T) the
    position whose hidden state predicts each completion token "tgt" (N, T), "mask".

    The rows run shortest first in chunks of `chunk`, each cut to its own longest row:
    completions of one batch differ a lot in length (5 to 128 tokens is common), and a
    batch padded to its longest row spent about half its forward and backward on padding
    (SmolLM2, 32 rows of 38 tokens on average). Right padding is never seen by the
    positions before it, so a row's log-probs do not depend on where it is cut."""
    pos, mask = b["pos"], b["mask"]  # (N, T)
    need = (pos * mask.long()).amax(1) + 1  # inputs a row needs: up to its last position
    order = torch.argsort(need, stable=True)
    parts = []
    for rows in order.split(chunk):
        n = int(need[rows].max())
        h = m.hidden(b["ids"][rows, :n])  # (R, n, C)
        p = pos[rows]
        hg = h.gather(1, p[..., None].expand(-1, -1, h.shape[-1]))  # (R, T, C)
        lp = token_logprobs(
            hg.flatten(0, 1), m.lm_head, b["tgt"][rows].flatten(), m.final_softcap, temp
        )
        parts.append(lp.view(p.shape))
    return torch.cat(parts).index_select(0, torch.argsort(order))


def build(cfg: RunConfig, project: Project) -> Built:
    a = load_adapted(cfg, project, "grpo")
    base, notes = a.base, a.notes
    data_path, val_path = data_files(cfg.data, cfg.val_data)
    strict = bool(cfg.strict)

    def read(path):
        pf = read_prompts(path, strict=strict)
        if pf.skipped:
            notes.append(f"warning: {path}: {pf.summary()}")
        if not pf.prompts:
            raise no_prompts(path, pf)
        return pf

    train_pf = read(data_path)
    val_pf = read(val_path) if val_path is not None else None
    regex = cfg.format_regex or DEFAULT_FORMAT
    rewards = [parse_reward(s, regex, int(cfg.target_length)) for s in cfg.reward]
    check_columns(rewards, list(columns(train_pf.prompts)), data_path)
    texts = not train_pf.conversational
    side = text_side(cfg, base, "prompt" if texts else "messages", notes)
    tok = side.tok
    G, T = int(cfg.num_generations), int(cfg.max_completion_length)
    room = int(a.seq_len) - T  # what a prompt may hold beside its completion
    cut = [0]

    def encode(p: Prompt) -> list[int]:
        if side.template is not None:
            text = render_template(
                side.template, list(p.chat), True, side.bos or "", side.eos or ""
            )
        else:
            text = p.text if p.text is not None else "\n".join(m["content"] for m in p.chat)
        ids = encode_prompt(tok, text)
        if len(ids) > room:  # the prompt's end is what the completion follows
            cut[0] += 1
            ids = ids[-room:]
        side.check_vocab(ids)
        return ids

    train = [(p, encode(p)) for p in train_pf.prompts]
    val = [(p, encode(p)) for p in val_pf.prompts] if val_pf is not None else None
    if val is None:
        train, val = hold_out(train, cfg.seed, notes, "prompt")
    if cut[0]:
        notes.append(
            f"{plural(cut[0], 'prompt')} cut from the left to {room} tokens (--max-seq-len "
            f"{a.seq_len} less --max-completion-length {T})"
        )
    val = val[: int(cfg.eval_batches) * int(cfg.batch_size)]
    stops = set(base.special.stops) or (
        {base.special.eos} if base.special.eos is not None else set()
    )
    pad = side.pad
    d = dist.info()
    per = int(cfg.batch_size)  # prompts a micro-batch
    n_batches = max(1, math.ceil(len(train) / (per * d.world)))
    A, MU = int(cfg.grad_accum), int(cfg.num_iterations)
    temp, top_p, beta = float(cfg.temperature), float(cfg.top_p), float(cfg.beta)
    eps = float(cfg.epsilon)
    eps_high = float(cfg.epsilon_high) if cfg.epsilon_high is not None else eps
    loss_type, scale = str(cfg.loss_type), str(cfg.scale_rewards)
    model = a.model
    figs = Figures()
    orders: dict[int, np.ndarray] = {}
    kept: dict[int, dict[str, torch.Tensor]] = {}  # micro-batch m of the generation reused
    kept_gen = [-1]
    state = State(max_steps=int(cfg.steps or 0))

    def prompts_of(j: int) -> list[tuple[Prompt, list[int]]]:
        """Global prompt batch j's share of this process: each epoch a fresh order."""
        epoch, i = divmod(j * d.world + d.rank, n_batches * d.world)
        if epoch not in orders:
            orders.clear()
            orders[epoch] = np.random.default_rng([cfg.seed, epoch, 17]).permutation(len(train))
        idx = orders[epoch][i * per : (i + 1) * per].tolist()
        if not idx:  # a last partial batch that this process has no share of
            idx = orders[epoch][:per].tolist()
        return [train[t] for t in idx]

    def token_logps(m, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return completion_logps(m, b, temp)

    def make(group: list[tuple[Prompt, list[int]]], live: Live, step: int) -> dict:
        """Sample G completions a prompt, score them, and lay the batch out."""
        groups = sample_groups(
            live.model,
            [ids for _, ids in group],
            G,
            T,
            temperature=temp,
            top_p=top_p,
            generator=live.generator,
            stop_ids=stops,
            max_rows=len(group) * G,
        )  # every completion of the step in one batch
        comps = [c for g in groups for c in g]
        prompts = [p for p, _ in group for _ in range(G)]
        texts = [tok.decode(c.ids, skip_special_tokens=True) for c in comps]
        cols = {
            k: [v for v in vs for _ in range(G)] for k, vs in columns([p for p, _ in group]).items()
        }
        state.global_step = step - 1
        try:
            per_func, total = score(
                rewards,
                [p.value for p in prompts],
                texts,
                [c.ids for c in comps],
                cols,
                state,
                Logs(),
            )
        except RewardError as e:
            e.step = step
            raise
        total_t = torch.tensor(total, dtype=torch.float32)
        adv = group_advantages(total_t, G, scale)
        # Rows: prompt + completion, right-padded; the hidden state at position j predicts
        # token j + 1, so a completion's tokens are predicted from len(prompt) - 1 on.
        seqs = [ids for _, ids in group for _ in range(G)]
        L = max(len(s) + len(c.ids) for s, c in zip(seqs, comps))
        Tc = max(len(c.ids) for c in comps)
        N = len(comps)
        ids = torch.full((N, L), pad, dtype=torch.long)
        pos = torch.zeros((N, Tc), dtype=torch.long)
        tgt = torch.full((N, Tc), IGNORE, dtype=torch.long)
        for r, (s, c) in enumerate(zip(seqs, comps)):
            row = s + c.ids
            ids[r, : len(row)] = torch.tensor(row)
            n = len(c.ids)
            pos[r, :n] = torch.arange(len(s) - 1, len(s) - 1 + n)
            tgt[r, :n] = torch.tensor(c.ids)
        mask = (tgt != IGNORE).float()
        b = {"ids": ids, "pos": pos, "tgt": tgt, "mask": mask, "adv": adv}
        # The figures ride in the batch: a reused generation (--num-iterations), kept in a
        # checkpoint, shows the same ones again after a resume.
        b["fig.reward"] = total_t.double()
        b["fig.length"] = torch.tensor([len(c.ids) for c in comps])
        b["fig.cut"] = torch.tensor([not c.stopped for c in comps])
        for j, vals in enumerate(per_func):
            b[f"fig.func{j}"] = torch.tensor(vals, dtype=torch.float64)
        dev = {k: v.to(live.device) for k, v in b.items()}
        if MU > 1:  # the log-probs of the policy that sampled them, for the later iterations
            b["old"] = token_logps(live.model, dev).float().cpu()
        if beta > 0:
            with disable_adapter(live.model):
                b["ref"] = token_logps(live.model, dev).float().cpu()
        _, count = grpo_loss_sum(torch.zeros_like(mask), mask, loss_type, T)
        b["count"] = count
        return b

    def micro_batch(k: int, live: Live) -> dict[str, torch.Tensor]:
        s, m = divmod(k, A)  # optimizer step (0-based), micro-batch within it
        gen = s - s % MU  # the step whose generation this one uses
        if gen != kept_gen[0]:
            kept.clear()
            kept_gen[0] = gen
        if m not in kept:
            b = make(prompts_of((gen // MU) * A + m), live, s + 1)
            if MU > 1:
                kept[m] = b
        else:  # reused: the generation's figures are this step's too
            b = kept[m]
        figs.rewards += b["fig.reward"].tolist()
        for j, r in enumerate(rewards):
            figs.funcs.setdefault(r.name, []).extend(b[f"fig.func{j}"].tolist())
        figs.lengths += b["fig.length"].tolist()
        figs.cut += b["fig.cut"].tolist()
        return b

    def loss(m, b):
        lp = token_logps(m, b)
        ptl, stats = grpo_token_losses(
            lp, b.get("old"), b.get("ref"), b["adv"], b["mask"], eps, eps_high, beta
        )
        figs.stats.append({k: v.detach() for k, v in stats.items()})
        return grpo_loss_sum(ptl, b["mask"], loss_type, T)

    def job_state() -> dict[str, torch.Tensor]:
        out = {"generation": torch.tensor([kept_gen[0]])}
        for m, b in kept.items():
            out.update({f"{m}.{k}": v.contiguous() for k, v in b.items()})
        return out

    def load_state(saved: dict[str, torch.Tensor]) -> None:
        kept.clear()
        kept_gen[0] = int(saved["generation"]) if "generation" in saved else -1
        for key, v in saved.items():
            if key != "generation":
                m, name = key.split(".", 1)
                kept.setdefault(int(m), {})[name] = v

    dev = resolve_device(cfg.device)
    precision = resolve_precision(cfg.precision, dev)

    @torch.no_grad()
    def eval_metrics(m, batches) -> dict[str, float]:
        """Each reward's mean on the held-out prompts: one greedy completion each."""
        with autocast(dev, precision):
            groups = sample_groups(
                m, [ids for _, ids in val], 1, T, temperature=0.0, generator=None, stop_ids=stops
            )
        comps = [g[0] for g in groups]
        texts = [tok.decode(c.ids, skip_special_tokens=True) for c in comps]
        try:
            per_func, total = score(
                rewards, [p.value for p, _ in val], texts, [c.ids for c in comps],
                columns([p for p, _ in val]), state, Logs(),
            )  # fmt: skip
        except RewardError as e:
            e.step = state.global_step + 1
            raise
        out = {"reward": float(np.nanmean(total)) if np.isfinite(total).any() else float("nan")}
        for r, vals in zip(rewards, per_func):
            v = np.array(vals, dtype=np.float64)
            out[r.name] = float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")
        out["completion_length"] = float(np.mean([len(c.ids) for c in comps]))
        return out

    notes.append(
        f"{data_path}: {plural(len(train), 'prompt')}, {per} a micro-batch x {G} completions "
        f"of up to {T} tokens at temperature {temp:g}; {plural(len(val), 'held-out prompt')} "
        f"(one greedy completion each at every evaluation); rewards: "
        + ", ".join(f"{r.name} x{r.weight:g}" for r in rewards)
        + ("; KL to the base with the adapter off" if beta > 0 else "")
    )
    info = {
        "data": str(cfg.data),
        **data_fingerprints("data", data_path),
        "prompts": len(train),
        "rewards": [r.spec for r in rewards],
        "num_generations": G,
        "max_completion_length": T,
        "temperature": temp,
        "loss_type": loss_type,
        "scale_rewards": scale,
        "beta": beta,
        "num_iterations": MU,
    }
    if val_path is not None and not cfg.val_data:
        info["val_data"] = str(val_path)
        info.update(data_fingerprints("val_data", val_path))
    derived = a.derived()
    epochs, note = cfg.epoch_steps(n_batches, A, "batches of prompts")
    derived.update(epochs)
    notes += [note] if note else []
    job = Job(
        recipe="grpo",
        model=model,
        micro_batch=micro_batch,
        eval_batches=lambda: [{}] if val else [],
        save_final=adapter_saver(cfg, a),
        config={**a.config, **info},
        loss=loss,
        count=lambda b: int(b["count"]),
        units="completion tokens" if loss_type in ("dapo", "bnpo") else "completions",
        n_items=lambda b: int(b["mask"].sum()),
        items_name="completion_tokens",
        eval_metrics=eval_metrics if val else None,
        step_metrics=figs.take,
        live=True,
        state=job_state if MU > 1 else None,
        load_state=load_state if MU > 1 else None,
        eval_loss=False,
    )
    n_params, note = a.sizes()
    notes.append(note)
    return Built(job=job, arch=base.arch, params=n_params, notes=notes, derived=derived)


RECIPE = Recipe(
    "grpo",
    build,
    defaults=DEFAULTS,
    flags=FLAGS,
    check=check,
    batch_unit=lambda cfg: "batches",
    figures=FIGURES,
)
