"""Training checkpoints and final model directories: safetensors for tensors, JSON for
everything else. Never pickle.

A checkpoint is a directory `step-NNNNNN/` holding

    model.safetensors      trainable tensors (the whole model, or just the adapter)
    optimizer.safetensors  AdamW moments, `state.<i>.<name>` by parameter index
    rng.safetensors        every process's torch CPU (and CUDA) generator state
    state.json             step, optimizer hyper-parameters, python/numpy RNG, data position

It is written under a temporary name, every file fsynced, then renamed into place:
a kill at any moment leaves either the whole new checkpoint or none of it. A
`state.json` is written last inside the temp dir; a directory without one is never
taken as valid.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from toy.errors import InputError
from toy.runs import current_umask, write_file_atomic  # formats' writers import it from here too

STEP_FMT = "step-{:06d}"


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_tensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    # Through write_file_atomic: fsynced and given 0666 less the umask (safetensors creates
    # its files 0600, which would hide a model or checkpoint from the machine's other users).
    flat = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    write_file_atomic(path, lambda tmp: save_file(flat, str(tmp), metadata=metadata))


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise InputError(f"{path} not found")
    except (SafetensorError, OSError, ValueError) as e:
        raise InputError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0]})")


def write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_json(path: Path) -> Any:
    try:
        with open(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise InputError(f"{path} not found")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e})")


def atomic_dir(final: Path):
    """Context manager: yields a temp dir next to `final`; on success gives its files the
    usual permissions (0666 less the umask: safetensors and mkstemp create theirs 0600,
    which would hide a merged model from the machine's other users) and renames it to
    `final` (replacing an old one); on failure removes it."""
    return _AtomicDir(final)


class _AtomicDir:
    def __init__(self, final: Path):
        self.final = final
        self.tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")

    def __enter__(self) -> Path:
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        mode = 0o666 & ~current_umask()
        for f in self.tmp.rglob("*"):
            if f.is_file() and not f.is_symlink():
                os.chmod(f, mode)
        _fsync_dir(self.tmp)
        if self.final.exists():
            old = self.final.with_name(f".{self.final.name}.old-{os.getpid()}")
            os.replace(self.final, old)
            os.replace(self.tmp, self.final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.tmp, self.final)
        _fsync_dir(self.final.parent)
        return False


# ------------------------------------------------------------------ optimizer


def optimizer_tensors(
    opt: torch.optim.Optimizer, names: dict[int, str], full=lambda t: t
) -> tuple[dict[str, torch.Tensor], dict]:
    """AdamW state keyed by parameter NAME (`state.<name>.<key>`), not by index: a
    checkpoint then loads whatever the process count or sharding was. `full` turns a
    sharded tensor (FSDP's DTensor) into the whole tensor; it is a collective, so every
    rank calls this in the same order."""
    tensors: dict[str, torch.Tensor] = {}
    for g in opt.param_groups:
        for p in g["params"]:
            for key, val in opt.state.get(p, {}).items():
                t = val if torch.is_tensor(val) else torch.tensor(val)
                tensors[f"state.{names[id(p)]}.{key}"] = full(t)
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [names[id(p)] for p in g["params"]],
        }
        for g in opt.param_groups
    ]
    return tensors, {"param_groups": groups}


def load_optimizer(
    opt: torch.optim.Optimizer,
    tensors: dict[str, torch.Tensor],
    meta: dict,
    names: dict[int, str],
    shard=lambda t, p: t,
) -> None:
    """Inverse of optimizer_tensors; `shard(full_tensor, param)` re-shards for FSDP. The
    saved groups must hold the same parameters as this optimizer's, group by group: their
    settings (weight decay, LR multiplier) are matched by position."""
    saved = [set(g["params"]) for g in meta["param_groups"]]
    ours = [{names[id(p)] for p in g["params"]} for g in opt.param_groups]
    if saved != ours:
        raise InputError(
            f"checkpoint optimizer groups ({len(saved)}) do not match this run's ({len(ours)}): "
            "it was made by another toy version or another run; "
            "resume it with that version or start a new run"
        )
    by_name = {names[id(p)]: p for g in opt.param_groups for p in g["params"]}
    for key, t in tensors.items():
        name, k = key[len("state.") :].rsplit(".", 1)
        p = by_name.get(name)
        if p is None:
            raise InputError(
                f"checkpoint optimizer state names {name!r}, which this model does not train"
            )
        # the optimizer's own state dtype (HalfStateAdamW: bf16), else the parameter's
        dtype = getattr(opt, "state_dtype", p.dtype)
        opt.state[p][k] = t if t.dim() == 0 else shard(t.to(dtype), p)
    for g, saved in zip(opt.param_groups, meta["param_groups"]):
        g.update({k: v for k, v in saved.items() if k != "params"})


# ------------------------------------------------------------------ RNG


def local_rng_state(device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """This process's torch generators: the CPU one, and its own CUDA device's."""
    out = {"cpu": torch.get_rng_state()}
    if device is not None and device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def _host_rng_meta() -> dict:
    py = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [
            np_state[0],
            np_state[1].tolist(),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
    }


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict, rank: int = 0) -> bool:
    """Restore this rank's generators; False when the checkpoint has none for this rank
    (the run had fewer processes), and the caller seeds a stream of its own."""
    cpu = tensors.get(f"torch_cpu_rank{rank}")
    if cpu is None and rank == 0:
        cpu = tensors.get("torch_cpu")  # checkpoints written before per-rank states
    if cpu is None:
        return False
    torch.set_rng_state(cpu)
    cuda = tensors.get(f"torch_cuda_rank{rank}")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda, torch.cuda.current_device())
    v, state, gauss = meta["python"]
    random.setstate((v, tuple(state), gauss))
    n = meta["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    return True


# ------------------------------------------------------------------ checkpoints


def save_checkpoint(
    ckpt_root: Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    opt_state: tuple[dict[str, torch.Tensor], dict],
    state: dict,
    rank_rng: list[dict[str, torch.Tensor]],
) -> Path:
    """opt_state: from optimizer_tensors; rank_rng: each process's generators, in rank
    order (local_rng_state of every rank), saved as torch_cpu_rank<r> / torch_cuda_rank<r>."""
    final = ckpt_root / STEP_FMT.format(step)
    with atomic_dir(final) as d:
        save_tensors(d / "model.safetensors", model_state)
        opt_t, opt_meta = opt_state
        save_tensors(d / "optimizer.safetensors", opt_t)
        rng_t = {
            f"torch_{kind}_rank{r}": t
            for r, states in enumerate(rank_rng)
            for kind, t in states.items()
        }
        rng_meta = _host_rng_meta()
        save_tensors(d / "rng.safetensors", rng_t)
        # What each file holds, written last: a resume checks it (checkpoint_problem).
        files = {f: file_sha256(d / f) for f in CHECKPOINT_FILES}
        write_json(
            d / "state.json",
            {**state, "step": step, "optimizer": opt_meta, "rng": rng_meta, "files": files},
        )
    return final


CHECKPOINT_FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors")


def file_sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def checkpoint_problem(d: Path) -> str | None:
    """What is wrong with checkpoint `d` (a file missing, or its bytes no longer the ones
    written: state.json records each file's sha256), or None. A checkpoint written before
    the digests were recorded is taken as it is."""
    try:
        state = read_json(d / "state.json")
    except InputError:
        return "its state.json is unreadable"
    files = state.get("files") if isinstance(state, dict) else None
    if not isinstance(files, dict):
        return None
    for name, digest in files.items():
        if not (d / name).is_file():
            return f"{name} is missing"
        if file_sha256(d / name) != digest:
            return f"{name}'s bytes changed since it was written"
    return None


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Valid checkpoints (complete, not temp), oldest first: ordered by the step number,
    not the name (past step 999999 the names grow a digit and sort wrongly as text)."""
    if not ckpt_root.is_dir():
        return []
    out = []
    for d in ckpt_root.iterdir():
        num = d.name.removeprefix("step-")
        if d.name.startswith("step-") and num.isdigit() and (d / "state.json").is_file():
            out.append((int(num), d))
    return [d for _, d in sorted(out)]


def prune_checkpoints(ckpt_root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    for d in list_checkpoints(ckpt_root)[:-keep_last]:
        shutil.rmtree(d, ignore_errors=True)


def load_checkpoint(
    d: Path,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    state = read_json(d / "state.json")
    return (
        load_tensors(d / "model.safetensors"),
        load_tensors(d / "optimizer.safetensors"),
        load_tensors(d / "rng.safetensors"),
        state,
    )
