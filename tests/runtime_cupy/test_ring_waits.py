"""One wait on a full ring (``Timeouts.edge_wait_ms``: "one wait on a ring", either
end), in this process: a queue of records that goes out a few at a time as the consumer
frees slots (a long prompt's chunks on token-in, a batch's outputs on a stage's outbound
ring) is so many waits, each bounded alone; the bound runs out only when no record was
written for that long."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace
from typing import Any

import pytest

from runplan import Timeouts
from runtime_core.workers.reference.worker import ReferenceWorker
from runtime_cupy.edges.links import ProcessLinks
from runtime_cupy.hosts.local import local_medium
from runtime_cupy.process import stage_loop
from runtime_cupy.process.chain_runner import ChainRunner
from runtime_cupy.process.control_channel import ControlChannel
from runtime_cupy.process.keys import control_key, new_secret
from runtime_cupy.process.ring_wait import RingWait
from runtime_cupy.process.stage_loop import StageProcess
from runtime_cupy.process.tracing import TraceLog

TIMEOUTS = Timeouts(edge_wait_ms=150)
STEP_S = 0.1  # between two attempts; two of them outlast the bound, one does not
RECORDS = 10


class SlowRing:
    """A queue of ``RECORDS`` records of which the consumer frees one slot between two
    attempts: each attempt writes one and is refused the next."""

    def __init__(self) -> None:
        self.left = RECORDS
        self.written = 0
        self.faults: list[str] = []

    def write(self) -> bool:
        self.left -= 1
        self.written += 1
        return self.left == 0


class SlowTokenIn(SlowRing):
    """Stands in for the chain runner's orchestrator: token-in records waiting."""

    @property
    def inject_pending(self) -> bool:
        return self.left > 0

    def try_inject(self) -> bool:
        return self.write()

    @property
    def records_sent(self) -> int:
        return self.written

    def link_fault(self, detail: str) -> None:
        self.faults.append(detail)


def test_token_in_written_a_record_a_wait_is_never_past_the_bound() -> None:
    runner: Any = ChainRunner.__new__(ChainRunner)
    runner.template = SimpleNamespace(timeouts=TIMEOUTS)
    runner.orchestrator = o = SlowTokenIn()
    runner._inject_wait = RingWait()
    now = 0.0
    while o.inject_pending:
        runner._inject(now)
        now += STEP_S
    assert o.faults == []
    assert o.written == RECORDS


def test_token_in_that_takes_nothing_for_the_bound_faults_the_chain() -> None:
    runner: Any = ChainRunner.__new__(ChainRunner)
    runner.template = SimpleNamespace(timeouts=TIMEOUTS)
    runner.orchestrator = o = SlowTokenIn()
    o.try_inject = lambda: False  # type: ignore[method-assign]
    runner._inject_wait = RingWait()
    for now in (0.0, STEP_S, 2 * STEP_S):
        runner._inject(now)
    assert o.faults == ["token-in: no free slot in time"]


class SlowOutbound(SlowRing):
    """Stands in for a stage's controller: one batch's outputs waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.chain = SimpleNamespace(timeouts=TIMEOUTS)
        self.runs: dict[str, Any] = {}
        self.setup_pending = self.links_pending = self.wants_input = False
        self.batch_ready = self.release_pending = False

    @property
    def output_pending(self) -> bool:
        return self.left > 0

    def try_publish_outputs(self) -> bool:
        return self.write()

    @property
    def records_published(self) -> int:
        return self.written

    def output_stuck(self, waited_ms: int) -> None:
        self.faults.append(f"stuck {waited_ms} ms")


@pytest.mark.parametrize("progress", [True, False])
def test_an_outbound_ring_written_a_record_a_wait_is_never_past_the_bound(
    monkeypatch: pytest.MonkeyPatch, progress: bool
) -> None:
    secret = new_secret()
    key = control_key(secret, "stage-0")
    stage_end, orchestrator_end = socket.socketpair()
    with stage_end, orchestrator_end:
        medium = local_medium("shm")
        stage = StageProcess(
            stage_index=0,
            node_id="stage-0",
            orchestrator_id="orchestrator",
            channel=ControlChannel(stage_end, key, "stage-0", "orchestrator"),
            links=ProcessLinks(medium, medium, secret, "chain-test-ring-wait"),
            worker=ReferenceWorker(),
            stop_s=1.0,
            trace=TraceLog("stage-0", enabled=False),
        )
        stage.controller = c = SlowOutbound()  # type: ignore[assignment]
        if not progress:
            c.try_publish_outputs = lambda: False  # type: ignore[method-assign]
        clock = [0.0]
        monkeypatch.setattr(stage_loop, "time", SimpleNamespace(monotonic=lambda: clock[0]))
        try:
            for _ in range(RECORDS):
                stage._pump()
                clock[0] += STEP_S
        finally:
            os.close(stage._wake_r)
            os.close(stage._wake_w)
    if progress:
        assert c.faults == []
        assert c.written == RECORDS
    else:
        assert c.faults[:1] == ["stuck 150 ms"]
