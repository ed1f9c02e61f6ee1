"""The frames a stage sends the slice server (``protocol``), as the server reads them:
its REQUEST (``SliceRequest``, which the stage writes with ``frame``), its WANT
(``wanted_tensors``) and its DONE (``done_bytes``). A frame that is not what it should
be (a field missing, of another type, or one it may not have) is refused with
``BadFrame``, naming the field and what it held, never with the bare text of a
``KeyError`` or a ``TypeError``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attrs import frozen

from runplan.shards import SliceParts
from runtime_cupy.slices.protocol import TransferError

_PARTS = {"layer_start": int, "layer_end_exclusive": int, "embedding": bool, "output": bool}


class BadFrame(TransferError):
    """A stage's frame is not what it should be; the message names the field."""


@frozen
class SliceRequest:
    """A stage asks for the slice ``parts`` of the source at ``paths`` whose content key
    is ``source_key``."""

    paths: tuple[str, ...]
    source_key: str
    parts: SliceParts

    def frame(self) -> dict[str, Any]:
        """The REQUEST frame's body."""
        parts = self.parts
        return {
            "source": list(self.paths),
            "source_key": self.source_key,
            "parts": {name: getattr(parts, name) for name in _PARTS},
        }

    @classmethod
    def read(cls, doc: Mapping[str, Any]) -> SliceRequest:
        """The request a REQUEST frame's body ``doc`` holds; ``BadFrame`` naming the
        field where it holds none."""
        _only(doc, ("source", "source_key", "parts"), "the slice request")
        paths = doc["source"]
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise BadFrame(f"the slice request's 'source' is {_short(paths)}, not a list of paths")
        key = doc["source_key"]
        if not isinstance(key, str):
            raise BadFrame(f"the slice request's 'source_key' is {_short(key)}, not a string")
        given = doc["parts"]
        if not isinstance(given, Mapping):
            raise BadFrame(f"the slice request's 'parts' is {_short(given)}, not an object")
        _only(given, tuple(_PARTS), "the slice request's 'parts'")
        for name, kind in _PARTS.items():
            value = given[name]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise BadFrame(
                    f"the slice request's 'parts.{name}' is {_short(value)}, not {kind.__name__}"
                )
        return cls(tuple(paths), key, SliceParts(**given))


def wanted_tensors(doc: Mapping[str, Any]) -> frozenset[str] | None:
    """The names of the tensors a WANT frame's body ``doc`` asks for; ``None`` where
    the stage sent no WANT (it gave up after the slice's header)."""
    if "tensors" not in doc:
        return None
    names = doc["tensors"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BadFrame(f"the stage's 'tensors' is {_short(names)}, not a list of tensor names")
    return frozenset(names)


def done_bytes(doc: Mapping[str, Any]) -> int | None:
    """How many bytes the stage says it received in a DONE frame's body ``doc``;
    ``None`` where it says it failed (``ok`` not true)."""
    if not doc.get("ok"):
        return None
    got = doc.get("bytes")
    if not isinstance(got, int) or isinstance(got, bool) or got < 0:
        raise BadFrame(f"the stage's DONE 'bytes' is {_short(got)}, not a count of bytes")
    return got


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _only(doc: Mapping[str, Any], names: tuple[str, ...], what: str) -> None:
    """``BadFrame`` where ``doc`` lacks one of ``names`` or has another field."""
    missing = [name for name in names if name not in doc]
    if missing:
        raise BadFrame(f"{what} has no {', '.join(map(repr, missing))}")
    other = sorted(str(name) for name in doc if name not in names)
    if other:
        raise BadFrame(f"{what} has {', '.join(map(repr, other))}, no field it may have")
