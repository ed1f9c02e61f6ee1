"""A stage's log of the refusals its controller reports (``StageTraces``): an object off
the inbound edge of a run that stopped on the stage (the stage before sent it as the run
was cancelled: the chat's Ctrl-C) is an INFO line, not a warning on the person's
terminal; a stopped run's control message, and every other refusal, stay warnings. Both
are in the trace. The orchestrator's side the same: a token record of a run that has
ended (``STALE_RUN``: in flight when the chat's Ctrl-C cancelled it) is an INFO line."""

from __future__ import annotations

import logging

import pytest

from runtime_cupy.process.chain_runner import ChainRunner
from runtime_cupy.process.stage_traces import StageTraces
from runtime_cupy.process.tracing import TraceLog
from tests.support.strategies import small_plan


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


@pytest.mark.parametrize(
    ("reason", "level"),
    [("STALE_RUN", logging.INFO), ("UNKNOWN_RUN", logging.WARNING),
     ("SEQUENCE_OUT_OF_ORDER", logging.WARNING)],
)  # fmt: skip
def test_the_orchestrators_late_token_of_an_ended_run_is_not_a_warning(
    reason: str, level: int, caplog: pytest.LogCaptureFixture
) -> None:
    runner = ChainRunner(small_plan(2), trace=True)
    try:
        caplog.set_level(logging.DEBUG, "runtime_cupy.process.chain_runner")
        runner._on_trace("reject", {"run_id": "r1", "reason": reason, "sequence": 3})
        (record,) = caplog.records
        assert record.levelno == level
        assert record.getMessage() == (
            f"orchestrator rejected {{'run_id': 'r1', 'reason': '{reason}', 'sequence': '3'}}"
        )
        (event,) = runner.trace.events
        assert event["name"] == "reject" and event["args"]["reason"] == reason
    finally:
        runner.close()
