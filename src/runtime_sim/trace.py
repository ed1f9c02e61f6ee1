"""The simulation's trace: every event each machine handled and every action it
took, every control message and every ring operation, stamped with virtual time.
The invariant checker reads it; ``chrome_trace`` turns it into Chrome trace events
(open in https://ui.perfetto.dev)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

#: (time_us, actor, kind, what, detail): ``kind`` is "ev" (an event a machine handled),
#: "act" (an action it took), "net" (a control message), "ring" (a ring operation),
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
    """Chrome trace events: one track per actor, with steps and loads as spans, each
    stage's waits for its next input as "wait" spans (the pipeline's bubbles), and
    messages as instants."""
    tid = {actor: i for i, actor in enumerate(actors)}
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 1, "tid": i, "name": "thread_name", "args": {"name": actor}}
        for actor, i in tid.items()
    ]
    idle_since: dict[str, int] = {}  # stage -> when it last became free for work
    for time_us, actor, kind, what, detail in entries:
        if kind == "state" and what == "READY" and actor not in idle_since:
            idle_since[actor] = time_us
        elif kind == "ev" and what == "ObjectLoaded" and actor in idle_since:
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
                        "args": {"for": f"sequence {detail[0]}"},
                    }
                )
        elif kind == "state" and what != "READY":
            idle_since.pop(actor, None)
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
