"""The rules of single values of a request body (``serve.requests``): each a ``Rule``,
``(param, value or None when absent / null) -> value``, checking type and range before
the value is used (a 400-digit integer is out of range, not an ``OverflowError``) and
raising ``RequestError`` naming the parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from runtime_cupy.serve.request_errors import RequestError, out_of_range, unknown, wrong

SEED_MAX = 2**64 - 1
MAX_STOPS = 4  # as OpenAI

Rule = Callable[[str, Any], Any]  # (param, value or None when absent / null) -> value


def required_string(param: str, value: Any) -> str:
    if value is None:
        raise RequestError(f"you must provide {param}", param=param, code="missing_required")
    if not isinstance(value, str):
        raise wrong(param, value, "a string")
    return value


def integer(low: int, high: int, default: int | None = None) -> Rule:
    def rule(param: str, value: Any) -> int | None:
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)  # 16.0 is 16, as JSON numbers go
            else:
                raise wrong(param, value, "an integer")
        if not low <= value <= high:
            raise out_of_range(param, value, f"in {low}..{high}")
        return int(value)

    return rule


def number(low: float, high: float, default: float, *, open_low: bool = False) -> Rule:
    def rule(param: str, value: Any) -> float:
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise wrong(param, value, "a number")
        bracket = "(" if open_low else "["
        try:
            x = float(value)
        except OverflowError:  # an integer past every float
            raise out_of_range(param, value, f"in {bracket}{low:g}, {high:g}]") from None
        if not math.isfinite(x) or x > high or x < low or (open_low and x == low):
            raise out_of_range(param, value, f"in {bracket}{low:g}, {high:g}]")
        return x

    return rule


def boolean(param: str, value: Any) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise wrong(param, value, "a boolean")
    return value


def seed(param: str, value: Any) -> int | None:
    """An integer in ``0..2**64-1``; null or -1 (llama.cpp's "random") is a new seed."""
    if value is None or (type(value) is int and value == -1):
        return None
    if type(value) is int and value < 0:
        raise out_of_range(param, value, f"in 0..{SEED_MAX}, or -1 (or null) for a random seed")
    checked = integer(0, SEED_MAX)(param, value)
    assert checked is not None
    return int(checked)


def stop(param: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise wrong(param, value, "a string or an array of strings")
    if len(items) > MAX_STOPS:
        raise out_of_range(param, value, f"at most {MAX_STOPS} strings")
    for i, item in enumerate(items):
        where = param if isinstance(value, str) else f"{param}[{i}]"
        if not isinstance(item, str):
            raise wrong(where, item, "a string")
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
        raise wrong(param, value, "an object")
    for key in value:
        if key not in ("include_usage", "include_obfuscation"):
            raise unknown(f"{param}.{key}")
    boolean(f"{param}.include_obfuscation", value.get("include_obfuscation"))
    return boolean(f"{param}.include_usage", value.get("include_usage"))


def ignored_string(param: str, value: Any) -> None:
    """A string the answer does not depend on (``user``)."""
    if value is not None and not isinstance(value, str):
        raise wrong(param, value, "a string")
