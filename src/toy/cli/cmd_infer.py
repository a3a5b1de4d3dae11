"""`toy infer`: sample from a trained model (KV cache, streaming).

With --prompt TEXT it continues the text; with --chat MESSAGE it answers one message
through the model's chat template; with neither it is an interactive chat on the
terminal (an empty line or Ctrl-D ends it). --image PATH classifies an image with an
image-classifier run instead."""

from __future__ import annotations

import sys
from pathlib import Path

from toy.cli.args import finite_float, nonneg_int, positive_int
from toy.errors import InputError, UsageError
from toy.formats.model_dir import final_dir, load_model_dir
from toy.models.generate import generate
from toy.tokenizer import eos_id


INFER_BASE_DTYPES = ("auto", "quantized", "bfloat16", "float32")
FIT = 0.8  # auto holds a float32 copy only where it takes at most this share of the available memory


def add_parser(sub) -> None:
    p = sub.add_parser("infer", help="generate text from a trained model (or chat with it)", description=__doc__)
    p.add_argument("--run", metavar="RUN_DIR", help="run directory (or its final/) of a trained model; a LoRA run "
                   "brings its base (the --model it trained on) and its adapter (no default: give --run or --model)")
    p.add_argument("--model", metavar="BASE.gguf", help="a GGUF model to generate with (without --run; no default: give "
                   "--run or --model); with --run on a LoRA run: its base (default: the one it trained on)")
    p.add_argument("--adapter", metavar="DIR", help="a LoRA adapter directory (PEFT layout), or a lora run directory "
                   "(its final/ is used), to apply on --model (default: none)")
    p.add_argument("--prompt", help="text to continue, as is (default: none; without --prompt or --chat, "
                   "an interactive chat)")
    p.add_argument("--chat", metavar="MESSAGE", help="one chat message, rendered with the model's chat template "
                   "(default: none; without --prompt or --chat, an interactive chat)")
    p.add_argument("--system", help="system message for --chat and interactive chat (default: none)")
    p.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=100, metavar="N",
                   help="tokens to generate at most (default 100)")
    p.add_argument("--temperature", type=finite_float, default=0.8, metavar="T",
                   help="sampling temperature, 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=nonneg_int, default=0, metavar="K",
                   help="sample from the K most likely tokens (default 0: all)")
    p.add_argument("--top-p", type=finite_float, default=1.0, metavar="P",
                   help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--device", choices=("cpu", "cuda", "metal"), default="cpu",
                   help="cpu, cuda or metal (macOS) (default cpu)")
    p.add_argument("--base-dtype", choices=INFER_BASE_DTYPES, default="auto",
                   help="how a GGUF model is held: float32 or bfloat16 (dequantized once: fast per token) or "
                   "quantized (the file's own blocks, each layer dequantized as it runs: the least memory, slower per "
                   "token) (default auto: bfloat16 on cuda; on cpu and metal float32 where that fits in "
                   f"{FIT * 100:.0f}%% of the available memory, else quantized)")  # %%: argparse formats help
    p.add_argument("--image", metavar="PATH", help="classify this PNG/JPEG with an image-classifier run "
                   "(prints the top 5 classes; --prompt is not needed) (default: none)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.image:
        from toy.cli.cmd_infer_image import infer_image
        return infer_image(args)
    from toy.train.device import resolve_device

    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not args.run and not args.model:
        raise UsageError("give --run RUN_DIR (a trained run) or --model BASE.gguf [--adapter DIR]")
    if args.prompt is not None and args.chat is not None:
        raise UsageError("--prompt and --chat conflict: continue raw text or send a chat message, not both")
    if args.adapter and not (args.model or args.run):
        raise UsageError("--adapter needs --model BASE.gguf")
    device = resolve_device(args.device)
    lm = load_lm(args, device)
    if args.prompt is not None:
        return continue_text(lm, args)
    if lm.template is None:
        raise UsageError(f"{lm.source}: {lm.no_template or 'has no chat template'}; use --prompt TEXT to continue "
                         "raw text")
    if args.chat is not None:
        chat_turn(lm, args, [*_system(args), {"role": "user", "content": args.chat}])
        return 0
    return interactive(lm, args)


class LM:
    """A model ready to generate, with its tokenizer and (for GGUF bases) chat template."""

    def __init__(self, model, tok, template=None, bos="", eos="", stop=(), source="", no_template=""):
        self.model, self.tok, self.template, self.bos, self.eos = model, tok, template, bos, eos
        self.stop, self.source, self.no_template = set(stop), source, no_template


def load_lm(args, device) -> LM:
    # A LoRA run directory stands for its final/ adapter, as in `toy export`.
    adapter = final_dir(args.adapter, "--adapter") if args.adapter else None
    model_path = Path(args.model) if args.model else None
    if args.run:
        d = final_dir(args.run, "--run")
        if (d / "adapter_config.json").is_file():  # a LoRA run: its base plus its adapter
            adapter = d
            if model_path is None:
                from toy.formats.checkpoint import read_json
                model_path = Path(read_json(d / "adapter_config.json").get("base_model_name_or_path", ""))
        else:
            _refuse_image_classifier(d, args.run)
            model, _, tok = load_model_dir(d, device)
            if tok is None:
                raise InputError(f"{d}: has no tokenizer.json (the corpus it trained on had no NAME.tokenizer.json "
                                 f"beside it); copy that corpus's tokenizer into {d / 'tokenizer.json'}")
            return LM(model, tok, stop={eos_id(tok)} - {None}, source=str(d))
    return load_gguf_lm(model_path, adapter, device, getattr(args, "base_dtype", "auto"))


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux: MemAvailable), else the
    machine's physical memory, else None when neither can be read."""
    import os

    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def choose_base_dtype(requested: str, device_type: str, float32_bytes: int, available: int | None) -> tuple[str, str]:
    """The --base-dtype to load a GGUF with, and a note when auto chose to save memory."""
    if requested != "auto":
        return requested, ""
    if device_type == "cuda":
        return "bfloat16", ""
    if available is None or float32_bytes <= FIT * available:
        return "float32", ""
    gb = 1e9
    return "quantized", (f"--base-dtype auto: a float32 copy ({float32_bytes / gb:.1f} GB) would not fit in {FIT:.0%} "
                         f"of the available memory ({available / gb:.1f} GB); holding the model quantized instead "
                         "(slower per token; --base-dtype float32 overrides)")


def _refuse_image_classifier(d: Path, run: str) -> None:
    """A vit run has no tokenizer and takes no text: say what it is and what it takes."""
    from toy.formats.checkpoint import read_json

    if not (d / "config.json").is_file():
        return  # load_model_dir names what is missing
    meta = read_json(d / "config.json")
    model = meta.get("model") if isinstance(meta, dict) else None
    if isinstance(model, dict) and model.get("arch") == "vit":
        raise UsageError(f"--run {run}: an image classifier (vit-tiny), not a language model; it takes no --prompt "
                         f"or --chat: classify an image with `toy infer --run {run} --image PATH`")


def load_gguf_lm(model_path: Path, adapter: Path | None, device, base_dtype: str = "auto") -> LM:
    import torch

    from toy.formats.base import float32_size, read_base
    from toy.formats.peft import load_peft_adapter
    from toy.lora import apply_lora, load_lora_state_dict, merge_lora

    if not model_path.exists():
        raise InputError(f"--model {model_path} not found; get SmolLM2 with `toy fetch smollm2` or pass a GGUF file or "
                         "a transformers or MLX model directory")
    # Float weights where they fit: one token at a time is matmul-light, and dequantizing
    # every layer for every token costs more than the matmuls. Quantized where they do not
    # (a 7B Q4 file is 4 GB, its float32 copy 28 GB).
    dtype, note = choose_base_dtype(base_dtype, torch.device(device).type, float32_size(model_path),
                                    available_memory())
    if note:
        print(f"note: {note}", file=sys.stderr)
    base = read_base(model_path, dtype)
    tok = base.tokenizer
    model = base.build_model(device)
    if adapter is not None:
        sd, cfg = load_peft_adapter(adapter)
        # The adapter's own tensors say which projections it adapts (target_modules may be a regex).
        targets = sorted({k.rsplit(".", 2)[-2] for k in sd})
        apply_lora(model, targets, int(cfg["r"]), float(cfg["lora_alpha"]), 0.0, seed=0)
        load_lora_state_dict(model, sd, source=str(adapter))
        merge_lora(model)  # one weight per projection (float32 where the base is quantized)
    from toy.data.chat import resolve_chat_template

    template, why = None, ""
    try:
        template, note = resolve_chat_template(base.chat_template, base.vocab_tokens, base.chat_format, None,
                                               str(model_path))
        if note:
            print(f"note: {note}", file=sys.stderr)
    except InputError as e:
        why = e.message.removeprefix(f"{model_path}: ")
    return LM(model.eval(), tok, template, base.token(base.special.bos), base.token(base.special.eos),
              set(base.special.stops), str(model_path), why)


def stream(lm: LM, ids: list[int], args, cache=None) -> list[int]:
    """Generate and print token by token; returns the new ids."""
    out = sys.stdout
    new: list[int] = []
    shown = ""
    for t in generate(lm.model, ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                      lm.stop, cache=cache):
        new.append(t)
        # Decode the whole continuation each time: a byte-level token may be half a
        # UTF-8 character, so print only the settled text.
        text = lm.tok.decode(new)
        if not text.endswith("\ufffd"):
            out.write(text[len(shown):])
            out.flush()
            shown = text
    out.write("\n")
    out.flush()
    return new


def continue_text(lm: LM, args) -> int:
    ids = lm.tok.encode(args.prompt, add_special_tokens=False).ids
    if not ids:
        eid = eos_id(lm.tok) if lm.template is None else None
        if eid is None:
            raise UsageError("--prompt is empty; give some text to continue")
        ids = [eid]
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    stream(lm, ids, args)
    return 0


def _system(args) -> list[dict]:
    return [{"role": "system", "content": args.system}] if args.system else []


def chat_turn(lm: LM, args, messages: list[dict]) -> str:
    from toy.data.chat import render_template

    text = render_template(lm.template, messages, add_generation_prompt=True, bos_token=lm.bos, eos_token=lm.eos)
    ids = lm.tok.encode(text, add_special_tokens=False).ids
    new = stream(lm, ids, args)
    return lm.tok.decode(new)


def interactive(lm: LM, args) -> int:
    """A chat session on the terminal: each turn re-renders the whole conversation with
    the template (simple and always right), and the reply streams with the KV cache."""
    messages = _system(args)
    print(f"chatting with {lm.source} (empty line or Ctrl-D to quit)", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        reply = chat_turn(lm, args, messages)
        messages.append({"role": "assistant", "content": reply})
