"""Chrome trace events of a process run (open in https://ui.perfetto.dev).

Every process records its own events with timestamps of the monotonic clock, which all
processes of one host share: the orchestrator keeps them in memory, a stage writes them
to a file when it exits (a warm stage, which serves many runs, also when each run ends,
before it reports ``StageStopped``), and the launcher merges them into one trace with
one track per process (the orchestrator and each stage)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

Event = dict[str, Any]


def now_us() -> int:
    return time.monotonic_ns() // 1000


class TraceLog:
    """The events of one process; a disabled log records nothing."""

    def __init__(self, name: str, *, enabled: bool = True, pid: int | None = None) -> None:
        self.name = name
        self.enabled = enabled
        self.pid = os.getpid() if pid is None else pid
        self.events: list[Event] = []

    def instant(self, name: str, **args: Any) -> None:
        if self.enabled:
            self.events.append(
                {
                    "name": name,
                    "ph": "i",
                    "s": "t",
                    "ts": now_us(),
                    "pid": self.pid,
                    "tid": self.pid,
                    "args": args,
                }
            )

    def span(self, name: str, start_us: int, **args: Any) -> None:
        """A span from ``start_us`` to now."""
        if self.enabled:
            end = now_us()
            self.events.append(
                {
                    "name": name,
                    "ph": "X",
                    "ts": start_us,
                    "dur": max(1, end - start_us),
                    "pid": self.pid,
                    "tid": self.pid,
                    "args": args,
                }
            )

    def metadata(self) -> list[Event]:
        return [
            {"name": "process_name", "ph": "M", "pid": self.pid, "args": {"name": self.name}},
            {
                "name": "thread_name",
                "ph": "M",
                "pid": self.pid,
                "tid": self.pid,
                "args": {"name": self.name},
            },
        ]

    def write(self, path: Path) -> None:
        """Write the events whole (a reader never sees half a file)."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(self.metadata() + self.events))
        os.replace(tmp, path)

    def flush(self, path: Path) -> None:
        """Write the events recorded since the last flush and forget them (a stage that
        serves many runs writes each run's events when the run ends)."""
        self.write(path)
        self.events = []


def read_events(path: Path) -> list[Event]:
    """A stage's events (none if it never wrote them, e.g. it was killed)."""
    try:
        events = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [e for e in events if isinstance(e, dict)] if isinstance(events, list) else []


def chrome_trace(events: list[Event]) -> dict[str, Any]:
    return {"traceEvents": events, "displayTimeUnit": "ms"}
