"""The run's configuration: one typed, frozen record, resolved once and read by everyone.

    flags > toy.toml [train.<recipe>] > toy.toml [train] > the recipe's FLAGS > the defaults here

`toy train` resolves the flags into a `RunConfig` before any work. A recipe reads it and
never writes it: what a recipe works out from the data (the step count of `--epochs`,
a `--seq-len` that defaults to the preset's context or is clamped to a GGUF's) comes
back in `Built.derived`, and train/run.py applies it with `RunConfig.with_derived`: in
`new_run`, and again in `resume_run` for the rebuilt job. The result is the resolved
config that `run.json` records under "config" and that `--resume` reads back: a resumed
run rebuilds its job from exactly that record.

The general flags (those of every recipe) are fields here. A recipe's own flags are
declared in its file (train/recipe.py: Flag) and held in `opts`, read as attributes like
the fields (`cfg.beta`): a key that is neither a field nor one of the run's recipe's
flags is an AttributeError at once, not a silent None. run.json records the two flat, as
one object.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from toy.errors import InputError, UsageError
from toy.runs import plural

OPTIMIZER_STATES = ("auto", "float32", "bfloat16")  # --optimizer-state (train/schedule.py)


@dataclass(frozen=True)
class RunConfig:
    # ---- run
    recipe: str = "from-scratch"
    arch: str = "llama"
    steps: int | None = 5  # None only while --epochs has not been turned into steps
    epochs: int | None = None
    seed: int = 0
    device: str = "cpu"
    fsdp: bool = False
    compile: bool = False
    checkpointing: bool = False
    threads: int | None = None  # --threads: torch's CPU threads; None: toy's default
    report_to: str = "none"  # --report-to: none | tensorboard (scalars beside events.jsonl)
    # auto | float32 | bf16 as given; run.json's config records what auto resolved to
    # (bf16 or float32), so a resumed run keeps it (train/device.py: resolve_precision)
    precision: str = "auto"
    # auto | float32 | bfloat16: AdamW's moments; run.json records what auto resolved to
    # (train/schedule.py: resolve_optimizer_state). Runs recorded before it: float32.
    optimizer_state: str = "auto"
    # ---- data (token streams)
    corpus: str | None = None
    val_corpus: str | None = None
    tokenizer: str | None = None
    raw_i32: bool = False
    vocab_size: int | None = None
    # ---- model shape
    preset: str | None = None
    n_layer: int | None = None
    d_model: int | None = None
    n_head: int | None = None
    n_kv_head: int | None = None
    seq_len: int | None = None
    # ---- optimiser and schedule
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 10
    weight_decay: float = 0.1
    clip: float = 1.0
    eval_every: int = 0
    eval_batches: int = 8
    save_every: int = 0
    keep_last: int = 2
    # ---- the recipe's own flags (its Flags' keys -> values), read as attributes
    opts: Mapping[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        # Only for names that are not fields: the recipe's own flags.
        opts = self.__dict__.get("opts")
        if opts is not None and name in opts:
            return opts[name]
        raise AttributeError(
            f"RunConfig has no {name!r}: neither a general flag nor a flag of the "
            f"{self.__dict__.get('recipe')} recipe"
        )

    # ------------------------------------------------------------------ building

    @classmethod
    def keys(cls) -> list[str]:
        """The general flags' keys (every recipe's config has them)."""
        return [f.name for f in fields(cls) if f.name != "opts"]

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {f.name: f.default for f in fields(cls) if f.name != "opts"}

    @classmethod
    def build(cls, values: dict[str, Any]) -> RunConfig:
        """General keys to their fields, the rest to `opts`, over the general defaults."""
        general = set(cls.keys())
        out = {**cls.defaults(), **{k: v for k, v in values.items() if k in general}}
        return cls(**out, opts={k: v for k, v in values.items() if k not in general})

    @classmethod
    def from_record(
        cls, record: dict[str, Any], own: Collection[str], source: str = "run.json"
    ) -> RunConfig:
        """The config a run recorded (run.json "config"), whose recipe takes the flags `own`.
        Keys this toy does not know mean the run came from another version: refuse rather
        than guess. Runs recorded before a recipe's flags moved into its file hold every
        recipe's keys, the others' as null: those are dropped."""
        general = set(cls.keys())
        unknown = sorted(
            k for k, v in record.items() if k not in general and k not in own and v is not None
        )
        if unknown:
            raise InputError(
                f"{source}: unknown config key(s) {', '.join(unknown)}; the run was made by "
                "another toy version: resume it with that version or start a new run"
            )
        return cls.build({k: v for k, v in record.items() if k in general or k in own})

    def with_derived(self, derived: dict[str, Any]) -> RunConfig:
        """The config with what the recipe worked out (Built.derived) filled in."""
        return self.replace(**derived) if derived else self

    def replace(self, **changes: Any) -> RunConfig:
        general = set(self.keys())
        opts = {k: v for k, v in changes.items() if k not in general}
        if unknown := sorted(set(opts) - set(self.opts)):
            raise AttributeError(f"RunConfig has no {', '.join(unknown)}")
        kept = {k: v for k, v in changes.items() if k in general}
        return dataclasses.replace(self, **kept, opts={**self.opts, **opts})

    def to_dict(self) -> dict[str, Any]:
        """The general flags and the recipe's, as one flat object (run.json's "config")."""
        return {**{k: getattr(self, k) for k in self.keys()}, **self.opts}

    def epoch_steps(
        self, n_units: int, per_step: int, unit: str, repeat: int = 1
    ) -> tuple[dict[str, Any], str | None]:
        """--epochs as a step count: each epoch is one pass over the `n_units` training
        units (token windows, images, chat batches), `per_step` of them a step (the global
        batch), each step's units used for `repeat` steps (GRPO's --num-iterations).
        Returns (derived, note); nothing when --steps counts (a resumed run keeps its own
        count)."""
        if self.steps is not None or self.epochs is None:
            return {}, None
        steps = self.epochs * math.ceil(max(1, n_units) / per_step) * repeat
        again = f", each used for {repeat} steps" if repeat > 1 else ""
        return {"steps": steps}, (
            f"{plural(self.epochs, 'epoch')} of {n_units:,} {_units(unit, n_units)}, "
            f"{per_step:,} a step{again} = {plural(steps, 'step')}"
        )

    # ------------------------------------------------------------------ reading

    @property
    def target_list(self) -> list[str]:
        return [t.strip() for t in str(self.targets or "").split(",") if t.strip()]


def _units(unit: str, n: int) -> str:
    """`unit` (a plural: "batches", "token windows", "batches of prompts") for `n` of them:
    its noun made singular for one ("1 batch of prompts", "1 token window")."""
    if n != 1:
        return unit
    head, of, tail = unit.partition(" of ")
    *before, noun = head.split(" ")
    noun = noun[:-2] if noun.endswith(("ches", "shes", "xes")) else noun.removesuffix("s")
    return " ".join([*before, noun]) + of + tail


# What `--resume` may change; everything else must match the run's recorded config.
RESUME_MAY_CHANGE = ("steps", "device", "compile", "threads", "report_to", "reward_changed")


def resolve(
    cli: dict[str, Any],
    toml: dict[str, Any],
    recipe: str,
    recipe_defaults: dict[str, Any],
    others: Collection[str] = (),
    many: Collection[str] = (),
) -> RunConfig:
    """flags (`cli`, None = not given) > toy.toml [train.<recipe>] > [train] > the recipe's
    defaults (its own flags' and the general ones it changes) > RunConfig's. `others`: the
    keys of the other recipes' flags, which toy.toml's [train] may hold for them (ignored
    here); any other unknown toy.toml key is an error naming it. `many`: the keys of
    repeatable flags, whose toy.toml value may be one string (`reward = "length"`) or a
    list of them."""
    if cli.get("epochs") is not None and cli.get("steps") is not None:
        raise UsageError("--epochs and --steps conflict: give one (--epochs sets the step count)")
    out = {**RunConfig.defaults(), **recipe_defaults}
    table = {k: v for k, v in toml.items() if not isinstance(v, dict)}
    table.update(toml.get(recipe, {}) if isinstance(toml.get(recipe), dict) else {})
    for k, v in table.items():
        key = k.replace("-", "_")
        if key not in out:
            if key in others and k not in (toml.get(recipe) or {}):
                continue  # [train] serves every recipe: another recipe's flag
            raise UsageError(
                f"toy.toml [train] has unknown key {k!r}; valid: {', '.join(sorted(out))}"
            )
        out[key] = [v] if key in many and isinstance(v, str) else v
    out.update({k: v for k, v in cli.items() if v is not None and k in out})
    out["recipe"] = recipe
    steps_given = cli.get("steps") is not None or "steps" in table
    if steps_given and cli.get("epochs") is None and "epochs" not in table:
        out["epochs"] = None  # a recipe's default epochs yield to a --steps given anywhere
    if out.get("epochs") is not None and cli.get("steps") is None:
        out["steps"] = None  # the recipe counts the steps of --epochs from the data
    return RunConfig.build(out)


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def problems(c: RunConfig, archs: list[str], presets: list[str] | None) -> list[str]:
    """Every problem with the general flags of a resolved config at once, each naming its
    flag (a recipe checks its own). `archs`: the valid --arch names; `presets`: --arch's
    presets (None when --arch is unknown)."""
    p = []
    if c.arch not in archs:
        p.append(
            f"--arch {c.arch!r} is unknown; valid: {', '.join(a for a in archs if a != 'vit')} "
            "(vit via --recipe vit-tiny)"
        )
    elif c.preset is not None and presets is not None and c.preset not in presets:
        p.append(f"--preset {c.preset!r} is unknown for {c.arch}; valid: {', '.join(presets)}")
    for k in ("batch_size", "grad_accum", "eval_batches") + (
        ("steps",) if c.steps is not None else ()
    ):
        v = getattr(c, k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            p.append(f"{_flag(k)} must be an integer >= 1, got {v!r}")
    if c.epochs is not None and (not isinstance(c.epochs, int) or c.epochs < 1):
        p.append(f"--epochs must be an integer >= 1, got {c.epochs!r}")
    if not (isinstance(c.lr, (int, float)) and c.lr > 0):
        p.append(f"--lr must be > 0, got {c.lr!r}")
    elif not (isinstance(c.min_lr, (int, float)) and 0 <= c.min_lr <= c.lr):
        p.append(f"--min-lr must be between 0 and --lr ({c.lr}), got {c.min_lr!r}")
    if not isinstance(c.weight_decay, (int, float)) or c.weight_decay < 0:
        p.append(f"--weight-decay must be >= 0, got {c.weight_decay!r}")
    if not isinstance(c.clip, (int, float)) or c.clip < 0:
        p.append(f"--clip must be >= 0 (0 disables), got {c.clip!r}")
    for k in ("warmup", "eval_every", "save_every", "keep_last"):
        v = getattr(c, k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            p.append(f"{_flag(k)} must be an integer >= 0, got {v!r}")
    if c.corpus:
        from pathlib import Path

        if not Path(c.corpus).is_file():
            p.append(
                f"--corpus {c.corpus} not found; make one with `toy prep TEXT --out FILE.bin` "
                "or start a project with `toy new DIR`"
            )
    return p
