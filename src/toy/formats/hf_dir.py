"""Model directories as bases: what transformers' `save_pretrained` writes and what
`mlx_lm.convert -q` writes from it.

    transformers   config.json (model_type, dtype or torch_dtype), model.safetensors or
                   shards + model.safetensors.index.json, tokenizer.json, the chat template
                   in chat_template.jinja or tokenizer_config.json, EOS in generation_config.json
    MLX            the same, plus config.json `quantization` {group_size, bits, mode, and per
                   module overrides}; a quantized module is `weight` (uint32, packed),
                   `scales` and `biases`

Tensor names are HF's (`model.layers.N.self_attn.q_proj.weight`, a multimodal Gemma 3's
under `language_model.model.` or `model.language_model.`); which tensors a family needs,
and where toy holds them, is the family's own `hf_plan` (models/<family>.py). Weights are
memory-mapped (formats/safetensors_map.py) and held as `--base-dtype` asks: quantized
(the default on CPU) keeps MLX's packed integers and a transformers directory's F16/BF16
values as they are in the file, dequantized per use; float32 and bfloat16 convert once.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from toy.data.prep import cache_dir
from toy.errors import InputError
from toy.formats.base import Base, QuantTensor, Specials, stop_ids
from toy.formats.safetensors_map import SafeFile, open_weights, weight_files
from toy.models import mlx_quant, registry
from toy.models.family import BadConfig, Family, HFType, Keys, Planned
from toy.models.quant import MLXSpec, QuantSpec
from toy.models.quant_types import BASE_DTYPES, BF16, F16
from toy.runs import content_fingerprint, fingerprint

# Tensors of a multimodal checkpoint that a text model does not use (counted in a note).
VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)
# A multimodal Gemma 3's text model, saved the legacy way or transformers 5's: both read as
# `model.`.
TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers older checkpoints saved


def _json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path} not found; {what}")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({str(e).splitlines()[0]})")


# The files a model directory is read from besides its weights (read_dir, _tokenizer,
# _specials): what a run's fingerprint of its base covers. Anything else in the folder (a
# README, an mlx-lm adapter saved beside the model) does not change the model.
READ_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
)


def read_files(d: Path) -> list[Path]:
    """The files of model directory `d` that toy reads: READ_FILES present and the
    weight files (safetensors_map.weight_files), sorted by name."""
    files = {d / n for n in READ_FILES if (d / n).is_file()}
    try:
        files.update(weight_files(d))
    except InputError:  # no usable weights: reading the directory says why
        pass
    return sorted(files)


def base_fingerprint(path: Path) -> str:
    """What a run records of its base (model_sha256, donor_sha256): toy.runs.
    content_fingerprint of every byte of a GGUF file, or of a model directory's read_files,
    so a base changed in place anywhere (re-merged, re-quantized to the same size) is
    caught. Each file's digest is cached in toy's cache folder (digests.json): hashed once,
    at the run's start, and a resume or `toy infer --run` of the same file costs a stat."""
    path = Path(path)
    files = read_files(path) if path.is_dir() else None
    return content_fingerprint(path, files, cache_dir() / "digests.json")


def same_base(path: Path, recorded: object) -> bool:
    """Whether `recorded` (a run's model_sha256 or donor_sha256) is base `path`'s
    fingerprint. Runs made before it covered every byte recorded 16 hex digits of the size
    and first 4 MiB (toy.runs.fingerprint: of read_files, or for a directory in the runs
    before those, of every file): still accepted where they match, though such a record
    cannot see a change past the first 4 MiB of a file."""
    path = Path(path)
    if not isinstance(recorded, str):
        return False
    if len(recorded) == 16 and path.is_dir():  # an older form: no need to read every byte
        return recorded in (fingerprint(path, files=read_files(path)), fingerprint(path))
    if len(recorded) == 16:
        return recorded == fingerprint(path)
    return recorded == base_fingerprint(path)


def _object(path: Path) -> dict:
    """An optional JSON file that holds an object (tokenizer_config.json,
    generation_config.json): {} when absent."""
    if not path.is_file():
        return {}
    v = _json(path, "")
    if not isinstance(v, dict):
        raise InputError(f"{path}: expected a JSON object, found {type(v).__name__}; fix the file")
    return v


def supported_types() -> dict[str, tuple[Family, HFType]]:
    """transformers model_type -> (its family, how the family reads it)."""
    return {t: (f, h) for f in registry.families().values() for t, h in f.hf_types.items()}


def dir_kind(d: Path) -> str:
    """ "transformers" or "mlx" for a model directory; an InputError naming what is
    missing for anything else."""
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        if (d / "adapter_config.json").is_file():
            raise InputError(
                f"{d}: is a LoRA adapter directory, not a model; pass the base model here "
                "(an adapter goes to --adapter)"
            )
        raise InputError(
            f"{d}: not a model directory (no config.json); give a GGUF file, a transformers "
            "directory or an MLX directory"
        )
    cfg = _json(cfg_path, "a model directory needs one")
    if not isinstance(cfg, dict):
        raise InputError(f"{cfg_path}: expected a JSON object")
    return "mlx" if isinstance(cfg.get("quantization"), dict) else "transformers"


def is_transformers(d: Path) -> bool:
    return d.is_dir() and dir_kind(d) == "transformers"


def is_mlx(d: Path) -> bool:
    return d.is_dir() and dir_kind(d) == "mlx"


def _canonical(name: str) -> str | None:
    """A file's tensor name as the family's plan names it; None for one a text model ignores."""
    if name.startswith(VISION_PREFIXES) or name.endswith(IGNORED_SUFFIXES):
        return None
    for old, new in TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _mode_problem(q: dict, where: str) -> str | None:
    mode = q.get("mode", "affine")
    if mode != "affine":
        return (
            f"{where}: MLX quantization mode {mode!r} is not supported; toy reads affine "
            "quantization (`mlx_lm.convert -q --q-mode affine`, the default)"
        )
    return None


def read_model_dir(d: Path, base_dtype: str = "float32") -> Base:
    if base_dtype not in BASE_DTYPES:
        raise ValueError(f"base_dtype must be one of {BASE_DTYPES}, got {base_dtype!r}")
    kind = dir_kind(d)
    config = _json(d / "config.json", "a model directory needs one")
    model_type = config.get("model_type")
    types = supported_types()
    if not isinstance(model_type, str) or model_type not in types:
        raise InputError(
            f"{d / 'config.json'}: model_type {model_type!r} is not supported; supported: "
            f"{', '.join(sorted(types))}"
        )
    family, hf = types[model_type]
    where = open_weights(d)
    names: dict[str, str] = {}  # plan name -> the file's name
    ignored = 0
    for name in where:
        canon = _canonical(name)
        if canon is None:
            ignored += 1
        else:
            names[canon] = name
    quant = config.get("quantization") if kind == "mlx" else None
    if quant is not None and (why := _mode_problem(quant, str(d / "config.json"))):
        raise InputError(why)

    # The file's shapes (a quantized module's weight at its packed width: the config reader
    # takes only rows and which tensors exist from them).
    shapes = {canon: where[n].entries[n].shape for canon, n in names.items()}
    try:
        cfg = hf.config(Keys(config, shapes, "config.json key"))
    except BadConfig as e:
        raise InputError(f"{d / 'config.json'}: {e}")
    plan = family.hf_plan(cfg)
    sd, types_seen = _load(d, model_type, plan, names, where, quant, base_dtype)
    used = set(plan) | {n[: -len(".weight")] + s for n in plan for s in (".scales", ".biases")}
    extra = sorted(set(names) - used)
    if extra:
        raise InputError(
            f"{d}: unexpected tensor {names[extra[0]]!r} ({len(extra)} in all); toy's "
            f"{model_type} has no place for it (a different architecture or an unsupported variant)"
        )
    tok = _tokenizer(d)
    special, template = _specials(d, config, tok)
    notes = (
        [f"{ignored} tensors of the vision tower left out (the text model only)"] if ignored else []
    )
    beyond = sorted(
        i for i in tok.get_vocab(with_added_tokens=True).values() if i >= cfg.vocab_size
    )
    # Tokens a converter added (mlx_lm.convert's <mask>, ...): text holding them cannot be
    # embedded.
    if beyond:
        notes.append(
            f"{len(beyond)} tokenizer ids beyond the model's {cfg.vocab_size} embedding rows (e.g. "
            f"{tok.id_to_token(beyond[0])!r}); text containing them is refused"
        )
    return Base(
        kind=kind,
        path=d,
        arch=model_type,
        family=family,
        config=cfg,
        state_dict=sd,
        tokenizer=tok,
        special=special,
        chat_template=template,
        chat_format=hf.chat_format,
        metadata=config,
        tensor_types=types_seen,
        base_dtype=base_dtype,
        notes=notes,
        mlx_prefix="language_model.model." if model_type == "gemma3" else "model.",
    )


def _load(
    d: Path,
    model_type: str,
    plan: dict[str, Planned],
    names: dict[str, str],
    where: dict[str, SafeFile],
    quant: dict | None,
    base_dtype: str,
) -> tuple[dict, Counter]:
    """toy name -> tensor or QuantTensor, and the count of each tensor type."""
    sd: dict[str, torch.Tensor | QuantTensor] = {}
    seen: Counter = Counter()
    for canon, p in plan.items():
        if canon not in names:
            raise InputError(
                f"{d}: missing tensor {canon!r}; the directory does not hold a complete "
                f"{model_type} model of this config (check config.json and the shards)"
            )
        file_name = names[canon]
        sf = where[file_name]
        e = sf.entries[file_name]
        module = canon[: -len(".weight")] if canon.endswith(".weight") else None
        scales = module + ".scales" if module else None
        if quant is not None and scales in names:  # an MLX quantized module
            spec = _mlx_spec(d, quant, module, names, where, p)
            parts = tuple(
                where[names[n]].tensor(names[n]) for n in (canon, scales, module + ".biases")
            )
            seen[spec.name] += 1
            if base_dtype == "quantized":
                sd[p.name] = QuantTensor(parts, spec)
            else:
                w = spec.dequantize(parts, torch.float32)
                sd[p.name] = w.to(torch.bfloat16) if base_dtype == "bfloat16" else w
            continue
        if e.shape != p.shape:
            raise InputError(
                f"{sf.path}: misshapen tensor {file_name!r}: expected {list(p.shape)}, found "
                f"{list(e.shape)}; config.json's hyper-parameters do not match the weights"
            )
        if e.dtype not in ("F32", "F16", "BF16"):
            raise InputError(
                f"{sf.path}: tensor {file_name!r} is {e.dtype}; a float weight (F32, F16, BF16) "
                "was expected"
            )
        seen[e.dtype] += 1
        if (
            base_dtype == "quantized"
            and len(p.shape) == 2
            and e.dtype in ("F16", "BF16")
            and not p.offset
        ):
            # Kept as the file's half-precision values, read as GGUF's F16/BF16 rows per use.
            sd[p.name] = QuantTensor(
                (sf.rows(file_name),), QuantSpec(F16 if e.dtype == "F16" else BF16, p.shape)
            )
            continue
        view = sf.tensor(file_name)
        t = view.float() + p.offset if p.offset else view
        t = t.to(torch.bfloat16 if base_dtype == "bfloat16" and t.dim() == 2 else torch.float32)
        sd[p.name] = t.clone() if t.data_ptr() == view.data_ptr() else t  # never a view of the map
    return sd, seen


def _mlx_spec(
    d: Path, quant: dict, module: str, names: dict[str, str], where: dict[str, SafeFile], p: Planned
) -> MLXSpec:
    """bits and group size of a quantized module: its entry in config.json's quantization
    (under the file's module path), else the defaults, checked against the shapes."""
    file_module = names[module + ".weight"][: -len(".weight")]
    own = quant.get(file_module)
    q = own if isinstance(own, dict) else quant
    if isinstance(own, dict) and (
        why := _mode_problem(own, f"{d / 'config.json'} ({file_module})")
    ):
        raise InputError(why)
    w = where[names[module + ".weight"]].entries[names[module + ".weight"]]
    s = where[names[module + ".scales"]].entries[names[module + ".scales"]]
    out, inp = p.shape
    bits, group = q.get("bits"), q.get("group_size")
    if not isinstance(bits, int) or not isinstance(group, int):
        bits, group = w.shape[-1] * 32 // inp, inp // max(1, s.shape[-1])
    if (
        w.dtype != "U32"
        or bits not in mlx_quant.BITS
        or group not in mlx_quant.GROUP_SIZES
        or w.shape != (out, inp * bits // 32)
        or s.shape != (out, inp // group)
    ):
        raise InputError(
            f"{d}: {file_module} does not hold {bits}-bit, group-{group} affine weights of shape "
            f"{[out, inp]} (weight {w.dtype} {list(w.shape)}, scales {list(s.shape)}); supported: "
            f"bits {', '.join(map(str, mlx_quant.BITS))}, group sizes "
            f"{', '.join(map(str, mlx_quant.GROUP_SIZES))}"
        )
    if s.dtype not in ("F16", "BF16", "F32"):
        raise InputError(
            f"{d}: {file_module} has {s.dtype} scales: not affine quantization (mxfp4, nvfp4 and "
            "mxfp8 are not supported)"
        )
    return MLXSpec(bits, group, p.shape)


def _tokenizer(d: Path) -> Tokenizer:
    path = d / "tokenizer.json"
    if not path.is_file():
        raise InputError(
            f"{d}: no tokenizer.json; toy reads the fast tokenizer transformers saves with the "
            "model"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise InputError(f"{path}: not a valid tokenizer.json ({str(e).splitlines()[0]})")


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(
        v.get("content"), str
    ):  # an AddedToken as older configs save it
        return v["content"]
    return None


def _specials(d: Path, config: dict, tok: Tokenizer) -> tuple[Specials, str | None]:
    """BOS/EOS/pad and the reply's stop ids (generation_config.json's eos_token_id, which
    may be a list, else config.json's), and the chat template (chat_template.jinja, else
    tokenizer_config.json's, a string or a list of named ones)."""
    tc = _object(d / "tokenizer_config.json")
    gc = _object(d / "generation_config.json")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    n_tokens = tok.get_vocab_size(with_added_tokens=True)

    def ids(source: dict, key: str, file: str) -> list[int]:
        """A token id or a list of them; one that is not a token of tokenizer.json is refused
        (it would stop nothing, or index past the vocabulary)."""
        v = source.get(key)
        vals = v if isinstance(v, list) else [v]
        out = [x for x in vals if isinstance(x, int) and not isinstance(x, bool)]
        bad = next((x for x in out if not 0 <= x < n_tokens), None)
        if bad is not None:
            raise InputError(
                f"{d / file}: {key} {bad} is not a token id of tokenizer.json (0 to "
                f"{n_tokens - 1}); fix the file"
            )
        return out

    def by_name(key: str) -> int | None:
        t = _token_text(tc.get(key))
        return tok.token_to_id(t) if t else None

    eos_list = (
        ids(gc, "eos_token_id", "generation_config.json")
        or ids(config, "eos_token_id", "config.json")
        or ids(text, "eos_token_id", "config.json")
    )
    eos = by_name("eos_token")
    if eos is None and eos_list:
        eos = eos_list[0]
    bos = by_name("bos_token")
    if bos is None:
        bos = (
            ids(gc, "bos_token_id", "generation_config.json")
            or ids(config, "bos_token_id", "config.json")
            or [None]
        )[0]
    pad = by_name("pad_token")
    if pad is None:
        pad = (
            ids(gc, "pad_token_id", "generation_config.json")
            or ids(config, "pad_token_id", "config.json")
            or [None]
        )[0]
    special = Specials(
        bos=bos,
        eos=eos,
        pad=pad,
        stops=stop_ids(tok, eos_list + ([eos] if eos is not None else [])),
    )
    template = None
    if (d / "chat_template.jinja").is_file():
        try:
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise InputError(
                f"{d / 'chat_template.jinja'}: not UTF-8 text (byte {e.start}); a chat template "
                "is a jinja2 text file"
            )
    else:
        t = tc.get("chat_template")
        if isinstance(t, list):  # named templates: the default one
            t = next(
                (
                    x.get("template")
                    for x in t
                    if isinstance(x, dict) and x.get("name") == "default"
                ),
                None,
            )
        template = t if isinstance(t, str) else None
    return special, template


def describe_dir(d: Path) -> dict[str, Any]:
    """What a model directory holds, as describe_gguf tells a GGUF: kind, family, shape,
    tensor types and the base's memory in each --base-dtype. Only headers and 1-D tensors
    are read. A directory toy cannot load still describes what it can (`load_error`)."""
    kind = dir_kind(d)
    config = _json(d / "config.json", "a model directory needs one")
    files = sorted({sf.path for sf in open_weights(d).values()})
    out: dict[str, Any] = {
        "path": str(d),
        "kind": kind,
        "arch": config.get("model_type"),
        "file_size": sum(f.stat().st_size for f in files),
        "n_files": len(files),
        "hyperparameters": None,
        "family": None,
        "load_error": None,
    }
    try:
        base = read_model_dir(d, "quantized")
    except InputError as e:
        out["load_error"] = e.message
        return out
    resident = {"quantized": 0, "bfloat16": 0, "float32": 0}
    n_params = 0
    for t in base.state_dict.values():
        if isinstance(t, QuantTensor):
            n = t.spec.shape[0] * t.spec.shape[1]
            resident["quantized"] += sum(p.numel() * p.element_size() for p in t.parts)
            resident["bfloat16"] += 2 * n
        else:
            n = t.numel()
            resident["quantized"] += t.numel() * t.element_size()
            resident["bfloat16"] += (2 if t.dim() == 2 else 4) * n
        resident["float32"] += 4 * n
        n_params += n
    hp = {k: v for k, v in base.config.to_dict().items() if k != "arch"}
    hp["context_length"] = hp.pop("max_seq_len")
    tok = base.tokenizer
    specials = {
        k: ({"id": i, "token": tok.id_to_token(i)} if i is not None else None)
        for k, i in (
            ("bos", base.special.bos),
            ("eos", base.special.eos),
            ("pad", base.special.pad),
        )
    }
    out.update(
        {
            "family": base.family.name,
            "hyperparameters": hp,
            "n_params": n_params,
            "n_tensors": len(base.state_dict),
            "tensor_types": dict(base.tensor_types.most_common()),
            "resident_bytes": resident,
            "chat_template": base.chat_template is not None,
            "tokenizer": {
                "vocab_size": tok.get_vocab_size(with_added_tokens=True),
                "special_tokens": specials,
                "stops": sorted(base.special.stops),
            },
            "notes": base.notes,
        }
    )
    return out
