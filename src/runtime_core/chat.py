"""Chat templates: a GGUF file's ``tokenizer.chat_template`` rendered with Jinja2.

The environment is the one Hugging Face's ``apply_chat_template`` uses (and
llama-cpp-python's Jinja2 formatter copies): sandboxed and immutable, blocks
trimmed, ``loopcontrols``, a ``tojson`` filter that keeps non-ASCII text, and the
globals ``raise_exception`` and ``strftime_now``. A template sees ``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token`` and any extra variables
(``tools``, ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runplan.picklable_error import PicklableError
from runtime_core.tokenizer_vocab import TokenizerError


class NoChatTemplate(PicklableError, TokenizerError):
    """The GGUF file has no ``tokenizer.chat_template``."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(f"{path}: the file has no chat template (tokenizer.chat_template)")


class ChatTemplateError(TokenizerError):
    """The chat template failed: a syntax error, an error while rendering, or the
    template's own ``raise_exception(message)``."""


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


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
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
    try:
        return compiled.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **variables,
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed: {exc}") from exc
