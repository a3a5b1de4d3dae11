"""The base an adapter run (a recipe whose final/ is a LoRA adapter) adapts (a GGUF file or a model
directory), found one way by `toy infer` and `toy export`.

An adapter run records its base twice: adapter_config.json's `base_model_name_or_path`
(PEFT's field; an absolute path, so the run works from any folder) and run.json's
`model_sha256` (the sha256 of every byte of a GGUF file; a model directory's: of each
file the model is read from, so an adapter saved beside the model changes nothing:
`toy.formats.hf_dir.base_fingerprint`), so a base replaced by another, or changed in
place, is noticed. Runs made before the path was absolute recorded it as given on the
command line: it is tried as it is (from the current folder), then against the run's
project root."""

from __future__ import annotations

from pathlib import Path

from toy.errors import InputError


def run_dir_of(arg: str | Path, final: Path) -> Path:
    """The run directory a user named: `arg` itself, or the parent of a final/ they named."""
    d = Path(arg)
    return d if final != d else final.parent


def resolve_base(
    final: Path, run_dir: Path, model: str | Path | None, config: dict
) -> tuple[Path, list[str]]:
    """(base path, notes): --model when given (`model`), else the path the adapter's
    config records. A recorded base whose fingerprint differs from run.json's is refused;
    one named with --model is used with a note saying it is not the file trained on."""
    from toy.formats.checkpoint import read_json
    from toy.formats.hf_dir import same_base
    from toy.runs import find_project

    notes: list[str] = []
    where = final / "adapter_config.json"
    if model:
        base = Path(model)
        if not base.exists():
            raise InputError(f"--model {base} not found; pass the base the adapter was trained on")
    else:
        recorded = config.get("base_model_name_or_path")
        if not isinstance(recorded, str) or not recorded:
            raise InputError(
                f"{where}: no base_model_name_or_path; pass --model BASE.gguf or --model MODEL_DIR"
            )
        cands = [Path(recorded)]
        if not Path(recorded).is_absolute():  # a run made before bases were recorded absolute
            root = find_project(run_dir.resolve()).root
            if root is not None:
                cands.append(root / recorded)
        base = next((c for c in cands if c.exists()), None)
        if base is None:
            raise InputError(
                f"base model {recorded} (from {where}) not found; restore it, or pass --model "
                f"{_flag_value(recorded)} (the base the adapter was trained on)"
            )
    run_json = run_dir / "run.json"
    want = None
    if run_json.is_file():
        info = read_json(run_json)
        want = (info.get("job") or {}).get("model_sha256") if isinstance(info, dict) else None
    # same_base also accepts the forms runs recorded before (see there).
    if want and not same_base(base, want):
        if not model:
            raise InputError(
                f"{base}: this base changed since the run trained on it (fingerprint differs from "
                f"{run_json}); restore it, or pass --model {_flag_value(base)} to use it anyway"
            )
        notes.append(
            f"--model {base} is not the file the adapter was trained on (fingerprint differs); "
            "it must be the same weights (e.g. another quantization) for the result to be right"
        )
    return base, notes


def _flag_value(base: str | Path) -> str:
    """What --model takes in place of `base`: a model directory, or a GGUF file."""
    p = Path(base)
    is_dir = p.is_dir() if p.exists() else p.suffix.lower() != ".gguf"
    return "MODEL_DIR (a model directory)" if is_dir else "BASE.gguf"
