"""A chat template is untrusted input (issue 23 item 3): the sandbox kept it from the OS,
but `{{ 'x' * 300000000 }}` took 1.46 GB and nested loops ran for ever. Each render is
bounded in size (every value it makes, and the text) and in time; past a limit it is
one InputError (exit 2) naming the template's source, not a skipped conversation."""

from __future__ import annotations

import resource
import time

import jinja2
import jinja2.ext
import pytest
from helpers.gguf_fixtures import smollm2_gguf, tiny_model, write_llama_gguf  # noqa: E402,F401
from jinja2.sandbox import ImmutableSandboxedEnvironment

from toy.data import chat, sandbox  # noqa: E402
from toy.data.chat import BUILTIN_TEMPLATES, ConversationError, render_template  # noqa: E402
from toy.errors import InputError  # noqa: E402

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy? Answer with café émoji 🙂."},
    {"role": "assistant", "content": " Rome, naturally 🙂"},
]

BIG = "{% set s = 'x' * 3000000 %}"  # within the limit, the makings of an attack
SIZE_ATTACKS = {
    "string times": "{{ 'x' * 300000000 }}",
    "list times": "{{ [0] * 300000000 }}",
    "list of a big string times": BIG + "{{ [s] * 100 }}",
    "percent width": "{{ '%300000000s' % 'x' }}",
    "percent star width": "{{ '%*d' % (300000000, 1) }}",
    "format filter width": "{{ '%300000000d'|format(1) }}",
    "center filter": "{{ 'x'|center(10**9) }}",
    "center method": "{{ 'x'.center(10**9) }}",
    "ljust method": "{{ 'x'.ljust(300000000) }}",
    "str.format width": "{{ '{:>999999999}'.format(1) }}",
    "str.format nested width": "{{ '{:>{}}'.format(1, 999999999) }}",
    "str.format repeated field": BIG + "{{ ('{0}' * 1000).format(s) }}",
    "huge power": "{{ 2 ** (10 ** 9) }}",  # jinja2 reads 2 ** 10 ** 9 as (2 ** 10) ** 9
    "huge product of integers": "{% set n = 10 ** 15000 %}{{ n * n * n * n }}",
    "tilde doubling": "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "plus doubling": "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "tilde chain": BIG + "{{ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s }}",
    "printing a literal list": BIG + "{{ [s, s, s, s, s, s, s, s, s, s] }}",
    "join filter": BIG + "{{ [s, s, s, s, s, s, s, s, s, s]|join }}",
    "join method of a generator": BIG + "{{ ''.join(range(1000)|map('replace', '1', s)) }}",
    "indent filter": "{{ ('a\n' * 1000000)|indent('xxxxxxxxxx') }}",
    "replace filter": "{{ ('x' * 1000)|replace('', 'y' * 10000) }}",
    "replace method": "{{ ('x' * 1000).replace('', 'y' * 10000) }}",
    "expandtabs": "{{ ('\t' * 1000).expandtabs(1000000) }}",
    "batch fill": "{{ [1]|batch(300000000, 'x')|list }}",
    "tojson indent": "{{ messages|tojson(indent=300000000) }}",
    "macro output": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}"
    "{% else %}{{ 'x' * 100000 }}{% endif %}{% endmacro %}{{ f(30) }}",
    "output accumulates": BIG + "{% for i in range(100) %}{{ s }}{% endfor %}",
    "a list of fresh strings": "{{ range(100000)|map('center', 3000000)|list|length }}",
    "sum of lists (quadratic)": "{{ ([[0] * 200] * 2000)|sum(start=[])|length }}",
    "filters jinja2 would run when compiling": "{{ 'x'|center(3000000) }}" * 30,
    "a generator drawn into a list": BIG + "{{ s|batch(1)|list|length }}",
    "a generator drawn into a dict": BIG + "{{ dict(s|batch(2))|length }}",
    "split into many small strings": "{% set s = 'ab ' * 1300000 %}{{ s.split()|length }}",
}
TIME_ATTACKS = {
    "nested loops without output": "{% set x = range(100000) %}"
    "{% for a in x %}{% for b in x %}{% endfor %}{% endfor %}",
    "exponential macro recursion": "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}"
    "{% endif %}{% endmacro %}{{ f(60) }}",
    "loop calling a filter": "{% set x = range(100000) %}"
    "{% for a in x %}{% for b in x %}{{ ''|trim }}{% endfor %}{% endfor %}",
    # One call that runs long by itself (issue 32 item 6): no clock check between calls can
    # stop it; wordwrap over a megabyte took 13 s, at 4 MB minutes.
    "one wordwrap call": "{% set s = 'x' * 1000000 %}{{ s|wordwrap(1)|length }}",
    "one urlize call": "{% set s = 'a ' * 900000 %}{{ s|urlize|length }}",
}
# A sort runs in one C call the clock cannot interrupt (4M characters: 6.6 s): refused by
# its number of items before it starts.
SORTS = {
    "sort of a string": "{% set s = 'ab' * 2000000 %}{{ s|sort|length }}",
    "sort of a list": "{{ (range(90000)|list + range(90000)|list)|sort|length }}",
    "sort of a generator": "{{ ('ab' * 200000)|map('upper')|sort|length }}",
    "groupby": "{% set s = 'ab' * 2000000 %}{{ s|groupby('x')|length }}",
}
# Nested deeper than jinja2's parser and code generator (one Python frame a level or more)
# or Python's compiler (100 nested blocks) can take: a RecursionError or IndentationError
# traceback before (issue 32 item 6).
DEEP = {
    "parentheses": "{{ " + "(" * 500 + "1" + ")" * 500 + " }}",
    "lists": "{{ " + "[" * 500 + "]" * 500 + " }}",
    "calls": "{{ " + "range(" * 100 + "1" + ")" * 100 + " }}",
    "a chain of +": "{{ 1" + " + 1" * 5000 + " }}",
    "a chain of filters": "{{ 1" + "|string" * 2000 + " }}",
    "unary minus": "{{ " + "-" * 5000 + "1 }}",
    "conditional expressions": "{{ 1" + " if 1 else 1" * 1000 + " }}",
    "nested if blocks": "{% if 1 %}" * 120 + "x" + "{% endif %}" * 120,
    "nested for loops": "{% for a in [1] %}" * 70 + "x" + "{% endfor %}" * 70,
    "a macro that calls itself": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
}


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _refused(template: str) -> tuple[InputError, float]:
    t0 = time.monotonic()
    with pytest.raises(InputError) as e:
        render_template(template, CONV, True, "<s>", "</s>")
    took = time.monotonic() - t0
    assert not isinstance(
        e.value, ConversationError
    )  # the template's own fault: not one skipped conversation
    assert "\n" not in e.value.message and "chat template" in e.value.message
    return e.value, took


@pytest.mark.parametrize("template", SIZE_ATTACKS.values(), ids=SIZE_ATTACKS.keys())
def test_a_template_cannot_take_all_the_memory(template, monkeypatch):
    # The size limits are tested, so the render's clock must not decide: on a machine that
    # another process keeps busy, counting a generator's 4M items took past the 2 s limit
    # (issue 43 item 13). With the clock far away, only a size limit can refuse it.
    monkeypatch.setattr(sandbox, "MAX_TEMPLATE_SECONDS", 600.0)
    peak = _peak_mb()
    err, _ = _refused(template)
    assert "limit" in err.message and "MAX_TEMPLATE" in err.message, err.message
    assert "MAX_TEMPLATE_SECONDS" not in err.message, err.message
    assert _peak_mb() - peak < 300  # never near the 1.46 GB of the unbounded render


@pytest.mark.parametrize("template", TIME_ATTACKS.values(), ids=TIME_ATTACKS.keys())
def test_a_template_cannot_hang(template, monkeypatch):
    monkeypatch.setattr(
        sandbox, "MAX_TEMPLATE_SECONDS", 0.5
    )  # the real limit is checked by the CLI test
    err, took = _refused(template)
    # The clock stops it, or (a sort of 4M characters, on a fast CPU) the size limit first.
    timed = "MAX_TEMPLATE_SECONDS" in err.message and "0.5 s" in err.message
    assert timed or "MAX_TEMPLATE_CHARS" in err.message, err.message
    assert took < 0.5 + 1.5, f"took {took:.1f} s"


@pytest.mark.parametrize("template", SORTS.values(), ids=SORTS.keys())
def test_a_sort_too_long_for_the_clock_is_refused_before_it_starts(template, monkeypatch):
    # The clock out of the way (a busy machine must not decide): the item count refuses it.
    monkeypatch.setattr(sandbox, "MAX_TEMPLATE_SECONDS", 600.0)
    err, _ = _refused(template)
    assert "MAX_TEMPLATE_SORT_ITEMS" in err.message, err.message


def test_a_sort_of_real_size_renders_as_jinja2_does():
    t = "{{ (messages|map(attribute='content')|list * 10)|sort|join(',') }}"
    plain = jinja2.Environment().from_string(t).render(messages=CONV)
    assert render_template(t, CONV, True, "<s>", "</s>") == plain


@pytest.mark.parametrize("template", DEEP.values(), ids=DEEP.keys())
def test_a_template_nested_too_deep_is_refused(template, monkeypatch):
    monkeypatch.setattr(sandbox, "MAX_TEMPLATE_SECONDS", 600.0)  # the depth limit decides
    err, _ = _refused(template)
    assert "limit" in err.message and "deep" in err.message, err.message


def test_nesting_limits_leave_real_templates_room():
    """The deepest nesting a real template has is far under the limits: 3 brackets, a tree
    21 deep (deepseekv3's; SmolLM2's 10); a template at the limits still renders."""
    at_limit = "{{ " + "(" * sandbox.MAX_TEMPLATE_NESTING + "1" + ")" * sandbox.MAX_TEMPLATE_NESTING
    assert render_template(at_limit + " }}", CONV, False, "", "") == "1"
    chain = "{{ 1" + " + 1" * (sandbox.MAX_TEMPLATE_TREE_DEPTH - 4) + " }}"
    assert render_template(chain, CONV, False, "", "") == str(sandbox.MAX_TEMPLATE_TREE_DEPTH - 3)


def test_the_deadline_timer_is_cheap_and_left_as_found():
    """A render arms SIGALRM only for itself: the handler and the timer are restored."""
    import signal

    before = signal.getsignal(signal.SIGALRM)
    t0 = time.perf_counter()
    for _ in range(200):
        render_template(BUILTIN_TEMPLATES["chatml"], CONV[1:3], False, "", "")
    per = (time.perf_counter() - t0) / 200
    assert signal.getsignal(signal.SIGALRM) is before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert per < 0.005, f"{per * 1e6:.0f} us a render"


def _plain(template: str, messages, add_generation_prompt: bool, bos: str, eos: str) -> str:
    """The same template rendered by jinja2's sandbox with none of toy's limits."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = chat._tojson
    env.globals["raise_exception"] = chat._raise_exception
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos
    )


# Uses most of what real templates use: namespace, macros, loop variables, filters, string
# methods and every operator, so each of toy's hooks is on the path of a normal render. A
# backslash at a line's end only wraps the line (Python drops it and the newline).
BUSY = """{%- set ns = namespace(system='', n=0) -%}
{%- macro header(role, i) -%}\
<|{{ role|upper }}|{{ '%02d'|format(i) }}|{{ '{:>4}'.format(i) }}>{%- endmacro -%}
{%- for m in messages -%}
{%- if m.role == 'system' %}{% set ns.system = ns.system ~ m.content|trim %}\
{% continue %}{% endif -%}
{%- set ns.n = ns.n + 1 -%}
{{ header(m.role, loop.index) }}{{ (ns.system + '\n') if ns.n == 1 and ns.system else '' }}
{{- m.content.strip().replace('  ', ' ') }}{{ ' [%d words]' % (m.content.split()|length) }}
{{- '' if loop.last else '\n' * 1 }}{{ '-' * (2 ** 2) }}{{ loop.cycle('a', 'b') }}\
{{ (ns.n * 3) // 2 }}
{%- endfor -%}
{{ messages|map(attribute='role')|join(',') }}|\
{{ messages|selectattr('role', 'equalto', 'user')|list|length }}
{{ messages[-1]|tojson }}{{ messages[:2]|tojson(indent=2) }}\
{{ ('x'|center(9)) ~ ('y'.ljust(3)) ~ ('7'.zfill(3)) }}
{{ ['a', 'b'] + ['c'] }}{{ (1, 2) * 2 }}{{ {'k': 'v'}|dictsort }}\
{{ 'abc'|replace('b', 'B')|indent(2, true) }}
{%- if add_generation_prompt %}{{ header('assistant', 0) }}{{ eos_token }}{% endif %}"""


@pytest.mark.parametrize("name", ["chatml", "gemma", "smollm2", "busy"])
def test_real_templates_render_as_before(name):
    from helpers.chat import SMOLLM2

    template = {"smollm2": SMOLLM2, "busy": BUSY}.get(name) or BUILTIN_TEMPLATES[name]
    convs = [
        CONV[1:],
        CONV[1:3],
        [{"role": "user", "content": "a" * 5000}, {"role": "assistant", "content": "b"}],
    ]
    if (
        name != "gemma"
    ):  # gemma folds a system turn into the first user turn; its template checks the order
        convs.append(CONV)
    for conv in convs:
        for gen in (False, True):
            assert render_template(template, conv, gen, "<bos>", "<eos>") == _plain(
                template, conv, gen, "<bos>", "<eos>"
            )


def test_smollm2s_own_template_renders_as_before(smollm2_gguf):  # noqa: F811
    from toy.formats.gguf_header import read_gguf_header

    template = read_gguf_header(smollm2_gguf).metadata["tokenizer.chat_template"]
    for gen in (False, True):
        assert render_template(template, CONV, gen, "", "<|im_end|>") == _plain(
            template, CONV, gen, "", "<|im_end|>"
        )


def test_a_long_conversation_is_not_an_attack():
    """The size limit grows with the conversation: a 5-million-character message renders."""
    conv = [
        {"role": "user", "content": "a" * (sandbox.MAX_TEMPLATE_CHARS + 1_000_000)},
        {"role": "assistant", "content": "b"},
    ]
    text = render_template(BUILTIN_TEMPLATES["chatml"], conv, False, "", "")
    assert len(text) > sandbox.MAX_TEMPLATE_CHARS


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from toy.data.dialogue import conversations, write_jsonl
    from toy.data.prep import bundled_text_paths
    from toy.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("template-limits")
    text = bundled_text_paths()[0].read_text()[:40000]
    tok = train_bpe([text[i : i + 400] for i in range(0, len(text), 400)], vocab_size=400)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    model = tiny_model(vocab_size=tok.get_vocab_size(with_added_tokens=True), max_seq_len=256)
    evil = write_llama_gguf(d / "evil.gguf", model, tok, chat_template=SIZE_ATTACKS["string times"])
    good = write_llama_gguf(d / "good.gguf", model, tok)
    deep = write_llama_gguf(d / "deep.gguf", model, tok, chat_template=DEEP["a chain of +"])
    slow = write_llama_gguf(
        d / "slow.gguf", model, tok, chat_template=TIME_ATTACKS["one wordwrap call"]
    )
    chat_file = write_jsonl(
        conversations(bundled_text_paths(), 10, seed=1, turns=(1, 1), max_chars=100),
        d / "chat.jsonl",
    )
    return {"evil": evil, "good": good, "deep": deep, "slow": slow, "chat": chat_file, "dir": d}


def test_the_cli_names_the_template_source(base, toy_cli, tmp_path):
    common = [
        "train",
        "--recipe",
        "lora",
        "--data",
        base["chat"],
        "--seq-len",
        "128",
        "--steps",
        "1",
        "--out",
        tmp_path,
    ]
    code, _, err = toy_cli(*common, "--model", base["evil"])
    assert (
        code == 2
        and str(base["evil"]) in err
        and "MAX_TEMPLATE_CHARS" in err
        and "Traceback" not in err
    ), err
    jinja = tmp_path / "evil.jinja"
    jinja.write_text(TIME_ATTACKS["nested loops without output"])
    t0 = time.monotonic()
    code, _, err = toy_cli(*common, "--model", base["good"], "--chat-template", jinja)
    assert code == 2 and f"--chat-template {jinja}" in err and "MAX_TEMPLATE_SECONDS" in err, err
    assert time.monotonic() - t0 < sandbox.MAX_TEMPLATE_SECONDS + 5
    assert len(err.strip().splitlines()) == 1  # one error, not a warning per conversation
    assert not any(tmp_path.glob("*-lora-*"))  # no run directory


def test_the_cli_refuses_deep_and_slow_templates_naming_their_source(base, toy_cli, tmp_path):
    """Issue 32 item 6 through the CLI: a nesting too deep (from the GGUF, and from
    --chat-template) and one filter call that runs long (the real 2 s limit), each one
    line, exit 2, naming where the template came from, no run directory."""
    common = ["train", "--recipe", "lora", "--data", base["chat"], "--seq-len", "128"]
    common += ["--steps", "1", "--out", tmp_path]
    code, _, err = toy_cli(*common, "--model", base["deep"])
    assert code == 2 and str(base["deep"]) in err and "MAX_TEMPLATE_TREE_DEPTH" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    jinja = tmp_path / "deep.jinja"
    jinja.write_text(DEEP["parentheses"])
    code, _, err = toy_cli(*common, "--model", base["good"], "--chat-template", jinja)
    assert code == 2 and f"--chat-template {jinja}" in err and "MAX_TEMPLATE_NESTING" in err, err
    t0 = time.monotonic()
    code, _, err = toy_cli(*common, "--model", base["slow"])
    took = time.monotonic() - t0
    assert code == 2 and str(base["slow"]) in err and "MAX_TEMPLATE_SECONDS" in err, err
    assert took < sandbox.MAX_TEMPLATE_SECONDS + 5, f"took {took:.1f} s"
    assert not any(tmp_path.glob("*-lora-*"))
