"""`toy list [DIR...]`: the models under the project's data/, the runs' exports
(runs/*/export/) and any DIR given -- GGUF files, transformers and MLX model directories
(merged ones too), PEFT and mlx-lm adapter directories, LoRA adapter GGUFs -- with kind,
architecture, parameter count and size (an adapter's rank and alpha), and the runs under
runs/ with their recipe and status. Headers only: nothing is dequantized, no weight is
loaded."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from toy.cli.args import columns, human_size
from toy.errors import ToyError, UsageError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "list",
        help="list models and adapters (GGUF files, model and adapter directories in data/, "
        "runs' exports, DIRs) and runs (runs/)",
        description=__doc__,
    )
    p.add_argument(
        "dirs",
        nargs="*",
        metavar="DIR",
        help="more directories (or .gguf files) to list models and adapters from "
        "(default: none; data/ and runs/*/export/ are always listed)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _gguf_files(paths: list[Path]) -> list[Path]:
    seen, out = set(), []
    for p in paths:
        found = [p] if os.path.isfile(p) else sorted(p.rglob("*.gguf"))
        for f in found:
            # Skip the temp files of an export in progress (.name.xxxx.tmp never ends in .gguf,
            # but a hidden .gguf may be a partial download).
            if f.name.startswith(".") or not os.path.isfile(f):
                continue
            key = f.resolve()
            if key not in seen:
                seen.add(key)
                out.append(f)
    return out


def describe_model(path: Path) -> dict[str, Any]:
    """One GGUF as a row: kind, arch, parameters, size -- or the error that stops toy
    reading it (a broken file is listed, never a crash)."""
    from toy.formats.gguf_describe import describe_gguf
    from toy.formats.gguf_header import read_gguf_header

    row: dict[str, Any] = {"path": str(path)}
    try:
        row["file_size"] = path.stat().st_size
    except OSError as e:
        return {**row, "error": f"cannot read ({e.strerror})"}
    try:
        d = describe_gguf(path)
        if d.get("type") == "adapter":
            raise ToyError("an adapter")  # listed from its header below
        hp = d["hyperparameters"]
        row = {
            **row,
            "kind": "model",
            "arch": d["arch"],
            "name": d.get("name"),
            "n_params": d["n_params"],
            "n_layer": (hp or {}).get("n_layer"),
            "d_model": (hp or {}).get("d_model"),
            "tensor_types": d["tensor_types"],
        }
        return (
            {**row, "note": d["load_error"].removeprefix(f"{path}: ")} if d["load_error"] else row
        )
    except ToyError as e:
        why = e.message
    # toy cannot run it (an adapter, another architecture), but the header may still say what it is.
    try:
        h = read_gguf_header(path)
    except ToyError as e:
        return {**row, "error": e.message}
    meta = h.metadata
    n_params = sum(ti.n_elements for ti in h.tensors.values())
    types: dict[str, int] = {}
    for ti in h.tensors.values():
        types[ti.qtype.name] = types.get(ti.qtype.name, 0) + 1
    base = {
        "arch": meta.get("general.architecture"),
        "name": meta.get("general.name"),
        "n_params": n_params,
        "tensor_types": types,
    }
    if meta.get("general.type") == "adapter":
        from toy.formats.gguf_adapter import describe_adapter

        a = describe_adapter(h)
        row = {
            **row,
            "kind": f"{meta.get('adapter.type', '?')} adapter",
            **base,
            "alpha": a["alpha"],
            "rank": a["rank"],
        }
        return {**row, "note": "; ".join(a["problems"])} if a["problems"] else row
    return {**row, "kind": "model", **base, "note": why.removeprefix(f"{path}: ")}


def _dirs(paths: list[Path]) -> list[Path]:
    """The model directories (config.json) and adapter directories (adapter_config.json)
    at or under `paths`, links followed, each once; hidden folders (an export or a fetch
    in progress) and folders toy may not look into skipped.

    os.path.isfile/isdir, not Path's: they say False where a path cannot be examined (a
    mode-000 folder on the way: PermissionError from Path.is_file before Python 3.14)."""
    seen: set[Path] = set()
    out: list[Path] = []

    def walk(d: Path, depth: int) -> None:
        key = d.resolve()
        if key in seen or depth > 8:
            return
        seen.add(key)
        if os.path.isfile(d / "config.json") or os.path.isfile(d / "adapter_config.json"):
            out.append(d)
            return
        try:
            children = sorted(
                c for c in d.iterdir() if os.path.isdir(c) and not c.name.startswith(".")
            )
        except OSError:
            return
        for c in children:
            walk(c, depth + 1)

    for p in paths:
        if os.path.isdir(p):
            walk(p, 0)
    return out


def _files_size(d: Path) -> dict[str, int]:
    """{"file_size": bytes of the files in `d`}, or {} where `d` cannot be listed (a folder
    of mode 311: its files can be opened by name, but not counted)."""
    try:
        return {"file_size": sum(f.stat().st_size for f in d.iterdir() if os.path.isfile(f))}
    except OSError:
        return {}


def describe_directory(d: Path) -> dict[str, Any]:
    """A model or adapter directory as a row, from config files and safetensors headers
    (a broken one is listed with its error, never a crash)."""
    row: dict[str, Any] = {"path": str(d)}
    try:
        if (d / "adapter_config.json").is_file():
            return {**row, **_describe_adapter_dir(d)}
        from toy.formats.hf_dir import describe_dir

        info = describe_dir(d)
    except ToyError as e:
        return {**row, **_files_size(d), "error": e.message}
    except OSError as e:
        return {**row, "error": f"cannot read ({e.strerror or e})"}
    row.update(
        kind=f"{info['kind']} model",
        arch=info["arch"],
        n_params=info.get("n_params"),
        **_files_size(d),
    )
    hp = info.get("hyperparameters") or {}
    row.update(n_layer=hp.get("n_layer"), d_model=hp.get("d_model"))
    if info.get("tensor_types"):
        row["tensor_types"] = info["tensor_types"]
    if info["load_error"]:
        row["note"] = info["load_error"].removeprefix(f"{d}: ")
    return row


def _describe_adapter_dir(d: Path) -> dict[str, Any]:
    """A PEFT adapter (adapter_model.safetensors) or an mlx-lm one (adapters.safetensors)."""
    from toy.formats.hf_dir import _json
    from toy.formats.safetensors_map import SafeFile

    cfg = _json(d / "adapter_config.json", "")
    if not isinstance(cfg, dict):
        raise ToyError(f"{d / 'adapter_config.json'}: expected a JSON object")
    row: dict[str, Any] = _files_size(d)
    if (d / "adapters.safetensors").is_file():
        lp = cfg.get("lora_parameters") if isinstance(cfg.get("lora_parameters"), dict) else {}
        rank, scale = lp.get("rank"), lp.get("scale")
        alpha = scale * rank if isinstance(scale, (int, float)) and isinstance(rank, int) else None
        weights, kind = d / "adapters.safetensors", "mlx adapter"
        row["note"] = f"mlx-lm: --adapter-path; scale {scale}" if scale is not None else "mlx-lm"
    elif (d / "adapter_model.safetensors").is_file():
        rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
        weights, kind = d / "adapter_model.safetensors", "peft adapter"
        base = cfg.get("base_model_name_or_path")
        if isinstance(base, str) and base:
            row["base"] = base
            row["note"] = f"base {_shown(base)}"
    else:
        raise ToyError(
            f"{d}: adapter_config.json without adapters.safetensors (mlx-lm) or "
            "adapter_model.safetensors (PEFT)"
        )
    sf = SafeFile(weights)
    n = 0
    for e in sf.entries.values():
        k = 1
        for x in e.shape:
            k *= x
        n += k
    return {
        **row,
        "kind": kind,
        "arch": _adapter_arch(d, cfg),
        "n_params": n,
        "rank": rank,
        "alpha": alpha,
    }


def _adapter_arch(d: Path, cfg: dict) -> str | None:
    """An adapter's architecture, where something at hand says it: its config's
    model_type; the base it names (PEFT's base_model_name_or_path, mlx-lm's "model") where
    that is a GGUF or model directory here (a relative one from here or from the
    adapter); else the run it was written in (final/ or export/ of a toy run: run.json's
    arch). None: nothing says."""
    if isinstance(cfg.get("model_type"), str):
        return cfg["model_type"]
    bases = [cfg.get(k) for k in ("base_model_name_or_path", "model")]
    paths = [p for b in bases if isinstance(b, str) and b for p in (Path(b), d / b)]
    for path in paths:
        try:
            if path.is_file():
                from toy.formats.gguf_header import read_gguf_header

                arch = read_gguf_header(path).metadata.get("general.architecture")
            elif (path / "config.json").is_file():
                arch = json.loads((path / "config.json").read_text()).get("model_type")
            else:
                continue
        except (ToyError, OSError, ValueError):
            continue
        if isinstance(arch, str):
            return arch
    for up in (d.parent, d.parent.parent):  # RUN/final, RUN/export/NAME
        try:
            arch = json.loads((up / "run.json").read_text()).get("arch")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(arch, str):
            return arch
    return None


def describe_run(d: Path) -> dict[str, Any]:
    """A run directory as a row: recipe, arch, steps, status (toy.runs.run_status, the
    word `toy runs` shows)."""
    from toy.runs import RUNNING, UNFINISHED, read_events, run_status

    row: dict[str, Any] = {
        "run_id": d.name,
        "path": str(d),
        "has_final": os.path.isdir(d / "final"),
    }
    info: Any = None
    try:
        info = json.loads((d / "run.json").read_text())
        if not isinstance(info, dict):
            raise ValueError("not an object")
        row.update(
            recipe=info.get("recipe"),
            arch=info.get("arch"),
            params=info.get("params"),
            steps=(info.get("train") or {}).get("steps"),
            started=info.get("started"),
        )
    except FileNotFoundError:
        row["error"] = "no run.json"
    except (OSError, ValueError, UnicodeDecodeError) as e:
        row["error"] = (
            f"unreadable run.json ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        )
    try:
        events = read_events(d)
    except ToyError:
        events = []
    last = events[-1] if events else None
    status = run_status(events, info)  # the word `toy runs` shows too
    if status in (UNFINISHED, RUNNING):  # where it has got to (the table's note)
        row["last_step"] = next(
            (e.get("step") for e in reversed(events) if e.get("event") == "step"), 0
        )
    if last is not None:
        ev = last.get("event")
        if ev == "run_failed" and last.get("error"):
            row["error"] = str(last["error"]).splitlines()[0][:200]
        if ev == "run_finished":
            row.update(
                final_step=last.get("step"), loss=last.get("loss"), val_loss=last.get("val_loss")
            )
    row["status"] = status
    return row


def _children(d: Path) -> list[Path]:
    """What `d` holds, sorted; none where it is not a folder toy may list."""
    try:
        return sorted(d.iterdir())
    except OSError:
        return []


def _runs(runs_dir: Path) -> list[dict[str, Any]]:
    dirs = [
        d
        for d in _children(runs_dir)
        if os.path.isdir(d)
        and not d.name.startswith(".")
        and (os.path.exists(d / "run.json") or os.path.exists(d / "events.jsonl"))
    ]
    return [describe_run(d) for d in dirs]


def _params(n: int | None) -> str:
    if not isinstance(n, int):
        return "?"
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def _shown(p: str | Path) -> str:
    """A path as the user would type it: relative to the working directory when under it."""
    try:
        return str(Path(p).relative_to(Path.cwd()))
    except ValueError:
        return str(p)


def _stale_export(path: Path, exports: list[Path]) -> str | None:
    """Why an export under a run's export/ no longer is the run's model: its final/ was
    written after it (a resumed run trained on); None when it is, or is not an export."""
    if path.parent not in exports:
        return None
    final = path.parent.parent / "final"
    try:
        made = max(f.stat().st_mtime for f in ([path] if path.is_file() else path.iterdir()))
        now = max(f.stat().st_mtime for f in final.iterdir())
    except (OSError, ValueError):
        return None
    if now <= made:
        return None
    return "STALE: the run's final/ is newer (resumed since); export again with --force"


def _export_dirs(runs_dir: Path) -> list[Path]:
    return [d / "export" for d in _children(runs_dir) if os.path.isdir(d / "export")]


def run(args) -> int:
    from toy.runs import find_project

    project = find_project()
    model_dirs: list[Path] = []
    if project.data_dir is not None and project.data_dir.is_dir():
        model_dirs.append(project.data_dir)
    exports = _export_dirs(project.runs_dir)
    model_dirs += exports
    for a in args.dirs:
        p = Path(a)
        if not p.exists():
            raise UsageError(
                f"{p}: no such directory or file; pass directories holding models (.gguf "
                "files, model or adapter directories)"
            )
        model_dirs.append(p)
    models = [describe_model(f) for f in _gguf_files(model_dirs)]
    models += [describe_directory(d) for d in _dirs(model_dirs)]
    for m in models:
        if why := _stale_export(Path(m["path"]), exports):
            m["stale"] = True
            m["note"] = f"{m['note']}; {why}" if m.get("note") else why
    runs = _runs(project.runs_dir)
    if args.json:
        print(
            json.dumps(
                {
                    "format": "toy/list-v1",
                    "project": str(project.root) if project.root else None,
                    "model_dirs": [str(d) for d in model_dirs],
                    "runs_dir": str(project.runs_dir),
                    "models": models,
                    "runs": runs,
                }
            )
        )
        return 0
    where = [_shown(d) for d in model_dirs if d not in exports]
    if exports:
        where.append(_shown(project.runs_dir / "*" / "export"))
    print(f"models ({', '.join(where) or 'no data/ (not in a toy project) and no DIR given'}):")
    table = [["path", "arch", "kind", "params", "size", "note"]]
    for m in models:
        if "error" in m:
            table.append(
                [
                    _shown(m["path"]),
                    "?",
                    "unreadable",
                    "",
                    human_size(m["file_size"]) if "file_size" in m else "",
                    f"ERROR: {m['error'].removeprefix(m['path'] + ': ')}",
                ]
            )
            continue
        kind = m["kind"] + (f" r{m['rank']}" if m.get("rank") else "")
        table.append(
            [
                _shown(m["path"]) + ("/" if Path(m["path"]).is_dir() else ""),
                str(m["arch"]) if m.get("arch") else "?",
                kind,
                _params(m["n_params"]),
                human_size(m["file_size"]) if "file_size" in m else "?",
                m.get("note") or "",
            ]
        )
    print("\n".join(columns(table, right={3, 4}, indent="  ")) if models else "  none")
    print(f"runs ({_shown(project.runs_dir)}):")
    table = [["run", "recipe", "arch", "params", "status", "note"]]
    for r in runs:
        table.append(
            [
                r["run_id"],
                r.get("recipe") or "?",
                r.get("arch") or "?",
                _params(r["params"]) if r.get("params") else "",
                r["status"],
                r.get("error") or (f"at step {r['last_step']}" if "last_step" in r else ""),
            ]
        )
    print("\n".join(columns(table, right={3}, indent="  ")) if runs else "  none")
    return 0
