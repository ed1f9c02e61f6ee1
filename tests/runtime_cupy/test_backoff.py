"""``process.backoff``: the waits between tries double up to the ceiling, and a success
makes the next try immediate."""

from __future__ import annotations

import itertools

from runtime_cupy.process.backoff import CEILING_S, FIRST_S, Backoff


def test_waits_double_to_the_ceiling_and_a_success_starts_again_at_once() -> None:
    retry = Backoff()
    assert retry.due(0.0)
    now, waits = 10.0, []
    for _ in range(12):
        retry.failed(now)
        assert not retry.due(now)
        waits.append(round(retry.at - now, 6))
        now = retry.at
        assert retry.due(now)
    assert waits[:3] == [FIRST_S, 2 * FIRST_S, 4 * FIRST_S]
    assert max(waits) == CEILING_S and waits[-1] == CEILING_S
    assert all(b == round(min(a * 2, CEILING_S), 6) for a, b in itertools.pairwise(waits))
    retry.succeeded()
    assert retry.due(now)
    retry.failed(now)
    assert round(retry.at - now, 6) == FIRST_S
