"""A jinja2 sandbox that also bounds what one render may take: a chat template comes
from a downloaded file and is untrusted input.

jinja2's `ImmutableSandboxedEnvironment` keeps a template from Python's internals and
from modifying its inputs, and caps `range()`; it does not stop `{{ 'x' * 300000000 }}`
(1.46 GB) or loops that never end. `BoundedSandbox` adds, for each render
(`render_bounded`):

- size: every value the template makes, and the rendered text, is at most `limit`
  characters: MAX_TEMPLATE_CHARS, or TEMPLATE_INPUT_FACTOR times the conversation's own
  text when that is more (a long conversation is not an attack). Checked BEFORE the
  value is made wherever its size follows from the operands (`*`, `+`, `%`, `**`, `~`,
  string methods and filters that pad, repeat, join or replace, `str.format` and
  `%`-format widths), after it otherwise (every call, method, macro and filter result;
  each printed value; the text of macros and blocks). A list counts its members, so
  `[s, s, s]` of one long `s` cannot hide its printed size behind shared references.
- work: all the values of one render together: MAX_TEMPLATE_WORK times `limit` (many
  values each under the limit, e.g. one per item of a long generator). A lazy filter
  result (map, select, batch ...) counts its items as they are drawn, all of them
  together at most `limit`: whatever draws them may keep them.
- integers: MAX_TEMPLATE_INT_BITS bits (`2 ** 10**9` would compute for hours).
- time: MAX_TEMPLATE_SECONDS. The clock is checked at the start of every block body the
  template runs (each loop iteration, each macro call, each `if` branch: compiled in, see
  _CodeGenerator) and in every hook above, so loops with no output and no calls stop too.
  Inside one call (a filter such as wordwrap or urlize over a few megabytes runs for
  minutes in Python), a timer (SIGALRM, in the main thread of a POSIX process: toy's
  CLI) ends the render at the deadline; a call in C over values the size limit holds
  (str methods, json, re-free joins) takes milliseconds, except a sort, which the timer
  cannot interrupt: sort, dictsort and groupby order at most MAX_TEMPLATE_SORT_ITEMS.
- nesting (`compile_bounded`, before jinja2 compiles): brackets nested more than
  MAX_TEMPLATE_NESTING deep in the token stream, or a parsed tree deeper than
  MAX_TEMPLATE_TREE_DEPTH (`1+1+...`, `x|f|f|...`, blocks in blocks): jinja2's parser and
  code generator recurse once per level and Python's compiler nests 100 blocks at most;
  a RecursionError there would be a traceback.

Past a bound: TemplateLimitError (an InputError: exit 2), the template's fault whatever
the conversation. A normal template renders the same text as in plain jinja2.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import signal
import string
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.runtime import Namespace
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum

from toy.errors import InputError

MAX_TEMPLATE_CHARS = (
    4_000_000  # one value, and the rendered text (or TEMPLATE_INPUT_FACTOR x the conversation)
)
TEMPLATE_INPUT_FACTOR = 4
MAX_TEMPLATE_WORK = 8  # all values of one render together: this many times the size limit
MAX_TEMPLATE_INT_BITS = 1 << 16  # about 19,700 decimal digits
MAX_TEMPLATE_SECONDS = (
    2.0  # one render (one conversation renders 1 + 2 x its assistant turns times)
)
MAX_TEMPLATE_DEPTH = 100  # lists and dicts nested in one value
MAX_TEMPLATE_NESTING = 32  # brackets nested in the source (real templates: 0 to 3)
MAX_TEMPLATE_TREE_DEPTH = 64  # the parsed template's depth (real templates: 8 to 21)
# Items one sort may order: sort, dictsort and groupby order their input in one C call the
# render's clock cannot interrupt (4M characters took 6.6 s); 100,000 take milliseconds.
MAX_TEMPLATE_SORT_ITEMS = 100_000
SORTING_FILTERS = frozenset({"sort", "dictsort", "groupby"})

FIX = (
    "a chat template is untrusted input: fix this one, "
    "or use another (toy train --chat-template FILE.jinja)"
)


class TemplateLimitError(InputError):
    """A render went past one of toy's bounds: the template's fault, for any conversation."""


class _Budget:
    """What one render may still take."""

    def __init__(self, limit: float, seconds: float, work: float, memo: bool = True):
        self.limit = limit
        self.work_left = work
        self.deadline = time.monotonic() + seconds
        self.expired = False
        # id -> (object, size) of long lists and dicts already measured: the sandbox keeps
        # them from changing, and `messages` is measured at every call it is passed to.
        self.memo: dict[int, tuple[Any, int]] | None = {} if memo else None

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            self.expire()

    def expire(self) -> None:
        self.expired = True
        raise TemplateLimitError(
            f"chat template ran past toy's limit of {MAX_TEMPLATE_SECONDS:g} s for one "
            f"conversation (MAX_TEMPLATE_SECONDS: a loop, a recursion or one call too long); {FIX}"
        )

    def check(self, size: int, what: str) -> None:
        if size > self.limit:
            raise TemplateLimitError(
                f"chat template exceeds toy's limit: {what} would make more than the "
                f"{self.limit:,} characters a value may have ({_count(size)} by toy's count; "
                f"MAX_TEMPLATE_CHARS); {FIX}"
            )

    def spend(self, size: int, what: str) -> None:
        self.work_left -= size
        if self.work_left < 0:
            raise TemplateLimitError(
                f"chat template exceeds toy's limit: the values it makes for one conversation "
                f"come to more than {MAX_TEMPLATE_WORK} x {self.limit:,} characters "
                f"(MAX_TEMPLATE_WORK; the last: {what}); {FIX}"
            )


def _count(n: int) -> str:
    return f"{n:,}" if n < 10**15 else "more than 10^15"


# Outside a render (jinja2 folds constant expressions when it compiles; filters refuse to
# run then, see bounded_filter): sizes only.
_OUTSIDE = _Budget(MAX_TEMPLATE_CHARS, math.inf, math.inf, memo=False)
_local = threading.local()


def _budget() -> _Budget:
    return getattr(_local, "budget", None) or _OUTSIDE


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int(x: Any) -> int:
    """x if it is an int (a width, a count), else 0: the call then fails on its own."""
    return x if _is_int(x) else 0


# --------------------------------------------------------------------------- sizes

_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))


# What a list or dict member counts for besides its own size: its slot, and its separator when
# printed.
MEMBER = 8


def size_of(x: Any, cap: float | None = None) -> int:
    """About how many characters `str(x)` takes, and about the bytes `x` holds, counted
    only until it passes `cap` (the current limit): a string its length, an integer its
    digits, a float 24, another object 64 (its repr), a list, tuple, set or dict its
    members, each MEMBER more (shared ones each time they appear: that is what printing
    them costs)."""
    b = _budget()
    if isinstance(x, str):
        return len(x)
    return _size(x, b.limit if cap is None else cap, 0, b.memo)[0]


def _size(x: Any, cap: float, depth: int, memo: dict | None) -> tuple[int, bool]:
    """(size, whether it holds a Namespace: `{% set ns.x = ... %}` changes one, so such
    a value is measured again each time)."""
    if isinstance(x, (str, bytes, bytearray)):
        return len(x), False
    if _is_int(x):
        return x.bit_length() // 3 + 1, False
    if isinstance(x, (float, bool)) or x is None:
        return 24, False
    volatile = isinstance(x, Namespace)
    if volatile:
        try:
            members = [v for kv in x._Namespace__attrs.items() for v in kv]  # type: ignore[attr-defined]
        except AttributeError:
            return 1, True
    elif isinstance(x, dict):
        members = [v for kv in x.items() for v in kv]
    elif isinstance(x, (list, tuple, set, frozenset, *_VIEWS)):
        members = x
    else:
        return 64, False
    keep = memo is not None and not volatile and isinstance(x, (list, tuple, dict)) and len(x) >= 32
    if keep:
        hit = memo.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1], False
    if depth >= MAX_TEMPLATE_DEPTH:
        raise TemplateLimitError(
            f"chat template exceeds toy's limit: a value nested more than {MAX_TEMPLATE_DEPTH} "
            f"deep (MAX_TEMPLATE_DEPTH); {FIX}"
        )
    total = 0
    for m in members:
        n, v = _size(m, cap - total, depth + 1, memo)
        total, volatile = total + MEMBER + n, volatile or v
        if total > cap:
            return total, volatile
    if keep and not volatile:
        memo[id(x)] = (x, total)  # complete (under the cap), and it cannot change
    return total, volatile


def _shape(x: Any, depth: int = 0) -> tuple[int, int]:
    """(members, depth) of a value, for the lines and indentation of its JSON."""
    if isinstance(x, dict):
        x = list(x.values())
    elif not isinstance(x, (list, tuple)):
        return 1, depth
    if depth >= MAX_TEMPLATE_DEPTH:
        return len(x), depth
    n, d = 1, depth + 1
    for m in x:
        mn, md = _shape(m, depth + 1)
        n, d = n + mn, max(d, md)
    return n, d


def _digits(g: str) -> int:
    return int(g) if len(g) <= 12 else 10**13


_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.?)", re.S)


def printf_size(fmt: str, args: Any) -> int:
    """An upper bound of `fmt % args`: its own length, each field's width and precision
    (`*` ones from the arguments) and the arguments (4x under %r/%a: `\\x00` escapes)."""
    ints = [abs(v) for v in (args if isinstance(args, tuple) else (args,)) if _is_int(v)]
    total, escapes = len(fmt), False
    for m in _PRINTF.finditer(fmt):
        for g in m.group(1, 2):
            total += max(ints, default=0) if g == "*" else _digits(g) if g else 0
        escapes = escapes or m.group(3) in ("r", "a")
    return total + size_of(args) * (4 if escapes else 1)


_SPEC_DIGITS = re.compile(r"\d+")


def format_size(fmt: str, values: list[Any]) -> int:
    """An upper bound of `fmt.format(...)`: each replacement field takes at most the
    largest argument (4x under !r/!a) plus the widths in its format spec (a nested
    `{}` width: the largest integer argument)."""
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return len(fmt)  # malformed: str.format raises on it by itself
    biggest = max((size_of(v) for v in values), default=0)
    ints = max((abs(v) for v in values if _is_int(v)), default=0)
    total = len(fmt)
    for _, field, spec, conversion in fields:
        if field is None:
            continue
        total += biggest * (4 if conversion in ("r", "a") else 1)
        if spec:
            total += sum(_digits(g) for g in _SPEC_DIGITS.findall(spec)) + (
                ints if "{" in spec else 0
            )
    return total


def _replace_size(s: Any, old: Any, new: Any, count: Any = -1) -> int:
    if not isinstance(s, str) or not isinstance(old, str) or not isinstance(new, str):
        return size_of(s) + size_of(new)
    times = len(s) + 1 if not old else len(s) // len(old)
    if _is_int(count) and count >= 0:
        times = min(times, count)
    return len(s) + times * len(new)


def _take(items: Any, each: int, what: str) -> tuple[list, int]:
    """A joined iterable as a list, refused as soon as its members (plus `each` for a
    separator) pass the limit: a generator is never drawn further than that."""
    b = _budget()
    out, total = [], 0
    for x in items:
        total += size_of(x) + each
        b.check(total, what)
        out.append(x)
    return out, total


# --------------------------------------------------------------------------- operators


def binop_size(op: str, a: Any, b: Any) -> int:
    """An upper bound of the size of `a op b`, computed before it is made."""
    if _is_int(a) and _is_int(b):
        if op == "*":
            bits = a.bit_length() + b.bit_length()
        elif op == "**":
            bits = 64 if b < 0 or abs(a) <= 1 else a.bit_length() * b
        elif op == "+":
            bits = max(a.bit_length(), b.bit_length()) + 1
        else:
            bits = b.bit_length()
        if bits > MAX_TEMPLATE_INT_BITS:
            raise TemplateLimitError(
                f"chat template exceeds toy's limit: '{op}' would make an integer of "
                f"{_count(bits)} bits, over the {MAX_TEMPLATE_INT_BITS:,} allowed "
                f"(MAX_TEMPLATE_INT_BITS); {FIX}"
            )
        return bits // 3 + 1
    seqs = (str, bytes, list, tuple)
    if op == "*":
        if isinstance(a, seqs) and isinstance(b, int):
            return size_of(a) * max(int(b), 0)
        if isinstance(b, seqs) and isinstance(a, int):
            return size_of(b) * max(int(a), 0)
    elif op == "+" and isinstance(a, seqs) and isinstance(b, seqs):
        return size_of(a) + size_of(b)
    elif op == "%" and isinstance(a, str):
        return printf_size(a, b)
    return 1  # numbers; Python raises OverflowError for a float too large by itself


# --------------------------------------------------------------------------- calls


def _str_method_size(obj: Any, args: tuple, kwargs: dict) -> tuple[int, tuple]:
    """(an upper bound of the result, the arguments to call with) for the str methods
    whose result can outgrow their string: padding, tab expansion, replace, join,
    translate. (str.format is bounded where it is looked up: wrap_str_format.)"""
    s, name = obj.__self__, obj.__name__
    n = len(s)
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(n, _int(args[0] if args else kwargs.get("width"))), args
    if name == "expandtabs":
        tab = _int(args[0] if args else kwargs.get("tabsize", 8))
        return n + s.count("\t") * max(tab, 1), args
    if name == "replace" and len(args) >= 2:
        return _replace_size(
            s, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1)
        ), args
    if name == "join" and args:
        items, total = _take(args[0], n, "str.join")
        return total, (items, *args[1:])
    if name == "translate" and args and isinstance(args[0], dict):
        return n * max([size_of(v) for v in args[0].values()] + [1]), args
    return n, args


def call_size(obj: Any, args: tuple, kwargs: dict) -> tuple[int, tuple]:
    if isinstance(getattr(obj, "__self__", None), str) and isinstance(obj, type("".join)):
        return _str_method_size(obj, args, kwargs)
    if obj is generate_lorem_ipsum:  # the `lipsum` global: n paragraphs of up to `max` words
        n = _int(args[0] if args else kwargs.get("n", 5))
        words = _int(args[3] if len(args) > 3 else kwargs.get("max", 100))
        return n * words * 16, args
    return 0, args


# --------------------------------------------------------------------------- filters


def _center(value: Any, width: Any = 80) -> tuple[int, tuple]:
    return max(size_of(value), _int(width)), (value, width)


def _indent(s: Any, width: Any = 4, first: Any = False, blank: Any = False) -> tuple[int, tuple]:
    w = len(width) if isinstance(width, str) else _int(width)
    lines = s.count("\n") + 1 if isinstance(s, str) else size_of(s)
    return size_of(s) + (lines + 1) * w, (s, width, first, blank)


def _format(value: Any, *args: Any, **kwargs: Any) -> tuple[int, tuple]:
    fmt = value if isinstance(value, str) else ""
    return size_of(value) + printf_size(fmt, kwargs or args), (value, *args)


def _join(value: Any, d: Any = "", attribute: Any = None) -> tuple[int, tuple]:
    items, total = _take(value, len(d) if isinstance(d, str) else 1, "the join filter")
    return total, (items, d, attribute)


def _replace(s: Any, old: Any, new: Any, count: Any = None) -> tuple[int, tuple]:
    return _replace_size(s, old, new, -1 if count is None else count), (s, old, new, count)


def _batch(value: Any, linecount: Any, fill_with: Any = None) -> tuple[int, tuple]:
    fill = 0 if fill_with is None else size_of(fill_with)
    return _int(linecount) * fill, (value, linecount, fill_with)


def _slice(value: Any, slices: Any, fill_with: Any = None) -> tuple[int, tuple]:
    return _int(slices) * (1 + (0 if fill_with is None else size_of(fill_with))), (
        value,
        slices,
        fill_with,
    )


def _sum(iterable: Any, attribute: Any = None, start: Any = 0) -> tuple[int, tuple]:
    if not isinstance(start, (str, list, tuple)):
        return 1, (iterable, attribute, start)
    # Adding sequences copies the sum so far at each step: the work is quadratic.
    items, total = _take(iterable, 0, "the sum filter")
    _budget().spend(len(items) * total // 2, "the sum filter")
    return total + size_of(start), (items, attribute, start)


def _wordwrap(
    s: Any,
    width: Any = 79,
    break_long_words: Any = True,
    wrapstring: Any = None,
    break_on_hyphens: Any = True,
) -> tuple[int, tuple]:
    n = size_of(s)
    sep = len(wrapstring) if isinstance(wrapstring, str) else 1
    return n + (n // max(_int(width), 1) + 1) * sep, (
        s,
        width,
        break_long_words,
        wrapstring,
        break_on_hyphens,
    )


def _urlize(
    value: Any,
    trim_url_limit: Any = None,
    nofollow: Any = False,
    target: Any = None,
    rel: Any = None,
    extra_schemes: Any = None,
) -> tuple[int, tuple]:
    n = size_of(value)
    extra = sum(len(x) for x in (target, rel) if isinstance(x, str))
    return 2 * n + (n // 4 + 1) * extra, (
        value,
        trim_url_limit,
        nofollow,
        target,
        rel,
        extra_schemes,
    )


def _tojson(
    x: Any,
    ensure_ascii: Any = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: Any = False,
) -> tuple[int, tuple]:
    w = len(indent) if isinstance(indent, str) else _int(indent)
    members, depth = _shape(x)
    return size_of(x) + members * (w * depth + 3), (x, ensure_ascii, indent, separators, sort_keys)


# Filters whose result can outgrow their input, by name (jinja2's and toy's tojson): an
# upper bound of the result from the filter's own arguments, before it runs.
FILTER_SIZES: dict[str, Callable[..., tuple[int, tuple]]] = {
    "center": _center,
    "indent": _indent,
    "format": _format,
    "join": _join,
    "replace": _replace,
    "batch": _batch,
    "slice": _slice,
    "sum": _sum,
    "wordwrap": _wordwrap,
    "urlize": _urlize,
    "tojson": _tojson,
}


def bounded_filter(name: str, f: Callable) -> Callable:
    """`f` with its inputs, its result (bounded in advance where FILTER_SIZES knows how)
    and the clock checked. jinja2's pass_context / pass_environment marks are kept."""
    if getattr(f, "toy_bounded", False):
        return f
    lead = 0 if getattr(f, "jinja_pass_arg", None) is None else 1
    estimate = FILTER_SIZES.get(name)
    what = f"the {name} filter"

    @functools.wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        b = getattr(_local, "budget", None)
        if (
            b is None
        ):  # jinja2 folding a constant while it compiles: leave it to the render, which is bounded
            raise RuntimeError(f"{what} runs only in a bounded render")
        b.tick()
        head, real = args[:lead], args[lead:]
        for v in (*real, *kwargs.values()):
            b.check(size_of(v), f"the input of {what}")
        if name in SORTING_FILTERS and real:
            real = (_sortable(real[0], what), *real[1:])
        if estimate is not None:
            size, real = estimate(*real, **kwargs)
            b.check(size, what)
            if name != "format":
                kwargs = {}  # the estimate passes every argument on by position
        rv = f(*head, *real, **kwargs)
        if isinstance(rv, Iterator) and not isinstance(rv, (str, list, tuple, dict)):
            return _Drawn(rv, what)  # lazy (map, select, batch ...): counted as it is drawn
        n = size_of(rv)
        b.check(n, what)
        b.spend(n, what)
        return rv

    bounded.toy_bounded = True  # type: ignore[attr-defined]
    return bounded


def _sortable(items: Any, what: str) -> Any:
    """The input of a sorting filter, refused past MAX_TEMPLATE_SORT_ITEMS before the sort
    starts (an iterator is drawn up to one past the limit first)."""
    sized = hasattr(items, "__len__")
    if not sized:
        items = list(itertools.islice(iter(items), MAX_TEMPLATE_SORT_ITEMS + 1))
    if len(items) > MAX_TEMPLATE_SORT_ITEMS:
        n = f"{len(items):,}" if sized else "more"
        raise TemplateLimitError(
            f"chat template exceeds toy's limit: {what} over {n} items, more than the "
            f"{MAX_TEMPLATE_SORT_ITEMS:,} one sort may order "
            f"(MAX_TEMPLATE_SORT_ITEMS); {FIX}"
        )
    return items


class _Drawn:
    """A filter's lazy result whose items count against the limit as they are drawn:
    whoever draws them (list, sort, join, dict, a loop) may keep them all."""

    def __init__(self, items: Iterator, what: str):
        self.items, self.what, self.total = items, what, 0

    def __iter__(self) -> _Drawn:
        return self

    def __next__(self) -> Any:
        x = next(self.items)
        b = _budget()
        n = size_of(x) + MEMBER
        self.total += n
        b.check(self.total, f"the items of {self.what}")
        b.spend(n, self.what)
        return x


class _BoundedFilters(dict):
    """env.filters: a filter added later (env.filters["tojson"] = ...) is bounded too."""

    def __init__(self, filters: dict):
        super().__init__((k, bounded_filter(k, f)) for k, f in filters.items())

    def __setitem__(self, name: str, f: Callable) -> None:
        super().__setitem__(name, bounded_filter(name, f))


class _CodeGenerator(CodeGenerator):
    """jinja2's compiler with two changes: every block body (a loop's, each iteration; a
    macro's, each call; an `if` branch's) starts by checking the clock, so a loop with no
    output and no calls still stops; and `a ~ b` goes through BoundedSandbox.join_values
    (jinja2 compiles it to a plain join)."""

    def blockvisit(self, nodes, frame) -> None:
        self.writeline("environment.tick()")
        super().blockvisit(nodes, frame)

    def visit_Concat(self, node, frame) -> None:  # noqa: N802 (jinja2's visitor naming)
        self.write("environment.join_values((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with every operator, call, filter, join and printed value
    checked against the current render's budget (see the module doc)."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})
    code_generator_class = _CodeGenerator

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.filters = _BoundedFilters(self.filters)
        self.finalize = self.checked_output

    def tick(self) -> None:
        _budget().tick()

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _budget()
        b.tick()
        size = binop_size(operator, left, right)
        b.check(size, f"'{operator}'")
        b.spend(size, f"'{operator}'")
        return self.binop_table[operator](left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja2's names)
        b = _budget()
        b.tick()
        what = f"calling {getattr(__obj, '__name__', type(__obj).__name__)}"
        for v in (*args, *kwargs.values()):
            b.check(size_of(v), f"an argument of {what}")
        size, args = call_size(__obj, args, kwargs)
        b.check(size, what)
        rv = super().call(__context, __obj, *args, **kwargs)
        n = size_of(rv)
        b.check(n, what)
        b.spend(n, what)
        return rv

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        fmt = super().wrap_str_format(value)
        if fmt is None:
            return None
        template, is_map = value.__self__, value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            b = _budget()
            b.tick()
            values = (
                list(args[0].values())
                if is_map and args and isinstance(args[0], dict)
                else [*args, *kwargs.values()]
            )
            b.check(format_size(template, values), "str.format")
            return fmt(*args, **kwargs)

        return functools.update_wrapper(bounded, fmt)

    def concat(self, parts: Any) -> str:  # type: ignore[override]  (jinja2's is "".join)
        """The text of a macro, a call block, a `{% set %}` block or a filter block."""
        b = _budget()
        parts = parts if isinstance(parts, list) else list(parts)
        n = sum(map(len, parts))
        b.check(n, "the text of a macro or block")
        b.spend(n, "the text of a macro or block")
        return "".join(parts)

    def join_values(self, values: tuple) -> str:
        """`a ~ b ~ ...`: the values' sizes are checked before they are turned into text."""
        b = _budget()
        n = 0
        for v in values:
            n += size_of(v)
            b.check(n, "'~'")
        b.spend(n, "'~'")
        return "".join(map(str, values))

    def checked_output(self, value: Any) -> Any:
        """Each printed value (`{{ x }}`): a list or dict is printed as its repr."""
        if not isinstance(value, str):
            _budget().check(size_of(value), "printing a value")
        return value


_OPEN, _CLOSE = frozenset("([{"), frozenset(")]}")


def _too_deep(what: str, lineno: int, limit: int, name: str) -> TemplateLimitError:
    return TemplateLimitError(
        f"chat template exceeds toy's limit: {what} nested more than {limit} deep at line "
        f"{lineno} ({name}); {FIX}"
    )


def compile_bounded(env: jinja2.Environment, source: str) -> jinja2.Template:
    """`env.from_string(source)` with its nesting checked first (see the module doc):
    the brackets on the token stream (jinja2's lexer does not recurse), the depth of the
    parsed tree before jinja2 generates and compiles its Python. TemplateLimitError past
    a limit; jinja2's own TemplateSyntaxError as before."""
    depth = 0
    for lineno, kind, value in env.lex(source):
        if kind == "operator" and value in _OPEN:
            depth += 1
            if depth > MAX_TEMPLATE_NESTING:
                raise _too_deep("brackets", lineno, MAX_TEMPLATE_NESTING, "MAX_TEMPLATE_NESTING")
        elif kind == "operator" and value in _CLOSE:
            depth -= 1
    try:
        tree = env.parse(source)
    except RecursionError:  # a long run of unary operators or nested blocks: the parser recurses
        raise _too_deep(
            "expressions or blocks", 1, MAX_TEMPLATE_TREE_DEPTH, "MAX_TEMPLATE_TREE_DEPTH"
        ) from None
    stack = [(tree, 1)]
    while stack:  # the tree's depth, without recursion
        node, d = stack.pop()
        if d > MAX_TEMPLATE_TREE_DEPTH:
            raise _too_deep(
                "expressions or blocks",
                getattr(node, "lineno", 1),
                MAX_TEMPLATE_TREE_DEPTH,
                "MAX_TEMPLATE_TREE_DEPTH",
            )
        stack.extend((child, d + 1) for child in node.iter_child_nodes())
    return env.from_string(tree)


class _Alarm:
    """A one-shot SIGALRM at the render's deadline whose handler ends the render: the
    clock checks between calls cannot stop one call that runs long in Python. Armed only
    in the main thread, where Python runs signal handlers, and only when no other timer
    is set (that one's owner keeps it)."""

    def __init__(self, budget: _Budget):
        self.budget, self.armed, self.previous = budget, False, None
        if not hasattr(signal, "setitimer") or threading.current_thread() is not (
            threading.main_thread()
        ):
            return
        if signal.getitimer(signal.ITIMER_REAL)[0] > 0:
            return
        self.previous = signal.signal(signal.SIGALRM, self._ring)
        self.armed = True
        signal.setitimer(signal.ITIMER_REAL, max(budget.deadline - time.monotonic(), 1e-3))

    def _ring(self, signum: int, frame: Any) -> None:
        if self.armed:
            self.disarm()
            self.budget.expire()

    def disarm(self) -> None:
        if self.armed:
            self.armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)


def render_bounded(tpl: jinja2.Template, input_chars: int, **context: Any) -> str:
    """Render `tpl` (from a BoundedSandbox) within the limits; TemplateLimitError past one.
    `input_chars`: the size of what it renders (the messages' text), which the size
    limit grows with."""
    limit = max(MAX_TEMPLATE_CHARS, TEMPLATE_INPUT_FACTOR * input_chars)
    b = _Budget(limit, MAX_TEMPLATE_SECONDS, MAX_TEMPLATE_WORK * limit)
    outer = getattr(_local, "budget", None)
    _local.budget = b
    alarm = _Alarm(b) if outer is None else None
    try:
        out, n = [], 0
        for chunk in tpl.generate(**context):
            n += len(chunk)
            b.check(n, "the rendered text")
            out.append(chunk)
    except RecursionError:  # a macro that calls itself without end
        raise TemplateLimitError(
            f"chat template exceeds toy's limit: its macros call each other deeper than "
            f"Python's recursion limit; {FIX}"
        ) from None
    finally:
        try:
            if alarm is not None:
                alarm.disarm()
        finally:
            _local.budget = outer
    if b.expired:  # in case something on the way caught the error
        b.expire()
    return "".join(out)
