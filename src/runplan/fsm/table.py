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

from attrs import frozen

S = TypeVar("S", bound=enum.Enum)  # state
K = TypeVar("K", bound=enum.Enum)  # event kind


@frozen
class Transition(Generic[S]):
    handler: Callable[[Any, Any], tuple[Any, tuple[Any, ...]]]
    # Every state the handler may return, with what leads there (for the diagram; a
    # target back to the same state with no label is not drawn).
    targets: Mapping[S, str]


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
