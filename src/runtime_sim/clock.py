"""Virtual time: an event heap with deterministic tie-breaking and a clock that jumps
to the next event. Time is in integer microseconds, so runs are exact and repeatable.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable

from attrs import define


@define(eq=False, slots=True)
class Handle:
    """A scheduled call; ``cancel()`` keeps it from running."""

    time_us: int
    fn: Callable[[], None] | None

    def cancel(self) -> None:
        self.fn = None

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

    def at(self, time_us: int, fn: Callable[[], None]) -> Handle:
        if time_us < self.now_us:
            raise ValueError(f"cannot schedule in the past ({time_us} < {self.now_us})")
        self._seq += 1
        handle = Handle(time_us, fn)
        heapq.heappush(self._heap, (time_us, self._seq, handle))
        return handle

    def after(self, delay_us: int, fn: Callable[[], None]) -> Handle:
        return self.at(self.now_us + max(0, int(delay_us)), fn)

    def run(self, *, max_events: int | None = None) -> None:
        """Run calls until none is left or ``max_events`` calls ran."""
        heap = self._heap
        pop = heapq.heappop
        budget = max_events if max_events is not None else -1
        while heap and budget != 0:
            time_us, _, handle = pop(heap)
            fn = handle.fn
            if fn is None:
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
