"""A chat template is a file's, possibly a stranger's (``runtime_core.chat``): whatever it
raises is a ``ChatTemplateError`` (the server answers 400, not 500), its rendering is
bounded in time and size, and it sees what Hugging Face's ``apply_chat_template`` gives
(``{% generation %}``, ``tools`` and ``documents`` as ``None``)."""

from __future__ import annotations

import time

import pytest

from runtime_core import chat
from runtime_core.chat import ChatTemplateError, render_chat_template

MESSAGES = [{"role": "user", "content": "hi"}]


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
    template: str, match: str
) -> None:
    """Once untyped: ``ZeroDivisionError``, ``TypeError``, ``RecursionError``, and a
    ``MemoryError`` after 10 s of allocating for ``'x' * 3000000000``."""
    began = time.monotonic()
    with pytest.raises(ChatTemplateError, match=match):
        render_chat_template(template, MESSAGES)
    assert time.monotonic() - began < 5


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
    assert time.monotonic() - began < 3
    assert render_chat_template("{{ messages[0].content }}", MESSAGES) == "hi"  # (untraced after)


def test_generation_blocks_and_tools_are_as_hugging_face_gives_them() -> None:
    marked = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    assert render_chat_template(marked, MESSAGES) == "hi"
    tools = "{% if tools is not none %}[TOOLS]{{ tools | length }}{% endif %}{{ documents }}"
    assert render_chat_template(tools, MESSAGES) == "None"
    assert render_chat_template(tools, MESSAGES, tools=[{"a": 1}], documents="d") == "[TOOLS]1d"
