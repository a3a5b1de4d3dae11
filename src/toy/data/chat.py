"""Chat JSONL -> (ids, mask): loss on every assistant turn, packing, padding.

Input, one conversation per line (blank lines and lines starting with `#` skipped):

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}

A line that is not such a conversation, or whose assistant replies are all empty (it
would teach only the end-of-turn marker), is skipped and counted by reason; the first
few are warned with their line number. A file with nothing valid in its first lines is
refused at once: it is not chat JSONL.

The conversation is rendered with the model's own chat template (jinja2, sandboxed:
a template from a downloaded GGUF is untrusted input), tokenized once, and masked.

Mask convention (what the loss code relies on):
    mask[t] == 1  <=>  token ids[t] is a *target*: the loss includes
                       -log p(ids[t] | ids[:t]).
    So the loss shifts: logits from ids[:-1] are scored against ids[1:] with mask[1:].
    mask[0] is 0 in practice (nothing predicts the first token).

What is supervised: for EVERY assistant turn (not only the last one, unlike mlx-lm: the
earlier replies are training signal too) the tokens of its content and of the end-of-turn
marker the template puts after it (ChatML: `<|im_end|>`), because the model must learn to
stop. Not supervised: system and user turns, the assistant header (`<|im_start|>assistant\\n`),
and the whitespace the template writes *after* the end-of-turn marker (ChatML's `\\n`
after `<|im_end|>`). That newline is glue before the next `<|im_start|>`: generation
stops at `<|im_end|>`, so the model never has to produce it (the same span TRL's
`{% generation %}` tags mark in ChatML templates).

How the spans are found: for assistant message i, render messages[:i] with
add_generation_prompt=True (P) and messages[:i+1] (F). The template must be
prefix-stable (P a prefix of F, F a prefix of the whole rendering); then F[len(P):] is
what the assistant "says". Character spans map to tokens through the tokenizer's
offsets: a token is supervised iff its characters overlap a supervised span, so every
character of a reply lies in a supervised token.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import numpy as np
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from tokenizers import Tokenizer

from toy.data.sandbox import BoundedSandbox, compile_bounded, render_bounded
from toy.data.tokens import MAGIC
from toy.errors import InputError, ToyError, UsageError
from toy.runs import plural
from toy.tokenizer import encode_prompt

ROLES = ("system", "user", "assistant")

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100  # a target the loss skips (torch's cross_entropy default, models.losses.IGNORE)
SCHEMA_HINT = (
    'each line must be one of {"messages": [{"role": "system"|"user"|"assistant", "content": '
    '"..."}, ...], "tools": [...]} with a non-empty assistant turn, {"prompt": "...", '
    '"completion": "..."}, or '
    '{"text": "..."}; one format per file'
)

SHOW_SKIPPED = 5  # skipped lines warned one by one; the rest are counted in one summary line
GIVE_UP_AFTER = 50  # this many bad lines and not one conversation: the file is not chat JSONL

Message = dict[str, str]
Conversation = list[Message]


class ConversationError(InputError):
    """The chat template cannot render this one conversation (it calls raise_exception,
    fails on it, or is not prefix-stable for it): the caller may skip the conversation.
    A plain InputError (syntax error, sandbox refusal) is the template's own fault."""


# --------------------------------------------------------------------------- templates


class _Env(BoundedSandbox):
    """The sandbox, bounded in size and time (data/sandbox.py), and an unsafe attribute
    access fails at once.

    Plain jinja2 sandboxes return an Undefined for `''.__class__`, which renders as an
    empty string: an escape attempt would then "succeed" silently with wrong text. We
    want it loud: raise SecurityError, which render_template turns into an InputError.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


def _raise_exception(message: str) -> None:
    # Templates call this to reject a conversation (e.g. "roles must alternate").
    raise ConversationError(f"chat template rejected the conversation: {message}")


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # HF's tojson: plain JSON. jinja2's own escapes <, >, & for HTML, which would change
    # the rendered text of tool schemas relative to what the model was trained on.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    # trim_blocks / lstrip_blocks and loopcontrols as transformers renders chat templates,
    # so the same template gives the same text here as there. No `strftime_now` global:
    # a date inside the rendered text would make the data depend on the day (Llama 3.1
    # templates then fall back to their fixed default date).
    env = _Env(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return compile_bounded(env, template)  # its nesting checked before jinja2 compiles it


def _one_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__


def render_template(
    template: str,
    messages: Sequence[Message],
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
    tools: list | None = None,
) -> str:
    """Render a chat template in jinja2's immutable sandbox, bounded in size and time.
    Every failure is an InputError: a syntax error, an unsafe access or a limit passed
    (TemplateLimitError) is the template's fault for every conversation; a
    `raise_exception` call or a runtime error is a ConversationError (this one only)."""
    try:
        tpl = _compile(template)
    except TemplateSyntaxError as e:
        raise InputError(f"chat template line {e.lineno}: syntax error: {_one_line(e)}")
    except TemplateError as e:
        raise InputError(f"chat template does not compile: {_one_line(e)}")
    size = sum(len(m.get("content") or "") + len(m.get("role") or "") for m in messages)
    size += len(json.dumps(tools)) if tools else 0
    extra = (
        {"tools": tools} if tools is not None else {}
    )  # as transformers: only when the data has them
    try:
        return render_bounded(
            tpl,
            size + len(bos_token) + len(eos_token),
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except ToyError:
        raise
    except SecurityError as e:
        raise InputError(
            f"chat template refused by the sandbox: {_one_line(e)} (a template may not reach "
            f"Python internals or modify its inputs); use the model's own chat template"
        )
    except (
        Exception
    ) as e:  # UndefinedError, TypeError ... on this conversation's data; not a toy bug
        raise ConversationError(
            f"chat template failed to render: {type(e).__name__}: {_one_line(e)}"
        )


# --------------------------------------------------------------------------- JSONL


def _stderr(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


@dataclass(frozen=True)
class Example:
    """One line of a data file, in one of the formats users have: a conversation
    ("messages", with the `tools` its template may show), a prompt with its completion
    ("prompt"), or plain text ("text")."""

    kind: str
    messages: tuple = ()
    tools: list | None = None
    prompt: str = ""
    completion: str = ""
    text: str = ""


PREFERENCE = "preference pair"  # the skip reason of a {"prompt", "chosen", "rejected"} line

FORMATS = {
    "messages": 'a {"messages"} conversation',
    "prompt": 'a {"prompt", "completion"} pair',
    "text": 'a {"text"} document',
}


def _check_line(obj: Any) -> tuple[Example | None, str, str]:
    """(example, "", "") or (None, reason, detail): the reason skipped lines are counted
    by, and a detail naming the offending part of this line."""
    if not isinstance(obj, dict):
        return None, "not a JSON object", f"expected a JSON object, got {type(obj).__name__}"
    if "messages" in obj:
        conv, reason, detail = _check_conversation(obj["messages"])
        if conv is None:
            return None, reason, detail
        tools = obj.get("tools")
        if tools is not None and not isinstance(tools, list):
            return (
                None,
                '"tools" not a list',
                f'"tools" must be a list of tool schemas, got {type(tools).__name__}',
            )
        return Example("messages", tuple(conv), tools=tools), "", ""
    if "chosen" in obj or "rejected" in obj:
        return None, PREFERENCE, 'a preference pair ({"prompt", "chosen", "rejected"})'
    if "prompt" in obj or "completion" in obj:
        p, c = obj.get("prompt"), obj.get("completion")
        if not isinstance(p, str) or not isinstance(c, str):
            bad = "prompt" if not isinstance(p, str) else "completion"
            return (
                None,
                f'"{bad}" not a string',
                f'"{bad}" must be a string, got {type(obj.get(bad)).__name__}',
            )
        if not c.strip():
            return None, "empty completion", '"completion" is empty (nothing to learn from)'
        return Example("prompt", prompt=p, completion=c), "", ""
    if "text" in obj:
        t = obj["text"]
        if not isinstance(t, str) or not t.strip():
            return None, "empty text", '"text" must be a non-empty string'
        return Example("text", text=t), "", ""
    keys = ", ".join(sorted(map(str, obj))[:5]) or "none"
    return (
        None,
        "no known key",
        f'no "messages", "prompt"/"completion" or "text" key (keys: {keys})',
    )


MESSAGE = '{"role", "content"}'  # a message, as the checks below name it
# A prompt (a pair's, a GRPO prompt's) must end with a question, not an answer.
ENDS_WITH_REPLY = "the prompt ends with an assistant turn, not a question"


def check_messages(x: Any, key: str) -> tuple[Conversation | None, str, str]:
    """The one check of a list of chat messages, for every reader of them (chat JSONL's
    "messages", a preference pair's "prompt"/"chosen"/"rejected", a GRPO prompt's
    "prompt"): (messages, "", "") when `x`, the value of a line's key `key`, is a non-empty
    list of {"role", "content"} objects, each role one of ROLES and each content a string
    (a message's other keys dropped: the template sees only these); else (None, reason,
    detail), one wording a problem: `reason` what skipped lines are counted by, `detail`
    the offending part of the line and what it must be (the reader puts FILE:LINE before
    it)."""
    if not isinstance(x, list):
        return (
            None,
            f'"{key}" not a list',
            f'"{key}" must be a list of {MESSAGE} messages, got {type(x).__name__}',
        )
    if not x:
        return None, f'empty "{key}"', f'"{key}" is empty; give at least one {MESSAGE} message'
    out: Conversation = []
    for j, m in enumerate(x):
        if not isinstance(m, dict):
            return (
                None,
                "message not an object",
                f"{key}[{j}] must be a {MESSAGE} object, got {type(m).__name__}",
            )
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            return (
                None,
                "unknown role",
                f"{key}[{j}] has unknown role {role!r} (use one of: {', '.join(ROLES)})",
            )
        if not isinstance(content, str):
            return (
                None,
                "content not a string",
                f'{key}[{j}] "content" must be a string, got {type(content).__name__}',
            )
        out.append({"role": role, "content": content})  # extra keys dropped
    return out, "", ""


def _check_conversation(msgs: Any) -> tuple[Conversation | None, str, str]:
    """A chat line's "messages": check_messages, and at least one assistant reply with
    content."""
    out, reason, detail = check_messages(msgs, "messages")
    if out is None:
        return None, reason, detail
    # An empty reply would supervise nothing but the end-of-turn marker: no conversation
    # made only of those is worth a step.
    replies = [m for m in out if m["role"] == "assistant"]
    if not any(m["content"].strip() for m in replies):
        detail = (
            "no assistant turn (nothing to learn from)"
            if not replies
            else "no assistant reply with content "
            "(an empty reply teaches only the end-of-turn marker)"
        )
        return None, "no assistant reply with content", detail
    return out, "", ""


class SkipCounts:
    """The lines a JSONL reader skipped, by reason, with the first line of each: mixed into
    the pair and prompt files (their `skipped` Counter and `first` dict)."""

    skipped: Counter
    first: dict

    def skip(self, reason: str, line: int) -> None:
        self.skipped[reason] += 1
        self.first.setdefault(reason, line)

    def summary(self) -> str:
        """'skipped 3 lines: 2 missing key (first line 4), 1 chosen == rejected (line 9)'."""
        parts = [
            f"{n} {why} ({'first line' if n > 1 else 'line'} {self.first[why]})"
            for why, n in self.skipped.most_common()
        ]
        n = sum(self.skipped.values())
        return f"skipped {n:,} line{'' if n == 1 else 's'}: {', '.join(parts)}"


def count_reasons(counts: Counter) -> str:
    """'3 not valid JSON, 1 unknown role': skipped lines by reason, most frequent first."""
    return ", ".join(f"{n} {why}" for why, n in counts.most_common())


@dataclass
class ChatFile:
    """The examples of a data file (one format), each with its line number, and what was skipped."""

    path: Path
    examples: list[Example] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)  # lines[i]: the line examples[i] came from
    skipped: Counter = field(default_factory=Counter)  # reason -> lines skipped for it

    @property
    def kind(self) -> str | None:
        return self.examples[0].kind if self.examples else None

    @property
    def conversations(self) -> list[Conversation]:
        """The conversations of a {"messages"} file."""
        return [list(e.messages) for e in self.examples]

    @property
    def n_skipped(self) -> int:
        return sum(self.skipped.values())


_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # the JSON escape of half a UTF-16 pair


def _lone_surrogate(obj: Any) -> str | None:
    """The first lone surrogate in the strings of a JSON object (keys too), or None. JSON
    may escape one (`"\\ud800"`); it is no character, and no tokenizer takes it."""
    todo = [obj]
    while todo:
        x = todo.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as e:
                return x[e.start]
        elif isinstance(x, dict):
            todo += [*x.keys(), *x.values()]
        elif isinstance(x, list):
            todo += x
    return None


def json_lines(path: Path, hint: str):
    """(line number, object, "", "") for each JSON line of a data file, or (line number,
    None, reason, detail) for one that is not UTF-8 (a lone surrogate escape included) or
    not JSON; blank lines and lines starting with `#` are passed over, a BOM on the first
    line dropped. A file that cannot be opened, or a token file from `toy prep`, is an
    InputError naming it (`hint`: what the file should hold)."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        raise InputError(f"{path}: no such file; pass a JSONL file ({hint})")
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory; pass a JSONL file")
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})")
    with fh:
        # `toy prep`'s output where its input belongs. Peeked, not read and sought back: a
        # pipe (--data <(...)) cannot seek.
        if fh.peek(len(MAGIC))[: len(MAGIC)] == MAGIC:
            raise InputError(
                f"{path} is a token file from `toy prep`, not JSONL: give the JSONL file "
                "itself (a token file goes to --corpus or --val-corpus, with a recipe that "
                "takes a corpus: `toy train --help` lists them)"
            )
        # Read as bytes and decode per line: one corrupt line must not hide the others.
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                where = f"bad byte at column {e.start + 1}"
                yield lineno, None, "not UTF-8", f"not UTF-8 text ({where})"
                continue
            if lineno == 1:
                line = line.removeprefix("\ufeff")  # editors on Windows add a BOM
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                where = f"{e.msg} at column {e.colno}"
                yield lineno, None, "not valid JSON", f"not valid JSON ({where})"
            except RecursionError:
                yield lineno, None, "not valid JSON", "not valid JSON (nested too deeply)"
            else:
                bad = _lone_surrogate(obj) if _SURROGATE.search(line) else None
                if bad is None:
                    yield lineno, obj, "", ""
                else:
                    yield (
                        lineno,
                        None,
                        "lone surrogate escape",
                        f"\\u{ord(bad):04x} is half of a UTF-16 surrogate pair, no character; "
                        "escape the whole pair or write the character itself",
                    )


def read_chat_jsonl(
    path: str | Path, strict: bool = False, warn: Callable[[str], None] | None = None
) -> ChatFile:
    """Read conversations, keeping each one's line number.

    An invalid line is skipped and counted by reason; the first SHOW_SKIPPED are reported
    through `warn` (default: stderr) as `FILE:LINE: reason`, the rest in one summary line.
    With strict=True the first one raises InputError instead. A file whose first
    GIVE_UP_AFTER lines are all invalid is not chat JSONL: InputError at once.
    """
    warn = warn or _stderr
    path = Path(path)
    chat = ChatFile(path)
    first_bad = ""
    # Lines skipped before the first example are told only once one is found: a file with
    # none (a binary, another format) gets its one error line, not warnings before it.
    held: list[str] = []
    for lineno, obj, kind, detail in json_lines(path, SCHEMA_HINT):
        if obj is not None:
            ex, kind, detail = _check_line(obj)
            if ex is not None:
                if chat.examples and ex.kind != chat.kind:
                    raise InputError(
                        f"{path}:{lineno}: {FORMATS[ex.kind]}, in a file of "
                        f"{FORMATS[chat.kind].removeprefix('a ')}s "
                        f"(from line {chat.lines[0]}); one format per file: split the file"
                    )
                chat.examples.append(ex)
                chat.lines.append(lineno)
                for line in held:
                    warn(line)
                held.clear()
                continue
            if kind == PREFERENCE and not chat.examples:
                raise InputError(
                    f"{path}:{lineno}: {detail}; train on preference pairs with --recipe dpo "
                    "or --recipe orpo (supervised fine-tuning takes conversations, "
                    "prompt/completion pairs or text)"
                )
        if strict:
            raise InputError(
                f"{path}:{lineno}: {detail}; "
                f"{SCHEMA_HINT} (strict mode stops at the first bad line)"
            )
        chat.skipped[kind] += 1
        first_bad = first_bad or f"line {lineno}: {detail}"
        if chat.n_skipped <= SHOW_SKIPPED:
            (warn if chat.examples else held.append)(f"{path}:{lineno}: {detail}; line skipped")
        if chat.n_skipped >= GIVE_UP_AFTER and not chat.examples:
            raise InputError(
                f"{path} does not look like training JSONL: none of its first {GIVE_UP_AFTER} "
                f"lines is an example ({first_bad}); {SCHEMA_HINT}"
            )
    if not chat.examples:
        what = (
            f"{plural(chat.n_skipped, 'line')} skipped: {count_reasons(chat.skipped)}"
            if chat.skipped
            else "it holds only blank lines and comments"
        )
        raise InputError(f"no example to learn from in {path} ({what}); {SCHEMA_HINT}")
    if chat.n_skipped > SHOW_SKIPPED:
        warn(
            f"{path}: ... and {chat.n_skipped - SHOW_SKIPPED} more invalid lines "
            f"({count_reasons(chat.skipped)} in all); lines skipped"
        )
    return chat


# --------------------------------------------------------------------------- encoding

CUT_MARGIN = 64  # tokens past the window a cut text still holds: the cut changes only its last ones
_LONGEST: dict[int, tuple[Tokenizer, int]] = {}


def window_chars(tok: Tokenizer, max_len: int) -> int:
    """How many characters of one string can matter to a window of max_len tokens: a token
    covers at most as many characters as its vocabulary entry has (byte-level entries are
    one character a byte), so max_len + CUT_MARGIN tokens of the longest entry, twice over
    (a normalizer may fold two characters into one). Text past that is cut before it is
    tokenized: a 20 MB line tokenized whole held 3.2 GB for a 64-token window."""
    hit = _LONGEST.get(id(tok))
    if hit is None or hit[0] is not tok:
        longest = max((len(t) for t in tok.get_vocab(with_added_tokens=True)), default=1)
        hit = _LONGEST[id(tok)] = (tok, max(longest, 1))
    return 2 * (max_len + CUT_MARGIN) * hit[1]


def cut_to_window(ex: Example, chars: int) -> tuple[Example, int]:
    """`ex` with each of its strings (text, prompt, completion, a message's content) cut to
    `chars` characters (window_chars), and how many were cut. What a window of the
    example's tokens holds is unchanged: each cut string still has more tokens than the
    window, so everything after it lies past the window too."""
    cut = 0

    def fit(x: str) -> str:
        nonlocal cut
        if len(x) <= chars:
            return x
        cut += 1
        return x[:chars]

    if ex.kind == "messages":
        msgs = tuple({**m, "content": fit(m["content"])} for m in ex.messages)
        ex = replace(ex, messages=msgs) if cut else ex
    elif ex.kind == "prompt":
        p, c = fit(ex.prompt), fit(ex.completion)
        ex = replace(ex, prompt=p, completion=c) if cut else ex
    else:
        t = fit(ex.text)
        ex = replace(ex, text=t) if cut else ex
    return ex, cut


def _assistant_char_spans(
    template: str,
    messages: Sequence[Message],
    bos_token: str,
    eos_token: str,
    tools: list | None = None,
    chars: int | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the [start, end) character spans to supervise (those that
    start within `chars` characters, when given: the rest lie past the window)."""
    full = render_template(template, messages, False, bos_token, eos_token, tools)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render_template(template, messages[:i], True, bos_token, eos_token, tools)
        if chars is not None and len(prompt) > chars:
            break
        upto = render_template(template, messages[: i + 1], False, bos_token, eos_token, tools)
        if not upto.startswith(prompt) or not full.startswith(upto):
            raise ConversationError(
                f"chat template is not prefix-stable at message {i} (assistant): rendering the "
                "conversation up to a turn must be a prefix of rendering the whole of it, so the "
                "assistant spans cannot be found; "
                "use a template that renders earlier turns the same way whatever follows"
            )
        start, end = len(prompt), len(upto)
        # Drop whitespace after the end-of-turn marker (template glue, see module doc),
        # unless there is no marker at all: then the whitespace is the reply's own.
        reply = upto[start:end].rstrip()
        content = m["content"].rstrip()
        has_marker = not content or not reply.endswith(content)
        if has_marker:
            end = start + len(reply)
        spans.append((start, end))
    return full, spans


def encode_chat(
    tok: Tokenizer,
    template: str,
    messages: Sequence[Message],
    max_len: int,
    bos_token: str,
    eos_token: str,
    tools: list | None = None,
    chars: int | None = None,
) -> tuple[list[int], list[int]]:
    """Render and tokenize one conversation; returns (ids, mask), truncated to max_len.
    `chars` (window_chars): the rendering is cut to that many characters before it is
    tokenized, as what lies past them lies past the window.

    mask[t] == 1 iff ids[t] is a supervised target (see the module doc). Special tokens
    come from the template, and the BOS the tokenizer's rules ask for (a GGUF's
    add_bos_token) only when the template did not write it (`encode_prompt`, as `toy
    infer --chat` encodes): never a second BOS. The mask may be all zero after
    truncation (a long prompt); the caller decides whether to skip it.
    """
    if max_len < 1:
        raise UsageError(f"--seq-len must be >= 1, got {max_len}")
    text, spans = _assistant_char_spans(template, messages, bos_token, eos_token, tools, chars)
    enc = tok.encode(text if chars is None else text[:chars], add_special_tokens=False)
    ids = list(enc.ids)
    head = encode_prompt(tok, "")  # the BOS the rules ask for ([] when none)
    head = head if ids[: len(head)] != head else []
    mask = [0] * len(ids)
    # Offsets are sorted; walk tokens and spans together.
    k = 0
    for t, (s, e) in enumerate(enc.offsets):
        while k < len(spans) and spans[k][1] <= s:
            k += 1
        if k == len(spans):
            break
        a, b = spans[k]
        if s < b and e > a:  # the token's characters overlap the supervised span
            mask[t] = 1
    return (head + ids)[:max_len], ([0] * len(head) + mask)[:max_len]


def encode_example(
    tok: Tokenizer,
    template: str | None,
    ex: Example,
    max_len: int,
    bos_token: str,
    eos_token: str,
    eos_id: int | None,
    cut: list[tuple[int, int]] | None = None,
) -> tuple[list[int], list[int]]:
    """(ids, mask) of one example, truncated to max_len; raw text starts with the BOS the
    tokenizer's rules ask for (`encode_prompt`, as `toy infer --prompt`), `eos_id` ends a
    document.

    - messages: every assistant turn supervised (encode_chat), `tools` shown to the template;
    - prompt/completion: one user/assistant exchange through the template where the model
      has one (the completion and its end-of-turn supervised); else the two texts joined,
      the completion and EOS supervised;
    - text: every token supervised (but the first, which nothing predicts), EOS appended.

    A string longer than a window can use is cut first (cut_to_window), so one huge line
    costs memory by the window, not by its size; `cut` gets (the number of strings cut,
    the characters each kept) when there are any."""
    chars = window_chars(tok, max_len)
    ex, n = cut_to_window(ex, chars)
    if n and cut is not None:
        cut.append((n, chars))
    if ex.kind == "messages":
        return encode_chat(
            tok, template, ex.messages, max_len, bos_token, eos_token, ex.tools, chars
        )
    tail = [eos_id] if eos_id is not None else []
    if ex.kind == "prompt":
        if template is not None:
            turns = [
                {"role": "user", "content": ex.prompt},
                {"role": "assistant", "content": ex.completion},
            ]
            return encode_chat(tok, template, turns, max_len, bos_token, eos_token, None, chars)
        p = encode_prompt(tok, ex.prompt)
        c = tok.encode(ex.completion, add_special_tokens=False).ids + tail
        return (p + c)[:max_len], ([0] * len(p) + [1] * len(c))[:max_len]
    ids = encode_prompt(tok, ex.text) + tail
    return ids[:max_len], ([0] + [1] * (len(ids) - 1))[:max_len]


# --------------------------------------------------------------------------- batching


def length_batches(
    lengths: Sequence[int], budget: int, seed: int, epoch: int, width: int = 16
) -> list[list[int]]:
    """One epoch's batches (lists of sample indices) of conversations of similar length,
    each holding at most `budget` tokens once right-padded to its longest member.

    This is what toy feeds a chat fine-tune instead of packed rows: a batch is padded
    only to its own longest member, so it wastes about as little as packing, and as no
    row holds two conversations, attention needs no block mask and stays plain causal
    (the fast kernel, and only each conversation's own length squared of work).

    Samples go to buckets by length rounded up to `width`; walking the buckets from the
    shortest, a batch takes budget // ceiling samples, and what is left of a bucket joins
    the next one. The number of batches is therefore the same in every epoch; which
    samples share a batch, and the order of the batches, are drawn from (seed, epoch).
    """
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    rng = np.random.default_rng([seed, epoch, 11])
    buckets: dict[int, list[int]] = {}
    for i in rng.permutation(len(lengths)).tolist():
        buckets.setdefault(-(-int(lengths[i]) // width) * width, []).append(i)
    batches: list[list[int]] = []
    pending: list[int] = []
    for ceiling in sorted(buckets):
        pending += buckets[ceiling]  # leftovers from shorter buckets fit this ceiling too
        cap = max(1, budget // ceiling)
        while len(pending) >= cap:
            batches.append(pending[:cap])
            pending = pending[cap:]
    if pending:
        batches.append(pending)
    return [batches[j] for j in rng.permutation(len(batches)).tolist()]


def spread_sample(n: int, k: int) -> list[int]:
    """k of the positions 0..n-1 (all of them when k >= n), evenly spread: the middle
    one of each of k equal slices. Applied to batches sorted by length, a small sample
    still covers short and long conversations alike."""
    if k >= n:
        return list(range(n))
    return [(2 * i + 1) * n // (2 * k) for i in range(k)]


def pad_batch(
    samples: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int, seq_len: int | None = None
) -> dict[str, torch.Tensor]:
    """Right-pad samples to a common length (the longest, or seq_len: longer samples
    are truncated). Returns ids and mask, int64 (B, T); mask is 0 on padding.

    Right padding needs no attention mask: with causal attention a real token never
    sees the padding after it, and padding positions are never targets.
    """
    import torch  # here: `toy prep` and `toy new` read chat files without torch (~1 s)

    if not samples:
        raise ValueError("pad_batch needs at least one sample")
    T = seq_len if seq_len is not None else max(len(ids) for ids, _ in samples)
    ids_out = torch.full((len(samples), T), pad_id, dtype=torch.long)
    mask_out = torch.zeros((len(samples), T), dtype=torch.long)
    for b, (ids, mask) in enumerate(samples):
        n = min(len(ids), T)
        ids_out[b, :n] = torch.tensor(list(ids[:n]), dtype=torch.long)
        mask_out[b, :n] = torch.tensor(list(mask[:n]), dtype=torch.long)
    return {"ids": ids_out, "mask": mask_out}


def to_batch(
    samples: list[tuple[list[int], list[int]]],
    pad: int,
    bucket: int = 1,
    seq_len: int | None = None,
) -> dict[str, torch.Tensor]:
    """Right-pad samples to their longest; shift: position t predicts token t+1, a
    target where mask[t+1] says so. Padding comes after every real token, so plain
    causal attention keeps each conversation to itself.

    `bucket` > 1 (under --compile) pads the length up to a multiple of it (at most
    seq_len), so the compiled blocks meet a handful of shapes instead of one per batch:
    each new shape is a recompile, and past dynamo's limit it silently runs eagerly."""
    import torch  # here, as in pad_batch

    longest = max(len(ids) for ids, _ in samples)
    width = None
    if bucket > 1:
        width = -(-(longest - 1) // bucket) * bucket + 1  # inputs are width - 1 long
        if seq_len is not None:
            width = min(width, max(longest, seq_len + 1))
    b = pad_batch(samples, pad, width)  # ids, mask: (n, L)
    ids, mask = b["ids"], b["mask"]
    targets = torch.where(mask[:, 1:] > 0, ids[:, 1:], torch.full_like(ids[:, 1:], IGNORE_INDEX))
    return {"ids": ids[:, :-1], "targets": targets}


class ChatBatches:
    """Length-grouped batches of encoded conversations (`samples`: (ids, mask) pairs), as
    `Windows` gives token windows: batch k of the run is a pure function of (seed, k), and
    each of `world` processes takes its own batches. A batch holds about `budget` tokens
    once padded (length_batches); `eval_batches(n)` is a fixed, length-spread sample."""

    def __init__(
        self,
        samples: list[tuple[list[int], list[int]]],
        budget: int,
        seed: int,
        pad: int,
        seq_len: int | None = None,
        bucket: int = 1,
        world: int = 1,
        rank: int = 0,
    ):
        self.samples, self.budget, self.seed, self.pad = samples, budget, seed, pad
        self.seq_len, self.bucket, self.world, self.rank = seq_len, bucket, world, rank
        self.lengths = [len(ids) for ids, _ in samples]
        self._epochs = {0: length_batches(self.lengths, budget, seed, 0)}
        self.n = len(self._epochs[0])  # the same count every epoch

    def __len__(self) -> int:
        return self.n

    def make(self, members: list[int]) -> dict[str, torch.Tensor]:
        """The batch of samples `members`, one a row in their order."""
        return to_batch([self.samples[j] for j in members], self.pad, self.bucket, self.seq_len)

    def members(self, k: int) -> list[int]:
        """The samples of this rank's share of global micro-batch k, in their rows' order.
        Batch j of the run is batch j % n of epoch j // n."""
        epoch, i = divmod(k * self.world + self.rank, self.n)
        if epoch not in self._epochs:
            self._epochs.clear()
            self._epochs[epoch] = length_batches(self.lengths, self.budget, self.seed, epoch)
        return self._epochs[epoch][i]

    def batch(self, k: int) -> dict[str, torch.Tensor]:
        """Global micro-batch k is `world` batches; this rank takes its own."""
        return self.make(self.members(k))

    def partition(self) -> list[list[int]]:
        """Epoch 0's batches: every sample once."""
        return self._epochs.get(0) or length_batches(self.lengths, self.budget, self.seed, 0)

    def eval_batches(self, n: int) -> list[dict[str, torch.Tensor]]:
        """Epoch 0's batches, or n of them spread over the lengths (the batches sorted by
        their longest member), kept in their order: the same sample every evaluation."""
        batches = self._epochs.get(0) or length_batches(self.lengths, self.budget, self.seed, 0)
        if len(batches) > n:
            longest = [max(self.lengths[j] for j in b) for b in batches]
            by_length = sorted(range(len(batches)), key=lambda b: (longest[b], b))
            batches = [
                batches[b] for b in sorted(by_length[i] for i in spread_sample(len(batches), n))
            ]
        return [self.make(b) for b in batches]


# --------------------------------------------------------------------------- encoding a file


def encode_all(items, path, source, encode, strict, warn) -> tuple[list, int, int]:
    """Encode the (line, messages) items read from `path`; returns (samples, the number
    dropped because their prompt fills --seq-len, the number the template cannot render).
    `source` names where the template came from (the GGUF, or --chat-template FILE).

    A conversation the template cannot render (ConversationError: it calls
    raise_exception, fails on it, or is not prefix-stable for it) is skipped, counted and
    warned with its line, as an invalid line is; with --strict it is fatal. If none
    renders, the template is the problem, not the data: one error, no warnings. A fault
    of the template itself (syntax, sandbox) stops at once."""
    samples, dropped, failed = [], 0, []
    for line, messages in items:
        try:
            ids, mask = encode(messages)
        except ConversationError as e:
            if strict:
                raise InputError(
                    f"{path}:{line}: {e.message} (--strict stops at the first conversation the "
                    "chat template cannot render)"
                )
            failed.append((line, e.message))
            if len(failed) == GIVE_UP_AFTER and not samples and not dropped:
                break  # the template rejects everything: the first reason says why
            continue
        except (
            InputError
        ) as e:  # the template's own fault (syntax, sandbox, a limit): every conversation fails
            raise InputError(f"{source}: {e.message}")
        if sum(mask) == 0:
            dropped += 1  # the prompt alone fills --seq-len: nothing left to supervise
            continue
        samples.append((ids, mask))
    if failed and not samples and not dropped:
        line, why = failed[0]
        tried = f"the first {len(failed)}" if len(failed) < len(items) else f"all {len(failed)}"
        raise InputError(
            f"{source}: the chat template renders none of {tried} conversations in {path} "
            f"(line {line}: {why}); use a model whose template fits this data, or fix the data"
        )
    for line, why in failed[:SHOW_SKIPPED]:
        warn(f"{path}:{line}: {why}; conversation skipped")
    if len(failed) > SHOW_SKIPPED:
        warn(
            f"{path}: ... and {len(failed) - SHOW_SKIPPED} more conversations the chat template "
            "cannot render; skipped"
        )
    return samples, dropped, len(failed)


# --------------------------------------------------------------------------- built-in templates

# For GGUF files that carry no tokenizer.chat_template (gemma-3-270m has none): the
# formats their families were trained on, used only when the vocabulary has the turn
# markers. Content is a plain string here (toy's chat JSONL), so these are the official
# templates without their multimodal branches.
BUILTIN_TEMPLATES = {
    "chatml": (
        "{%- for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
    # Gemma: roles user/model; a system message becomes the head of the first user turn.
    "gemma": (
        "{{ bos_token }}"
        "{%- if messages[0]['role'] == 'system' -%}"
        "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
        "{%- set loop_messages = messages[1:] -%}"
        "{%- else -%}{%- set first_user_prefix = '' -%}"
        "{%- set loop_messages = messages -%}{%- endif -%}"
        "{%- for message in loop_messages -%}"
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
        "{{ raise_exception("
        "'Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{%- endif -%}"
        "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
        "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
        "{{ message['content'] | trim }}"
        "{{ '<end_of_turn>\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
    ),
}
# The tokens a vocabulary must have for a built-in template to make sense.
_TEMPLATE_MARKERS = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "gemma": ("<start_of_turn>", "<end_of_turn>"),
}


def resolve_chat_template(
    file_template: str | None,
    tokens: Sequence[str],
    family_format: str | None,
    override: str | Path | None,
    source: str,
) -> tuple[str, str | None]:
    """(template, note): `override` (--chat-template FILE.jinja) if given, else the
    GGUF's own template, else the built-in one of the model's family when its vocabulary
    has that format's turn markers (with a note saying so). InputError when none fits."""
    if override:
        path = Path(override)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise InputError(
                f"--chat-template {path}: no such file; give a jinja chat template file"
            )
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"--chat-template {path}: cannot read it as UTF-8 text ({e})")
        _compile_checked(text, f"--chat-template {path}")
        return text, f"chat template from {path} (--chat-template)"
    if file_template:
        return file_template, None
    vocab = set(tokens)
    candidates = [family_format] if family_format else []
    candidates += [k for k in _TEMPLATE_MARKERS if k not in candidates]
    for name in candidates:
        if all(m in vocab for m in _TEMPLATE_MARKERS[name]):
            return BUILTIN_TEMPLATES[name], (
                f"{source} has no chat template; using toy's built-in {name} template "
                "(its vocabulary has the turn markers); --chat-template FILE.jinja "
                "overrides"
            )
    raise InputError(
        f"{source}: has no chat template (tokenizer.chat_template) and its vocabulary has no known "
        "turn markers; pass --chat-template FILE.jinja, or train on a token file with --corpus"
    )


def _compile_checked(template: str, where: str) -> None:
    try:
        _compile(template)
    except TemplateSyntaxError as e:
        raise InputError(f"{where}: line {e.lineno}: syntax error: {_one_line(e)}")
    except TemplateError as e:
        raise InputError(f"{where}: does not compile: {_one_line(e)}")
    except InputError as e:  # a limit (nesting)
        raise InputError(f"{where}: {e.message}")
