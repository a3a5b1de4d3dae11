"""What the preference recipes (those built on build_pairs) share; not a recipe: the pair data
(--data FILE|DIR, --val-data, held-out share), the batches of pairs, the reference
log-probs (DPO: the same base with the adapter switched off, computed once per pair and
kept: the base is frozen, so they never change, and later epochs run the policy only),
the figures (rewards, margin, preference accuracy), and the job (PairJob).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from toy.data.preference import (
    SCHEMA,
    Encoded,
    cut_note,
    encode_pair,
    encode_pairs,
    no_pairs,
    pair_batch,
    read_pairs,
)
from toy.data.streams import CHAT_BUCKET, data_files, hold_out
from toy.lora import disable_adapter
from toy.models.losses import IGNORE, sequence_logprobs
from toy.recipes.adapter import (
    ADAPTER_DEFAULTS,
    AdapterJob,
    adapter_flags,
    check_adapter_opts,
    load_adapted,
    text_side,
)
from toy.recipes.scoring import shared_logps, shares
from toy.runs import Project, data_fingerprints, plural
from toy.train import dist
from toy.train.config import RunConfig
from toy.train.device import Precision, autocast
from toy.train.job import Built
from toy.train.recipe import Figure

PAIR_DEFAULTS = {**ADAPTER_DEFAULTS, "batch_size": 4, "lr": 5e-5, "min_lr": 5e-6}
# The preference recipes' own: three passes over a small user set (20-80 pairs) at an LR that
# moves it, chosen on SmolLM2-135M over a "prefix" set, a "terse answers" set and the
# bundled pairs (docs/results.md, "Preference defaults for small sets"); a --steps given
# anywhere replaces the epochs.
SMALL_SET_EPOCHS = 3
DATA_HELP = (
    'preference pairs, one JSON object a line (TRL\'s forms): {"prompt", "chosen", "rejected"} '
    'strings, the same with lists of {"role", "content"} messages, or {"chosen": [messages], '
    '"rejected": [messages]} sharing their leading messages; or a directory holding '
    "train.jsonl and valid.jsonl (no default). --batch-size counts pairs"
)


PAIR_FLAGS = adapter_flags(DATA_HELP)


# The figures of every preference recipe (Figures below): the rewards, the margin and the
# accuracy on each step's line; the held-out accuracy on the done line, the bar and the plot.
def accuracy_figure(key: str, label: str, json_key: str) -> Figure:
    """A held-out accuracy in [0, 1]: on the done line, the bar ("acc"), --json and the plot."""
    return Figure(key, label, final=True, json_key=json_key, bar="acc", plot=True, span=(0.0, 1.0))


PAIR_FIGURES = (
    accuracy_figure("pref_accuracy", "held-out preference accuracy", "val_pref_accuracies"),
)


def check_pair_opts(cfg: RunConfig) -> list[str]:
    p = [] if cfg.data else ["give --data pairs.jsonl (preference pairs)"]
    if cfg.corpus:
        p.append("--corpus is a token file; preference recipes train on --data pairs.jsonl")
    return p + check_adapter_opts(cfg)


def batches_unit(cfg: RunConfig) -> str:
    return "batches"


def pair_figures(rc: torch.Tensor, rr: torch.Tensor, across: bool = False) -> dict[str, float]:
    """The preference figures of the pairs seen: mean rewards, margin and accuracy (the
    share whose chosen reward is above the rejected one's). `across`: over the pairs every
    process saw (a DDP step's global batch: each process holds its own pairs' rewards)."""
    rc, rr = rc.double(), rr.double()
    m = rc - rr
    if across and dist.info().enabled:  # sums and the count, added over the processes
        n = torch.tensor(float(m.numel()), dtype=torch.float64, device=m.device)
        s = dist.all_sum(torch.stack([rc.sum(), rr.sum(), m.sum(), (m > 0).double().sum(), n]))
        vals = (s[:4] / s[4].clamp_min(1.0)).tolist()
    else:
        vals = torch.stack([rc.mean(), rr.mean(), m.mean(), (m > 0).double().mean()]).tolist()
    return dict(zip(("reward_chosen", "reward_rejected", "margin", "pref_accuracy"), vals))


class Tally:
    """Rewards gathered as the loss runs (detached, on the device): the step's, read once
    after the step (one host read), and an evaluation's."""

    def __init__(self):
        self.seen = {True: [], False: []}  # model.training -> [(rc, rr)]

    def add(self, training: bool, rc: torch.Tensor, rr: torch.Tensor) -> None:
        self.seen[training].append((rc, rr))

    def take(self, training: bool) -> dict[str, float]:
        """The figures gathered since the last take. A training step's are summed over the
        processes (each saw its own pairs; every process takes them, as the loop calls
        step_figures on every rank); an evaluation's are every process's own (each
        evaluates all the held-out batches)."""
        got, self.seen[training] = self.seen[training], []
        if not got:
            return {}
        rc, rr = torch.cat([a for a, _ in got]), torch.cat([b for _, b in got])
        return pair_figures(rc, rr, across=training)


def answer_logps(model, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the (2B,) answer log-probs, the hidden states (2B, T, C)) of a pair batch."""
    h = model.hidden(b["ids"])  # (2B, T, C)
    pos = b["ans_pos"]  # (2B, A)
    hg = h.gather(1, pos[..., None].expand(-1, -1, h.shape[-1]))  # (2B, A, C)
    return sequence_logprobs(hg, model.lm_head, b["ans_tgt"], model.final_softcap), h


def answer_sums(model, b: dict[str, torch.Tensor], share: bool | None = None) -> torch.Tensor:
    """The (2B,) answer log-probs of a pair batch, as answer_logps's. share (None: as
    scoring.shares says, bf16 blocks) where every answer is one run of tokens after its
    prompt: a pair's two rows run their prompt through the blocks once (scoring.shared_logps),
    and each answer after it. A prompt is most of a row in the usual preference set (a chat
    template's system turn and a question, then a short answer), so the blocks meet ~1/3 fewer
    tokens; float32 runs every row whole, the reference bytes."""
    pos, tgt = b["ans_pos"], b["ans_tgt"]  # (2B, A)
    mask = tgt != IGNORE
    n = mask.sum(1, keepdim=True)
    ar = torch.arange(pos.shape[1], device=pos.device)
    runs = bool(((pos == pos[:, :1] + ar) | (ar >= n)).all())  # no turn between answer tokens
    if runs and (share if share is not None else shares(model)):
        g = {"ids": b["ids"], "pos": pos, "tgt": tgt, "mask": mask}
        return shared_logps(model, g, 1.0, pos.shape[0]).sum(1)
    return answer_logps(model, b)[0]


class References:
    """The reference log-probs of every pair: the base alone (adapters off), computed the
    first time a pair is met and kept, in the run's precision (at step 0 the two passes
    are the same). `computed` counts the pairs that took a pass."""

    def __init__(self, model, n: int, precision: Precision | None = None, halves=False):
        self.model = model
        # each half of a batch in a pass of its own, as a loss that runs them apart does
        # (KTO's): the same shapes, so at step 0 the two passes give the same bits
        self.halves = halves
        self.precision = precision  # the policy's: at step 0 the two passes are the same
        self.logps = torch.zeros((n, 2), dtype=torch.float32)
        self.known = torch.zeros(n, dtype=torch.bool)
        self.computed = 0

    @torch.no_grad()
    def fill(self, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        idx = b["pair"]
        new = ~self.known[idx]
        if bool(new.any()):
            dev = next(self.model.parameters()).device
            keys = ("ids", "ans_pos", "ans_tgt")
            on = {k: b[k].to(dev) for k in keys}
            with disable_adapter(self.model), autocast(dev, self.precision):
                if self.halves:
                    n = idx.numel()
                    s = torch.cat(
                        [
                            answer_logps(self.model, {k: v[part] for k, v in on.items()})[0]
                            for part in (slice(0, n), slice(n, 2 * n))
                        ]
                    )
                else:
                    s = answer_sums(self.model, on)
            s = s.float().cpu().view(2, -1).T  # (B, 2): chosen, rejected
            self.logps[idx[new]] = s[new]
            self.known[idx[new]] = True
            self.computed += int(new.sum())
        return {**b, "ref": self.logps[idx]}


def pair_micro_batches(
    encoded: list[Encoded], per: int, seed: int, pad: int, world, rank, bucket=1, budget=None
):
    """micro_batch(k): global batch k of `per` pairs; each epoch a fresh order from
    (seed, epoch), each of `world` processes taking its own batches (padded as
    pair_batch's `bucket` and `budget` say)."""
    n = max(1, math.ceil(len(encoded) / per))
    orders: dict[int, np.ndarray] = {}

    def batch(k: int) -> dict[str, torch.Tensor]:
        epoch, i = divmod(k * world + rank, n)
        if epoch not in orders:
            orders.clear()
            orders[epoch] = np.random.default_rng([seed, epoch, 13]).permutation(len(encoded))
        members = orders[epoch][i * per : (i + 1) * per].tolist()
        return pair_batch([(j, encoded[j]) for j in members], pad, bucket, budget)

    return batch, n


class PairJob(AdapterJob):
    """Preference pairs: each batch holds B chosen rows then B rejected ones, with the
    reference log-probs of each pair where the loss reads them (DPO); the loss is the
    recipe's (`pair_loss(model, batch, tally) -> (sum over pairs, pairs)`), normalised by
    the pairs of the whole step."""

    units = "pairs"
    halves = False  # whether the loss runs a batch's two halves apart (References)
    tally_class: type = Tally  # what gathers the figures the loss reports

    def __init__(self, recipe, a, cfg, config, micro, evals, n_pairs, pair_loss, reference):
        super().__init__(recipe, a, cfg, config)
        self.micro, self.evals, self.n_pairs = micro, evals, n_pairs
        self.pair_loss, self.reference = pair_loss, reference
        self.references: References | None = None  # made by bind, in the run's precision
        self.tally = self.tally_class()
        self.filled: list = []

    def bind(self, device, precision, run_dir=None) -> None:
        super().bind(device, precision, run_dir)
        if self.reference:
            self.references = References(self.model, self.n_pairs, precision, self.halves)

    def fill(self, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.references.fill(b) if self.references is not None else b

    def state(self) -> dict[str, torch.Tensor]:
        """The reference log-probs met so far: a resumed run reads them back rather than
        computing them again in other batches (other widths, other float rounding: a
        KTO run resumed across an epoch moved its figures in the sixth digit)."""
        r = self.references
        return {} if r is None else {"ref_logps": r.logps, "ref_known": r.known}

    def load_state(self, states: list[dict[str, torch.Tensor]]) -> None:
        """This process's own saved references where the run had as many processes (each
        computed those of its own batches); every process's, where it had not."""
        r = self.references
        if r is None:
            return
        d = dist.info()
        mine = [states[d.rank]] if len(states) == d.world else states
        for st in mine:
            logps, known = st.get("ref_logps"), st.get("ref_known")
            if logps is None or known is None or logps.shape != r.logps.shape:
                continue  # a checkpoint from before these were kept: computed again
            take = known.bool() & ~r.known
            r.logps[take] = logps[take].float()
            r.known |= take

    def micro_batch(self, k: int, live=None) -> dict[str, torch.Tensor]:
        return self.fill(self.micro(k))

    def eval_batches(self) -> list[dict[str, torch.Tensor]]:
        if not self.filled:  # once the model is on its device: the references pass there
            self.filled.extend(self.fill(b) for b in self.evals)
        return self.filled

    def prepare(self, batch):
        return batch

    def count(self, batch) -> int:
        return int(batch["pair"].numel())

    def loss(self, model, batch):
        return self.pair_loss(model, batch, self.tally)

    def step_figures(self) -> dict[str, float]:
        return self.tally.take(True)

    def eval_figures(self, model, batches) -> dict[str, float]:
        return self.tally.take(False)


@dataclass(frozen=True)
class PairData:
    """What a preference recipe's lines are: how a file is read (`read(path, cfg)` ->
    PairFile), how one of its items is encoded (-> Encoded), and the words for them."""

    read: Callable = lambda path, cfg: read_pairs(path)  # noqa: E731
    encode: Callable = encode_pair
    one: str = "preference pair"
    schema: str = SCHEMA


PAIRS = PairData()


def build_pairs(
    cfg: RunConfig,
    project: Project,
    recipe: str,
    loss: Callable,
    own: dict,
    reference: bool,
    form: PairData = PAIRS,
    job_class: type | None = None,
) -> Built:
    """The preference job: `loss(model, batch, figures)` -> (sum over pairs, pairs);
    `own`: the recipe's own settings recorded in run.json; `reference`: whether the
    loss reads reference log-probs (DPO's) or not; `form`: the data's lines (pairs, or
    KTO's labelled completions); `job_class`: PairJob or one of its kind."""
    a = load_adapted(cfg, project, recipe)
    base, tok, notes = a.base, a.base.tokenizer, a.notes
    data_path, val_path = data_files(cfg.data, cfg.val_data)
    train_pf = form.read(data_path, cfg)
    val_pf = form.read(val_path, cfg) if val_path is not None else None
    texts = all(p.text is not None for p in train_pf.pairs + (val_pf.pairs if val_pf else []))
    side = text_side(cfg, base, "prompt" if texts else "messages", notes)
    budget = int(a.seq_len) + 1

    def encode(pair) -> Encoded:
        e = form.encode(tok, side.template, pair, budget, side.bos, side.eos, side.eos_id)
        side.check_vocab(e.chosen[0] + e.rejected[0])
        return e

    def encode_file(pf, path) -> list[Encoded]:
        if not pf.pairs:
            raise no_pairs(path, pf, form.one, form.schema)
        enc, cuts = encode_pairs(pf, encode, lambda m: None)
        if pf.skipped:
            notes.append(f"warning: {path}: {pf.summary()}")
        if not enc:
            raise no_pairs(path, pf, form.one, form.schema)
        if n := cut_note(cuts, budget):
            notes.append(n)
        return enc

    train = encode_file(train_pf, data_path)
    if val_pf is not None:
        val = encode_file(val_pf, val_path)
    else:
        train, val = hold_out(train, cfg.seed, notes, "pair")
    d = dist.info()
    pad = side.pad
    bucket = CHAT_BUCKET if cfg.compile else 1  # few shapes for the compiled blocks
    micro, n_batches = pair_micro_batches(
        train, int(cfg.batch_size), cfg.seed, pad, d.world, d.rank, bucket, budget
    )
    # Held-out batches: every held-out pair, in order (the same at every evaluation), up
    # to --eval-batches of them. Their pair indices follow the training pairs'.
    n_eval = min(cfg.eval_batches, math.ceil(len(val) / cfg.batch_size)) if val else 0
    per = int(cfg.batch_size)
    val_items = [(len(train) + j, e) for j, e in enumerate(val)]
    evals = [
        pair_batch(val_items[i * per : (i + 1) * per], pad, bucket, budget) for i in range(n_eval)
    ]
    notes.append(
        f"{data_path}: {plural(len(train), form.one)} in "
        f"{plural(n_batches, 'batch', 'batches')} of {per}; "
        f"{plural(len(val), 'held out', 'held out')}"
        + (
            f", reference log-probs from the base with the adapter off, once a {form.one}"
            if reference
            else ""
        )
    )
    info = {
        "data": str(cfg.data),
        **data_fingerprints("data", data_path),
        "pairs": len(train),
        "batches": n_batches,
        **own,
    }
    if val_path is not None:  # a file given or found in a --data directory: checked alike
        info["val_data"] = str(val_path)
        info.update(data_fingerprints("val_data", val_path))
    derived = a.derived()
    epochs, note = cfg.epoch_steps(n_batches, d.world * cfg.grad_accum, "batches")
    derived.update(epochs)
    notes += [note] if note else []
    config = {**a.config, **info}
    n_pairs = len(train) + len(val)
    job = (job_class or PairJob)(recipe, a, cfg, config, micro, evals, n_pairs, loss, reference)
    n_params, note = a.sizes()
    notes.append(note)
    return Built(job=job, arch=base.arch, params=n_params, notes=notes, derived=derived)
