"""A job hands each run of its request (the first, and a replay after a loss) what
happened to the request meanwhile (``jobs.Job._attach``): a client gone, a stop, a stop
string; the choices of a request share its answer's id (the log names each by it)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from runtime_cupy.serve.engine import Engine
from runtime_cupy.serve.jobs import SHUTTING_DOWN, Job, Tally
from runtime_cupy.serve.prompts import Prepared
from runtime_cupy.serve.requests import CompletionRequest


class _Run:
    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.plan = SimpleNamespace(run_id="run-0123456789abcdef0123456789abcdef")

    def cancel(self, why: str) -> None:
        self.cancelled.append(why)


def _job() -> Job:
    prepared: Any = SimpleNamespace(request=SimpleNamespace(endpoint="chat", n=1))
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


def test_the_choices_of_a_request_share_its_answer_s_id_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The log names each choice of a request by the id its answer carries, and the
    choice: a client's ``chatcmpl-...`` finds every choice's lines. (Each choice had
    an id of its own, which no answer carried but the first's.)"""
    chain: Any = SimpleNamespace(
        tokenizer=None, model_id="m", max_concurrent=4, ready=False, kv_in_use=lambda: [],
        batch_counts=lambda: [], restarts=0, in_flight=0,
        recoveries=SimpleNamespace(count=0, seconds=0.0),
    )  # fmt: skip
    engine = Engine(chain)
    request = CompletionRequest(endpoint="chat", model="m", n=3)
    choices = Prepared(request, (1, 2), 4, 0).choices()
    with caplog.at_level(logging.INFO, logger="runtime_cupy.serve"):
        jobs = engine.submit(choices, lambda index: lambda event: None)
    assert len({job.id for job in jobs}) == 1 and jobs[0].id.startswith("chatcmpl-")
    queued = [r.getMessage() for r in caplog.records if "queued" in r.getMessage()]
    expected = [f"({jobs[0].id}[{i}]) queued" for i in range(3)]
    assert all(e in line for e, line in zip(expected, queued, strict=True)), queued
    alone = engine.submit(Prepared(CompletionRequest("completion", "m"), (1,), 4, 0).choices(),
                          lambda index: lambda event: None)  # fmt: skip
    assert alone[0].id != jobs[0].id and alone[0].label == alone[0].id
    assert alone[0].id.startswith("cmpl-")
