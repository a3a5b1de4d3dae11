"""What the adapter recipes share (every recipe whose job is an AdapterJob, and distill's
LoRA student); not a recipe itself. Each trains a
LoRA adapter on a frozen base read as the user has it (a GGUF file, a transformers or MLX
directory): the base resolved and loaded, the adapters applied, the flags they all take
(with their checks), the --output policy, the final adapter saved (PEFT in final/, and
--output's copy), the data files (--data FILE|DIR, --val-data), the chat template for the
data, and the chat data stream. No recipe imports another; they import this.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from toy.data.chat import resolve_chat_template
from toy.data.streams import (
    Stream,
    StreamOpts,
    TextSide,
    chat_stream,
    data_files,
    read_chat_files,
)
from toy.errors import InputError, UsageError
from toy.formats.base import Base
from toy.formats.base_readers import held_as, read_base
from toy.formats.checkpoint import atomic_dir
from toy.formats.hf_dir import base_fingerprint
from toy.formats.mlx_adapter import save_mlx_adapter
from toy.formats.peft import save_peft_adapter
from toy.lora import VALID_TARGETS, apply_lora, lora_state_dict
from toy.models.quant import count_params, resident_bytes
from toy.models.quant_types import BASE_DTYPES
from toy.recipes.lm import open_token_data, token_windows
from toy.runs import Project, data_fingerprints, plural
from toy.train import dist
from toy.train.config import RunConfig
from toy.train.job import Job
from toy.train.memory import available_memory
from toy.train.recipe import Flag

DEFAULT_MODEL = "data/smollm2-135m.gguf"
GET_MODEL = (
    "get it with `toy fetch smollm2`, or pass --model FILE.gguf or a transformers or MLX "
    "model directory"
)

# The general flags whose default differs for the adapter recipes.
ADAPTER_DEFAULTS = dict(
    lr=2e-4,
    min_lr=2e-5,
    seq_len=512,
    batch_size=4,
    warmup=10,
    weight_decay=0.0,
)


def adapter_flags(data_help: str) -> tuple[Flag, ...]:
    """The flags every adapter recipe takes (the base, the adapter's shape, --output, the
    data files); `data_help`: what its --data holds. targets None: the family's default
    (q_proj,v_proj; Phi-3's fused qkv_proj); base_dtype None: auto (base_dtype() below)."""
    return (
        Flag(
            "model",
            options=("--model", "--model-path"),
            help="base model: a GGUF file, or a transformers or MLX model directory "
            "(--model-path: mlx-lm's name)",
            shown=f"{DEFAULT_MODEL} in the project",
        ),
        Flag("data", help=data_help),
        Flag(
            "val_data",
            help="validation JSONL, in --data's format",
            shown=": 5% of --data held out",
        ),
        # rank, alpha and targets are checked where the adapters are applied (toy.lora)
        Flag("rank", 8, "LoRA rank r", int),
        Flag("alpha", 16.0, "LoRA alpha; the update is scaled by alpha / r", float, shown="16"),
        Flag("dropout", 0.0, "dropout on the LoRA input", float, shown="0"),
        Flag(
            "targets",
            help=f"comma-separated projections to adapt, from {','.join(VALID_TARGETS)}",
            shown="q_proj,v_proj; qkv_proj for phi3",
        ),
        Flag(
            "base_dtype",
            help="how the frozen base is held: quantized (the GGUF's own blocks, memory-mapped, "
            "dequantized per layer in forward and backward: the least memory), bfloat16 or "
            "float32 (dequantized once at load)",
            choices=BASE_DTYPES,
            shown="bfloat16 on cuda, and on a cpu training in bf16 where the copy takes at most "
            "1 GB and a quarter of the free memory; quantized elsewhere",
        ),
        Flag(
            "chat_template",
            metavar="FILE.jinja",
            help="chat template for --data",
            shown=": the GGUF's own; for a file without one, toy's built-in template of its "
            "family: Gemma turns, ChatML",
        ),
        Flag(
            "output",
            help="also copy the final adapter directory (PEFT) to PATH, which must be new or a "
            "directory of toy's adapter files (it is replaced whole; anything else exits 2 before "
            "training); PATH ending in .safetensors: the adapter for mlx-lm there, its "
            "adapter_config.json beside it, as mlx-lm's trainer writes them",
            shown=": only RUN_DIR/final",
        ),
        Flag(
            "strict",
            False,
            "an invalid data line is fatal",
            bool,
            shown=": warn, skip, count",
        ),
        Flag(
            "seq_len",
            options=("--max-seq-len", "--max-seq-length"),
            type=int,
            help="aliases of --seq-len (--max-seq-length: mlx_lm.lora's name)",
            shown="512 for the adapter recipes",
        ),
        # mlx_lm.lora's own flags, so that its command line runs as it is (README: "Flags
        # from mlx-lm"); where toy reads one differently, load_adapted says so in a note.
        Flag(
            "adapter_path",
            metavar="DIR",
            help="mlx_lm.lora's: the adapter for mlx-lm goes to DIR/adapters.safetensors, its "
            "adapter_config.json beside it (as --output DIR/adapters.safetensors)",
            shown=": none",
        ),
        Flag("train", help="mlx_lm.lora's: toy train always trains", type=bool, shown=""),
        Flag(
            "mask_prompt",
            help="mlx_lm.lora's: the loss on the replies only, which toy always does for "
            "conversations and prompt/completion data",
            type=bool,
            shown="",
        ),
        Flag(
            "fine_tune_type",
            help="mlx_lm.lora's: lora (toy trains LoRA adapters; dora and full are refused, "
            "with what to give instead)",
            shown=": lora",
        ),
        Flag(
            "optimizer",
            help="mlx_lm.lora's: adamw, or adam (toy's AdamW at --weight-decay 0, the adapter "
            "recipes' default, is Adam); others are refused",
            shown=": adamw",
        ),
        Flag(
            "num_layers",
            type=int,
            help="mlx_lm.lora's: adapt the last N blocks only (-1: every block, as without "
            "it); the exports say which (mlx-lm's num_layers, PEFT's layers_to_transform)",
            shown=": every block",
        ),
    )


def output_of(cfg: RunConfig) -> str | None:
    """Where the final adapter is also written: --output, or mlx_lm.lora's --adapter-path
    DIR as DIR/adapters.safetensors."""
    if cfg.output:
        return cfg.output
    return os.path.join(cfg.adapter_path, "adapters.safetensors") if cfg.adapter_path else None


def resolve_model(cfg: RunConfig, project: Project) -> Path:
    if cfg.model:
        p = Path(cfg.model)
        if not p.exists():
            raise InputError(f"--model {p} not found; {GET_MODEL}")
        return p
    root = project.root or Path.cwd()
    p = root / DEFAULT_MODEL
    if not p.is_file():
        raise InputError(f"no --model given and {p} is missing; {GET_MODEL}")
    return p


# Under bf16 autocast on a cpu with bf16 units, a base held as bfloat16 skips dequantizing
# its blocks at every use (forward and backward) for the same losses: the blocks are
# dequantized straight to bf16 either way (docs/performance.md). It costs the copy's memory
# (SmolLM2-135M: 0.27 GB against 0.10 GB of Q4_1 blocks), so auto takes it for a base whose
# copy is at most BF16_BASE_MAX and BF16_FIT of the available memory; larger bases keep
# their blocks, the least memory (a 1B Q4_0 base trains in ~1.6 GB that way).
BF16_BASE_MAX = 10**9
BF16_FIT = 0.25


def base_dtype(
    cfg: RunConfig, bf16_bytes: int | None = None, flag: str = "base_dtype"
) -> tuple[str, str]:
    """How the frozen base is held, and why where auto chose: --base-dtype (or `flag`, e.g.
    distill's --teacher-dtype) as given; bfloat16 on cuda; on a cpu under bf16 autocast
    (cfg.precision, resolved), bfloat16 where the copy (`bf16_bytes`) is small enough
    (above), else the quantized blocks."""
    if asked := getattr(cfg, flag):
        return asked, ""
    opt = "--" + flag.replace("_", "-")
    if cfg.device == "cuda":
        return "bfloat16", ""
    if cfg.device != "cpu" or cfg.precision != "bf16" or bf16_bytes is None:
        return "quantized", ""
    avail = available_memory()
    size = f"{bf16_bytes / 1e9:.2f} GB"
    if bf16_bytes > BF16_BASE_MAX:
        return "quantized", (
            f"{opt} auto: quantized, the least memory (a bfloat16 copy would take {size}; "
            f"{opt} bfloat16 trains faster under bf16 where memory allows)"
        )
    if avail is not None and bf16_bytes > BF16_FIT * avail:
        return "quantized", (
            f"{opt} auto: quantized, a bfloat16 copy ({size}) would take over "
            f"{BF16_FIT:.0%} of the available memory ({avail / 1e9:.1f} GB)"
        )
    return "bfloat16", (
        f"{opt} auto: bfloat16 under bf16 autocast, faster than dequantizing the blocks "
        f"at every use (the copy takes {size}; {opt} quantized holds the least memory)"
    )


def check_adapter_opts(cfg: RunConfig) -> list[str]:
    """Every problem across the flags all adapter recipes share (the base, --seq-len,
    --base-dtype, --output, --val-data, --data's path when given)."""
    p = []
    if cfg.base_dtype is not None and cfg.base_dtype not in BASE_DTYPES:
        p.append(f"--base-dtype {cfg.base_dtype!r} is unknown; valid: {', '.join(BASE_DTYPES)}")
    if cfg.val_data and not cfg.data:
        p.append("--val-data needs --data (use --val-corpus with --corpus)")
    if cfg.seq_len is None or cfg.seq_len < 2:
        p.append(f"--seq-len must be >= 2, got {cfg.seq_len}")
    if cfg.model and not Path(cfg.model).exists():
        p.append(f"--model {cfg.model} not found; {GET_MODEL}")
    if cfg.data and not Path(cfg.data).exists():
        p.append(
            f"--data {cfg.data} not found; give a JSONL file (conversations, prompt/completion "
            "pairs or text) "
            "or a directory holding train.jsonl"
        )
    if cfg.val_data and not Path(cfg.val_data).is_file():
        p.append(f"--val-data {cfg.val_data} not found; give a JSONL file")
    if cfg.output and cfg.adapter_path:
        p.append("--output and --adapter-path conflict: give one (--adapter-path DIR is "
                 "--output DIR/adapters.safetensors)")  # fmt: skip
    if output_of(cfg):
        p += [why] if (why := output_problem(output_of(cfg))) else []
    if cfg.fine_tune_type not in (None, "lora"):
        p.append(
            f"--fine-tune-type {cfg.fine_tune_type}: toy trains LoRA adapters only; give "
            "--fine-tune-type lora (a higher --rank and --targets of every projection come "
            "closer to full fine-tuning)"
        )
    if cfg.optimizer not in (None, "adam", "adamw"):
        p.append(f"--optimizer {cfg.optimizer}: toy trains with AdamW; give --optimizer adamw "
                 "(or adam: AdamW at --weight-decay 0)")  # fmt: skip
    return p


# What toy writes into --output: a directory holding only these may be replaced.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "README.md")


def mlx_output_problem(output: str) -> str | None:
    """--output FILE.safetensors (mlx-lm's trainer's own flag): the mlx-lm adapter goes
    there with adapter_config.json beside it. Neither may overwrite anything but an
    earlier mlx-lm adapter's files."""
    path = Path(output)
    cfg = path.parent / "adapter_config.json"
    fix = "give a new path, or the adapters.safetensors of an earlier mlx-lm adapter"
    if path.is_symlink() or (path.exists() and not path.is_file()):
        return f"--output {output} is not a plain file; {fix}"
    if cfg.exists():
        try:
            ok = "lora_parameters" in json.loads(cfg.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError):
            ok = False
        if not ok:
            return (
                f"--output {output}: {cfg} exists and is not an mlx-lm adapter config, which this "
                f"would replace; {fix}"
            )
    elif path.exists():
        return f"--output {output} exists beside no mlx-lm adapter_config.json; {fix}"
    return None


def output_problem(output: str) -> str | None:
    """Why --output PATH may not be written, or None. The copy replaces PATH whole, so
    PATH must be new, or a directory of toy's own adapter files (as `toy export --format
    peft` requires of its --out); never the working directory or one that holds it. A
    PATH ending in .safetensors is mlx-lm's form (mlx_output_problem)."""
    if output.endswith(".safetensors"):
        return mlx_output_problem(output)
    path = Path(output)
    fix = "give a new path, or a directory holding only a toy adapter"
    where, cwd = path.resolve(), Path.cwd().resolve()
    if where == cwd or where in cwd.parents:
        return (
            f"--output {output} is the working directory or holds it, and the copy replaces its "
            f"path whole; {fix}"
        )
    if path.is_symlink():
        return f"--output {output} is a symbolic link; {fix}"
    if not path.exists():
        return None
    if not path.is_dir():
        return f"--output {output} exists and is not a directory; {fix}"
    names = sorted(p.name for p in path.iterdir())
    others = [n for n in names if n not in ADAPTER_FILES]
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        return f"--output {output} holds files that are not a toy adapter's ({shown}); {fix}"
    if names and "adapter_config.json" not in names:
        return (
            f"--output {output} holds no adapter_config.json, so it is not a toy adapter "
            f"directory; {fix}"
        )
    return None


@dataclass
class Adapted:
    """A frozen base with LoRA adapters applied: what an adapter recipe builds its job on.
    `config` is the run.json "job" part every adapter recipe records (the recipe adds its
    data's); `notes` the lines the run prints before its first step."""

    model_path: Path  # absolute: run.json and `toy infer --run` find it from any folder
    base: Base  # its state_dict dropped: the model holds the only copy
    model: nn.Module
    targets: list[str]
    dtype: str
    seq_len: int
    wrapped: list[str]
    config: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def derived(self) -> dict:
        return {
            "seq_len": self.seq_len,
            "targets": ",".join(self.targets),
            "base_dtype": self.dtype,
        }

    def sizes(self) -> tuple[int, str]:
        """(the model's parameter count, the line saying how many of them train)."""
        n_params = count_params(self.model)
        n_train = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return n_params, (
            f"adapters on {plural(len(self.wrapped), 'module')}: {n_train:,} trainable of "
            f"{plural(n_params, 'parameter')}"
        )


def mlx_lm_notes(cfg: RunConfig, depth: int) -> list[str]:
    """What toy does with mlx_lm.lora's flags that it reads differently."""
    notes = []
    if cfg.num_layers is not None and 0 < cfg.num_layers < depth:
        notes.append(f"--num-layers {cfg.num_layers}: adapters on the last {cfg.num_layers} of "
                     f"the {depth} blocks, as mlx_lm.lora")  # fmt: skip
    if cfg.optimizer == "adam" and cfg.weight_decay:
        notes.append(f"--optimizer adam: toy's AdamW at --weight-decay {cfg.weight_decay:g} "
                     "(give --weight-decay 0 for Adam's update)")  # fmt: skip
    if cfg.mask_prompt:
        notes.append(
            "--mask-prompt: toy scores only the replies of conversations and prompt/completion "
            'data anyway ({"text"} lines are scored whole)'
        )
    return notes


def adapted_blocks(num_layers: int | None, depth: int) -> list[int] | None:
    """The blocks --num-layers N adapts: the last N, as mlx_lm.lora's (None: every one)."""
    if num_layers is None or num_layers == -1 or num_layers == depth:
        return None
    if not 0 < num_layers < depth:
        raise UsageError(
            f"--num-layers {num_layers}: the model has {depth} blocks; give 1 to {depth} (the "
            "last N blocks adapted), or -1 for every block"
        )
    return list(range(depth - num_layers, depth))


def load_adapted(cfg: RunConfig, project: Project, recipe: str) -> Adapted:
    """The base --model names (or the project's default), held as --base-dtype asks, with
    adapters on --targets; --seq-len lowered to the base's context."""
    output = output_of(cfg)
    if output and (why := output_problem(output)):  # a resumed run skips the checks
        raise UsageError(why)
    # Absolute: run.json, adapter_config.json and `toy infer --run` / `toy export` find the
    # base from any folder (model_sha256 below notices a file changed since).
    model_path = resolve_model(cfg, project).resolve()
    # Read as asked (cuda: bfloat16), else in its blocks; auto then chooses once, knowing
    # the size a bfloat16 copy of the blocks would take.
    read_as = cfg.base_dtype or ("bfloat16" if cfg.device == "cuda" else "quantized")
    base = read_base(model_path, read_as)
    blocks = any(t not in ("F32", "F16", "BF16") for t in base.tensor_types)
    dtype, why = base_dtype(cfg, base.float32_bytes() // 2 if blocks else None)
    if dtype != read_as:  # auto held it in bf16: dequantized from what was read, not re-read
        base = held_as(base, model_path, dtype)
    targets = cfg.target_list or base.default_targets.split(",")
    # The adapters' dropout draws from torch's generator: seeded here so --seed decides it
    # (the loop then gives each process its own stream from (seed, rank)).
    torch.manual_seed(cfg.seed)
    model = base.build_model()
    del base.state_dict  # the model holds the only copy of the base
    # Validation of rank/alpha/targets happens here, before any data work.
    layers = adapted_blocks(cfg.num_layers, base.config.n_layer)
    wrapped = apply_lora(
        model, targets, int(cfg.rank), cfg.alpha, cfg.dropout, int(cfg.seed), layers
    )
    seq_len = int(cfg.seq_len)
    notes: list[str] = list(base.notes) + ([why] if why else [])
    resident = resident_bytes(model)
    held = f"held {dtype}"
    if dtype == "quantized" and not blocks:
        # --base-dtype quantized on a float base keeps its own dtype: nothing is quantized.
        own = [t.lower() for t in base.tensor_types if t in ("F16", "BF16")] or ["float32"]
        held = f"kept in {', '.join(own)} (its own dtype)"
    notes.append(
        f"base {model_path.name}: {base.arch}, {held} ({resident / 1e9:.2f} GB resident"
        + (", memory-mapped blocks)" if dtype == "quantized" else ")")
    )
    if seq_len > base.config.max_seq_len:
        notes.append(
            f"--seq-len {seq_len} lowered to the model's context {base.config.max_seq_len}"
        )
        seq_len = base.config.max_seq_len
    if output:  # the done line names final/ only: say here where the copy goes
        notes.append(output_note(output))
    notes += mlx_lm_notes(cfg, base.config.n_layer)
    config = {
        "recipe": recipe,
        "arch": base.arch,
        "model": str(model_path),
        "model_sha256": base_fingerprint(model_path),
        "rank": int(cfg.rank),
        "alpha": cfg.alpha,
        "targets": targets,
        "seq_len": seq_len,
        "base_dtype": dtype,
        "base_resident_bytes": resident,
    }
    return Adapted(model_path, base, model, targets, dtype, seq_len, wrapped, config, notes)


def output_note(output: str) -> str:
    """Where --output's copy of the final adapter goes, in the run's notes."""
    dest = Path(os.path.abspath(output))
    if output.endswith(".safetensors"):
        return (
            f"--output: at the end the adapter for mlx-lm goes to {dest}, its "
            f"adapter_config.json beside it"
        )
    return f"--output: at the end the final adapter (PEFT) is copied to {dest}/"


class AdapterJob(Job):
    """A job whose model is a frozen base with LoRA adapters (load_adapted's): final/ holds
    the PEFT adapter and the tokenizer (what `toy infer --run` and `toy export` read), then
    --output's copy. Every adapter recipe's job subclasses it."""

    def __init__(self, recipe: str, a: Adapted, cfg: RunConfig, config: dict[str, Any]):
        super().__init__(recipe, a.model, config)
        self.adapted, self.cfg = a, cfg

    def save_final(self, out: Path) -> None:
        save_adapter(self.cfg, self.adapted, out)


def save_adapter(cfg: RunConfig, a: Adapted, out: Path) -> None:
    """final/ of an adapter run: the PEFT adapter and the tokenizer, then --output's copy."""
    sd = lora_state_dict(a.model)  # once, for final/ and --output's mlx-lm form
    save_peft_adapter(
        out,
        sd,
        rank=int(cfg.rank),
        alpha=cfg.alpha,
        dropout=cfg.dropout,
        targets=a.targets,
        base_model_name_or_path=str(a.model_path),
        layers_to_transform=adapted_blocks(cfg.num_layers, a.base.config.n_layer),
    )
    a.base.tokenizer.save(str(out / "tokenizer.json"))
    output = output_of(cfg)
    if not output:
        return
    # Checked again now: PATH may have changed since the start, or be this very run's
    # directory (its name was not known then). final/ is written already.
    why = output_problem(output)
    if why:
        raise InputError(f"{why}; the adapter is in {out}, not copied")
    dest = Path(os.path.abspath(output))
    if output.endswith(".safetensors"):  # mlx-lm's trainer's --output: its adapter, there
        save_mlx_adapter(
            dest.parent,
            sd,
            int(cfg.rank),
            cfg.alpha,
            cfg.dropout,
            n_layers=a.base.config.n_layer,
            weights_name=dest.name,
            prefix=a.base.mlx_prefix,
            model=str(a.model_path),
        )
    elif dest != out.resolve():
        with atomic_dir(dest) as tmp:
            for name in ADAPTER_FILES:
                if (out / name).is_file():
                    shutil.copyfile(out / name, tmp / name)


# ---------------------------------------------------------------- the base's side of the data


def data_template(cfg: RunConfig, base: Base, kind: str, notes: list[str]) -> str | None:
    """The chat template the data goes through: a conversation ("messages") needs one
    (--chat-template, the base's own, or toy's built-in of its family); a prompt with its
    answers ("prompt") uses it where the model has one, else the texts are joined (a note
    says so); plain text needs none."""
    model = base.path or cfg.model or DEFAULT_MODEL
    if kind == "messages" or cfg.chat_template:
        template, note = resolve_chat_template(
            base.chat_template, base.vocab_tokens, base.chat_format, cfg.chat_template, str(model)
        )
        notes += [note] if note else []
        return template
    if kind == "prompt":
        try:
            template, note = resolve_chat_template(
                base.chat_template, base.vocab_tokens, base.chat_format, None, str(model)
            )
            notes += [note] if note else []
            return template
        except InputError:
            notes.append(
                f"{model} has no chat template: each prompt and completion are joined as plain text"
            )
    return None


def text_side(cfg: RunConfig, base: Base, kind: str, notes: list[str]) -> TextSide:
    """What the base gives the data stream of `kind` ("messages", "prompt", "text"): its
    tokenizer, the template (data_template), BOS/EOS, padding and embedding rows."""
    special = base.special
    return TextSide(
        tok=base.tokenizer,
        template=data_template(cfg, base, kind, notes),
        source=(
            f"--chat-template {cfg.chat_template}"
            if cfg.chat_template
            else str(base.path or cfg.model or DEFAULT_MODEL)
        ),
        bos=base.token(special.bos),
        eos=base.token(special.eos),
        eos_id=special.eos,
        pad=special.pad if special.pad is not None else (special.eos or 0),
        rows=base.config.vocab_size,
    )


def stream_opts(cfg: RunConfig) -> StreamOpts:
    """The flags a data stream reads, and this process's place among the run's."""
    d = dist.info()
    return StreamOpts(
        data=str(cfg.data),
        val_data=cfg.val_data,
        strict=bool(cfg.strict),
        seed=int(cfg.seed),
        batch_size=int(cfg.batch_size),
        eval_batches=int(cfg.eval_batches),
        compile=bool(cfg.compile),
        world=d.world,
        rank=d.rank,
    )


def chat_data(cfg: RunConfig, base: Base, seq_len: int, notes: list[str]) -> Stream:
    """--data's conversations, prompt/completion pairs or text as a Stream."""
    files = data_files(cfg.data, cfg.val_data)
    chat = read_chat_files(*files, bool(cfg.strict), notes)
    side = text_side(cfg, base, chat[0].kind, notes)
    return chat_stream(stream_opts(cfg), files, chat, side, seq_len, notes)


def token_stream(cfg: RunConfig, project: Project, tok, model_path: Path, seq_len: int) -> Stream:
    """Random windows of a token file made with the base's tokenizer (checked by its hash),
    and fixed windows of its validation split."""
    data = open_token_data(cfg, project, tokenizer=tok, tokenizer_source=str(model_path))
    win, val = token_windows(data, cfg, seq_len)
    evals = val.eval_batches(cfg.eval_batches) if val is not None else []
    n_rows = max(1, len(data.train) // seq_len)
    info = {
        "corpus": str(data.train.path),
        "corpus_tokens": len(data.train),
        **data_fingerprints("corpus", data.train.path),
    }
    return Stream(win.batch, evals, n_rows, info)
