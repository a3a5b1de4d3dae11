"""`toy train`'s general flags, declared once each (toy.train.flags.Flag), in their help
groups. A general flag's default is RunConfig's; its help names the recipes whose default
differs ("(default 1e-3; lora 2e-4, ...)"), written by code from the recipes' declarations.
The recipes' own flags are declared in their files (toy.recipes.*.RECIPE.flags)."""

from __future__ import annotations

from toy.cli.args import finite_float, nonneg_int, positive_int
from toy.models import registry
from toy.train.config import OPTIMIZER_STATES
from toy.train.device import DEVICES, PRECISIONS
from toy.train.flags import Flag
from toy.train.report import REPORT_TO


def _presets() -> str:
    out = []
    for arch in registry.arch_names():
        for name in registry.preset_names(arch):
            f = registry.preset(arch, name)
            shape = (
                (f"{f['image_size']}px/{f['patch_size']}, " if "image_size" in f else "")
                + f"{f['n_layer']}x{f['d_model']}, {f['n_head']} heads"
                + (f", context {f['max_seq_len']}" if "max_seq_len" in f else "")
            )
            out.append(f"{arch} {name} ({shape})")
    return "; ".join(out)


def _int(key: str):
    return positive_int("--" + key.replace("_", "-"))


# Shown after the default of a flag every recipe shares; "" where no default is shown.
NO_DEFAULT = ""


def general_flags(recipe_names: list[str]) -> list[tuple[str, tuple[Flag, ...]]]:
    """(group title, flags) of `toy train`'s general flags. `shown` None: the default is
    RunConfig's, with each recipe's that differs (cli/cmd_train.py writes it)."""
    from toy.recipes import vit_tiny as vit

    run = (
        Flag("recipe", help=f"what to train: {', '.join(recipe_names)}", shown="from-scratch"),
        Flag("arch", help=f"architecture: {', '.join(registry.arch_names())}"),
        Flag(
            "steps",
            help="optimizer steps (--iters: mlx_lm.lora's name)",
            type=_int("steps"),
            options=("--steps", "--iters"),
        ),
        Flag(
            "epochs",
            help="passes over the training data (token windows, images or chat batches); sets "
            "--steps from the data, conflicts with --steps",
            type=_int("epochs"),
            shown=": none, --steps counts",
        ),
        Flag("seed", help="seed for init, data order and sampling", type=int, shown="0"),
        Flag(
            "out",
            help="directory that holds run directories",
            shown=": the project's runs/",
        ),
        Flag(
            "run_id",
            help="run directory name",
            shown="from toy.toml's template '{date}-{recipe}-{arch}-{n}'",
        ),
        Flag(
            "json",
            help="print one JSON object (format toy/train-v1) instead of step lines",
            type=bool,
            shown=NO_DEFAULT,
        ),
        Flag("device", help="cpu (default), cuda or metal (macOS)", choices=DEVICES, shown=""),
        Flag(
            "precision",
            help="what the matmuls compute in: auto (default: bf16 autocast on cuda and on a cpu "
            "with bf16 units (avx512_bf16, amx_bf16), float32 elsewhere), float32, or bf16 "
            "(refused on a cpu without the units). Norms, softmax, the loss and the weights stay "
            "float32; run.json records the choice and why",
            choices=PRECISIONS,
            shown="",
        ),
        Flag(
            "optimizer_state",
            help="what AdamW keeps its two moments in: auto (default: bfloat16 under bf16 "
            "precision when the run trains 16M values or more, a whole model's weights, "
            "halving their memory; float32 otherwise, an adapter's), float32 or bfloat16. "
            "The update is computed in float32 either way; run.json records the choice",
            choices=OPTIMIZER_STATES,
            shown="",
        ),
        Flag(
            "nproc",
            help="launch N local processes through torch.distributed.run (DDP; gloo on cpu, nccl "
            "on cuda); --batch-size is per process. For multi-node use torchrun, see README",
            type=_int("nproc"),
            metavar="N",
            shown=": one process",
        ),
        Flag(
            "threads",
            help="torch's CPU threads (each process's, with --nproc); the default is one a core "
            "that other programs leave free, looked at as the run starts and every few seconds "
            "(a busy core made every step wait for the thread on it)",
            type=_int("threads"),
            metavar="N",
            shown=": one a free core",
        ),
        Flag(
            "report_to",
            help="also write the run's figures for a tracker: tensorboard (the run's "
            "tensorboard/, `tensorboard --logdir runs/`; needs `pip install tensorboard`), "
            "trackio (the run's trackio/, `TRACKIO_DIR=runs/<run>/trackio trackio show`; "
            "needs `pip install trackio`) or none. events.jsonl and `toy plot` have them "
            "either way",
            choices=REPORT_TO,
            shown="none",
        ),
        Flag(
            "fsdp",
            help="with several processes: shard parameters, gradients and AdamW state (FSDP2) "
            "instead of replicating them (DDP)",
            type=bool,
            shown=NO_DEFAULT,
        ),
        Flag(
            "compile",
            help="torch.compile each transformer block (inductor; needs a C++ compiler on cpu). "
            "Faster steps after a one-off compile of tens of seconds; falls back to eager where "
            "it cannot",
            type=bool,
            shown=NO_DEFAULT,
        ),
        Flag(
            "checkpointing",
            help="activation checkpointing, the low-memory mode: keep only each block's input and "
            "recompute the block in backward, and give freed memory back to the OS at once. "
            "Measured on SmolLM2 LoRA (docs/performance.md): peak memory 0.59 GB instead of 2.1 "
            "GB, steps about 2.3x slower. Every recipe (--grad-checkpoint: mlx_lm.lora's name)",
            type=bool,
            options=("--checkpointing", "--grad-checkpoint"),
            shown=NO_DEFAULT,
        ),
        Flag(
            "resume",
            help="continue RUN_DIR from its latest checkpoint, in place (same config; --steps may "
            "be raised: docs/reliability.md says what the LR then does)",
            metavar="RUN_DIR",
            shown=": a new run",
        ),
    )
    data = (
        Flag(
            "corpus",
            help="token file from `toy prep`",
            shown=": the project's data/corpus.bin, else the bundled Shakespeare plays",
        ),
        Flag("val_corpus", help="validation token file", shown=": CORPUS.val.bin beside --corpus"),
        Flag(
            "tokenizer",
            help="tokenizer.json for the corpus",
            shown=": CORPUS.tokenizer.json, else tokenizer.json, beside the corpus",
        ),
        Flag(
            "raw_i32",
            help="--corpus is headerless packed int32 tokens",
            type=bool,
            shown=NO_DEFAULT,
        ),
        Flag(
            "vocab_size",
            help="vocabulary size of a --raw-i32 corpus without --tokenizer",
            type=_int("vocab_size"),
            shown=": the tokenizer's",
        ),
    )
    model = (
        Flag(
            "preset",
            help=f"named model shape: {_presets()}",
            shown=f": llama small, gpt2 small; vit {vit.SMALL_PRESET} under {vit.SMALL_SET:,} "
            "training images, else vit-tiny",
        ),
        Flag("n_layer", help="transformer blocks", type=_int("n_layer"), shown=": the preset's"),
        Flag("d_model", help="model width", type=_int("d_model"), shown=": the preset's"),
        Flag("n_head", help="attention (query) heads", type=_int("n_head"), shown=": the preset's"),
        Flag(
            "n_kv_head",
            help="key/value heads, grouped-query attention, llama only",
            type=_int("n_kv_head"),
            shown=": the preset's",
        ),
        Flag("seq_len", help="training sequence length", type=_int("seq_len")),
    )
    optimiser = (
        Flag(
            "batch_size",
            help="sequences per micro-batch {default}; with --data (any form), a token budget: a "
            "micro-batch holds up to batch-size x (seq-len + 1) tokens, filled with conversations "
            "of similar length (more short conversations, fewer long ones)",
            type=_int("batch_size"),
        ),
        Flag(
            "grad_accum",
            help="micro-batches per optimizer step; the loss is normalised over all of them",
            type=_int("grad_accum"),
        ),
        Flag(
            "lr",
            help="peak learning rate (--learning-rate: mlx_lm.lora's name)",
            type=finite_float,
            options=("--lr", "--learning-rate"),
        ),
        Flag("min_lr", help="final learning rate of the cosine decay", type=finite_float),
        Flag(
            "warmup",
            help="linear warmup steps, at most 10% of the run (a longer one is cut, with a note)",
            type=nonneg_int,
        ),
        Flag("weight_decay", help="AdamW decay on matrices and embeddings", type=finite_float),
        Flag("clip", help="gradient norm clip, 0 disables", type=finite_float),
        Flag(
            "eval_every",
            help="validation every N steps; it also runs before step 1 and at the end "
            "(--steps-per-eval: mlx_lm.lora's name)",
            type=nonneg_int,
            options=("--eval-every", "--steps-per-eval"),
            shown="0: only those",
        ),
        Flag(
            "eval_batches",
            help="validation batches per eval (--val-batches: mlx_lm.lora's name)",
            type=_int("eval_batches"),
            options=("--eval-batches", "--val-batches"),
        ),
        Flag(
            "save_every",
            help="checkpoint every N steps; the last step is always checkpointed",
            type=nonneg_int,
            shown="0: only the last",
        ),
        Flag("keep_last", help="checkpoints to keep, 0 keeps all", type=nonneg_int, shown="2"),
    )
    return [("run", run), ("data", data), ("model", model), ("optimiser", optimiser)]
