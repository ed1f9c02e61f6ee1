"""The simulation's trace: every event each machine handled and every action it
took, every control message and every ring operation, stamped with virtual time.
The invariant checker reads it; ``chrome_trace`` turns it into Chrome trace events
(open in https://ui.perfetto.dev)."""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Iterable
from operator import attrgetter
from typing import Any

import attrs

from runplan.fsm import orchestrator as ofsm
from runplan.fsm import stage as sfsm

#: (time_us, actor, kind, what, detail): ``kind`` is "ev" (an event a machine handled),
#: "act" (an action it took), "ctl" (a controller's own trace: its fields), "net" (a
#: control message), "ring" (a ring operation),
#: "span" (a step or a load, detail holds its duration) or "sim" (the simulator).
Entry = tuple[int, str, str, str, tuple[Any, ...]]


class Trace:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.entries: list[Entry] = []

    def add(self, time_us: int, actor: str, kind: str, what: str, *detail: Any) -> None:
        if self.enabled:
            self.entries.append((time_us, actor, kind, what, detail))

    def of(self, kind: str, what: str | None = None, actor: str | None = None) -> list[Entry]:
        return [
            e
            for e in self.entries
            if e[2] == kind and (what is None or e[3] == what) and (actor is None or e[1] == actor)
        ]

    def dumps(self) -> str:
        """One JSON line per entry: byte-identical for the same seed and inputs."""
        return "\n".join(
            json.dumps(list(e), separators=(",", ":"), default=str) for e in self.entries
        )


def chrome_trace(entries: Iterable[Entry], actors: list[str]) -> dict[str, Any]:
    """Chrome trace events: one track per actor, with batches ("step ...") and loads as
    spans, each stage's waits for its next batch as "wait" spans (the pipeline's
    bubbles), and messages as instants."""
    tid = {actor: i for i, actor in enumerate(actors)}
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 1, "tid": i, "name": "thread_name", "args": {"name": actor}}
        for actor, i in tid.items()
    ]
    idle_since: dict[str, int] = {}  # stage -> when it last became free for work
    for time_us, actor, kind, what, detail in entries:
        if kind == "ctl" and what == "state" and detail[0]["to"] == "READY":
            idle_since.setdefault(actor, time_us)
        elif kind == "sim" and what == "batch_end":
            idle_since[actor] = time_us
        elif kind == "sim" and what == "batch_begin" and actor in idle_since:
            began = idle_since.pop(actor)
            if time_us > began:
                events.append(
                    {
                        "pid": 1,
                        "tid": tid.setdefault(actor, len(tid)),
                        "ts": began,
                        "ph": "X",
                        "name": "wait",
                        "dur": time_us - began,
                        "args": {},
                    }
                )
        if actor not in tid:
            tid[actor] = len(tid)
            events.append(
                {
                    "ph": "M",
                    "pid": 1,
                    "tid": tid[actor],
                    "name": "thread_name",
                    "args": {"name": actor},
                }
            )
        base = {"pid": 1, "tid": tid[actor], "ts": time_us}
        if kind == "span":
            events.append(
                {
                    **base,
                    "ph": "X",
                    "name": what,
                    "dur": detail[0],
                    "args": {"detail": list(detail[1:])},
                }
            )
        elif (
            kind in ("net", "sim")
            or (kind == "act" and what in ("InjectTokens", "SendToOrchestrator", "RunFinished"))
            or (kind == "ev" and what in ("TokenConsumed",))
            or (kind == "ctl" and what in ("batch", "finished", "chain_fault", "queued"))
        ):
            events.append(
                {
                    **base,
                    "ph": "i",
                    "s": "t",
                    "name": f"{what}",
                    "args": {"detail": [str(d) for d in detail]},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


# -- how each event and action is described ----------------------------------------------


#: The fields ``describe`` reports of any other event or action, in this order.
_DESCRIBED = ("sequence", "part", "timer", "edge_id", "run_id", "reason", "token_id", "stage_index")
Describer = Callable[[Any], tuple[Any, ...]]
#: How ``describe`` describes each class it met (made once per class by ``_describer``).
DESCRIBERS: dict[type, Describer] = {}


def describe(obj: Any) -> tuple[Any, ...]:
    """The fields of an event or action the checker and the trace need."""
    cls = type(obj)
    return (DESCRIBERS.get(cls) or learn_describer(cls))(obj)


def learn_describer(cls: type) -> Describer:
    describer = DESCRIBERS[cls] = _describer(cls)
    return describer


def _describe_received(obj: Any) -> tuple[Any, ...]:
    m = obj.message
    return (
        obj.sender,
        type(m).__name__,
        getattr(m, "run_id", None),
        getattr(m, "stage_index", None),
        getattr(m, "node_id", None),
    )


def _describe_to_orchestrator(obj: Any) -> tuple[Any, ...]:
    m = obj.message
    return (type(m).__name__, m.stage_index, str(getattr(m, "reason", "")))


def _describe_to_stage(obj: Any) -> tuple[Any, ...]:
    return (obj.stage_index, obj.node_id)


def _describe_inject(obj: Any) -> tuple[Any, ...]:
    return (obj.sequence, len(obj.token_ids))


def _describe_finished(obj: Any) -> tuple[Any, ...]:
    return (obj.outcome.value, len(obj.tokens), str(obj.fault) if obj.fault else None)


def _describe_fields(obj: Any, names: tuple[str, ...]) -> tuple[Any, ...]:
    fields = []
    for name in names:
        value = getattr(obj, name)
        fields.append(value._name_ if isinstance(value, enum.Enum) else value)
    return tuple(fields)


def _describe_any(obj: Any) -> tuple[Any, ...]:
    return _describe_fields(obj, tuple(name for name in _DESCRIBED if hasattr(obj, name)))


def _describer(cls: type) -> Describer:
    """How to describe the instances of ``cls``: the messages and actions the checker
    reads have their own fields; any other event or action reports those of
    ``_DESCRIBED`` it has, enum members by name."""
    if issubclass(cls, (sfsm.Received, ofsm.Received)):
        return _describe_received
    if issubclass(cls, sfsm.SendToOrchestrator):
        return _describe_to_orchestrator
    if issubclass(cls, (ofsm.SendProvision, ofsm.SendStopRun)):
        return _describe_to_stage
    if issubclass(cls, ofsm.InjectTokens):
        return _describe_inject
    if issubclass(cls, ofsm.RunFinished):
        return _describe_finished
    names = _described_fields(cls)
    if names is None:
        return _describe_any
    return _fields_describer(names)


def _plain(value: Any) -> Any:
    return value._name_ if isinstance(value, enum.Enum) else value


def _fields_describer(names: tuple[str, ...]) -> Describer:
    """``_describe_fields(obj, names)`` for one set of names, unrolled for the few
    fields an event or action has (it runs for every one traced)."""
    if not names:
        return lambda obj: ()
    get = attrgetter(*names)
    Enum = enum.Enum
    if len(names) == 1:

        def describe_one(obj: Any) -> tuple[Any, ...]:
            a = get(obj)
            return (a._name_ if isinstance(a, Enum) else a,)

        return describe_one
    if len(names) == 2:

        def describe_two(obj: Any) -> tuple[Any, ...]:
            a, b = get(obj)
            return (
                a._name_ if isinstance(a, Enum) else a,
                b._name_ if isinstance(b, Enum) else b,
            )

        return describe_two
    if len(names) == 3:

        def describe_three(obj: Any) -> tuple[Any, ...]:
            a, b, c = get(obj)
            return (
                a._name_ if isinstance(a, Enum) else a,
                b._name_ if isinstance(b, Enum) else b,
                c._name_ if isinstance(c, Enum) else c,
            )

        return describe_three
    return lambda obj: tuple(map(_plain, get(obj)))


def _described_fields(cls: type) -> tuple[str, ...] | None:
    """The names of ``_DESCRIBED`` that every instance of ``cls`` has, when the class
    alone decides it: an attrs class whose fields are all set by ``__init__`` and that
    has no other attribute of those names. None otherwise (ask each instance)."""
    getattribute: Any = cls.__getattribute__
    custom_lookup = hasattr(cls, "__getattr__") or getattribute is not object.__getattribute__
    if not attrs.has(cls) or custom_lookup:
        return None
    fields = {a.name: a for a in attrs.fields(cls)}
    names = []
    for name in _DESCRIBED:
        if name in fields:
            if not fields[name].init:
                return None
            names.append(name)
        elif hasattr(cls, name):
            return None
    return tuple(names)
