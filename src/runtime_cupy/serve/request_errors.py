"""A request this server refuses (``serve.requests``): ``RequestError``, with OpenAI's
error object, and the refusals that name the bad value (``wrong``: its type,
``out_of_range``, ``unknown``: a field the API does not define), quoting it short
(``show``). A message or parameter name that quotes the body can always be encoded (a
lone surrogate is written as its escape).
"""

from __future__ import annotations

import json
from typing import Any

from runplan.picklable_error import PicklableError


class RequestError(PicklableError, Exception):
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


def _encodable(text: str) -> str:
    """``text`` with what UTF-8 cannot hold (lone surrogates) written as escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def type_name(value: Any) -> str:
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


def wrong(param: str, value: Any, expected: str) -> RequestError:
    """``param`` holds a value of the wrong type: its type and the value (null once)."""
    given = type_name(value) if value is None else f"{type_name(value)} {show(value)}"
    return RequestError(
        f"{param} must be {expected}, not {given}",
        param=param,
        code="invalid_type",
    )


def show(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (ValueError, TypeError, RecursionError):  # never for a body the parser took
        text = type_name(value)
    return text if len(text) <= 40 else text[:37] + "..."


def out_of_range(param: str, value: Any, allowed: str) -> RequestError:
    return RequestError(
        f"{param} is {show(value)}; it must be {allowed}", param=param, code="invalid_value"
    )


def unknown(param: str) -> RequestError:
    return RequestError(
        f"Unrecognized request argument supplied: {param}",
        param=param,
        code="unknown_parameter",
    )
