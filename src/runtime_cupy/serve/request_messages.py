"""What a request asks the model about (``serve.requests``): a chat's messages
(``Message``; message objects as strict as bodies: a field OpenAI's assistant messages
carry empty is taken empty, any other refused by name) and a completion's prompt (text
or token ids).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attrs import frozen

from runtime_cupy.serve.request_errors import RequestError, out_of_range, show, unknown, wrong
from runtime_cupy.serve.request_rules import required_string

ROLES = ("system", "developer", "user", "assistant")


@frozen
class Message:
    role: str  # system, user or assistant ("developer" reads as "system")
    content: str
    name: str | None = None  # the participant's name: the chat template sees it, if given


def messages(param: str, value: Any) -> tuple[Message, ...]:
    if value is None:
        raise RequestError(f"you must provide {param}", param=param, code="missing_required")
    if not isinstance(value, list):
        raise wrong(param, value, "an array of messages")
    if not value:
        raise RequestError(f"{param} is empty", param=param, code="invalid_value")
    return tuple(_message(f"{param}[{i}]", m) for i, m in enumerate(value))


_MESSAGE_KEYS = ("role", "content", "name")

#: An assistant message's fields (OpenAI's) that an answer of this server never sets: a
#: conversation sent back as the client library holds it (``model_dump()``) carries
#: them empty, which changes nothing; anything else is refused naming it.
_ASSISTANT_EMPTY: Mapping[str, tuple[Any, ...]] = {
    "refusal": (None,),
    "tool_calls": (None, []),
    "function_call": (None,),
    "audio": (None,),
    "annotations": (None, []),
}


def _message(param: str, value: Any) -> Message:
    if not isinstance(value, dict):
        raise wrong(param, value, "an object with role and content")
    role = required_string(f"{param}.role", value.get("role"))
    if role not in ROLES:  # before its other keys: a tool message names its role
        raise RequestError(
            f"{param}.role is {role!r}; this server takes {', '.join(ROLES)}",
            param=f"{param}.role",
            code="invalid_value",
        )
    for key in value:
        empty = _ASSISTANT_EMPTY.get(key) if role == "assistant" else None
        if empty is not None:
            if not any(value[key] == e and type(value[key]) is type(e) for e in empty):
                raise RequestError(
                    f"{param}.{key} is {show(value[key])}: this server's answers hold none "
                    "(no tools, refusals or audio)",
                    param=f"{param}.{key}",
                    code="unsupported_value",
                )
        elif key not in _MESSAGE_KEYS:
            raise unknown(f"{param}.{key}")
    name = value.get("name")
    if name is not None:
        name = required_string(f"{param}.name", name)
    content = _content(f"{param}.content", value.get("content"), role)
    return Message("system" if role == "developer" else role, content, name)


def _content(param: str, value: Any, role: str) -> str:
    if value is None:
        if role == "assistant":
            return ""
        raise RequestError(f"you must provide {param}", param=param, code="missing_required")
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise wrong(param, value, "a string or an array of text parts")
    parts = []
    for i, part in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise wrong(where, part, "an object")
        if part.get("type") != "text":  # first: a refusal part's own keys are not unknown
            raise RequestError(
                f"{where}.type is {show(part.get('type'))}; this server reads text parts only",
                param=f"{where}.type",
                code="unsupported_value",
            )
        for key in part:
            if key not in ("type", "text"):
                raise unknown(f"{where}.{key}")
        parts.append(required_string(f"{where}.text", part.get("text")))
    return "".join(parts)


def prompt(param: str, value: Any, *, inner: bool = False) -> str | tuple[int, ...]:
    """Text, token ids, or an array holding exactly one of them (``inner``: that one,
    which holds no array in turn)."""
    if value is None:
        raise RequestError(f"you must provide {param}", param=param, code="missing_required")
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise wrong(param, value, "a string, an array of token ids, or an array of one")
    if _nested(value):
        if inner:  # [["a"]] or [[[1]]]: no prompt shape of OpenAI's
            raise wrong(param, value, "a string or an array of token ids")
        if len(value) != 1:
            raise RequestError(
                f"{param} holds {len(value)} prompts: this server takes one per request",
                param=param,
                code="unsupported_value",
            )
        return prompt(f"{param}[0]", value[0], inner=True)
    ids = []
    for i, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int):
            raise wrong(f"{param}[{i}]", token, "a token id (an integer)")
        if token < 0:
            raise out_of_range(f"{param}[{i}]", token, "a token id (>= 0)")
        ids.append(token)
    return tuple(ids)


def prompt_ids_param(param: str, value: Any) -> str:
    """Where in the body a checked prompt (``prompt``'s ``value``) has its token ids:
    ``param``, or ``param[0]`` for an array of one."""
    return f"{param}[0]" if isinstance(value, list) and _nested(value) else param


def _nested(value: list[Any]) -> bool:
    """Whether a prompt's array holds prompts (texts, or arrays of ids) rather than ids."""
    return bool(value) and (isinstance(value[0], list) or all(isinstance(v, str) for v in value))
