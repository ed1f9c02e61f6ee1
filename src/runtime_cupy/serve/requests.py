"""The bodies of ``POST /v1/chat/completions`` and ``POST /v1/completions``, checked
into typed values (OpenAI's API reference for what each field means).

A body is one JSON object. Every field the API defines has a rule here, as data
(``CHAT_FIELDS``, ``COMPLETION_FIELDS``): the fields this server serves are checked for
type and range; those it does not serve (penalties, logit bias, log probabilities,
tools, ...) are accepted only at the value that changes nothing (``NEUTRAL``), so a
request is never answered as if a setting applied that did not; any other field is
refused by name, as OpenAI refuses an unrecognized argument. Message objects are
strict the same way.

Every refusal is a ``RequestError``: the HTTP status, a message, the offending
parameter (``messages[1].content``), and OpenAI's error type and code, which the app
turns into an OpenAI error object. Nothing here raises anything else for any body:
the body parser bounds how deep it nests (``MAX_DEPTH``) before any rule looks at it,
every number is checked by type and range before it is used (a 400-digit integer is
out of range, not an ``OverflowError``), and a message or parameter name that quotes
the body can always be encoded (a lone surrogate is written as its escape).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from attrs import frozen

SEED_MAX = 2**64 - 1
MAX_STOPS = 4  # as OpenAI
#: How deep a body may nest: an object holding messages holding parts is 5 deep.
MAX_DEPTH = 32
ROLES = ("system", "developer", "user", "assistant")


class RequestError(Exception):
    """A request this server refuses: ``status``, ``message``, the offending ``param``
    (``None`` when the whole body is at fault), OpenAI's ``type`` and ``code``."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        message = _encodable(message)
        super().__init__(message)
        self.message = message
        self.param = None if param is None else _encodable(param)
        self.status = status
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        """The OpenAI error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@frozen
class Message:
    role: str  # system, user or assistant ("developer" reads as "system")
    content: str
    name: str | None = None  # the participant's name: the chat template sees it, if given


@frozen
class CompletionRequest:
    """One request, checked. ``messages`` for a chat, ``prompt`` (text or token ids)
    for a completion. ``max_tokens`` ``None``: the endpoint's default. ``seed`` ``None``:
    a new seed for this request."""

    endpoint: str  # "chat" or "completion"
    model: str
    messages: tuple[Message, ...] = ()
    prompt: str | tuple[int, ...] = ""
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # the field it came in (max_completion_tokens)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices, each a run of its own (``choice_seed``)
    #: Log probabilities (``logprobs.py``): ``None`` not asked, else the alternatives
    #: shown per token (chat's ``top_logprobs``, completions' ``logprobs``).
    logprobs: int | None = None


def _encodable(text: str) -> str:
    """``text`` with what UTF-8 cannot hold (lone surrogates) written as escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# -- the rules of single values ---------------------------------------------------------

Rule = Callable[[str, Any], Any]  # (param, value or None when absent / null) -> value


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _wrong(param: str, value: Any, expected: str) -> RequestError:
    return RequestError(
        f"{param} must be {expected}, not {_type_name(value)} {_show(value)}",
        param=param,
        code="invalid_type",
    )


def _show(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (ValueError, TypeError, RecursionError):  # never for a body the parser took
        text = _type_name(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _out_of_range(param: str, value: Any, allowed: str) -> RequestError:
    return RequestError(
        f"{param} is {_show(value)}; it must be {allowed}", param=param, code="invalid_value"
    )


def required_string(param: str, value: Any) -> str:
    if value is None:
        raise RequestError(f"you must provide {param}", param=param, code="missing_required")
    if not isinstance(value, str):
        raise _wrong(param, value, "a string")
    return value


def integer(low: int, high: int, default: int | None = None) -> Rule:
    def rule(param: str, value: Any) -> int | None:
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)  # 16.0 is 16, as JSON numbers go
            else:
                raise _wrong(param, value, "an integer")
        if not low <= value <= high:
            raise _out_of_range(param, value, f"in {low}..{high}")
        return int(value)

    return rule


def number(low: float, high: float, default: float, *, open_low: bool = False) -> Rule:
    def rule(param: str, value: Any) -> float:
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _wrong(param, value, "a number")
        bracket = "(" if open_low else "["
        try:
            x = float(value)
        except OverflowError:  # an integer past every float
            raise _out_of_range(param, value, f"in {bracket}{low:g}, {high:g}]") from None
        if not math.isfinite(x) or x > high or x < low or (open_low and x == low):
            raise _out_of_range(param, value, f"in {bracket}{low:g}, {high:g}]")
        return x

    return rule


def boolean(param: str, value: Any) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _wrong(param, value, "a boolean")
    return value


def seed(param: str, value: Any) -> int | None:
    """An integer in ``0..2**64-1``; null or -1 (llama.cpp's "random") is a new seed."""
    if value is None or (type(value) is int and value == -1):
        return None
    checked = integer(0, SEED_MAX)(param, value)
    assert checked is not None
    return int(checked)


def stop(param: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise _wrong(param, value, "a string or an array of strings")
    if len(items) > MAX_STOPS:
        raise _out_of_range(param, value, f"at most {MAX_STOPS} strings")
    for i, item in enumerate(items):
        where = param if isinstance(value, str) else f"{param}[{i}]"
        if not isinstance(item, str):
            raise _wrong(where, item, "a string")
        if not item:
            raise RequestError(f"{where} is empty", param=where, code="invalid_value")
    return tuple(items)


#: The most choices (``n``) one request may ask for: each is a run of its own.
MAX_CHOICES = 16


def choices(param: str, value: Any) -> int:
    """``n``: how many choices, each one run (1 to ``MAX_CHOICES``)."""
    n = integer(1, MAX_CHOICES, 1)(param, value)
    assert n is not None
    return int(n)


def stream_options(param: str, value: Any) -> bool:
    """``{"include_usage": bool}``: whether a streamed answer ends with a usage chunk.
    ``include_obfuscation`` (OpenAI's random padding of each chunk, against reading
    their lengths off the wire) is taken as a boolean and does nothing: the chunks here
    carry no padding, and a client reads them the same."""
    if value is None:
        return False
    if not isinstance(value, dict):
        raise _wrong(param, value, "an object")
    for key in value:
        if key not in ("include_usage", "include_obfuscation"):
            raise _unknown(f"{param}.{key}")
    boolean(f"{param}.include_obfuscation", value.get("include_obfuscation"))
    return boolean(f"{param}.include_usage", value.get("include_usage"))


def ignored_string(param: str, value: Any) -> None:
    """A string the answer does not depend on (``user``)."""
    if value is not None and not isinstance(value, str):
        raise _wrong(param, value, "a string")


def messages(param: str, value: Any) -> tuple[Message, ...]:
    if value is None:
        raise RequestError(f"you must provide {param}", param=param, code="missing_required")
    if not isinstance(value, list):
        raise _wrong(param, value, "an array of messages")
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
        raise _wrong(param, value, "an object with role and content")
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
                    f"{param}.{key} is {_show(value[key])}: this server's answers hold none "
                    "(no tools, refusals or audio)",
                    param=f"{param}.{key}",
                    code="unsupported_value",
                )
        elif key not in _MESSAGE_KEYS:
            raise _unknown(f"{param}.{key}")
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
        raise _wrong(param, value, "a string or an array of text parts")
    parts = []
    for i, part in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise _wrong(where, part, "an object")
        for key in part:
            if key not in ("type", "text"):
                raise _unknown(f"{where}.{key}")
        if part.get("type") != "text":
            raise RequestError(
                f"{where}.type is {_show(part.get('type'))}; this server reads text parts only",
                param=f"{where}.type",
                code="unsupported_value",
            )
        parts.append(required_string(f"{where}.text", part.get("text")))
    return "".join(parts)


def prompt(param: str, value: Any) -> str | tuple[int, ...]:
    """Text, token ids, or an array holding exactly one of them."""
    if value is None:
        raise RequestError(f"you must provide {param}", param=param, code="missing_required")
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _wrong(param, value, "a string, an array of token ids, or an array of one")
    nested = bool(value) and (isinstance(value[0], list) or all(isinstance(v, str) for v in value))
    if nested:
        if len(value) != 1:
            raise RequestError(
                f"{param} holds {len(value)} prompts: this server takes one per request",
                param=param,
                code="unsupported_value",
            )
        return prompt(f"{param}[0]", value[0])
    ids = []
    for i, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int):
            raise _wrong(f"{param}[{i}]", token, "a token id (an integer)")
        if token < 0:
            raise _out_of_range(f"{param}[{i}]", token, "a token id (>= 0)")
        ids.append(token)
    return tuple(ids)


# -- what the API defines and this server does not serve ----------------------------------


def _zero(v: Any) -> bool:
    return v is None or (type(v) in (int, float) and v == 0)


def _false(v: Any) -> bool:
    return v is None or v is False


def _empty(v: Any) -> bool:
    return v is None or (isinstance(v, dict | list) and not v)


NEUTRAL: Mapping[str, tuple[Callable[[Any], bool], str]] = {
    "presence_penalty": (_zero, "0"),
    "frequency_penalty": (_zero, "0"),
    "logit_bias": (_empty, "null or {}"),
    "tools": (_empty, "null or []"),
    "tool_choice": (lambda v: v in (None, "none"), 'null or "none"'),
    "parallel_tool_calls": (lambda v: v is None or isinstance(v, bool), "a boolean"),
    "functions": (_empty, "null or []"),
    "function_call": (lambda v: v in (None, "none"), 'null or "none"'),
    "response_format": (lambda v: v is None or v == {"type": "text"}, '{"type": "text"}'),
    "store": (_false, "null or false"),
    "metadata": (lambda v: v is None or isinstance(v, dict), "an object"),
    "service_tier": (lambda v: v in (None, "auto", "default"), '"auto"'),
    "modalities": (lambda v: v in (None, ["text"]), '["text"]'),
    "echo": (_false, "false"),
    "suffix": (lambda v: v is None or v == "", "null"),
    "best_of": (lambda v: v is None or (type(v) is int and v == 1), "1"),
}
_CHAT_NEUTRAL = frozenset(NEUTRAL) - {"echo", "suffix", "best_of"}
_COMPLETION_NEUTRAL = frozenset(
    {"presence_penalty", "frequency_penalty", "logit_bias", "echo", "suffix", "best_of"}
)


def _unknown(param: str) -> RequestError:
    return RequestError(
        f"Unrecognized request argument supplied: {param}",
        param=param,
        code="unknown_parameter",
    )


_TOKENS = 2**31 - 1  # a bound for the parser; the context bounds them for real
#: The most alternatives per token a request may ask for (OpenAI's bounds): chat's
#: ``top_logprobs``, completions' ``logprobs``.
MAX_TOP_CHAT = 20
MAX_TOP_COMPLETION = 5

_COMMON: dict[str, Rule] = {
    "model": required_string,
    "max_tokens": integer(1, _TOKENS),
    "temperature": number(0.0, 2.0, 1.0),
    "top_p": number(0.0, 1.0, 1.0, open_low=True),
    "top_k": integer(0, _TOKENS, 0),
    "seed": seed,
    "stop": stop,
    "n": choices,
    "stream": boolean,
    "stream_options": stream_options,
    "user": ignored_string,
}
CHAT_FIELDS: Mapping[str, Rule] = {
    **_COMMON,
    "messages": messages,
    "max_completion_tokens": integer(1, _TOKENS),
    "logprobs": boolean,
    "top_logprobs": integer(0, MAX_TOP_CHAT),
    # who asks, and a hint for OpenAI's prompt cache: strings no answer depends on
    "safety_identifier": ignored_string,
    "prompt_cache_key": ignored_string,
}
#: (/v1/completions' logprobs 0 asks for the sampled tokens' log probabilities alone)
COMPLETION_FIELDS: Mapping[str, Rule] = {
    **_COMMON,
    "prompt": prompt,
    "logprobs": integer(0, MAX_TOP_COMPLETION),
}


# -- bodies -------------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; ``RequestError`` for anything else."""
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise RequestError("the request body is not UTF-8", code="invalid_json") from None
    except RecursionError:  # nested past what the interpreter's stack holds
        raise _too_deep() from None
    except ValueError as exc:
        raise RequestError(
            f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(value, dict):
        raise RequestError(
            f"the request body must be a JSON object, not {_type_name(value)}",
            code="invalid_json",
        )
    if _deeper_than(value, MAX_DEPTH):
        raise _too_deep()
    return value


def _too_deep() -> RequestError:
    return RequestError(
        f"the request body nests deeper than {MAX_DEPTH} levels (arrays and objects)",
        code="invalid_json",
    )


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than ``limit`` deep (without recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def _fields(body: bytes, rules: Mapping[str, Rule], neutral: frozenset[str]) -> dict[str, Any]:
    obj = json_object(body)
    for key in obj:
        if key not in rules and key not in neutral:
            raise _unknown(key)
    for key in sorted(neutral & obj.keys()):
        accepts, what = NEUTRAL[key]
        if not accepts(obj[key]):
            raise RequestError(
                f"{key} is {_show(obj[key])}: this server does not serve it (only {what})",
                param=key,
                code="unsupported_parameter",
            )
    values = {key: rule(key, obj.get(key)) for key, rule in rules.items()}
    if obj.get("stream_options") is not None and not values["stream"]:  # as OpenAI's
        raise RequestError(
            "stream_options is only allowed when stream is true",
            param="stream_options",
            code="invalid_value",
        )
    return values


def _common(values: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": values["model"],
        "temperature": values["temperature"],
        "top_p": values["top_p"],
        "top_k": values["top_k"],
        "seed": values["seed"],
        "stop": values["stop"],
        "stream": values["stream"],
        "include_usage": values["stream_options"],
        "n": values["n"],
    }


def parse_chat(body: bytes) -> CompletionRequest:
    """A ``/v1/chat/completions`` body; ``RequestError`` naming what is wrong."""
    v = _fields(body, CHAT_FIELDS, _CHAT_NEUTRAL)
    limit = v["max_completion_tokens"]
    if limit is not None and v["max_tokens"] is not None and limit != v["max_tokens"]:
        raise RequestError(
            f"max_tokens ({v['max_tokens']}) and max_completion_tokens ({limit}) disagree",
            param="max_completion_tokens",
            code="invalid_value",
        )
    if v["top_logprobs"] and not v["logprobs"]:
        raise RequestError(
            f"top_logprobs ({v['top_logprobs']}) is only allowed when logprobs is true",
            param="top_logprobs",
            code="invalid_value",
        )
    return CompletionRequest(
        endpoint="chat",
        logprobs=(v["top_logprobs"] or 0) if v["logprobs"] else None,
        messages=v["messages"],
        max_tokens=limit if limit is not None else v["max_tokens"],
        max_tokens_param="max_tokens" if limit is None else "max_completion_tokens",
        **_common(v),
    )


def parse_completion(body: bytes) -> CompletionRequest:
    """A ``/v1/completions`` body; ``RequestError`` naming what is wrong."""
    v = _fields(body, COMPLETION_FIELDS, _COMPLETION_NEUTRAL)
    return CompletionRequest(
        endpoint="completion",
        prompt=v["prompt"],
        max_tokens=v["max_tokens"],
        logprobs=v["logprobs"],
        **_common(v),
    )
