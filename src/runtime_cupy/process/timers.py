"""Deadlines for the state machines' timers: the ``Timers`` port of both controllers
(``start(timer, ms)`` / ``cancel(timer)``) on the monotonic clock. The event loops read
the next deadline to bound their waits and fire what is due."""

from __future__ import annotations

import time
from typing import Generic, TypeVar

T = TypeVar("T")


class Deadlines(Generic[T]):
    def __init__(self) -> None:
        self._due: dict[T, float] = {}

    def start(self, timer: T, ms: int) -> None:
        self._due[timer] = time.monotonic() + ms / 1000.0

    def cancel(self, timer: T) -> None:
        self._due.pop(timer, None)

    def next_due(self) -> float | None:
        """The earliest deadline (monotonic seconds), or ``None``."""
        return min(self._due.values()) if self._due else None

    def expired(self, now: float) -> list[T]:
        """The timers due by ``now``, earliest first; they are no longer running."""
        if not self._due:
            return []
        due = sorted((at, i, t) for i, (t, at) in enumerate(self._due.items()) if at <= now)
        for _, _, timer in due:
            del self._due[timer]
        return [timer for _, _, timer in due]


class RunDeadlines(Generic[T]):
    """The ``RunTimers`` port of the chain controllers: each run's timers
    (``start(run_id, timer, ms)`` / ``cancel(run_id, timer)``), due as ``(run_id,
    timer)`` pairs."""

    def __init__(self) -> None:
        self._due: Deadlines[tuple[str, T]] = Deadlines()

    def start(self, run_id: str, timer: T, ms: int) -> None:
        self._due.start((run_id, timer), ms)

    def cancel(self, run_id: str, timer: T) -> None:
        self._due.cancel((run_id, timer))

    def next_due(self) -> float | None:
        return self._due.next_due()

    def expired(self, now: float) -> list[tuple[str, T]]:
        return self._due.expired(now)
