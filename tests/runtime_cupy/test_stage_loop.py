"""A stage process's loop (``StageProcess._pump``), in this process: a stage that has a
batch to run after every batch still reads its control channel between them, so a
``StopRun`` waits behind the worker call in progress, not behind every batch its
runs keep asking for (``Timeouts.stop_limit_ms`` counts on that)."""

from __future__ import annotations

import itertools
import os
import socket
import time
from typing import Any

from runplan.fsm import stage as fsm
from runplan.messages import StopReason, StopRun
from runtime_core.workers.reference.worker import ReferenceWorker
from runtime_cupy.edges.links import ProcessLinks
from runtime_cupy.hosts.local import local_medium
from runtime_cupy.process import backoff
from runtime_cupy.process.control_channel import ControlChannel
from runtime_cupy.process.keys import control_key, new_secret
from runtime_cupy.process.stage_loop import StageProcess
from runtime_cupy.process.tracing import TraceLog

NODE, ORCHESTRATOR = "stage-0", "orchestrator"


class BusyController:
    """Stands in for the stage's controller: ``batches`` batches ready one after
    another (each run's next record always there); the control events it is handed,
    each with the number of batches run before it."""

    def __init__(self, batches: int) -> None:
        self.left = batches
        self.batches = 0
        self.last_batch_rows = 0
        self.handled: list[tuple[int, Any]] = []
        self.runs: dict[str, Any] = {}
        self.setup_pending = self.links_pending = self.wants_input = False
        self.output_pending = self.release_pending = False

    @property
    def batch_ready(self) -> bool:
        return self.left > 0

    def run_batch(self) -> None:
        self.left -= 1
        self.batches += 1
        self.last_batch_rows = 8

    def handle(self, event: Any) -> None:
        self.handled.append((self.batches, event))


def _stage(secret: bytes, stage_end: socket.socket) -> StageProcess:
    medium = local_medium("shm")
    return StageProcess(
        stage_index=0,
        node_id=NODE,
        orchestrator_id=ORCHESTRATOR,
        channel=ControlChannel(stage_end, control_key(secret, NODE), NODE, ORCHESTRATOR),
        links=ProcessLinks(medium, medium, secret, "chain-test-loop"),
        worker=ReferenceWorker(),
        stop_s=1.0,
        trace=TraceLog("stage-0", enabled=False),
    )


def test_a_stage_with_a_batch_after_every_batch_reads_its_stop_run_between_them() -> None:
    secret = new_secret()
    key = control_key(secret, NODE)
    stage_end, orchestrator_end = socket.socketpair()
    with stage_end, orchestrator_end:
        orchestrator = ControlChannel(orchestrator_end, key, ORCHESTRATOR, NODE)
        stage = _stage(secret, stage_end)
        busy = BusyController(batches=5)
        stage.controller = busy  # type: ignore[assignment]
        stop = StopRun("run-1", StopReason.CANCELLED)
        orchestrator.send(stop)  # already come when the stage's loop turns
        try:
            stage._pump()
        finally:
            os.close(stage._wake_r)
            os.close(stage._wake_w)
        assert busy.batches == 5
        received = [(n, e) for n, e in busy.handled if isinstance(e, fsm.Received)]
        assert [e.message for _, e in received] == [stop]
        assert received[0][0] < 1, busy.handled  # before the next batch, not after all


class Attaching(BusyController):
    """Stands in for a stage's controller whose neighbour's ring is not there: each try
    to attach fails until ``attach_at`` tries, then links are pending again. ``seen``:
    each try (``None``) and each wait of the stage's loop (its bound, in s), in order."""

    def __init__(self, attach_at: int) -> None:
        super().__init__(batches=0)
        self.links_pending = True
        self.attach_at = attach_at
        self.tries = 0
        self.seen: list[float | None] = []

    def try_attach_links(self) -> bool:
        self.tries += 1
        self.seen.append(None)
        return self.tries == self.attach_at  # then pending again (a chain joined)


def test_a_stage_waiting_for_its_neighbours_ring_backs_off_and_tries_at_once_after_a_success() -> (
    None
):
    """A neighbour slow to start (a large model loading: up to the readiness bound)
    gives nothing to wait on: the stage tried to attach every 2 ms (hundreds a second);
    it now waits twice as long after each failure, up to ``backoff.CEILING_S``, and tries
    at once after a success. The loop's waits are read from the bounds it gives its
    poller, not timed (a loaded host stretches any wait)."""
    secret = new_secret()
    stage_end, orchestrator_end = socket.socketpair()
    with stage_end, orchestrator_end:
        stage = _stage(secret, stage_end)
        attaching = Attaching(attach_at=4)
        stage.controller = attaching  # type: ignore[assignment]
        poll = stage._waiter.poll

        def bounded(entries: Any, timeout_ms: float) -> list[tuple[int, int]]:
            attaching.seen.append(max(0.0, timeout_ms) / 1000.0)
            return poll(entries, timeout_ms)

        stage._waiter.poll = bounded  # type: ignore[method-assign]
        try:
            began = time.monotonic()
            while time.monotonic() - began < 1.0:
                stage._pump()
                stage._wait()
        finally:
            os.close(stage._wake_r)
            os.close(stage._wake_w)
    seen = attaching.seen
    tries = [i for i, s in enumerate(seen) if s is None]
    assert len(tries) > 6, seen
    waits = [sum(w for w in seen[a + 1 : b] if w is not None) for a, b in itertools.pairwise(tries)]
    assert waits[3] == 0.0, waits  # at once after the success (the 4th try)
    # Each bound is what is left of the backoff's wait when the loop polls (less on a
    # loaded host, none if the loop was held past it): at most the ceiling, and grown.
    assert max(waits) <= backoff.CEILING_S, waits
    assert max(waits) > 4 * backoff.FIRST_S, waits
    assert len(tries) < 30, len(tries)  # in 1 s: the waits grew to 0.1 s (it made ~400)
