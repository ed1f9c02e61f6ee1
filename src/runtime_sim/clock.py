"""Virtual time: an event heap with deterministic tie-breaking and a clock that jumps
to the next event. Time is in integer microseconds, so runs are exact and repeatable.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable

from attrs import define, field

_heappush = heapq.heappush
#: Cancelled calls stay in the heap until their time; once there are more than this
#: many, and more of them than live calls, the heap is rebuilt without them (timers are
#: mostly cancelled, and a heap of dead timers makes every push and pop slower).
COMPACT_AFTER = 32


@define(eq=False, slots=True)
class Handle:
    """A scheduled call; ``cancel()`` keeps it from running."""

    time_us: int
    fn: Callable[[], None] | None
    scheduler: Scheduler | None = field(default=None, repr=False)  # whose heap holds it

    def cancel(self) -> None:
        if self.fn is not None:
            self.fn = None
            if self.scheduler is not None:
                self.scheduler.cancelled += 1

    @property
    def cancelled(self) -> bool:
        return self.fn is None


class Scheduler:
    """Runs calls in time order; calls at the same time run in the order scheduled."""

    def __init__(self) -> None:
        self.now_us = 0
        # (time, sequence number, handle): ties run in the order they were scheduled.
        self._heap: list[tuple[int, int, Handle]] = []
        self._seq = 0
        self.events_run = 0
        self.cancelled = 0  # cancelled calls still in the heap

    def at(self, time_us: int, fn: Callable[[], None]) -> Handle:
        if time_us < self.now_us:
            raise ValueError(f"cannot schedule in the past ({time_us} < {self.now_us})")
        self._seq = seq = self._seq + 1
        handle = Handle(time_us, fn, self)
        if self.cancelled > COMPACT_AFTER and 2 * self.cancelled > len(self._heap):
            self._compact()
        _heappush(self._heap, (time_us, seq, handle))
        return handle

    def after(self, delay_us: int, fn: Callable[[], None]) -> Handle:
        """``at(now + delay)``; a negative delay is none."""
        delay = int(delay_us)
        time_us = self.now_us + delay if delay > 0 else self.now_us
        self._seq = seq = self._seq + 1
        handle = Handle(time_us, fn, self)
        if self.cancelled > COMPACT_AFTER and 2 * self.cancelled > len(self._heap):
            self._compact()
        _heappush(self._heap, (time_us, seq, handle))
        return handle

    def _compact(self) -> None:
        """Drop cancelled calls from the heap when they outnumber the live ones. The
        order of the rest is their (time, sequence number): no two are equal, so the
        order they run in does not depend on the heap's layout."""
        heap = self._heap
        heap[:] = [entry for entry in heap if entry[2].fn is not None]
        heapq.heapify(heap)
        self.cancelled = 0

    def run(self, *, max_events: int | None = None) -> None:
        """Run calls until none is left or ``max_events`` calls ran."""
        heap = self._heap
        pop = heapq.heappop
        budget = max_events if max_events is not None else -1
        while heap and budget != 0:
            time_us, _, handle = pop(heap)
            fn = handle.fn
            if fn is None:
                self.cancelled -= 1
                continue
            self.now_us = time_us
            handle.fn = None
            self.events_run += 1
            budget -= 1
            fn()


def derive_rng(seed: int, name: str) -> random.Random:
    """A PRNG for one purpose, derived from the run's one seed (string seeding of
    ``random.Random`` hashes with SHA-512: the same on every platform)."""
    return random.Random(f"{seed}/{name}")
