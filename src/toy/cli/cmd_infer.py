"""`toy infer`: sample from a trained model (KV cache, streaming).

With --prompt TEXT it continues the text; with --chat MESSAGE it answers one message
through the model's chat template; with neither it is an interactive chat on the
terminal (an empty line or Ctrl-D ends it). --image PATH classifies an image with an
image-classifier run instead."""

from __future__ import annotations

import sys
from pathlib import Path

from toy.cli import reply_fast
from toy.cli.args import finite_float, human_size, nonneg_int, positive_int
from toy.errors import InputError, UsageError
from toy.tokenizer import encode_prompt, eos_id
from toy.train.memory import available_memory

INFER_BASE_DTYPES = ("auto", "quantized", "bfloat16", "float32")
# auto on a cpu holds a packed GGUF (models/decode.py) or a float32 copy by the expected wait
# of this run (pack_pays). Measured on a 2-core AMD Zen 4 (avx512_bf16), SmolLM2-135M Q4_1,
# 2 threads, quiet: a float32 token reads every weight, 15.1-15.3 tokens/s for its 0.54 GB
# (0.122 s a token per GB of float32 weights); the packed codes give 43.7-44.1 tokens/s
# (2.9x; 48-56 against 13-16 in the 2026-11-25 record; with AVX-512 the nibble kernel's
# unrolled form now gives ~6x, 108-111 against 17.9: 2.9 stays, the CPU kinds' floor, so auto
# never packs where it would not pay). Before the first token the packed
# path no longer waits longer than float32 once its steps are built on the machine (first
# token 1.88-1.93 s against 1.90-2.31 s, three rounds, 100 tokens asked: the steps are
# loaded as built libraries, no tracing, no compiler stack imported; it waited 3.3-4.4 s
# longer before); PACKED_EXTRA_S keeps 0.3 s for the packed codes read from toy's cache
# and the libraries loaded. The first time on a machine the build itself takes about 20 s
# (docs/performance.md): no reply waits for it (pack_pays, build_in_background). For
# SmolLM2 packing pays from about 7 new tokens asked for once built.
F32_TOKEN_S_PER_GB = 0.122
PACKED_SPEEDUP = 2.9
PACKED_EXTRA_S = 0.3
# auto holds a float32 copy (and the KV cache) only where they take at most this share of
# free memory
FIT = 0.8
CACHE_CHUNK = 256  # an interactive chat's KV cache grows by this many positions at a time


def add_parser(sub) -> None:
    p = sub.add_parser(
        "infer", help="generate text from a trained model (or chat with it)", description=__doc__
    )
    p.add_argument(
        "--run",
        metavar="RUN_DIR",
        help="run directory (or its final/) of a trained model: a full model "
        "run brings its weights and tokenizer (--model and --adapter are refused); a LoRA run "
        "brings its adapter (--adapter is refused) and its base, found at the absolute path it "
        "recorded (older runs: as given, then against the project root) and refused if the file "
        "changed since training (no default: give --run or --model)",
    )
    p.add_argument(
        "--model",
        metavar="BASE",
        help="a model to generate with: a GGUF file, or a transformers or MLX "
        "model directory (without --run; no default: give --run or --model); with --run on a "
        "LoRA run: its base (default: the one it trained on)",
    )
    p.add_argument(
        "--adapter",
        metavar="PATH",
        help="a LoRA adapter to apply on --model (not with --run): a PEFT adapter directory, a "
        "lora run directory (its final/ is used), an mlx-lm adapter directory "
        "(adapters.safetensors + adapter_config.json, as `toy export --format mlx` writes) or its "
        ".safetensors file, or a LoRA adapter GGUF (llama.cpp's --lora layout, as `toy export "
        "--format gguf-lora` writes) (default: none)",
    )
    p.add_argument(
        "--prompt",
        help="text to continue, as is (default: none; without --prompt or --chat, "
        "an interactive chat)",
    )
    p.add_argument(
        "--chat",
        metavar="MESSAGE",
        help="one chat message, rendered with the model's chat template; - reads it from stdin "
        "(default: none; without --prompt or --chat, an interactive chat)",
    )
    p.add_argument(
        "--system", help="system message for --chat and interactive chat (default: none)"
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive_int("--max-new-tokens"),
        default=100,
        metavar="N",
        help="tokens to generate at most; the KV cache holds the prompt plus N tokens (at most the "
        f"model's context), and an interactive chat's grows {CACHE_CHUNK} tokens at a time; a "
        "reply cut at N says so on stderr in an interactive chat (default 100)",
    )
    p.add_argument(
        "--temperature",
        type=finite_float,
        default=0.8,
        metavar="T",
        help="sampling temperature, 0 is greedy (default 0.8)",
    )
    p.add_argument(
        "--top-k",
        type=nonneg_int,
        default=0,
        metavar="K",
        help="sample from the K most likely tokens (default 0: all)",
    )
    p.add_argument(
        "--top-p",
        type=finite_float,
        default=1.0,
        metavar="P",
        help="nucleus sampling mass (default 1.0: off)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling seed: the tokens are drawn as GRPO draws a group of one (models/sample.py), "
        "so the same seed and prompt give the same tokens there (default 0)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda", "metal"),
        default="cpu",
        help="cpu, cuda or metal (macOS) (default cpu)",
    )
    p.add_argument(
        "--base-dtype",
        choices=INFER_BASE_DTYPES,
        default="auto",
        help="how the base (a GGUF file or a model directory) is held: float32 or bfloat16 "
        "(dequantized once) or quantized (the "
        "file's own blocks; on cpu with a C++ compiler they are packed for generation, one token's "
        "products computed on the 4- or 8-bit codes and each block compiled for one token: the "
        "fastest and smallest there, after a build on first use (~20 s the first time on a "
        "machine; then loaded as built, in a fraction of a second); else each layer "
        "is dequantized as it runs: the least memory, slower per token) (default auto: bfloat16 on "
        "cuda; on cpu quantized where the blocks pack and the expected wait is shorter packed "
        "(the tokens asked for and measured costs, where the steps are built on this machine: "
        "SmolLM2-135M packs from about 7 new tokens, an interactive chat always; where they are "
        "not, the reply comes from float32 at once and a background process builds them for the "
        "next run), else float32 where it and the KV cache fit in "
        f"{FIT * 100:.0f}%% of the available memory (the smaller of MemAvailable and what a "
        "container's cgroup memory limit leaves), else quantized)",
    )  # %%: argparse formats help
    p.add_argument(
        "--build-steps",
        action="store_true",
        help="build the compiled one-token steps of --model (with --adapter: of the adapted "
        "model) on this machine and exit; what auto starts in the background the first time "
        "(TOY_BACKGROUND_BUILDS=0 turns that off)",
    )
    p.add_argument(
        "--build-lock",
        metavar="FILE",
        help="with --build-steps: a file to remove when the build ends (the lock a background "
        "build is started with) (default: none)",
    )
    p.add_argument(
        "--precision",
        choices=("auto", "float32", "bf16"),
        default="auto",
        help="what the products compute in: bf16 holds a dequantized base in bfloat16 (half the "
        "bytes read per token; on a cpu it needs bf16 units, avx512_bf16 or amx_bf16, else "
        "exit 2); "
        "packed codes always compute in float32 (default auto: bf16 on cuda, float32 on a cpu, "
        "where bf16 changed SmolLM2's greedy text from its 15th token)",
    )
    p.add_argument(
        "--threads",
        type=positive_int("--threads"),
        metavar="N",
        help="torch's CPU threads (default: one a core that other programs leave free as the "
        "reply starts: a busy core made every token wait for the thread on it)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="with --prompt or --chat: print one JSON object at the end (the text, the tokens, "
        "the time to the first token and the tokens/s after it, how the base was held and why) "
        "instead of streaming the text",
    )
    p.add_argument(
        "--image",
        metavar="PATH",
        help="classify this PNG/JPEG with an image-classifier run "
        "(prints the top 5 classes; --prompt is not needed) (default: none)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    if args.image:
        from toy.cli.cmd_infer_image import infer_image

        return infer_image(args)
    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not args.run and not args.model:
        raise UsageError(
            "give --run RUN_DIR (a trained run) or --model BASE [--adapter DIR] (BASE: a GGUF "
            "file or a model directory)"
        )
    if args.prompt is not None and args.chat is not None:
        raise UsageError(
            "--prompt and --chat conflict: continue raw text or send a chat message, not both"
        )
    chat_stdin = args.chat == "-"
    if chat_stdin:  # the message from stdin (a file, a here-document, a pipe)
        try:
            args.chat = sys.stdin.read().rstrip("\n")
        except UnicodeDecodeError as e:  # a UTF-8 locale reads stdin strictly
            raise UsageError(_not_utf8("--chat -", f"byte 0x{e.object[e.start]:02x}"))
        if not args.chat.strip():
            raise UsageError("--chat -: stdin held no message; pipe the message in, or give it")
    chat_flag = "--chat -" if chat_stdin else "--chat"
    for flag, text in (
        ("--prompt", args.prompt),
        (chat_flag, args.chat),
        ("--system", args.system),
    ):
        _check_utf8(flag, text)
    if args.adapter and not (args.model or args.run):
        raise UsageError(
            "--adapter needs --model BASE (the GGUF file or model directory it was trained on)"
        )
    if getattr(args, "json", False) and args.prompt is None and args.chat is None:
        raise UsageError("--json needs --prompt TEXT or --chat MESSAGE (not an interactive chat)")
    lm = load_kept(args)  # a llama GGUF's reply kept in toy's cache: no torch
    if lm is None:
        from toy.train.device import apply_threads, resolve_device

        device = resolve_device(args.device)
        apply_threads(args.threads)
        args.precision = infer_precision(args, device)
        if getattr(args, "build_steps", False):
            if not args.model or args.run or args.prompt is not None or args.chat is not None:
                raise UsageError(
                    "--build-steps takes --model BASE (a GGUF file) and optionally --adapter, "
                    "nothing to generate"
                )
            return build_steps(args, device)
        lm = load_lm(args, device)
    else:
        reply_fast.threads(args)
    try:
        if args.prompt is not None:
            code = continue_text(lm, args)
        elif lm.template is None:
            raise UsageError(
                f"{lm.source}: {lm.no_template or 'has no chat template'}; use --prompt TEXT to "
                "continue raw text"
            )
        elif args.chat is not None:
            chat_turn(lm, args, [*_system(args), {"role": "user", "content": args.chat}])
            code = 0
        else:
            return interactive(lm, args)
        if getattr(args, "json", False):
            import json

            print(json.dumps(lm.report))
        return code
    finally:
        if lm.build is not None:  # the reply is out (or the chat over): build for next time
            build_in_background(*lm.build)


def load_kept(args) -> LM | None:
    """An LM whose model is a reply_c.Model read from toy's cache (cli/reply_fast.py), ready
    for run's replies before torch is imported; None where that path does not take the
    command."""
    if not reply_fast.eligible(args):
        return None
    from toy.formats import reply_image

    try:
        path = reply_image.path_for(Path(args.model))
    except OSError:
        return None
    if not path.is_file():
        return None
    got = reply_image.read(path)
    if got is None:
        args.reply_image_bad = True  # damaged or another layout: the torch path writes it
        return None
    from toy.errors import ToyError

    try:
        return _kept_lm(args, *got)
    except ToyError:  # the user's to mend (a template that does not render): torch's path
        return None  # says it, as it always has
    except Exception:  # a kept file this toy cannot use: torch's path writes it again
        args.reply_image_bad = True
        return None


def _kept_lm(args, plan: dict, arrays: dict, meta: dict) -> LM | None:
    """load_kept's LM from a kept model, or None where auto would not hold it packed or the
    reply is not one the loop takes (reply_fast.takes)."""
    from tokenizers import Tokenizer

    from toy.models import reply_c

    source = str(Path(args.model))  # as torch's path names it (load_base_lm)
    lm = LM(
        None,
        Tokenizer.from_str(meta["tokenizer"]),
        meta["template"],
        meta["bos"],
        meta["eos"],
        set(meta["stop"]),
        source,
        meta["no_template"],
        limit=meta["limit"],
    )
    most = reply_c.positions(plan, arrays)
    tokens = _tokens(args)  # None: an interactive chat
    if tokens is None:  # its steps in C where the tables cover the context (new_cache)
        if most != lm.limit:
            return None
    elif not reply_fast.takes(_prompt_len(lm, args), args.max_new_tokens, most, lm.limit):
        return None
    positions = _planned_cache(args)(lm)
    kv = 2 * meta["n_layer"] * meta["n_kv"] * meta["head_dim"] * positions * 4
    want = [args.base_dtype, "cpu", meta["float32_bytes"], available_memory(), kv]
    dtype, note = choose_base_dtype(*want, meta["packed_bytes"], tokens, True)
    # the library last: loaded before torch, it brings the system's libgomp, which a torch
    # loaded after it would then share (a command this path does not take imports torch)
    if dtype != "quantized" or reply_c.library() is None:
        return None
    model = reply_c.Model(plan, arrays)
    template_note = meta["template_note"]
    if template_note:
        if template_note.startswith("\0"):
            template_note = source + template_note[1:]
        print(f"note: {template_note}", file=sys.stderr)
    if note:
        print(f"note: {note}", file=sys.stderr)
    lm.held, lm.why = "quantized (packed)", note
    if not note and args.base_dtype == "auto":
        lm.why = (
            "auto: packed, an interactive chat"
            if tokens is None
            else f"auto: packed, shorter expected wait for {tokens} new tokens"
        )
    lm.c = model
    return lm


def _not_utf8(flag: str, what: str) -> str:
    return (
        f"{flag}: not UTF-8 text ({what}); give the text in UTF-8 (a terminal or file in "
        "another encoding: convert it, e.g. with iconv -t UTF-8)"
    )


def _check_utf8(flag: str, text: str | None) -> None:
    """Text no tokenizer takes, refused in one line: bytes that are not UTF-8 reach a
    command line's (or a surrogateescape stdin's) string as lone surrogates (0xe9 as
    U+DCE9)."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        raise UsageError(
            _not_utf8(flag, f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"U+{c:04X}")
        )


def infer_precision(args, device) -> str:
    """--precision resolved for generation: 'bf16' or 'float32'. auto keeps float32 on a cpu
    even with bf16 units: measured on an AMD Zen 4 (avx512_bf16), a bf16 SmolLM2-135M's greedy
    reply left the float32 one at its 15th token (a greedy text is only as stable as its
    closest logits). bf16 asked for needs the units (resolve_precision says why not) and a
    dequantized base: --base-dtype float32 conflicts."""
    from toy.train.device import resolve_precision

    name = getattr(args, "precision", "auto")
    if name == "auto" and device.type != "cuda":
        return "float32"
    prec = resolve_precision(name, device).name
    base = getattr(args, "base_dtype", "auto")
    if prec == "bf16" and base == "float32":
        raise UsageError(
            "--precision bf16 conflicts with --base-dtype float32: drop one (bf16 holds a "
            "dequantized base in bfloat16)"
        )
    if prec == "bf16" and device.type == "cpu" and base == "quantized":
        print("note: --precision bf16: packed codes compute in float32", file=sys.stderr)
    return prec


class LM:
    """A model ready to generate, with its tokenizer and (for GGUF bases) chat template.
    `limit` is the model's context (the most a KV cache may hold)."""

    def __init__(
        self,
        model,
        tok,
        template=None,
        bos="",
        eos="",
        stop=(),
        source="",
        no_template="",
        limit: int = 0,
    ):
        self.model, self.tok, self.template, self.bos, self.eos = model, tok, template, bos, eos
        self.stop, self.source, self.no_template = set(stop), source, no_template
        self.limit = limit or getattr(getattr(model, "cfg", None), "max_seq_len", 2048)
        self.held, self.why = "", ""  # how the base is held for generation, and why (auto)
        self.steps_marker = None  # a file written once the compiled steps are built (decode)
        self.build = None  # (marker, model, adapter): steps to build in the background after
        self.report: dict = {}  # the last reply: its text, tokens and times (--json)
        self.c = None  # models/reply_c.Model: a one-shot reply's loop in C (cli/reply_fast.py)
        self.image = None  # (path, sizes, note): a one-shot reply steps in C, its model kept


def load_lm(args, device) -> LM:
    # A LoRA run directory stands for its final/ adapter, as in `toy export`.
    from toy.cli.adapter_base import resolve_base, run_dir_of
    from toy.formats.checkpoint import read_json
    from toy.formats.model_dir import final_dir, load_model_dir

    adapter = _adapter_path(args.adapter) if args.adapter else None
    model_path = Path(args.model) if args.model else None
    plan = _planned_cache(args)
    if args.run:
        d = final_dir(args.run, "--run")
        lora = (d / "adapter_config.json").is_file()
        if args.adapter:
            what = "its adapter (a LoRA run)" if lora else "its own weights (a full model run)"
            raise UsageError(
                f"--run {args.run} brings {what}; --adapter conflicts with it: drop --adapter, or "
                "apply an adapter with --model BASE --adapter DIR"
            )
        if lora:  # its base plus its adapter
            base, notes = resolve_base(
                d, run_dir_of(args.run, d), args.model, read_json(d / "adapter_config.json")
            )
            for note in notes:
                print(f"note: {note}", file=sys.stderr)
            return load_base_lm(
                base,
                d,
                device,
                getattr(args, "base_dtype", "auto"),
                plan,
                _tokens(args),
                getattr(args, "precision", "float32"),
            )
        if args.model:
            raise UsageError(
                f"--run {args.run} is a full model run: it brings its own weights and tokenizer; "
                "drop --model (it names a LoRA run's base)"
            )
        _refuse_image_classifier(d, args.run)
        model, _, tok = load_model_dir(d, device)
        if tok is None:
            raise InputError(
                f"{d}: has no tokenizer.json (the corpus it trained on had no NAME.tokenizer.json "
                f"beside it); copy that corpus's tokenizer into {d / 'tokenizer.json'}"
            )
        return LM(model, tok, stop={eos_id(tok)} - {None}, source=str(d))
    if adapter is not None and adapter.is_dir() and model_path is not None and model_path.exists():
        # An adapter from a run: say so when --model is not the file it trained on.
        _, notes = resolve_base(adapter, run_dir_of(args.adapter, adapter), model_path, {})
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
    return load_base_lm(
        model_path,
        adapter,
        device,
        getattr(args, "base_dtype", "auto"),
        plan,
        _tokens(args),
        getattr(args, "precision", "float32"),
    )


def _tokens(args) -> int | None:
    """The new tokens this run asks for (what auto weighs packing against); None for an
    interactive chat (many replies share one load)."""
    if args.prompt is None and args.chat is None:
        return None
    return args.max_new_tokens


def _round_up(n: int, chunk: int) -> int:
    return -(-n // chunk) * chunk


def _prompt_len(lm: LM, args) -> int:
    """The ids --prompt or --chat's rendered message feed (0 for a chat without a template,
    refused once loaded)."""
    if args.prompt is not None:
        return max(1, len(encode_prompt(lm.tok, args.prompt)))
    if lm.template is None:
        return 0
    from toy.data.chat import render_template

    text = render_template(
        lm.template,
        [*_system(args), {"role": "user", "content": args.chat}],
        add_generation_prompt=True,
        bos_token=lm.bos,
        eos_token=lm.eos,
    )
    return len(encode_prompt(lm.tok, text))


def _planned_cache(args):
    """The KV cache positions the generation will need, from an LM whose weights are not
    loaded yet: its prompt (or rendered chat message) plus --max-new-tokens; for an
    interactive chat, its first allocation (a chunk for the first message, and the reply)."""

    def plan(lm: LM) -> int:
        if args.prompt is None and args.chat is None:
            return min(lm.limit, _round_up(args.max_new_tokens + CACHE_CHUNK, CACHE_CHUNK))
        fed = _prompt_len(lm, args)
        return min(lm.limit, fed + args.max_new_tokens) if fed else 0

    return plan


def pack_pays(float32_bytes: int, tokens: int | None, steps_cached: bool) -> bool:
    """Whether generating `tokens` new tokens packed (models/decode.py) ends sooner than in
    float32: the seconds a packed token saves (float32 reads all of its weights every token,
    the codes PACKED_SPEEDUP faster) against what the packed path costs more before its
    first token. The measured costs: see PACKED_EXTRA_S. None tokens: an interactive chat,
    many replies on one load: it pays. Never where this machine has not built the steps:
    a reply does not wait for a build (~20 s for SmolLM2, 45 s with the packed kernels
    too), which a 10-token reply to `--max-new-tokens 1500` did; float32 answers at once
    and load_base_lm starts the build in the background (build_in_background)."""
    if not steps_cached:
        return False
    if tokens is None:
        return True
    per_token = F32_TOKEN_S_PER_GB * float32_bytes / 1e9 * (1 - 1 / PACKED_SPEEDUP)
    return tokens * per_token > PACKED_EXTRA_S


def choose_base_dtype(
    requested: str,
    device_type: str,
    float32_bytes: int,
    available: int | None,
    cache_bytes: int = 0,
    packed_bytes: int | None = None,
    tokens: int | None = None,
    steps_cached: bool = True,
) -> tuple[str, str]:
    """The --base-dtype to load a GGUF with, and a note when auto chose to save memory.
    `cache_bytes`: the KV cache the generation needs, counted beside the weights;
    `packed_bytes`: what the weights take packed for generation (models/decode.py), None
    where they cannot be (not a block type it packs, no compiler, not the cpu); packed is
    chosen where it is smaller and pack_pays(tokens, steps_cached) says it ends sooner."""
    if requested != "auto":
        return requested, ""
    if device_type == "cuda":
        return "bfloat16", ""
    if (
        packed_bytes is not None
        and packed_bytes < float32_bytes
        and pack_pays(float32_bytes, tokens, steps_cached)
    ):
        return "quantized", ""
    if available is None or float32_bytes + cache_bytes <= FIT * available:
        return "float32", ""
    what = f"a float32 copy ({human_size(float32_bytes)})"
    if cache_bytes:
        what += f" and its KV cache ({human_size(cache_bytes)})"
    return "quantized", (
        f"--base-dtype auto: {what} would not fit in {FIT:.0%} of the available memory "
        f"({human_size(available)}); holding the model quantized instead (slower per token; "
        "--base-dtype float32 overrides)"
    )


def _refuse_image_classifier(d: Path, run: str) -> None:
    """A vit run has no tokenizer and takes no text: say what it is and what it takes."""
    from toy.formats.checkpoint import read_json

    if not (d / "config.json").is_file():
        return  # load_model_dir names what is missing
    meta = read_json(d / "config.json")
    model = meta.get("model") if isinstance(meta, dict) else None
    if isinstance(model, dict) and model.get("arch") == "vit":
        raise UsageError(
            f"--run {run}: an image classifier (vit-tiny), not a language model; it takes no "
            f"--prompt or --chat: classify an image with `toy infer --run {run} --image PATH`"
        )


# What --adapter takes, named wherever a path is refused.
ADAPTER_FORMS = (
    "a PEFT adapter directory, an mlx-lm adapter directory or its .safetensors file "
    "(adapter_config.json beside it), a lora run directory, or a LoRA adapter GGUF"
)


def _adapter_path(arg: str) -> Path:
    """--adapter: a directory (a PEFT or mlx-lm adapter, a run) as final_dir finds it; a file
    as it is: a LoRA adapter GGUF, or an mlx-lm adapter's weights beside their
    adapter_config.json (`toy train --output DIR/NAME.safetensors` writes them so). A PEFT
    adapter's weights file stands for its directory. Anything else: one line naming the forms."""
    p = Path(arg)
    if not p.exists():
        raise InputError(
            f"--adapter {p}: no such run or adapter directory or file; pass {ADAPTER_FORMS}"
        )
    if p.is_dir():
        from toy.formats.model_dir import final_dir

        d = final_dir(arg, "--adapter")
        if not (d / "adapter_config.json").is_file():
            raise InputError(
                f"--adapter {d}: no adapter_config.json, not an adapter; pass {ADAPTER_FORMS}"
            )
        return d
    if not p.is_file():
        raise InputError(f"--adapter {p}: not a file or directory; pass {ADAPTER_FORMS}")
    with open(p, "rb") as fh:
        magic = fh.read(4)
    if magic == b"GGUF":
        from toy.formats.gguf_header import read_gguf_header

        if read_gguf_header(p).metadata.get("general.type") != "adapter":
            raise InputError(
                f"--adapter {p}: is a model GGUF, not a LoRA adapter; pass it as --model, or "
                "give --adapter an adapter (`toy export --format gguf-lora` writes one)"
            )
        return p
    if p.suffix == ".safetensors" and (p.parent / "adapter_config.json").is_file():
        return p.parent if p.name == "adapter_model.safetensors" else p
    raise InputError(f"--adapter {p}: not a LoRA adapter; pass {ADAPTER_FORMS}")


def _gguf_adapter(path: Path, base, model_path: Path):
    """(lora_sd, {"r", "lora_alpha"}) of a llama.cpp LoRA adapter GGUF, checked against the
    base it is applied to: its architecture and every A/B shape; one line where it does not
    fit."""
    from toy.formats.gguf_write import read_lora_gguf

    arch = base.gguf_arch
    try:
        ad = read_lora_gguf(path, base.config)
    except InputError as e:
        raise InputError(
            f"--adapter {path} does not fit --model {model_path}: "
            f"{e.message.removeprefix(f'{path}: ')}; pass the base it was trained on"
        )
    if ad.arch != arch:
        raise InputError(
            f"--adapter {path} is an adapter for a {ad.arch} model and --model {model_path} is "
            f"{arch}; pass the base it was trained on"
        )
    return ad.lora_sd, {"r": ad.rank, "lora_alpha": ad.alpha}


def _background_builds() -> bool:
    """Whether auto may start a build in the background (TOY_BACKGROUND_BUILDS=0: not)."""
    import os

    return os.environ.get("TOY_BACKGROUND_BUILDS", "1") != "0"


def background_plan() -> str:
    """What happens about the steps not built yet, for the --json `why`."""
    if not _background_builds():
        return "TOY_BACKGROUND_BUILDS=0: no background build; `toy infer --build-steps` builds them"
    return "a background build of them starts once this reply is out; the next run uses them"


def build_in_background(marker: Path, model_path: Path, adapter: Path | None) -> None:
    """Start `toy infer --model M [--adapter A] --build-steps` as a process of its own, at
    a lower priority, so that the next run finds the steps built (the marker written);
    at most one a model at a time (a lock beside the marker, taken over after 15 minutes).
    Called once the reply is out: a build beside it slowed a float32 reply 30-fold on two
    cores. A start that fails is a note. TOY_BACKGROUND_BUILDS=0: none started."""
    import os
    import subprocess
    import time

    if not _background_builds():
        return
    lock = _build_lock(marker)
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        if lock.exists() and time.time() - lock.stat().st_mtime < 15 * 60:
            return  # one is under way
        lock.write_text(str(os.getpid()))
        argv = [sys.executable, "-m", "toy", "infer", "--model", str(model_path)]
        argv += ["--adapter", str(adapter)] if adapter is not None else []
        subprocess.Popen(
            [*argv, "--build-steps", "--build-lock", str(lock)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # not stopped with this command's terminal
            **({"preexec_fn": lambda: os.nice(10)} if hasattr(os, "nice") else {}),
        )
    except OSError as e:
        print(
            f"note: the background build of the packed steps could not start "
            f"({e.strerror or e}); `toy infer --model {model_path} --build-steps` builds them",
            file=sys.stderr,
        )


def build_steps(args, device) -> int:
    """`toy infer --build-steps`: hold --model packed, build (or load) its one-token steps
    for the first two spans a reply reads, and write the marker auto looks for. The
    --build-lock file is removed at the end only where it is this model's own lock (the
    one build_in_background made): a path toy did not make is never deleted."""
    from toy.models import decode, decode_native

    args.base_dtype = "quantized"
    lm = load_lm(args, device)
    try:
        if decode.has_steps(lm.model):
            last = min(2 * decode.SPAN_MIN, lm.limit) - 1
            decode.warm_steps(lm.model, lm.limit, 0, last)
            if decode_native.serving(lm.model):  # nothing built in C's place
                print(
                    "nothing to build: this model's reply steps in C (models/decode_step.c)",
                    file=sys.stderr,
                )
                return 0
            if lm.steps_marker is not None and decode.compile_failed is None:
                decode.mark_steps(lm.steps_marker)
                print(f"built: {lm.steps_marker.name}", file=sys.stderr)
                return 0
        print("nothing built: the base does not pack for generation here", file=sys.stderr)
        return 0
    finally:
        given = getattr(args, "build_lock", None)
        if given and lm.steps_marker is not None and Path(given) == _build_lock(lm.steps_marker):
            Path(given).unlink(missing_ok=True)


def _build_lock(marker: Path) -> Path:
    """The lock beside a steps marker while a background build of those steps runs."""
    return marker.with_name(marker.name + ".building")


def _adapter_reach(sd: dict) -> tuple[list[str], list[int] | None]:
    """(the projections, the blocks) an adapter's own tensors adapt: its target_modules may
    be a regex, and mlx-lm adapts the last --num-layers (16 by default), PEFT its
    layers_to_transform."""
    from toy.lora import adapted_layers

    return sorted({k.rsplit(".", 2)[-2] for k in sd}), adapted_layers(sd)


def _adapter_shape(reach: tuple[list[str], list[int] | None]) -> str:
    """What an adapter changes in the blocks' kinds (its _adapter_reach), as a file-name
    part: a digest, the same for every adapter of that shape."""
    import hashlib
    import json

    return "lora-" + hashlib.sha256(json.dumps(reach).encode()).hexdigest()[:12]


def _read_adapter(path: Path, base, model_path: Path):
    """(lora_sd, {"r", "lora_alpha"}) of --adapter as _adapter_path found it: a LoRA adapter
    GGUF, an mlx-lm adapter (its directory or weights file: adapters.safetensors, as
    `mlx_lm.generate --adapter-path` and `toy describe` read it) or a PEFT adapter directory."""
    from toy.formats import mlx_adapter
    from toy.formats.peft import load_peft_adapter

    if path.is_file():
        with open(path, "rb") as fh:
            gguf = fh.read(4) == b"GGUF"
        if gguf:
            return _gguf_adapter(path, base, model_path)
        return mlx_adapter.load_mlx_adapter(path.parent, weights_name=path.name)
    if (path / mlx_adapter.WEIGHTS_NAME).is_file():
        return mlx_adapter.load_mlx_adapter(path)
    return load_peft_adapter(path)


def load_base_lm(
    model_path: Path,
    adapter: Path | None,
    device,
    base_dtype: str = "auto",
    cache_tokens=None,
    tokens: int | None = 0,
    precision: str = "float32",
) -> LM:
    """A base (a GGUF, a transformers or MLX directory) and adapter, ready to generate.
    `cache_tokens(lm)`, given the LM before its weights load (tokenizer and template ready,
    model None), says how many KV cache positions the generation needs: --base-dtype auto
    counts them beside the weights. `tokens`: the new tokens asked for (None: an interactive
    chat), what auto weighs packing a quantized base (models/decode.py) against."""
    import torch

    from toy.data.chat import resolve_chat_template
    from toy.formats import base_readers, packed_cache
    from toy.formats.base_readers import read_base
    from toy.lora import apply_lora, load_lora_state_dict, merge_lora
    from toy.models import decode, decode_native
    from toy.models.layers import kv_cache_bytes

    if not model_path.exists():
        raise InputError(
            f"--model {model_path} not found; get SmolLM2 with `toy fetch smollm2` or pass a GGUF "
            "file or a transformers or MLX model directory"
        )
    # Held as stored first: memory-mapped, nothing big is read, and a model toy cannot load
    # is refused before any work; its tokenizer, template and size decide the rest.
    probe = read_base(model_path, "quantized")
    cfg, tok, special = probe.config, probe.tokenizer, probe.special
    template, why, template_note = None, "", None
    try:
        template, template_note = resolve_chat_template(
            probe.chat_template, probe.vocab_tokens, probe.chat_format, None, str(model_path)
        )
        if template_note:
            print(f"note: {template_note}", file=sys.stderr)
    except InputError as e:
        why = e.message.removeprefix(f"{model_path}: ")
    lm = LM(
        None,
        tok,
        template,
        probe.token(special.bos),
        probe.token(special.eos),
        set(special.stops),
        str(model_path),
        why,
        limit=cfg.max_seq_len,
    )
    # Float weights where they fit: one token at a time is matmul-light, and dequantizing
    # every layer for every token costs more than the matmuls. Quantized where they do not
    # (a 7B Q4 file is 4 GB, its float32 copy 28 GB), the KV cache counted with them.
    cache = kv_cache_bytes(cfg, cache_tokens(lm)) if cache_tokens is not None else 0
    packed = decode.base_packed_bytes(probe.state_dict, torch.device(device))
    marker = None
    adapted = reach = None  # (lora tensors, their config): read before auto weighs packing
    if adapter is not None:
        adapted = _read_adapter(adapter, probe, model_path)
        reach = _adapter_reach(adapted[0])
    if packed is not None and model_path.is_file():  # a GGUF: its compiled steps are marked
        # An adapter merges float32 weights into the projections it adapts, in the blocks
        # it adapts: blocks of another kind, with steps of their own (a first chat with an
        # adapter built them for 33 s while auto counted them as built).
        merged = "" if reach is None else "-" + _adapter_shape(reach)
        marker = decode.steps_marker(packed_cache.path_for(model_path).stem + merged)
    # A llama model steps its reply in C (models/decode_native.py), an adapter merged into
    # its blocks or not: nothing to build for it.
    native = packed is not None and decode_native.covers(cfg)
    cached = marker is None or marker.is_file() or native
    want = [base_dtype, torch.device(device).type, probe.float32_bytes(), available_memory()]
    want += [cache, packed, tokens, cached]
    dtype, note = choose_base_dtype(*want)
    # The compiler is looked for only where the packed form is to be used and this machine
    # has not built its steps before (the look imports torch's compiler stack, 1.3 s; built
    # steps load without it, and a shape still to build falls back to eager if it fails).
    look = dtype == "quantized" and not native and not (marker is not None and marker.is_file())
    why_not = decode.compile_unavailable(torch.device(device)) if look else None
    if why_not and packed is not None:  # compiling is a speed lever, never a requirement
        held = (
            "each layer dequantized as it runs"
            if base_dtype == "quantized"
            else "float32 where it fits"
        )
        print(
            f"note: {why_not}; generating without compiled kernels ({held}: the same text, "
            "slower per token)",
            file=sys.stderr,
        )
        packed = want[5] = None
        dtype, note = choose_base_dtype(*want)
    if note:
        print(f"note: {note}", file=sys.stderr)
    if dtype == "float32" and precision == "bf16":
        dtype = "bfloat16"
    lm.held, lm.why = dtype, note
    if not note and base_dtype == "auto" and torch.device(device).type == "cpu":
        if packed is None:
            lm.why = "auto: float32, the base does not pack for generation here"
        elif dtype == "quantized":
            lm.why = (
                "auto: packed, an interactive chat"
                if tokens is None
                else f"auto: packed, shorter expected wait for {tokens} new tokens"
            )
        elif not cached and marker is not None and pack_pays(want[2], tokens, True):
            what = "an interactive chat" if tokens is None else f"{tokens} new tokens"
            lm.build = (marker, model_path, adapter)  # started once the reply is out
            lm.why = (
                f"auto: float32 now; packed would pay for {what} once its steps are built on "
                "this machine (not yet: " + background_plan() + ")"
            )
        else:
            lm.why = f"auto: float32, {tokens} new tokens do not repay packing" + (
                "" if cached else " (its compile is not cached on this machine yet)"
            )
    base = base_readers.held_as(probe, model_path, dtype)
    model = base.build_model(device)
    if adapted is not None:
        sd, acfg = adapted
        targets, layers = reach
        apply_lora(model, targets, int(acfg["r"]), float(acfg["lora_alpha"]), 0.0, 0, layers)
        load_lora_state_dict(model, sd, source=str(adapter))
        merge_lora(model)  # one weight per projection (float32 where the base is quantized)
    if (
        dtype == "quantized" and packed is not None
    ):  # asked for, or chosen by auto (see choose_base_dtype)
        # The products on the codes and each block's step for one token are compiled on first
        # use: about 20 s the first time on a machine, then loaded as built (models/decode.py).
        lm.held, lm.steps_marker = "quantized (packed)", marker
        if marker is not None and marker.is_file():
            decode.trust_isa()  # built here before: inductor's per-process ISA probe is skipped
        if model_path.is_file():  # a GGUF: packed once, then read from toy's cache
            packed_cache.pack(model, model_path)
            if native and adapted is None and precision == "float32":
                # a one-shot reply steps in C from its first token (models/reply_c.py), as
                # the next command (cli/reply_fast.py) will from the model kept after it
                from toy.formats import reply_image

                sizes = {"float32_bytes": want[2], "packed_bytes": packed}
                sizes |= {"n_layer": cfg.n_layer, "n_kv": cfg.n_kv_head, "head_dim": cfg.head_dim}
                lm.image = (reply_image.path_for(model_path), sizes, template_note)
        else:
            decode.pack(model)
        decode.compile_steps(
            model,
            lambda: print(
                "note: compiling the one-token step for this model's blocks (the first time "
                "on this machine: about 20 s for SmolLM2-135M, ~50 s for Gemma-3-270M's two "
                "kinds of layers and four block types; loaded as built after that)",
                file=sys.stderr,
                flush=True,
            ),
            check=look,
        )
    lm.model = model.eval()
    return lm


def new_cache(lm: LM, positions: int):
    """The KV cache of a generation that needs `positions`. With compiled steps
    (models/decode.py), one of the model's whole context, resident only where written
    (KVCache lazy): its strides, for which the steps are built, are the same for every
    prompt and --max-new-tokens, so a step built once serves them all (a cache sized to
    the reply took a build of ~20 s for each new size: --max-new-tokens 1500 waited 22 s
    for its first token where 200 had it built). Without them, CACHE_CHUNKs enough for
    `positions` (grown by reserve)."""
    from toy.models import decode

    if decode.has_steps(lm.model):
        return lm.model.new_cache(1, lm.limit, lazy=True)
    return lm.model.new_cache(1, min(lm.limit, _round_up(positions, CACHE_CHUNK)))


def stream(lm: LM, ids: list[int], args, cache=None, echo: str = "") -> list[int]:
    """Generate and print token by token (after `echo`, the text continued); returns the new
    ids. With compiled steps the KV cache (made here when none is given: new_cache) spans
    the model's context, so that a compiled step's shapes (models/decode.py) are the same
    for every prompt and come from inductor's cache; the first span's steps are built (or
    loaded) before the first token, so no note lands inside the reply. Ends with one stderr line:
    the time to the first token and the tokens/s after it.

    A one-shot reply (no cache given) of a llama base held packed steps in C from its first
    token to its last (models/reply_c.py), on a model read from toy's cache (lm.c:
    cli/reply_fast.py) or made from the loaded one, which is then kept for the next command."""
    from toy.models import reply_c

    c = None
    if isinstance(cache, reply_c.State):  # an interactive chat's, in C (new_cache)
        c = cache.m
    elif cache is None:
        c = lm.c if lm.model is None else _c_model(lm, ids, args)
    if c is not None:
        drawn = reply_c.reply(c, ids, *_sampling(lm, args), state=cache)
        new = _emit(lm, drawn, ids, args, echo, cache is None, reply_c.threads(0))
        _keep(lm, c, args)
        return new
    import torch

    from toy.models import decode, decode_native
    from toy.models.generate import generate

    room = max(1, lm.limit - (cache.pos if cache is not None else 0))
    fed = min(len(ids), room)
    if cache is None and decode.has_steps(lm.model):  # else generate makes it, no larger
        cache = new_cache(lm, fed + args.max_new_tokens)
    if cache is not None:
        first = cache.pos + fed
        # Built before the first token: the steps of the span that token reads, not every
        # span --max-new-tokens could reach (1500 of them: four spans, 41 s for SmolLM2,
        # where most replies end in the first). A later span is built where the reply
        # reaches it, a pause there without a note (notes go before a reply, not inside).
        last = min(first + args.max_new_tokens - 1, decode.span_last(first, cache.max_len))
        decode.warm_steps(lm.model, cache.max_len, first, last)
        decode.quiet_steps(lm.model)
        if (  # auto may count on the cached compile now (not built where C stepped it)
            lm.steps_marker is not None
            and decode.compile_failed is None
            and not decode_native.serving(lm.model)
        ):
            decode.mark_steps(lm.steps_marker)
    drawn = generate(lm.model, ids, *_sampling(lm, args), cache=cache)
    return _emit(lm, drawn, ids, args, echo, cache is None, torch.get_num_threads())


def _sampling(lm: LM, args) -> tuple:
    """What a reply's loop takes after the prompt (generate's and reply_c.reply's order)."""
    return (args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, lm.stop)


def _c_model(lm: LM, ids: list[int], args):
    """The C loop's model (models/reply_c.py) for a one-shot reply of a loaded LM: a llama
    base held packed whose prompt and reply reply_fast.takes; None for decode.py's path."""
    if len(ids) > reply_fast.PREFILL_MAX or lm.image is None:  # only what reply_fast takes
        return None
    from toy.models import decode_native

    c = decode_native.reply_model(lm.model)
    if c is None or not reply_fast.takes(len(ids), args.max_new_tokens, c.positions(), lm.limit):
        return None
    return c


def _session_state(lm: LM):
    """An interactive chat's state in C (models/reply_c.py: every turn stepped there, as
    one-shot replies are): its model kept (lm.c, cli/reply_fast.py), or made from the loaded
    one where the next command could take it from the cache (lm.image); only where its
    tables cover the model's whole context. None: torch's KV cache (new_cache)."""
    c = lm.c
    if c is None and lm.model is not None and lm.image is not None:
        from toy.models import decode_native

        c = lm.c = decode_native.reply_model(lm.model)
    if c is None or c.positions() != lm.limit:
        return None
    from toy.models import reply_c

    return reply_c.State(c, c.positions())


def _keep(lm: LM, c, args) -> None:
    """After a reply from a loaded model: its C loop's model kept in toy's cache (best
    effort), where load_base_lm marked it for keeping and no good copy is there yet (none,
    or one load_kept found damaged or stale)."""
    if lm.image is None or lm.model is None:
        return
    from toy.formats import reply_image

    path, sizes, note = lm.image
    lm.image = None
    if getattr(args, "reply_image_bad", False) or not path.is_file():
        reply_image.write(path, c.plan, c.arrays, reply_fast.meta_of(lm, sizes, note))


def _emit(lm: LM, drawn, ids: list[int], args, echo: str, cut_note: bool, threads: int):
    """Print the tokens `drawn` yields as they come (see stream), the speed line after them,
    and keep the reply's report (lm.report); returns the new ids."""
    import time

    out = sys.stdout
    new: list[int] = []
    shown = ""
    quiet = getattr(args, "json", False)  # the text goes into the JSON object instead
    if echo and not quiet:
        out.write(echo)
        out.flush()
    t0 = time.perf_counter()
    t1 = None
    for t in drawn:
        if t1 is None:
            t1 = time.perf_counter()
        new.append(t)
        held = min(len(ids), lm.limit) + len(new) - 1  # positions fed so far
        # Decode the whole continuation each time: a byte-level token may be half a
        # UTF-8 character, so print only the settled text.
        text = lm.tok.decode(new)
        if not text.endswith("\ufffd") and not quiet:
            out.write(text[len(shown) :])
            out.flush()
            shown = text
    end = time.perf_counter()
    if not quiet:
        if new and text != shown:  # the end of the reply is half a character: shown as is
            out.write(text[len(shown) :])
        out.write("\n")
        out.flush()
    if cut_note and new and len(new) < args.max_new_tokens and held >= lm.limit:
        print(
            f"[cut at {len(new)} new tokens: the model's context of {lm.limit} tokens is full "
            f"(--max-new-tokens {args.max_new_tokens} asked for more)]",
            file=sys.stderr,
        )
    print(_speed_line(len(new), t0, t1, end), file=sys.stderr, flush=True)
    since = _process_age()
    lm.report = {
        "text": echo + lm.tok.decode(new),
        "tokens": len(new),
        "first_token_s": None if t1 is None else round(t1 - t0, 4),
        "first_token_since_command_s": (
            None if t1 is None or since is None else round(since - (end - t1), 4)
        ),
        "tokens_per_s": (
            round((len(new) - 1) / max(end - t1, 1e-9), 2) if t1 is not None and new[1:] else None
        ),
        "base_dtype": lm.held,
        "why": lm.why,
        "threads": threads,
    }
    return new


def _speed_line(n: int, t0: float, t1: float | None, end: float) -> str:
    """'[N tokens: first after X s (Y s since the command), Z tokens/s after it]'."""
    if t1 is None:
        return "[no tokens generated]"
    since = _process_age()
    line = f"[{n} token{'s' if n != 1 else ''}: first after {t1 - t0:.2f} s"
    if since is not None:
        line += f" ({since - (end - t1):.2f} s since the command)"
    if n > 1:
        line += f", {(n - 1) / max(end - t1, 1e-9):.1f} tokens/s after it"
    return line + "]"


def _process_age() -> float | None:
    """Seconds since this process started (Linux: /proc), or None where it cannot be read."""
    import os

    try:
        start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _prompt_ids(lm: LM, prompt: str) -> list[int]:
    """--prompt's ids, with the BOS the model's tokenizer asks for (a GGUF's add_bos_token);
    an empty prompt is that BOS alone, or the end-of-text token of a toy-trained model."""
    ids = encode_prompt(lm.tok, prompt)
    if not ids:
        eid = eos_id(lm.tok) if lm.template is None else None
        if eid is None:
            raise UsageError("--prompt is empty; give some text to continue")
        ids = [eid]
    return ids


def continue_text(lm: LM, args) -> int:
    ids = _prompt_ids(lm, args.prompt)
    stream(lm, ids, args, echo=args.prompt)
    return 0


def _system(args) -> list[dict]:
    return [{"role": "system", "content": args.system}] if args.system else []


class Session:
    """An interactive chat's KV cache, kept across turns, and the ids it holds."""

    def __init__(self):
        self.cache = None
        self.held: list[int] = []


def chat_turn(lm: LM, args, messages: list[dict], session: Session | None = None) -> str:
    """Render the conversation, generate the reply (printed as it comes), return its text.
    With a session, the cache keeps every position whose ids are unchanged since the last
    turn (the conversation so far) and only the rest is fed; it grows CACHE_CHUNK
    positions at a time, up to the model's context."""
    from toy.data.chat import render_template

    text = render_template(
        lm.template, messages, add_generation_prompt=True, bos_token=lm.bos, eos_token=lm.eos
    )
    ids = encode_prompt(lm.tok, text)
    if session is None:
        return lm.tok.decode(stream(lm, ids, args))
    keep = 0
    if session.cache is None:
        session.cache = _session_state(lm) or new_cache(lm, len(ids) + args.max_new_tokens)
    elif len(ids) < lm.limit:
        while keep < min(len(session.held), len(ids) - 1) and session.held[keep] == ids[keep]:
            keep += 1
    cache = session.cache
    cache.truncate(keep)
    cache.reserve(min(lm.limit, _round_up(len(ids) + args.max_new_tokens, CACHE_CHUNK)))
    new = stream(lm, ids[keep:], args, cache)
    # Past the context, generate kept only the prompt's end: the cache then matches no prefix.
    session.held = (ids + new)[: cache.pos] if len(ids) <= lm.limit else []
    if len(new) >= args.max_new_tokens:
        print(f"[reply cut at --max-new-tokens {args.max_new_tokens}]", file=sys.stderr)
    elif cache.pos >= lm.limit:
        print(f"[reply cut: the model's context of {lm.limit} tokens is full]", file=sys.stderr)
    return lm.tok.decode(new)


def interactive(lm: LM, args) -> int:
    """A chat session on the terminal: each turn re-renders the whole conversation with
    the template (simple and always right), and the reply streams with a KV cache kept
    across turns (only what changed since the last turn is fed)."""
    messages = _system(args)
    session = Session()
    print(f"chatting with {lm.source} (empty line or Ctrl-D to quit)", file=sys.stderr)
    while True:
        try:
            line = input("> ")
            _check_utf8("your line", line)
        except EOFError:
            print(file=sys.stderr)
            return 0
        except (UnicodeDecodeError, UsageError) as e:  # one bad line never ends the session
            what = e.message if isinstance(e, UsageError) else _not_utf8("your line", e.reason)
            print(f"{what}; type it again", file=sys.stderr)
            continue
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        reply = chat_turn(lm, args, messages, session)
        messages.append({"role": "assistant", "content": reply})
