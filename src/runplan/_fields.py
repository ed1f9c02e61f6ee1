"""Field helpers for the value classes.

Value classes check the *types* of their fields and nothing else: a combination of
values that contradicts the contract is for ``plan_run`` and ``check_plan`` to
reject, so a plan read off the wire or built by hand can still be checked.

Converters and defaults are module-level functions, never lambdas: a field's
``TypeError`` carries its ``attrs.Attribute``, and pickling it (a process pool, a Ray
task) pickles them too.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
from attrs import validators as v


def _not_bool(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool):
        raise TypeError(f"'{attribute.name}' must be an int, not bool ({value!r})")


def int_field(**kwargs: Any) -> Any:
    """An ``int`` field (``bool`` refused)."""
    return attrs.field(validator=[v.instance_of(int), _not_bool], **kwargs)


def _activation_width(self: Any) -> Any:
    return self.dtype_width_bytes


def kv_width_field() -> Any:
    """The KV cache's element width (``kv_dtype_width_bytes``): by default, where a plan
    or message written without it is read, the activations' (``dtype_width_bytes``, a
    field before it), as the planner counted the cache then."""
    return int_field(default=attrs.Factory(_activation_width, takes_self=True))


def float_field(**kwargs: Any) -> Any:
    """A ``float`` field; an ``int`` is converted (``bool`` is not, and is refused)."""
    return attrs.field(converter=_float_member, validator=v.instance_of(float), **kwargs)


def str_field(**kwargs: Any) -> Any:
    return attrs.field(validator=v.instance_of(str), **kwargs)


def bool_field(**kwargs: Any) -> Any:
    return attrs.field(validator=v.instance_of(bool), **kwargs)


def typed_field(cls: type | tuple[type, ...], **kwargs: Any) -> Any:
    return attrs.field(validator=v.instance_of(cls), **kwargs)


def _to_tuple(value: object) -> object:
    if isinstance(value, list):
        return tuple(value)
    return value


def tuple_field(member: type | tuple[type, ...], **kwargs: Any) -> Any:
    """A tuple field whose members are ``member``; a list is converted to a tuple."""
    return attrs.field(
        converter=_to_tuple,
        validator=v.deep_iterable(
            member_validator=v.instance_of(member), iterable_validator=v.instance_of(tuple)
        ),
        **kwargs,
    )


def int_tuple_field(**kwargs: Any) -> Any:
    """A tuple of ``int`` (``bool`` refused)."""
    return attrs.field(
        converter=_to_tuple,
        validator=v.deep_iterable(
            member_validator=[v.instance_of(int), _not_bool],
            iterable_validator=v.instance_of(tuple),
        ),
        **kwargs,
    )


def _float_member(value: object) -> object:
    """An ``int`` as a ``float``; one past a float's range as an infinity of its sign
    (``float()`` raised ``OverflowError``, naming no field), which ``plan_run`` rejects
    naming the field as it does any value out of range."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            return math.inf if value > 0 else -math.inf
    return value


def _to_float_tuple(value: object) -> object:
    if isinstance(value, list | tuple):
        return tuple(_float_member(m) for m in value)
    return value


def float_tuple_field(**kwargs: Any) -> Any:
    """A tuple of ``float`` (an ``int`` member is converted; ``bool`` refused)."""
    return attrs.field(
        converter=_to_float_tuple,
        validator=v.deep_iterable(
            member_validator=v.instance_of(float), iterable_validator=v.instance_of(tuple)
        ),
        **kwargs,
    )
