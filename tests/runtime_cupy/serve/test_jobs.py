"""A job hands each run of its request (the first, and a replay after a loss) what
happened to the request meanwhile (``jobs.Job._attach``): a client gone, a stop, a stop
string."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from runtime_cupy.serve.jobs import SHUTTING_DOWN, Job, Tally


class _Run:
    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.plan = SimpleNamespace(run_id="run-0123456789abcdef0123456789abcdef")

    def cancel(self, why: str) -> None:
        self.cancelled.append(why)


def _job() -> Job:
    prepared: Any = SimpleNamespace(request=SimpleNamespace(endpoint="chat"))
    engine: Any = None
    return Job(engine, prepared, 1, lambda event: None, Tally(1))


@pytest.mark.parametrize(
    ("before", "why"),
    [
        ("cancelled", "the client went away"),
        ("interrupted", SHUTTING_DOWN),
        # A stop string ended the answer as a loss ended its run: the replay ran to its
        # end unseen, and the answer waited for it.
        ("stopped", "a stop string"),
        (None, None),
    ],
)
def test_a_run_attached_after_the_request_ended_is_cancelled_so(
    before: str | None, why: str | None
) -> None:
    job = _job()
    if before is not None:
        setattr(job, before, True)
    run = _Run()
    job._attach(run)  # type: ignore[arg-type]
    assert run.cancelled == ([why] if why else [])
    assert job.submitted.is_set()
