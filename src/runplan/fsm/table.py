"""What both state machines share: a transition table held as data, and its rendering
as a Mermaid state diagram.

A table maps ``(state, event kind)`` to a ``Transition``: the handler that computes the
next machine and its actions, the states it may lead to (for the diagram and for the
exhaustive tests) and a label for the guard it applies. A pair that is not in the
table is a protocol violation, handled by each machine's fault path.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import attrs
from attrs import frozen

S = TypeVar("S", bound=enum.Enum)  # state
K = TypeVar("K", bound=enum.Enum)  # event kind
M = TypeVar("M")  # a machine


def evolver(cls: type[M]) -> Callable[..., M]:
    """``attrs.evolve`` for one attrs class, made once: ``evolve(m, field=value, ...)``
    is ``cls(...)`` with every field of ``m`` but those given, as ``attrs.evolve``
    does, without looking the fields up on every call (a machine evolves a few times
    per event). Only for classes whose fields all go through ``__init__`` under their
    own names."""
    fields = attrs.fields(cls)  # type: ignore[arg-type]
    names = [a.name for a in fields]
    if any(not a.init or a.alias != a.name or not a.name.isidentifier() for a in fields):
        raise TypeError(f"{cls.__name__}: every field must be an __init__ argument of its name")
    params = ", ".join(f"{n}=_SAME" for n in names)
    args = ", ".join(f"m.{n} if {n} is _SAME else {n}" for n in names)
    namespace: dict[str, Any] = {"cls": cls, "_SAME": object()}
    exec(f"def evolve(m, *, {params}):\n    return cls({args})\n", namespace)
    evolve: Callable[..., M] = namespace["evolve"]
    evolve.__qualname__ = f"evolver({cls.__name__})"
    return evolve


@frozen
class Transition(Generic[S]):
    handler: Callable[[Any, Any], tuple[Any, tuple[Any, ...]]]
    # Every state the handler may return, with what leads there (for the diagram; a
    # target back to the same state with no label is not drawn).
    targets: Mapping[S, str]


def by_value(table: Mapping[tuple[S, K], Transition[S]]) -> dict[tuple[Any, Any], Transition[S]]:
    """``table`` keyed by the values of its states and event kinds, for a machine's
    ``step``: a key of two Enum members runs both members' Python-level ``__hash__`` on
    every event. The table stays the one source; this is made from it at import."""
    return {(state._value_, kind._value_): t for (state, kind), t in table.items()}


def mermaid(title: str, initial: enum.Enum, table: Mapping[tuple[S, K], Transition[S]]) -> str:
    """A Mermaid ``stateDiagram-v2`` of ``table``, in a stable order. Transitions back to
    the same state are drawn only when they do something (their label)."""
    lines = [f"---\ntitle: {title}\n---", "stateDiagram-v2", f"    [*] --> {initial.name}"]
    edges: dict[tuple[str, str], list[str]] = {}
    for (state, kind), transition in table.items():
        for target, text in transition.targets.items():
            if target is state and not text:
                continue
            label = kind.name + (f": {text}" if text else "")
            edges.setdefault((state.name, target.name), []).append(label)
    for (source_name, target_name), labels in edges.items():
        lines.append(f"    {source_name} --> {target_name}: {'<br/>'.join(labels)}")
    terminal = [
        s
        for s in type(initial)
        if all(t is s for (state, _), tr in table.items() if state is s for t in tr.targets)
    ]
    lines += [f"    {s.name} --> [*]" for s in terminal]
    return "\n".join(lines) + "\n"
