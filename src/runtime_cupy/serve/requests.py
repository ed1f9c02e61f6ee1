"""The bodies of ``POST /v1/chat/completions`` and ``POST /v1/completions``, checked
into typed values (OpenAI's API reference for what each field means).

A body is one JSON object. Every field the API defines has a rule here, as data
(``CHAT_FIELDS``, ``COMPLETION_FIELDS``): the fields this server serves are checked for
type and range (log probabilities among them, on a server started with ``--logprobs``);
those it does not serve (penalties, logit bias, tools, ...) are accepted only at the
value that changes nothing (``NEUTRAL``), so a
request is never answered as if a setting applied that did not; any other field is
refused by name, as OpenAI refuses an unrecognized argument. Message objects are
strict the same way.

The rules of single values are ``request_rules``'s, messages and prompts
``request_messages``'s, ``RequestError`` and the texts naming a bad value
``request_errors``'s (``Message``, ``RequestError`` and ``MAX_CHOICES`` are importable
from here too).

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
from collections.abc import Callable, Mapping
from typing import Any

from attrs import frozen

from runtime_cupy.serve.request_errors import RequestError, show, type_name, unknown
from runtime_cupy.serve.request_messages import Message, messages, prompt, prompt_ids_param
from runtime_cupy.serve.request_rules import (
    MAX_CHOICES,
    Rule,
    boolean,
    choices,
    ignored_string,
    integer,
    number,
    required_string,
    seed,
    stop,
    stream_options,
)

__all__ = [
    "CHAT_FIELDS",
    "COMPLETION_FIELDS",
    "MAX_CHOICES",
    "MAX_DEPTH",
    "MAX_TOP_CHAT",
    "MAX_TOP_COMPLETION",
    "NEUTRAL",
    "CompletionRequest",
    "Message",
    "RequestError",
    "json_object",
    "parse_chat",
    "parse_completion",
]

#: How deep a body may nest: an object holding messages holding parts is 5 deep.
MAX_DEPTH = 32


@frozen
class CompletionRequest:
    """One request, checked. ``messages`` for a chat, ``prompt`` (text or token ids)
    for a completion. ``max_tokens`` ``None``: the endpoint's default. ``seed`` ``None``:
    a new seed for this request."""

    endpoint: str  # "chat" or "completion"
    model: str
    messages: tuple[Message, ...] = ()
    prompt: str | tuple[int, ...] = ""
    #: Where the prompt's token ids are in the body (``prompt[0]`` in an array of one).
    prompt_param: str = "prompt"
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
    #: A completion's text starts with its prompt's (as given, or its token ids' text).
    echo: bool = False


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
    "suffix": (lambda v: v is None or v == "", "null"),
    "best_of": (lambda v: v is None or (type(v) is int and v == 1), "1"),
}
_CHAT_NEUTRAL = frozenset(NEUTRAL) - {"suffix", "best_of"}
_COMPLETION_NEUTRAL = frozenset(
    {"presence_penalty", "frequency_penalty", "logit_bias", "suffix", "best_of"}
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
    "echo": boolean,
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
            f"the request body must be a JSON object, not {type_name(value)}",
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


def _fields(
    obj: dict[str, Any], rules: Mapping[str, Rule], neutral: frozenset[str]
) -> dict[str, Any]:
    for key in obj:
        if key not in rules and key not in neutral:
            raise unknown(key)
    for key in sorted(neutral & obj.keys()):
        accepts, what = NEUTRAL[key]
        if not accepts(obj[key]):
            raise RequestError(
                f"{key} is {show(obj[key])}: this server does not serve it (only {what})",
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
    v = _fields(json_object(body), CHAT_FIELDS, _CHAT_NEUTRAL)
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
    obj = json_object(body)
    v = _fields(obj, COMPLETION_FIELDS, _COMPLETION_NEUTRAL)
    if obj.get("best_of") is not None and v["n"] > obj["best_of"]:  # as OpenAI refuses it
        raise RequestError(
            f"best_of is {show(obj['best_of'])} and n is {v['n']}: best_of, the candidates "
            "the n choices are picked from, must be at least n (or null)",
            param="best_of",
            code="invalid_value",
        )
    if v["echo"] and v["logprobs"] is not None:
        raise RequestError(
            "echo with logprobs asks for the prompt's log probabilities, which this server "
            "does not compute: echo without logprobs, or logprobs without echo",
            param="echo",
            code="unsupported_parameter",
        )
    return CompletionRequest(
        endpoint="completion",
        prompt=v["prompt"],
        prompt_param=prompt_ids_param("prompt", obj["prompt"]),
        max_tokens=v["max_tokens"],
        logprobs=v["logprobs"],
        echo=v["echo"],
        **_common(v),
    )
