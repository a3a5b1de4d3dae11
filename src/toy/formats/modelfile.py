"""An Ollama Modelfile beside an exported GGUF (`ollama create NAME -f FILE.Modelfile`):
FROM the model (for a LoRA GGUF: FROM its base, ADAPTER the adapter), every token that
ends a reply as a PARAMETER stop (the GGUF's EOS and the turn markers its vocabulary has),
and, where the GGUF's chat template is one of the formats toy knows (ChatML, Gemma), a
TEMPLATE in Ollama's Go syntax: Ollama matches a GGUF's jinja template against the ones it
knows and otherwise sends the bare prompt, which a chat model answers badly (the stop token
and template lost on the way to Ollama are its users' most repeated complaint). Paths are
written relative to the Modelfile where the file lies beside it, else absolute."""

from __future__ import annotations

from pathlib import Path

from toy.formats.base import TURN_ENDS
from toy.formats.gguf_header import read_gguf_header
from toy.runs import write_file_atomic

# Ollama's Go templates of the chat formats toy knows (data/chat.py BUILTIN_TEMPLATES).
GO_TEMPLATES = {
    "chatml": (
        "{{- range .Messages }}<|im_start|>{{ .Role }}\n"
        "{{ .Content }}<|im_end|>\n"
        "{{ end }}<|im_start|>assistant\n"
    ),
    "gemma": (
        "{{- range $i, $_ := .Messages }}\n"
        "{{- $last := eq (len (slice $.Messages $i)) 1 }}\n"
        '{{- if or (eq .Role "user") (eq .Role "system") }}<start_of_turn>user\n'
        "{{ .Content }}<end_of_turn>\n"
        "{{ if $last }}<start_of_turn>model\n"
        "{{ end }}\n"
        '{{- else if eq .Role "assistant" }}<start_of_turn>model\n'
        "{{ .Content }}{{ if not $last }}<end_of_turn>\n"
        "{{ end }}\n"
        "{{- end }}\n"
        "{{- end }}"
    ),
}
_MARKERS = {"chatml": "<|im_start|>", "gemma": "<start_of_turn>"}
MARK = "# written by toy export (it replaces this file when it exports the GGUF again)"


def chat_format(template: str | None, tokens: list[str]) -> str | None:
    """The known chat format a jinja template writes (its turn marker, which the vocabulary
    has), or None."""
    if not template:
        return None
    for name, marker in _MARKERS.items():
        if marker in template and marker in tokens:
            return name
    return None


def modelfile_text(gguf: Path, where: Path, base: Path | None = None) -> tuple[str, list[str]]:
    """(the Modelfile of `gguf`, written at `where`; the stop tokens): a LoRA GGUF's
    `base` gives the tokenizer and template."""
    src = base if base is not None and base.is_file() else None if base is not None else gguf
    meta = read_gguf_header(src).metadata if src is not None else {}  # a LoRA GGUF has none
    tokens = [str(t) for t in meta.get("tokenizer.ggml.tokens") or []]
    eos = meta.get("tokenizer.ggml.eos_token_id")
    stops = [tokens[eos]] if isinstance(eos, int) and 0 <= eos < len(tokens) else []
    stops += [t for t in TURN_ENDS if t in tokens and t not in stops]
    fmt = chat_format(meta.get("tokenizer.chat_template"), tokens)

    def ref(p: Path) -> str:
        p = p.resolve()
        return f"./{p.name}" if p.parent == where.parent.resolve() else str(p)

    lines = [MARK, f"FROM {ref(base) if base else ref(gguf)}"]
    if base:
        lines.append(f"ADAPTER {ref(gguf)}")
    if fmt:
        lines.append(f'TEMPLATE """{GO_TEMPLATES[fmt]}"""')
    lines += [f'PARAMETER stop "{s}"' for s in stops]
    return "\n".join(lines) + "\n", stops


def write_modelfile(gguf: Path, base: Path | None = None) -> Path | None:
    """Write FILE.Modelfile beside FILE.gguf (atomically); returns its path, or None where a
    file of that name that toy did not write is there (it is left as it is)."""
    path = gguf.with_suffix(".Modelfile") if gguf.suffix == ".gguf" else Path(f"{gguf}.Modelfile")
    if path.exists():
        try:
            ours = path.read_text(encoding="utf-8").startswith(MARK)
        except (OSError, UnicodeDecodeError):
            ours = False
        if not ours:
            return None
    text, _ = modelfile_text(gguf, path, base)
    write_file_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return path
