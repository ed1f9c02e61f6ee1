"""A stage's log of the refusals its controller reports (``StageTraces``): an object off
the inbound edge of a run that stopped on the stage (the stage before sent it as the run
was cancelled: the chat's Ctrl-C) is an INFO line, not a warning on the person's
terminal; a stopped run's control message, and every other refusal, stay warnings. Both
are in the trace."""

from __future__ import annotations

import logging

import pytest

from runtime_cupy.process.stage_traces import StageTraces
from runtime_cupy.process.tracing import TraceLog


def _traces() -> StageTraces:
    traces = StageTraces()
    traces.trace = TraceLog("stage-1")
    return traces


@pytest.mark.parametrize(
    ("sender", "reason", "level"),
    [
        ("", "STALE_RUN", logging.INFO),
        ("orchestrator", "STALE_RUN", logging.WARNING),
        ("", "UNKNOWN_RUN", logging.WARNING),
        ("stage-9", "UNAUTHORIZED_SENDER", logging.WARNING),
    ],
)
def test_a_late_object_of_a_stopped_run_is_not_a_warning(
    sender: str, reason: str, level: int, caplog: pytest.LogCaptureFixture
) -> None:
    traces = _traces()
    caplog.set_level(logging.DEBUG, "runtime_cupy.process.stage_process")
    detail = "run 'r1' has stopped on this node"
    traces._on_trace("reject", {"sender": sender, "reason": reason, "detail": detail})
    (record,) = caplog.records
    assert record.levelno == level
    assert record.getMessage() == f"rejected from {sender!r}: {reason}: {detail}"
    (event,) = traces.trace.events
    assert event["name"] == "reject" and event["args"]["reason"] == reason
