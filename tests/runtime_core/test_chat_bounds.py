"""A chat template is a file's, possibly a stranger's (``runtime_core.chat``): whatever it
raises is a ``ChatTemplateError`` (the server answers 400, not 500), its rendering is
bounded in time and size, and it sees what Hugging Face's ``apply_chat_template`` gives
(``{% generation %}``, ``tools`` and ``documents`` as ``None``)."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from runtime_core import chat
from runtime_core.chat import ChatTemplateError, render_chat_template

MESSAGES = [{"role": "user", "content": "hi"}]

#: A bound on a hang, never a timing: a rendering that ends is timed by the deadline.
HANG_S = 60.0


def _refused_having_made_little(template: str, match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``template`` refused with ``match``, having made at most what one value past
    ``MAX_RENDER_CHARS`` takes (traced, not timed: a template that makes what it asks
    takes the gigabytes). ``RENDER_SECONDS`` raised: the render deadline is no part of
    this, and a checking that takes a second on a loaded host may take ten."""
    monkeypatch.setattr(chat, "RENDER_SECONDS", 600.0)
    tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateError, match=match):
            render_chat_template(template, MESSAGES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * chat.MAX_RENDER_CHARS, f"it made {peak} bytes on the way"


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{{ 1 // 0 }}", "ZeroDivisionError"),
        ("{{ messages[0]['content'] + 1 }}", "TypeError"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
        ("{{ 'x' * 3000000000 }}", "repeats a sequence of 1 3000000000 times"),
        ("{{ [1, 2] * 100000000 }}", "repeats a sequence of 2 100000000 times"),
        ("{{ 10 ** 100000000 }}", r"computes 10 \*\* 100000000"),
        (
            "{% for i in range(2000) %}{{ 'x' * 20000 }}{% endfor %}",
            "more than 33554432 characters",
        ),
    ],
)
def test_what_a_template_raises_or_makes_past_its_bounds_is_typed(
    template: str, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once untyped: ``ZeroDivisionError``, ``TypeError``, ``RecursionError``, and a
    ``MemoryError`` after 10 s of allocating for ``'x' * 3000000000``."""
    _refused_having_made_little(template, match, monkeypatch)


BIG = 1500000000


@pytest.mark.parametrize(
    ("template", "match"),
    [
        (f"{{{{ 'x'.ljust({BIG})|length }}}}", r"'x'\.ljust\(\.\.\.\): 1500000000 characters"),
        (f"{{{{ 'x'.rjust({BIG}) }}}}", r"'x'\.rjust"),
        (f"{{{{ ('x' ~ 'y').center({BIG}) }}}}", r"'xy'\.center"),
        (f"{{{{ 'x'.zfill({BIG}) }}}}", r"'x'\.zfill"),
        (f"{{{{ '\t'.expandtabs({BIG}) }}}}", r"expandtabs"),
        ("{{ ('a' * 1000000)|replace('a', 'b' * 100) }}", "the filter replace"),
        ("{{ 'aaaa'.replace('a', 'b' * 10000000) }}", r"'aaaa'\.replace"),
        (f"{{{{ '%*s' % ({BIG}, 'x') }}}}", "the formatting '%\\*s'"),
        (f"{{{{ '%{BIG}s' % 'x' }}}}", "formatting"),
        (f"{{{{ '%.{BIG}f' % 1.0 }}}}", "formatting"),
        (f"{{{{ '%*s'|format({BIG}, 'x') }}}}", "the filter format"),
        (f"{{{{ '{{:>{BIG}}}'.format('x') }}}}", r"\.format\(\.\.\.\)"),
        (f"{{{{ '{{:>{{}}}}'.format('x', {BIG}) }}}}", r"\.format\(\.\.\.\)"),
        (f"{{{{ '{{a:>{{w}}}}'.format_map({{'a': 'x', 'w': {BIG}}}) }}}}", r"format_map"),
        (f"{{{{ 'x'|center({BIG}) }}}}", "the filter center"),
        ("{{ ('a\n' * 1000000)|indent(1000) }}", "the filter indent"),
        ("{{ ('a ' * 1000000)|wordwrap(1, wrapstring='x' * 100) }}", "the filter wordwrap"),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
            "a join with ~: 67108864 characters",
        ),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
            "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
            "a sum with +",
        ),
        ("{{ (['x' * 1000000] * 40)|join }}", r"repeats a sequence of 1 40 times"),
        ("{{ ([1] * 1000000)|join('x' * 40) }}", "the filter join"),
        ("{{ ('x' * 40).join(['y'] * 1000000) }}", r"'x{40}'\.join"),
        ("{{ (' ab' * 10000000).split(' ')|length }}", r"'( ab){13} '\.split\(\.\.\.\): 190000016"),
        ("{{ range(100000)|map('center', 30000000)|list|length }}", "the filter list"),
        (f"{{{{ [1]|batch({BIG}, 'x')|list }}}}", "the filter batch"),
        (f"{{{{ [1]|slice({BIG})|list }}}}", "the filter slice"),
        (f"{{{{ lipsum({BIG}) }}}}", "lipsum"),
        # markupsafe's Markup (|safe, |e) has Python methods of its own
        ("{{ ('x'|safe).ljust(200000000) }}", r"Markup\('x'\)\.ljust\(\.\.\.\)"),
        ("{{ ('1'|e).zfill(200000000) }}", r"Markup\('1'\)\.zfill"),
        ("{{ (('a' * 40)|safe).replace('a', 'b' * 10000000) }}", r"\.replace\(\.\.\.\)"),
        # a string's characters as a list's items; big integers printed or joined
        ("{{ ('x' * 4000000)|list|length }}", "the filter list: 64000000"),
        ("{{ [(2 ** 2000) * (2 ** 2000)] * 200000 }}", "repeats a sequence of 1 200000"),
        ("{{ [(2 ** 2000) * (2 ** 2000)] * 200000 ~ '' }}", "repeats a sequence of 1 200000"),
        (
            "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}"
            "{% endfor %}{{ ns.n }}",
            "multiplies",
        ),
    ],
)
def test_what_a_template_asks_to_make_past_its_bounds_is_refused_before_it_is_made(
    template: str, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once made in full: ``'x'.ljust(1500000000)`` allocated 1.5 GB (only the output was
    bounded), and ``ns.s ~ ns.s`` doubled in a loop until memory ran out. (Timed once,
    under 5 s: a loaded 2-core host took 20 s to size a join of 1,000,000 items, and the
    10 s render deadline refused it first.)"""
    _refused_having_made_little(template, match, monkeypatch)


def test_bounded_operations_make_what_they_made_below_the_bounds() -> None:
    rendered = render_chat_template(
        "{{ 'x'.ljust(3) }}|{{ 'a\tb'.expandtabs(2) }}|{{ '%-3s|%.2f' % ('a', 1) }}|"
        "{{ '{:>3}{}'.format('a', 'b') }}|{{ 'ab'|center(4) }}|{{ 'a\nb'|indent(2) }}|"
        "{{ [1, 2]|join(', ') }}|{{ ', '.join(['x', 'y']) }}|{{ 'a' ~ 1 ~ none }}|"
        "{{ [1] + [2] }}|{{ 'ab' + 'c' }}|{{ 'ab'|replace('a', 'xy') }}|{{ 7 % 3 }}|"
        "{{ range(3)|map('string')|list }}|{{ '%(a)s' % {'a': 'q'} }}|{{ 3 * 4 }}|"
        "{{ 'a b'.split() }}{{ 'a,b'.split(',') }}",
        MESSAGES,
    )
    assert rendered == (
        "x  |a b|a  |1.00|  ab| ab |a\n  b|1, 2|x, y|a1None|[1, 2]|abc|xyb|1|['0', '1', '2']|q|12|"
        "['a', 'b']['a', 'b']"
    )


def test_a_template_that_renders_for_ever_is_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three nested loops of ``range(100000)`` (10**15 turns, no output) once rendered
    for ever, holding a server thread; now past ``RENDER_SECONDS`` (0.3 here)."""
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.3)
    endless = (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}"
        "{% endfor %}{% endfor %}{% endfor %}x"
    )
    began = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"rendered for more than 0\.3 s"):
        render_chat_template(endless, MESSAGES)
    assert time.monotonic() - began < HANG_S  # ended, by the deadline its error names
    assert render_chat_template("{{ messages[0].content }}", MESSAGES) == "hi"  # (untraced after)


@pytest.mark.parametrize("filtered", ["urlize", "striptags", "title"])
def test_a_filter_that_runs_long_in_one_call_is_ended(
    monkeypatch: pytest.MonkeyPatch, filtered: str
) -> None:
    """Only the template's own lines were traced, so one call of a filter written in
    Python ran to its end: ``urlize`` of a text of 2,000,000 characters (well within
    ``MAX_RENDER_CHARS``) rendered for 25 s, of one of 32,000,000 for minutes. Each
    line the rendering runs is checked now (``RENDER_SECONDS``: 0.3 here)."""
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.3)
    long = "{{ ('<a> b ' * 1000000)|" + filtered + "|length }}"
    with pytest.raises(ChatTemplateError, match=r"rendered for more than 0\.3 s"):
        render_chat_template(long, MESSAGES)
    assert render_chat_template("{{ messages[0].content|title }}", MESSAGES) == "Hi"


def test_generation_blocks_and_tools_are_as_hugging_face_gives_them() -> None:
    marked = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    assert render_chat_template(marked, MESSAGES) == "hi"
    tools = "{% if tools is not none %}[TOOLS]{{ tools | length }}{% endif %}{{ documents }}"
    assert render_chat_template(tools, MESSAGES) == "None"
    assert render_chat_template(tools, MESSAGES, tools=[{"a": 1}], documents="d") == "[TOOLS]1d"
