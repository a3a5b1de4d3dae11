"""`toy export RUN_DIR --format gguf|gguf-lora|peft|mlx|transformers`: a trained run in
the formats other tools load -- a GGUF model for llama.cpp/Ollama, a LoRA adapter GGUF for
llama.cpp (`--lora`), a PEFT adapter, an mlx-lm adapter (`mlx_lm.generate --adapter-path`),
or the LoRA merged into its base (`--merge`): a GGUF from a GGUF base, a transformers or
MLX directory from a directory base of that kind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from toy.cli.args import human_size, plural
from toy.errors import InputError, UsageError

FORMATS = ("gguf", "gguf-lora", "peft", "mlx", "transformers")


def add_parser(sub) -> None:
    from toy.formats.gguf_write import MERGED_DTYPES

    p = sub.add_parser(
        "export",
        help="export a run as GGUF (model or LoRA adapter), PEFT or mlx-lm adapter, or merged "
        "model",
        description=__doc__,
    )
    p.add_argument("run", metavar="RUN_DIR", help="a run directory (or its final/)")
    p.add_argument(
        "--format",
        required=True,
        choices=FORMATS,
        help="gguf: a full model (from-scratch runs; LoRA runs on a GGUF base with --merge); "
        "gguf-lora: a LoRA run's adapter for llama.cpp (--lora); peft: a LoRA run's adapter for "
        "HF PEFT; mlx: a LoRA run's adapter for mlx-lm (adapters.safetensors + "
        "adapter_config.json), or with --merge "
        "the adapter fused into an MLX base; transformers: with --merge, the adapter merged into a "
        "transformers base (see --dtype for how the adapted tensors are written)",
    )
    p.add_argument(
        "--out",
        help="output file, or a directory to put it in (a directory for peft, mlx and "
        "transformers) (default RUN_DIR/export/<name>)",
    )
    p.add_argument(
        "--dtype",
        choices=MERGED_DTYPES,
        help="tensor type for GGUF: f32 (lossless, the default for "
        "models and adapters), f16 or q8_0 (norms and other 1-D tensors stay f32; q8_0 falls "
        "back to f16 for rows not a multiple of 32). With --merge only: keep (its default) "
        "copies every tensor the adapter does not change byte for byte and writes the changed "
        "ones as f16 (f32 on an f32 base), which keeps the fine-tune, as llama.cpp's export-lora "
        "does; base requantizes the changed ones to the base's own type (else q8_0): the "
        "smallest file, but lossy: a 4-bit base rounds most of a LoRA update away and llama.cpp "
        "then answers much as the base model does (the export notes how much of the update it "
        "kept). A merged MLX or transformers directory takes keep (the default: "
        "MLX's adapted linears unquantized, in float16, or float32 where the base's scales are "
        "float32 (as `toy fetch --as mlx` writes them), as mlx_lm.fuse --dequantize; a "
        "half-precision transformers base's in float32) or base (re-quantized as mlx_lm.fuse "
        "does, or the base's dtype: lossy)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="on a LoRA run: fold the adapter into its base and write the "
        "full model, of the base's kind (--format gguf for a GGUF base, transformers or mlx "
        "for a directory)",
    )
    p.add_argument(
        "--model",
        metavar="BASE",
        help="a LoRA run's base model, a GGUF file or a model directory "
        "(default: the path in its adapter_config.json)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing output file, or a directory holding an earlier export of "
        "this kind (never the run's base, anything in a base directory, or the run itself)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


# ------------------------------------------------------------------ the run


class _Run:
    """What kind of run a directory is, read from its final/ without loading weights."""

    def __init__(self, arg: str):
        from toy.formats.model_dir import final_dir

        d = Path(arg)
        self.final = final_dir(d)
        self.dir = d if self.final != d else d.parent  # a run, or its final/ itself
        self.name = self.dir.resolve().name or "model"
        if (self.final / "adapter_config.json").is_file():
            self.kind, self.arch = "lora", "llama"
            return
        cfg_path = self.final / "config.json"
        if not cfg_path.is_file() or not (self.final / "model.safetensors").is_file():
            raise InputError(
                f"{self.final}: neither a run's final/ model (config.json + model.safetensors) "
                "nor a LoRA adapter (adapter_config.json); pass a finished run (`toy list` shows "
                "them)"
            )
        from toy.formats.checkpoint import read_json

        self.meta = read_json(cfg_path)
        model = self.meta.get("model") if isinstance(self.meta, dict) else None
        if not isinstance(model, dict):
            raise InputError(f'{cfg_path}: not a toy model config (no "model" object)')
        self.kind, self.arch = "model", str(model.get("arch", "llama"))


def _check_request(r: _Run, args) -> str:
    """Every bad combination, refused before any work. Returns the dtype."""
    fmt, where = args.format, str(r.dir)
    if r.arch == "vit":
        raise UsageError(
            f"{where}: a vit image classifier cannot be exported as --format {fmt}: "
            "GGUF (llama.cpp) holds language models and PEFT holds LoRA adapters; its "
            "final/model.safetensors is "
            "already the portable form"
        )
    if r.kind == "model":
        if fmt == "gguf-lora":
            raise UsageError(
                f"{where}: --format gguf-lora needs a LoRA run; this is a full {r.arch} model: "
                "use --format gguf"
            )
        if fmt == "peft":
            raise UsageError(
                f"{where}: --format peft writes LoRA adapters; this is a full {r.arch} model: "
                "use --format gguf"
            )
        if args.merge:
            raise UsageError(
                f"{where}: --merge folds a LoRA adapter into its base; this is a full {r.arch} "
                "model run: drop --merge"
            )
        if args.model:
            raise UsageError(
                "--model names a LoRA run's base; a full model run needs none: drop --model"
            )
        if r.arch not in ("llama", "gpt2"):
            raise UsageError(
                f"{where}: arch {r.arch!r} cannot be exported to GGUF; supported: llama, gpt2"
            )
        if fmt in ("mlx", "transformers") and r.arch != "llama":
            raise UsageError(
                f"{where}: --format {fmt} writes llama models as a directory; this is a "
                f"{r.arch} model: use --format gguf"
            )
    else:
        if fmt == "gguf" and not args.merge:
            raise UsageError(
                f"{where}: a LoRA run's final/ is an adapter, not a model: use --format "
                "gguf-lora (llama.cpp --lora), --format peft or mlx, or --merge for the full "
                "merged model"
            )
        if fmt == "transformers" and not args.merge:
            raise UsageError(
                f"{where}: --format transformers writes a merged model: add --merge (for the "
                "adapter alone, --format peft)"
            )
        if args.merge and fmt not in ("gguf", "mlx", "transformers"):
            raise UsageError(
                f"--merge writes a full model: use it with --format gguf, mlx or transformers (the "
                f"base's kind), not --format {fmt}"
            )
    if fmt in ("mlx", "transformers") and args.merge:
        if args.dtype not in (None, "keep", "base"):
            raise UsageError(
                f"--dtype {args.dtype} is not offered for a merged {fmt} directory; choose keep "
                "(the default: the adapted linears at a width that holds the update) or base "
                "(in the base's own form: smaller, lossy)"
            )
        return args.dtype or "keep"
    if fmt in ("peft", "mlx", "transformers"):
        if args.dtype:
            raise UsageError(
                f"--dtype applies to GGUF exports and merges; --format {fmt} keeps the adapter as "
                "trained: drop --dtype"
            )
        return ""
    if args.dtype in ("keep", "base") and not args.merge:
        raise UsageError(
            f"--dtype {args.dtype} keeps a base model's own tensors: it applies to --merge only; "
            "use f32, f16 or q8_0"
        )
    dtype = args.dtype or ("keep" if args.merge else "f32")
    if fmt == "gguf-lora" and dtype == "q8_0":
        raise UsageError(
            "--dtype q8_0 is not offered for --format gguf-lora: an adapter is small and its B "
            "matrices (r columns) rarely fill q8_0's 32-wide blocks; use f16 or f32"
        )
    return dtype


def _out_path(r: _Run, args, default_name: str) -> Path:
    if args.out:
        out = Path(args.out)
        return out / default_name if out.is_dir() and args.format != "peft" else out
    return r.dir / "export" / default_name


def _claim(r: _Run, args, out: Path, base: Path | None = None, marker: str = "") -> Path:
    """The one output policy of every export, checked before any work: `out` is never the
    run's base, inside a base directory or a folder holding the base, nor the run's own
    directory or final/ (even with --force); an existing file, or a non-empty directory,
    is replaced only with --force, and a directory only when it holds an earlier export
    (`marker`, the file a directory export always writes: given for directory exports;
    no subfolders). Every writer then writes under a temp name and renames (nothing
    half-written)."""
    where = f"--out {out}" if args.out else str(out)
    at = out.resolve()
    guarded = [(r.final, "the run's own final/", True), (r.dir, "the run's own directory", False)]
    if base is not None:
        kind = "base directory" if base.is_dir() else "base"
        guarded.insert(0, (base, f"the run's {kind} {base}", base.is_dir()))
    for path, what, inside in guarded:
        p = path.resolve()
        if at == p or at in p.parents or (inside and p in at.parents):
            how = "is" if at == p else ("holds" if at in p.parents else "is inside")
            raise UsageError(
                f"{where} {how} {what}; an export never writes there, even with --force: "
                "choose a path outside it"
            )
    if marker:  # a directory export
        if out.exists() and not out.is_dir():
            raise UsageError(
                f"{where} is a file and a --format {args.format} export is a directory; "
                "choose a new path"
            )
        names = list(out.iterdir()) if out.is_dir() else []
        if names and not args.force:
            raise UsageError(
                f"{where} exists and is not empty; pass --force to replace it, or choose a new path"
            )
        if names and (not (out / marker).is_file() or any(n.is_dir() for n in names)):
            raise UsageError(
                f"{where} is not an earlier export (no {marker}, or it holds folders), and "
                "--force replaces only that: choose a new path"
            )
        return out
    if out.is_dir():
        raise UsageError(f"{where} is a directory; name the file to write")
    if out.exists() and not args.force:
        raise UsageError(f"{where} exists; pass --force to replace it, or choose a new path")
    return out


# ------------------------------------------------------------------ LoRA base


def _resolve_base(r: _Run, args, config: dict) -> tuple[Path, list[str]]:
    """The base an adapter run adapts (a GGUF file or a model directory), as `toy infer
    --run` finds it (cli/adapter_base.py):
    --model, else the recorded path; a base that changed since training is refused
    unless --model names it explicitly."""
    from toy.cli.adapter_base import resolve_base

    return resolve_base(r.final, r.dir, args.model, config)


# ------------------------------------------------------------------ export


def run(args) -> int:
    from toy.formats.gguf_write import WriteReport

    r = _Run(args.run)
    dtype = _check_request(r, args)
    if args.format == "peft":
        out, notes = _export_peft(r, args)
        return _report(args, r, out, "", notes)
    if args.format in ("mlx", "transformers"):
        if args.merge:
            return _report_merged_dir(args, r, _export_merged_dir(r, args, dtype), dtype)
        if r.kind == "model":
            return _report(args, r, _export_model_dir(r, args), "")
        return _report(args, r, _export_mlx(r, args), "")
    if r.kind == "model":
        report = _export_model(r, args, dtype)
    elif args.format == "gguf-lora":
        report = _export_lora(r, args, dtype)
    else:
        report = _export_merged(r, args, dtype)
    assert isinstance(report, WriteReport)
    return _report(args, r, report, dtype)


def _export_model(r: _Run, args, dtype: str):
    from toy.formats.checkpoint import read_json
    from toy.formats.gguf_write import write_model_gguf
    from toy.formats.model_dir import GGUF_TOKENIZER, load_model_dir

    out = _claim(r, args, _out_path(r, args, f"{r.name}-{dtype}.gguf"))
    model, meta, tok = load_model_dir(r.final)
    if tok is None:
        raise InputError(
            f"{r.final}: no tokenizer.json, and llama.cpp needs the tokenizer inside the GGUF (the "
            "corpus the run trained on had no NAME.tokenizer.json beside it); copy that corpus's "
            f"tokenizer into {r.final / 'tokenizer.json'}"
        )
    template = meta.get("chat_template") if isinstance(meta.get("chat_template"), str) else None
    if template is None and (r.final / "chat_template.jinja").is_file():
        template = (r.final / "chat_template.jinja").read_text()
    kv = None  # a GGUF's tokenizer keys, kept whole (a student of a GGUF teacher)
    if (r.final / GGUF_TOKENIZER).is_file():
        kv = read_json(r.final / GGUF_TOKENIZER)
        if not isinstance(kv, dict) or not all(k.startswith("tokenizer.") for k in kv):
            raise InputError(f"{r.final / GGUF_TOKENIZER}: not a GGUF's tokenizer keys")
    try:
        rep = write_model_gguf(
            out, model, tok, dtype=dtype, chat_template=template, name=r.name, tokenizer_kv=kv
        )
    except UsageError as e:
        raise UsageError(f"{r.final}: {e.message}")
    return _with_modelfile(rep)


def _export_model_dir(r: _Run, args) -> Path:
    """A full llama run (from-scratch, warm-start, a distilled student) as a transformers
    or (unquantized) MLX directory: its weights in float32, config.json, its tokenizer with
    the special tokens and chat template final/ records (a student: its teacher's)."""
    from toy.formats.base import Specials
    from toy.formats.dir_write import write_trained_dir
    from toy.formats.model_dir import load_model_dir

    out = _claim(r, args, _out_path(r, args, f"{r.name}-{args.format}"), marker="config.json")
    model, meta, tok = load_model_dir(r.final)
    if tok is None:
        raise InputError(
            f"{r.final}: no tokenizer.json, and a model directory needs its tokenizer; copy the "
            f"corpus's NAME.tokenizer.json into {r.final / 'tokenizer.json'}"
        )
    sp = meta.get("special") if isinstance(meta.get("special"), dict) else {}
    vocab = tok.get_vocab(with_added_tokens=True)
    eos = sp.get("eos")
    if eos is None:  # a model trained from scratch: its tokenizer's end-of-text token
        eos = next((vocab[t] for t in ("<|endoftext|>", "</s>", "<|im_end|>") if t in vocab), None)
    special = Specials(bos=sp.get("bos"), eos=eos, pad=sp.get("pad"))
    template = meta.get("chat_template") if isinstance(meta.get("chat_template"), str) else None
    try:
        write_trained_dir(model, tok, special, template, out, args.format)
    except UsageError as e:
        raise UsageError(f"{r.final}: {e.message}")
    return out


def _with_modelfile(rep, base: Path | None = None):
    """An Ollama Modelfile beside the GGUF written (formats/modelfile.py)."""
    from toy.formats.modelfile import write_modelfile

    rep.modelfile = write_modelfile(rep.path, base)
    if rep.modelfile is None:
        rep.notes.append(
            f"{rep.path.with_suffix('.Modelfile')} is not one toy wrote: left as it is (no "
            "Modelfile written)"
        )
    return rep


def _load_adapter(r: _Run):
    from toy.formats.peft import load_peft_adapter

    sd, config = load_peft_adapter(r.final)
    return sd, config


def _export_lora(r: _Run, args, dtype: str):
    from toy.formats.gguf_write import base_config, write_lora_gguf

    sd, config = _load_adapter(r)
    base, notes = _resolve_base(r, args, config)
    out = _claim(r, args, _out_path(r, args, f"{r.name}-lora-{dtype}.gguf"), base)
    from toy.formats.base_readers import base_kind, read_base

    if base_kind(base) != "gguf":  # the GGUF llama.cpp's converter makes of this directory
        b = read_base(base, "quantized")
        cfg, arch = b.config, b.gguf_arch
        if arch is None:
            raise UsageError(
                f"{base}: a {b.arch} model has no llama.cpp architecture toy knows; "
                "use --format peft"
            )
    else:
        cfg, arch, _ = base_config(base)
    rep = write_lora_gguf(
        out,
        sd,
        alpha=float(config["lora_alpha"]),
        base=cfg,
        arch=arch,
        dtype=dtype,
        name=f"{r.name} (LoRA)",
    )
    rep.notes = (
        notes + rep.notes + [f"load it on {base} (llama.cpp: --lora; llama-cpp-python: lora_path=)"]
    )
    return _with_modelfile(rep, Path(base))


def _export_mlx(r: _Run, args) -> Path:
    """The run's adapter as mlx-lm loads it: adapters.safetensors + adapter_config.json."""
    from toy.formats.checkpoint import atomic_dir
    from toy.formats.mlx_adapter import save_mlx_adapter

    sd, config = _load_adapter(r)
    base, _ = _resolve_base(r, args, config)
    out = Path(args.out) if args.out else r.dir / "export" / f"{r.name}-mlx"
    _claim(r, args, out, base, marker="adapter_config.json")
    # the base's own depth: mlx-lm adapts the LAST num_layers blocks, so an adapter of the
    # last N (--num-layers N) is written as N of them
    from toy.formats.base_readers import describe_base

    n_layers = int(describe_base(base)["hyperparameters"].get("n_layer") or 0)
    n_layers = n_layers or 1 + max(int(k.split(".")[1]) for k in sd)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out) as tmp:  # both files or neither
        save_mlx_adapter(
            tmp,
            sd,
            rank=int(config["r"]),
            alpha=float(config["lora_alpha"]),
            dropout=float(config.get("lora_dropout") or 0.0),
            n_layers=n_layers,
            prefix=_mlx_prefix(base),
            model=str(base),
        )
    return out


def _mlx_prefix(base: Path) -> str:
    from toy.formats.base_readers import read_base

    return read_base(base, "quantized").mlx_prefix  # memory-mapped: nothing big is read


def _export_merged_dir(r: _Run, args, dtype: str):
    from toy.formats.base_readers import read_base
    from toy.formats.hf_write import merge_into_dir

    sd, config = _load_adapter(r)
    base_path, notes = _resolve_base(r, args, config)
    kind = "mlx" if args.format == "mlx" else "transformers"
    out = Path(args.out) if args.out else r.dir / "export" / f"{r.name}-merged-{kind}"
    _claim(r, args, out, base_path, marker="config.json")
    base = read_base(base_path, "quantized")
    if base.kind != args.format:
        raise UsageError(
            f"--merge --format {args.format}: the run's base {base_path} is a {base.kind} "
            f"{'file' if base.kind == 'gguf' else 'directory'}; merge into it with --format "
            f"{'gguf' if base.kind == 'gguf' else base.kind}"
        )
    rep = merge_into_dir(
        out, base, sd, rank=int(config["r"]), alpha=float(config["lora_alpha"]), dtype=dtype
    )
    rep.notes = notes + rep.notes
    return rep


def _export_merged(r: _Run, args, dtype: str):
    from toy.formats.gguf_write import write_merged_gguf

    sd, config = _load_adapter(r)
    base_path, notes = _resolve_base(r, args, config)
    if base_path.is_dir():
        raise UsageError(
            f"--merge --format gguf: the run's base {base_path} is a model directory; merge into "
            "it with --format transformers or mlx (its own kind)"
        )
    out = _claim(r, args, _out_path(r, args, f"{r.name}-merged-{dtype}.gguf"), base_path)
    try:
        rep = write_merged_gguf(
            out,
            base_path,
            sd,
            rank=int(config["r"]),
            alpha=float(config["lora_alpha"]),
            dtype=dtype,
            name=f"{r.name} (merged)",
        )
    except InputError as e:  # the adapter does not fit this base
        raise InputError(f"{r.final}: does not fit the base {base_path}: {e.message}")
    rep.notes = notes + rep.notes
    return _with_modelfile(rep)


def _export_peft(r: _Run, args) -> tuple[Path, list[str]]:
    from toy.formats.checkpoint import atomic_dir

    _, config = _load_adapter(r)  # validates the adapter: config, keys, shapes
    # A PEFT copy needs no base; the one it names (or --model) is still never written over.
    named = args.model or config.get("base_model_name_or_path")
    base = Path(named) if isinstance(named, str) and named and Path(named).exists() else None
    out = Path(args.out) if args.out else r.dir / "export" / f"{r.name}-peft"
    _claim(r, args, out, base, marker="adapter_config.json")
    recorded = config.get("base_model_name_or_path")
    twin, notes = _peft_base(r, recorded) if isinstance(recorded, str) else (None, [])
    out.parent.mkdir(parents=True, exist_ok=True)
    # final/ of a LoRA run already is a PEFT directory (save_peft_adapter wrote it): copy it.
    with atomic_dir(out) as d:
        for name in ("adapter_model.safetensors", "tokenizer.json", "README.md"):
            if (r.final / name).is_file():
                shutil.copyfile(r.final / name, d / name)
        if twin is None:
            shutil.copyfile(r.final / "adapter_config.json", d / "adapter_config.json")
        else:
            config = {**config, "base_model_name_or_path": str(twin)}
            (d / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out, notes


def _peft_base(r: _Run, recorded: str) -> tuple[Path | None, list[str]]:
    """For a run on a GGUF base, which PEFT (transformers) cannot load: the transformers
    directory `toy fetch NAME --as transformers` made of that same file, where the GGUF is a
    model toy fetches (known by its sha256) and the directory is made: the link
    fetch puts in the run's project's data/ (or beside the GGUF), else the made directory in
    toy's cache it points at. Else None and a note on how to get one. Nothing for a
    directory base."""
    from toy.cli.cmd_fetch import MANIFEST, MODELS, cache_dir
    from toy.data.prep import cache_dir as toy_cache
    from toy.runs import file_digest, find_project

    gguf = Path(recorded)
    if gguf.is_dir() or not (gguf.is_file() or gguf.suffix.lower() == ".gguf"):
        return None, []
    # The run hashed its base when it began (the digest cache base_fingerprint keeps): a stat.
    sha = file_digest(gguf, toy_cache() / "digests.json") if gguf.is_file() else ""
    known = next((m for m in MODELS.values() if m.sha256 == sha and "transformers" in m.dirs), None)
    if known is None:
        return None, [
            f"PEFT cannot load the GGUF base {gguf} that base_model_name_or_path names: point it "
            "at a transformers directory of the same weights (or load the base yourself: "
            f"AutoModelForCausalLM.from_pretrained(DIR, gguf_file={gguf.name!r}))"
        ]
    made = cache_dir() / f"{known.name}-{known.sha256[:12]}-transformers"
    if (made / MANIFEST).is_file():  # written last: the directory is whole
        # The recorded GGUF is the resolved file (fetch's link into data/ points into the
        # cache), so data/'s own link is looked for in the run's project first.
        link = f"{Path(known.target).stem}-transformers"
        data = find_project(r.dir.resolve()).data_dir
        links = [d / link for d in (data, gguf.parent) if d is not None]
        twin = next((d for d in links if d.is_dir() and d.resolve() == made.resolve()), made)
        return twin, [
            f"base_model_name_or_path: {twin}, the transformers directory of the GGUF base "
            f"{gguf.name} (the same weights, which PEFT loads; a GGUF it cannot)"
        ]
    return None, [
        f"PEFT cannot load the GGUF base {gguf} that base_model_name_or_path names: run `toy "
        f"fetch {known.name} --as transformers` (its transformers directory) and export again"
    ]


def _report_merged_dir(args, r: _Run, rep, dtype: str) -> int:
    files = sorted(p.name for p in rep.path.iterdir())
    if args.json:
        print(
            json.dumps(
                {
                    "format": "toy/export-v1",
                    "run_dir": str(r.dir),
                    "kind": r.kind,
                    "merged": True,
                    "export_format": args.format,
                    "path": str(rep.path),
                    "files": files,
                    "dtype": dtype,
                    "update_kept": rep.update_kept,
                    "update_error": rep.update_error,
                    "notes": rep.notes,
                }
            )
        )
        return 0
    print(f"wrote {rep.path}/ ({args.format} model, the adapter merged in: {', '.join(files)})")
    for note in rep.notes:
        print(f"  {note}")
    return 0


def _report(args, r: _Run, rep, dtype: str, notes: list[str] | None = None) -> int:
    from toy.train.device import AMX_LLAMACPP_NOTE, cpu_has_amx

    if isinstance(rep, Path):  # a directory: peft, mlx, a merged directory
        files = sorted(p.name for p in rep.iterdir())
        if args.json:
            print(
                json.dumps(
                    {
                        "format": "toy/export-v1",
                        "run_dir": str(r.dir),
                        "kind": r.kind,
                        "merged": args.merge,
                        "export_format": args.format,
                        "path": str(rep),
                        "files": files,
                        "notes": notes or [],
                    }
                )
            )
        else:
            what = {"peft": "PEFT adapter", "mlx": "mlx-lm adapter"}.get(args.format, "")
            if r.kind == "model":
                what = f"{args.format} model, float32"
            print(f"wrote {rep}/ ({what}: {', '.join(files)})")
            if args.format == "mlx" and not args.merge and r.kind == "model":
                print(f"  load it with mlx_lm.generate --model {rep}")
            elif args.format == "mlx" and not args.merge:
                print(f"  load it with mlx_lm.generate --model MLX_BASE --adapter-path {rep}")
            for note in notes or []:
                print(f"  {note}")
        return 0
    size = rep.path.stat().st_size
    if cpu_has_amx():  # a GGUF goes to llama.cpp, which crashes on AMX unless told otherwise
        rep.notes = [*rep.notes, AMX_LLAMACPP_NOTE]
    if args.json:
        print(
            json.dumps(
                {
                    "format": "toy/export-v1",
                    "run_dir": str(r.dir),
                    "kind": r.kind,
                    "export_format": args.format,
                    "merged": bool(args.merge),
                    "path": str(rep.path),
                    "arch": rep.arch,
                    "dtype": dtype,
                    "file_size": size,
                    "n_params": rep.n_params,
                    "tensor_types": dict(rep.tensor_types.most_common()),
                    "notes": rep.notes,
                    "modelfile": str(rep.modelfile) if rep.modelfile else None,
                    **(
                        {"update_kept": rep.update_kept, "update_error": rep.update_error}
                        if rep.update_kept is not None
                        else {}
                    ),
                }
            )
        )
        return 0
    what = {"gguf": "merged model" if args.merge else "model", "gguf-lora": "LoRA adapter"}[
        args.format
    ]
    types = ", ".join(f"{k} x{v}" for k, v in rep.tensor_types.most_common())
    print(
        f"wrote {rep.path} ({human_size(size)}, {rep.arch} {what}, "
        f"{plural(rep.n_params, 'parameter')}; {types})"
    )
    for note in rep.notes:
        print(f"  {note}")
    if rep.modelfile is not None:
        print(f"  Ollama: ollama create NAME -f {rep.modelfile}")
    return 0
