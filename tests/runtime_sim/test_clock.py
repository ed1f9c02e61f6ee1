"""The event heap: calls run in time order, ties in the order scheduled, cancelled
calls never, however many of them the heap drops along the way."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from runtime_sim.clock import COMPACT_AFTER, Handle, Scheduler


@given(
    st.lists(
        st.tuples(st.integers(0, 50), st.booleans(), st.integers(0, 3)), min_size=1, max_size=300
    )
)
def test_calls_run_in_time_then_schedule_order_and_cancelled_ones_never(
    plan: list[tuple[int, bool, int]],
) -> None:
    clock = Scheduler()
    ran: list[int] = []
    handles: list[Handle] = []
    expected: list[tuple[int, int]] = []
    for i, (time_us, cancel, spawn) in enumerate(plan):

        def call(i: int = i, spawn: int = spawn) -> None:
            ran.append(i)
            for _ in range(spawn):  # calls scheduled while running, some cancelled at once
                clock.after(1, lambda: None).cancel()

        handles.append(clock.at(time_us, call))
        if not cancel:
            expected.append((time_us, i))
    for handle, (_, cancel, _) in zip(handles, plan, strict=True):
        if cancel:
            handle.cancel()
    clock.run()
    assert ran == [i for _, i in sorted(expected)]
    assert clock.events_run == len(expected)
    assert all(h.cancelled for h in handles)


def test_a_heap_of_cancelled_timers_is_dropped_and_order_kept() -> None:
    clock = Scheduler()
    rng = random.Random(7)
    ran: list[tuple[int, int]] = []
    live: list[tuple[int, int]] = []
    for n in range(20 * COMPACT_AFTER):
        time_us = rng.randrange(0, 1000)

        def call(t: int = time_us, n: int = n) -> None:
            ran.append((t, n))

        handle = clock.at(time_us, call)
        if n % 7:
            handle.cancel()  # most timers are cancelled before they fire
        else:
            live.append((time_us, n))
        assert len(clock._heap) <= 2 * len(live) + 2 * COMPACT_AFTER + 2
    clock.run()
    assert ran == sorted(live)
    assert clock.cancelled == 0
