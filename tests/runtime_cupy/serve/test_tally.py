"""A request of several choices counts once in the metrics (``jobs.Tally``): when its
last choice ends, as the worst of their outcomes, its prompt once if one was answered."""

from __future__ import annotations

import pytest

from runtime_cupy.serve.jobs import Tally


@pytest.mark.parametrize(
    ("outcomes", "counted"),
    [
        (["completed"], ("completed", True)),
        (["completed", "completed", "completed"], ("completed", True)),
        (["completed", "faulted", "cancelled"], ("faulted", True)),
        (["cancelled", "completed"], ("cancelled", True)),
        (["cancelled", "cancelled"], ("cancelled", False)),
        (["rejected", "cancelled"], ("rejected", False)),
    ],
)
def test_a_request_ends_with_its_last_choice_as_the_worst_of_them(
    outcomes: list[str], counted: tuple[str, bool]
) -> None:
    tally = Tally(len(outcomes))
    assert [tally.end(o) for o in outcomes[:-1]] == [None] * (len(outcomes) - 1)
    assert tally.end(outcomes[-1]) == counted
