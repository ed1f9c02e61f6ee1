"""The wire codec: ``dumps(obj) -> bytes`` and ``loads(data) -> obj`` for ``RunPlan``
and every control message (``runplan.messages.ControlMessage``).

The encoding is canonical JSON (sorted keys, no spaces, UTF-8) of the message's
fields, tagged with ``"type"``. Decoding is strict: an unknown type, a missing or extra
key, a value of the wrong JSON type, a negative or over-64-bit integer, a non-finite
number or invalid UTF-8 raise ``WireError`` and nothing else. A key is missing even
where its field has a default (``dumps`` writes every field), except the keys of
``OPTIONAL_KEYS``, which messages written before them lack.
"""

from __future__ import annotations

import enum
import json
import math
from typing import Any, TypeAlias, get_args, get_origin

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn
from cattrs.strategies import configure_tagged_union

from runplan.messages import (
    JoinChain,
    ProvisionRefused,
    ProvisionStage,
    RewireEdge,
    StageFault,
    StageReady,
    StageStopped,
    StopRun,
)
from runplan.plan import U64_MAX, OrchestratorEndpoint, RunPlan, StageEndpoint

#: Largest message ``loads`` accepts.
MAX_MESSAGE_BYTES = 64 * 2**20

#: The types that travel on their own (tagged by ``"type"``).
WireMessage: TypeAlias = (
    RunPlan
    | ProvisionStage
    | StopRun
    | StageReady
    | StageFault
    | StageStopped
    | ProvisionRefused
    | RewireEdge
    | JoinChain
)
MESSAGE_TYPES: tuple[type, ...] = get_args(WireMessage)

_TAG = "type"

#: The keys a message may lack, each read as its field's default, because plans and
#: provisions written before the field was carried lack them: the KV cache's width
#: (``kv_dtype_width_bytes`` of a plan's and a provision's model; read as the
#: activations' width, the width the planner counted the cache at then) and the model's
#: end-of-generation ids (``eog_token_ids``; read as none: ``eos_token_id`` alone ends a
#: run, as it did then).
OPTIONAL_KEYS = frozenset({"kv_dtype_width_bytes", "eog_token_ids"})


class WireError(ValueError):
    """Bytes that are not a well-formed message of a known type."""


def _strict_int(value: Any, _type: Any) -> int:
    if type(value) is not int:
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    if not 0 <= value <= U64_MAX:
        raise ValueError(f"integer {value} outside 0..2**64-1")
    return value


def _strict_float(value: Any, _type: Any) -> float:
    if type(value) not in (int, float):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError("number is not finite")
    return result


def _strict_str(value: Any, _type: Any) -> str:
    if type(value) is not str:
        raise TypeError(f"expected a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a string holds a lone surrogate") from None
    return value


def _strict_bool(value: Any, _type: Any) -> bool:
    if type(value) is not bool:
        raise TypeError(f"expected true or false, got {type(value).__name__}")
    return value


def _is_tuple(t: Any) -> bool:
    return get_origin(t) is tuple


def _tuple_hook(t: Any, converter: cattrs.Converter) -> Any:
    args = get_args(t)
    if len(args) != 2 or args[1] is not Ellipsis:
        raise TypeError(f"the wire has only homogeneous tuples, not {t}")
    member = converter.get_structure_hook(args[0])

    def structure(value: Any, _type: Any) -> tuple[Any, ...]:
        if type(value) is not list:
            raise TypeError(f"expected a list, got {type(value).__name__}")
        return tuple(member(v, args[0]) for v in value)

    return structure


def _is_enum(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, enum.Enum)


def _enum_hook(t: Any) -> Any:
    def structure(value: Any, _type: Any) -> Any:
        if type(value) is not str:
            raise TypeError(f"expected a {t.__name__} name, got {type(value).__name__}")
        return t(value)

    return structure


def _complete_hook(cl: type, converter: cattrs.Converter) -> Any:
    """cattrs's hook for the attrs class ``cl``, which first requires every key but those
    of ``OPTIONAL_KEYS`` (cattrs fills in a missing key that has a default)."""
    inner: Any = make_dict_structure_fn(cl, converter)
    required = tuple(f.name for f in attrs.fields(cl) if f.name not in OPTIONAL_KEYS)

    def structure(value: Any, _type: Any) -> Any:
        if type(value) is not dict:
            raise TypeError(f"expected a {cl.__name__} object, got {type(value).__name__}")
        missing = [key for key in required if key not in value]
        if missing:
            keys = "the key" if len(missing) == 1 else "the keys"
            raise ValueError(f"{cl.__name__} lacks {keys} {', '.join(map(repr, missing))}")
        return inner(value, _type)

    return structure


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=False)
    conv.register_structure_hook_factory(attrs.has, lambda cl: _complete_hook(cl, conv))
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook_factory(_is_enum, _enum_hook)
    conv.register_structure_hook_factory(_is_tuple, lambda t: _tuple_hook(t, conv))
    configure_tagged_union(OrchestratorEndpoint | StageEndpoint, conv, tag_name=_TAG)
    configure_tagged_union(WireMessage, conv, tag_name=_TAG)
    return conv


_converter = _make_converter()


def dumps(obj: Any) -> bytes:
    """Encode a message (any of ``MESSAGE_TYPES``); ``WireError`` for a value no peer's
    ``loads`` takes (a non-finite number, an integer outside ``0..2**64-1``, a string
    holding a lone surrogate), before it is sent."""
    if not isinstance(obj, MESSAGE_TYPES):
        raise TypeError(f"{type(obj).__name__} is not a wire message type")
    raw = _converter.unstructure(obj, unstructure_as=WireMessage)
    try:
        _check_values(raw)
        return _ENCODER.encode(raw).encode()
    except ValueError as exc:
        raise WireError(f"{type(obj).__name__} cannot be encoded: {exc}") from None


def _check_values(raw: Any) -> None:
    """``ValueError`` for an integer or a string in ``raw`` (unstructured: dicts, lists,
    scalars) that ``loads``'s strict hooks would refuse."""
    if type(raw) is dict:
        for value in raw.values():
            _check_values(value)
    elif type(raw) is list:
        for value in raw:
            _check_values(value)
    elif type(raw) is int and not 0 <= raw <= U64_MAX:
        raise ValueError(f"integer {raw} outside 0..2**64-1")
    elif type(raw) is str:
        _strict_str(raw, str)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number the wire allows")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members as a dict; a key twice is malformed (``dumps`` never writes
    one, and which of the two a reader takes is a reader's choice)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"the key {key!r} appears twice in an object")
            seen.add(key)
    return out


# What ``json.dumps`` / ``json.loads`` would make on every call with these arguments.
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False)
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_unique_keys)


def loads(data: bytes | bytearray | memoryview) -> Any:
    """Decode one message; ``WireError`` on anything malformed or unknown."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        text = bytes(data).decode("utf-8")
        if text.startswith("\ufeff"):  # what json.loads says before decoding
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        raw = _DECODER.decode(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireError(f"not a JSON message: {exc}") from None
    if type(raw) is not dict:
        raise WireError(f"a message is a JSON object, not {type(raw).__name__}")
    tag = raw.get(_TAG)
    if type(tag) is not str or tag not in _TYPE_NAMES:
        raise WireError(f"unknown message type {tag!r}; known: {sorted(_TYPE_NAMES)}")
    try:
        return _converter.structure(raw, WireMessage)  # type: ignore[arg-type]
    except Exception as exc:  # cattrs, attrs validators: every failure is a WireError
        raise WireError(f"malformed {tag}: {_describe(exc)}") from None


_TYPE_NAMES = frozenset(t.__name__ for t in MESSAGE_TYPES)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"
