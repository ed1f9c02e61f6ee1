"""Chrome trace events of a process run (open in https://ui.perfetto.dev).

Every process records its own events with timestamps of the monotonic clock, which all
processes of one host share: the orchestrator keeps them in memory, a stage writes them
to a file when it exits (a warm stage, which serves many runs, also when each run ends,
before it reports ``StageStopped``), and the launcher merges them into one trace with
one track per process (the orchestrator and each stage). A stage's file lies in a
folder of its own that the launcher made (``TRACE_FOLDER_PREFIX``) and removes once
the stage has exited; a stage whose orchestrator is gone, so that no one will read its
file, removes the file and the folder itself (``TraceLog.discard``)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

Event = dict[str, Any]

#: The start of the name of the temporary folder a launcher makes for a stage's trace.
TRACE_FOLDER_PREFIX = "gguf-pipeline-trace-"
#: The file in such a folder that its launcher holds locked (``process.trace_folders``).
TRACE_FOLDER_LOCK = ".held"


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
        tmp = self._partial(path)
        tmp.write_text(json.dumps(self.metadata() + self.events))
        os.replace(tmp, path)

    def discard(self, path: Path) -> None:
        """Forget the events and remove ``path`` (with any half-written copy of this
        process's), and its folder where a launcher made it for the trace
        (``TRACE_FOLDER_PREFIX``) and nothing else is left in it: what no one will read."""
        self.events = []
        for name in (path, self._partial(path)):
            with contextlib.suppress(FileNotFoundError):
                name.unlink()
        if path.parent.name.startswith(TRACE_FOLDER_PREFIX):
            with contextlib.suppress(FileNotFoundError):  # its launcher's lock: gone too
                (path.parent / TRACE_FOLDER_LOCK).unlink()
            with contextlib.suppress(OSError):  # not empty, or gone: left as it is
                path.parent.rmdir()

    @staticmethod
    def _partial(path: Path) -> Path:
        return path.with_name(f".{path.name}.{os.getpid()}")

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
