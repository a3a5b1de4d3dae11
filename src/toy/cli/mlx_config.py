"""mlx_lm.lora's YAML config file (`toy train -c FILE`, as `mlx_lm.lora -c FILE`): its keys
become the flags of mlx_lm.lora's that toy train takes (README, "Flags from mlx-lm"), put
before the command line's own, so a flag given there wins, as it does in mlx_lm.lora. The
recipe is lora unless --recipe says otherwise. A key toy cannot honour (a learning-rate
schedule, an optimizer's own settings, an adapter to resume from) is one line
naming the file, the key and what to give instead; an unknown key likewise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toy.errors import InputError, UsageError

# mlx_lm.lora's keys (its CONFIG_DEFAULTS) -> toy train's option; None: no bearing on
# toy's run (mlx-lm's report cadence, cache and hub settings), passed over.
FLAGS: dict[str, str | None] = {
    "model": "--model-path",
    "train": "--train",
    "fine_tune_type": "--fine-tune-type",
    "optimizer": "--optimizer",
    "data": "--data",
    "seed": "--seed",
    "num_layers": "--num-layers",
    "batch_size": "--batch-size",
    "iters": "--iters",
    "val_batches": "--val-batches",
    "learning_rate": "--learning-rate",
    "steps_per_eval": "--steps-per-eval",
    "adapter_path": "--adapter-path",
    "save_every": "--save-every",
    "max_seq_length": "--max-seq-length",
    "grad_checkpoint": "--grad-checkpoint",
    "grad_accumulation_steps": "--grad-accum",
    "mask_prompt": "--mask-prompt",
    "report_to": "--report-to",
    "steps_per_report": None,  # toy writes every step's line
    "clear_cache_threshold": None,  # MLX's memory cache
    "project_name": None,  # a wandb/swanlab project
    "trust_remote_code": None,  # toy runs no model code of a hub's
    "config": None,
    "test": "--test",
    "test_batches": "--test-batches",
    "optimizer_config": None,  # checked below
    "lora_parameters": None,  # below
    "lr_schedule": None,  # below
    "resume_adapter_file": None,  # below
}
# Not honoured: a set value is one line with what to give instead.
INSTEAD = {
    "lr_schedule": "toy's schedule is a warmup then cosine decay: give --warmup, --lr and --min-lr",
    "resume_adapter_file": "toy resumes a run from its checkpoint: `toy train --resume RUN`",
}


def _switch(option: str) -> bool:
    return option in ("--train", "--grad-checkpoint", "--mask-prompt", "--test")


def config_words(path: Path) -> list[str]:
    """The flags the YAML file at `path` stands for."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise InputError(f"-c {path}: cannot read it ({e.strerror or e}); give mlx_lm.lora's "
                         "YAML config file")  # fmt: skip
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise InputError(f"{path}{where}: not YAML ({getattr(e, 'problem', None) or e})")
    if data is None:
        return []
    if not isinstance(data, dict):
        raise InputError(f"{path}: an mlx_lm.lora config is a mapping of its flags' names")
    words: list[str] = []
    for key, value in data.items():
        if key not in FLAGS:
            known = ", ".join(sorted(FLAGS))
            raise UsageError(f"{path}: {key!r} is not one of mlx_lm.lora's config keys ({known})")
        if value is None or value is False:
            continue
        if key in INSTEAD:
            raise UsageError(f"{path}: {key}: {value!r}: {INSTEAD[key]}")
        if key == "optimizer_config":
            if not isinstance(value, dict) or any(v for v in value.values()):
                raise UsageError(
                    f"{path}: optimizer_config: toy does not read an optimizer's own settings; "
                    "give --weight-decay (AdamW's) and remove them"
                )
            continue
        if key == "lora_parameters":
            words += _lora_words(path, value)
            continue
        option = FLAGS[key]
        if option is None:
            continue
        if _switch(option):
            if value is not True:
                raise UsageError(f"{path}: {key}: {value!r}; give true or false")
            words.append(option)
        else:
            words += [option, str(value)]
    return words


def _lora_words(path: Path, p: Any) -> list[str]:
    """lora_parameters {rank, scale, dropout, keys} as --rank, --alpha (scale x rank: mlx-lm
    scales the update by `scale` as it is, toy by alpha / rank), --dropout, --targets."""
    if not isinstance(p, dict):
        raise UsageError(f"{path}: lora_parameters: a mapping of rank, scale, dropout, keys")
    if unknown := sorted(set(p) - {"rank", "scale", "dropout", "keys"}):
        raise UsageError(f"{path}: lora_parameters: {', '.join(unknown)} unknown; mlx_lm.lora "
                         "reads rank, scale, dropout and keys")  # fmt: skip
    words: list[str] = []
    rank = p.get("rank", 8)
    if "rank" in p:
        words += ["--rank", str(rank)]
    if "scale" in p:
        try:
            words += ["--alpha", repr(float(p["scale"]) * int(rank))]
        except (TypeError, ValueError):
            raise UsageError(f"{path}: lora_parameters: scale {p['scale']!r} and rank {rank!r} "
                             "must be numbers")  # fmt: skip
    if "dropout" in p:
        words += ["--dropout", str(p["dropout"])]
    if p.get("keys"):
        keys = p["keys"] if isinstance(p["keys"], list) else [p["keys"]]
        names = list(dict.fromkeys(str(k).rsplit(".", 1)[-1] for k in keys))
        words += ["--targets", ",".join(names)]
    return words


def expand(words: list[str]) -> list[str]:
    """`toy train` words with `-c FILE` / `--config FILE` replaced by the file's flags, put
    first (the command line's own come after and win), and --recipe lora where none is
    given. Words without -c come back as they are."""
    at = [i for i, w in enumerate(words) if w in ("-c", "--config") or w.startswith("--config=")]
    if not at:
        return words
    i = at[0]
    w = words[i]
    if w.startswith("--config="):
        path, rest = w.split("=", 1)[1], words[:i] + words[i + 1 :]
    else:
        if i + 1 >= len(words):
            raise UsageError(f"{w} needs a file: mlx_lm.lora's YAML config")
        path, rest = words[i + 1], words[:i] + words[i + 2 :]
    cmd = rest.index("train")
    given = rest[cmd + 1 :]
    recipe = [] if any(x == "--recipe" or x.startswith("--recipe=") for x in given) else [
        "--recipe", "lora"]  # fmt: skip
    return rest[: cmd + 1] + recipe + config_words(Path(path)) + given
