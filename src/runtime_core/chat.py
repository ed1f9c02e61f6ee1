"""Chat templates: a GGUF file's ``tokenizer.chat_template`` rendered with Jinja2.

The environment is the one Hugging Face's ``apply_chat_template`` uses (and
llama-cpp-python's Jinja2 formatter copies): sandboxed and immutable, blocks
trimmed, ``loopcontrols``, ``{% generation %}`` blocks (rendered as their body), a
``tojson`` filter that keeps non-ASCII text, and the globals ``raise_exception`` and
``strftime_now``. A template sees ``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token``, ``tools`` and ``documents`` (``None`` unless given) and
any extra variables.

A template is a file's, so possibly a stranger's: whatever it raises is a
``ChatTemplateError``, and it is bounded: at most ``RENDER_SECONDS`` of rendering (a
check on each line of Python it runs, its compiled code and the filters and methods it
calls: three nested loops of ``range(100000)`` ran for ever, ``urlize`` of a long text
for minutes; a call into C, such as a regular expression, ends before the check) and
``MAX_RENDER_CHARS`` of text, in its output and in each value it makes on the way
(``'x' * 3000000000`` and ``'x'.ljust(3000000000)`` are refused before they are made:
``runtime_core.chat_sandbox``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from types import FrameType
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.parser import Parser

from runplan.picklable_error import PicklableError
from runtime_core.chat_sandbox import (
    MAX_EXPONENT_BITS,
    MAX_RENDER_CHARS,
    BoundedEnvironment,
    ChatTemplateError,
    size,
)
from runtime_core.tokenizer_vocab import TokenizerError

__all__ = [
    "MAX_EXPONENT_BITS",
    "MAX_RENDER_CHARS",
    "RENDER_SECONDS",
    "ChatTemplateError",
    "NoChatTemplate",
    "render_chat_template",
]


class NoChatTemplate(PicklableError, TokenizerError):
    """The GGUF file has no ``tokenizer.chat_template``."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(f"{path}: the file has no chat template (tokenizer.chat_template)")


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


#: The longest a template renders.
RENDER_SECONDS = 10.0


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (Hugging Face's mark of the assistant's
    tokens): its body, rendered as if unmarked."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's own declaration)

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _Generation],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.bound_filters()
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **variables: Any,
) -> str:
    """Render ``template`` for ``messages`` (each with ``role`` and ``content``)."""
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ChatTemplateError(f"message {i} is not a mapping with a 'role': {message!r}")
    compiled = _compile(template)
    context = {"tools": None, "documents": None, **variables}
    deadline = _Deadline(time.monotonic() + RENDER_SECONDS)
    before = sys.gettrace()
    sys.settrace(deadline.trace)
    try:
        out: list[str] = []
        size = 0
        for piece in compiled.generate(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **context,
        ):
            size += len(piece)
            if size > MAX_RENDER_CHARS:
                raise ChatTemplateError(
                    f"the chat template made more than {MAX_RENDER_CHARS} characters"
                )
            out.append(piece)
        return "".join(out)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed: {exc}") from exc
    except (
        ArithmeticError,
        LookupError,
        TypeError,
        ValueError,
        RecursionError,
        MemoryError,
    ) as exc:
        raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.settrace(before)


#: The sandbox's count of what a value holds (``chat_sandbox.size``): it stops soon past
#: ``MAX_RENDER_CHARS``, so its lines need no deadline (a count of a list of a million
#: items took 1.3 s of CPU traced line by line, 7 s on a loaded machine).
_COUNTING = size.__code__


class _Deadline:
    """A trace function that ends a template's rendering past ``at`` (monotonic): it
    looks at each line of every frame the rendering runs, the template's compiled code
    and the Python code it calls (a filter such as ``urlize``, ``wordwrap`` or
    ``striptags`` given a long text ran for minutes in one call, its lines untraced)."""

    def __init__(self, at: float) -> None:
        self.at = at

    def trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is _COUNTING:  # bounded by itself: traced, it ran 5-10 x slower
            return None
        return self._line

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and time.monotonic() > self.at:
            raise ChatTemplateError(f"the chat template rendered for more than {RENDER_SECONDS} s")
        return self._line
