"""The stage controller: drives one stage's state machine (``runplan.fsm.stage``) with
a worker, a control channel and two edge ends (PIPELINE_ORCHESTRATION_MVP.md §6-§7).

It is control-path only and does no waiting of its own. ``handle(event)`` feeds the
machine and carries out its actions at once; the work that takes time is left for the
runtime to run when it chooses, each piece reporting back as events:

- ``run_setup()`` (after provisioning): configure the worker, load and bind the range,
  open the receive edge (each part done traced as ``setup_done``, so that a runtime
  can time them); ``try_attach_outbound()`` until the consumer's ring exists.
- ``poll_inbound()`` while ``wants_input``: the next record, validated, becomes
  ``ObjectLoaded`` (or an ``EdgeFault``).
- ``run_step()`` while ``step_pending``: the worker's step over the loaded record; then
  ``try_publish_output()`` until the output record is on the outbound edge, which is
  when ``StepCompleted`` is fed (a full ring is backpressure: the runtime waits).
- ``run_release()`` while ``release_pending``: close both ends, release the worker.

The simulator calls these in virtual time; the process runtime in a loop with real
waits. Both run the same machine, worker and edge ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from runplan.fsm import stage as fsm
from runplan.messages import (
    ProvisionRefused,
    ProvisionStage,
    StageFault,
    StageReady,
    StageStopped,
)
from runplan.record_header import HeaderDType
from runtime_core.edge_ends import EdgeFaultError, ReceiveEnd, Record, SendEnd
from runtime_core.records import decode_input, encode_output
from runtime_core.ring import EdgeClosed
from runtime_core.workers.interface import Progress, StepWorker

# Enum members read on every event, bound once: on Python 3.11 ``Enum.MEMBER`` goes
# through the slow attribute hook of ``EnumType.__getattr__`` (about 0.1 us a read).
_READY = fsm.State.READY
_GAVE_UP = (fsm.State.FAULTED, fsm.State.STOPPING)

#: ``trace(kind, fields)``: what the controller did, for logs and Chrome traces.
Trace = Callable[[str, dict[str, Any]], None]


class Transport(Protocol):
    """Makes a stage's edge ends. The receive end allocates the ring; the send end
    attaches to its consumer's ring, which may not exist yet (``None``: try again)."""

    def open_inbound(self, provision: ProvisionStage) -> ReceiveEnd: ...

    def open_outbound(self, provision: ProvisionStage) -> SendEnd | None: ...


class ControlChannel(Protocol):
    def send(self, message: StageReady | StageFault | StageStopped | ProvisionRefused) -> None: ...


class Timers(Protocol):
    def start(self, timer: fsm.Timer, ms: int) -> None: ...

    def cancel(self, timer: fsm.Timer) -> None: ...


def _no_trace(kind: str, fields: dict[str, Any]) -> None:
    pass


class StageController:
    def __init__(
        self,
        node_id: str,
        orchestrator_node_id: str,
        worker: StepWorker,
        transport: Transport,
        control: ControlChannel,
        timers: Timers,
        trace: Trace | None = None,
        stopped_runs: frozenset[str] = frozenset(),
        trace_steps: bool = True,
    ) -> None:
        # ``stopped_runs``: runs this node served before (their ids stay stale).
        # ``trace_steps=False``: leave out the trace events that come with every step
        # (``loaded``, ``published`` and ``state``), for a runtime that would drop them;
        # rejections, protocol violations and failed releases are traced regardless.
        self.machine = fsm.StageMachine.new(node_id, orchestrator_node_id)
        if stopped_runs:
            self.machine = attrs.evolve(self.machine, stale_runs=stopped_runs)
        self.worker = worker
        self.transport = transport
        self.control = control
        self.timers = timers
        self.trace = trace or _no_trace
        self._trace_steps = trace_steps
        self._provision: ProvisionStage | None = None
        self._setup_pending = False
        self._outbound_pending = False
        self._release_pending = False
        self._inbound: ReceiveEnd | None = None
        self._outbound: SendEnd | None = None
        self._record: Record | None = None  # the loaded record, until released
        self._step: int | None = None  # ExecuteStep issued, not yet run
        self._output: tuple[int, int, HeaderDType, bytes] | None = None  # to publish

    # -- state the runtime reads ----------------------------------------------------
    @property
    def state(self) -> fsm.State:
        return self.machine.state

    @property
    def setup_pending(self) -> bool:
        return self._setup_pending

    @property
    def outbound_pending(self) -> bool:
        return self._outbound_pending

    @property
    def wants_input(self) -> bool:
        return self.machine.state is _READY and self._inbound is not None and self._record is None

    @property
    def record(self) -> Record | None:
        """The loaded inbound record, until released."""
        return self._record

    @property
    def provision(self) -> ProvisionStage | None:
        return self._provision

    @property
    def step_pending(self) -> bool:
        return self._step is not None

    @property
    def output_pending(self) -> bool:
        return self._output is not None

    @property
    def release_pending(self) -> bool:
        return self._release_pending

    @property
    def inbound(self) -> ReceiveEnd | None:
        return self._inbound

    @property
    def outbound(self) -> SendEnd | None:
        return self._outbound

    # -- events in, actions out ----------------------------------------------------------
    def handle(self, event: fsm.Event) -> None:
        """Feed one event to the machine and carry out its actions."""
        before = self.machine.state
        self.machine, actions = fsm.step(self.machine, event)
        if self.machine.state in _GAVE_UP:
            # Reject new run work: a step not yet run, or an output not yet published,
            # of a faulted or stopping stage goes nowhere.
            self._step = None
            self._output = None
        if self.machine.state is not before and self._trace_steps and self.trace is not _no_trace:
            self.trace(
                "state",
                {
                    "from": before._name_,
                    "to": self.machine.state._name_,
                    "event": type(event).__name__,
                },
            )
        for action in actions:
            self._act(action)

    def _act(self, action: fsm.Action) -> None:
        # The action classes are unrelated, so the order of the tests is free: the
        # actions of every step come first.
        if isinstance(action, fsm.StartTimer):
            self.timers.start(action.timer, action.ms)
        elif isinstance(action, fsm.CancelTimer):
            self.timers.cancel(action.timer)
        elif isinstance(action, fsm.ExecuteStep):
            self._step = action.sequence
        elif isinstance(action, (fsm.ReleaseInput, fsm.DiscardObject)):
            self._release_record(action.sequence)
        elif isinstance(action, fsm.SendToOrchestrator):
            self.control.send(action.message)
        elif isinstance(action, fsm.BeginSetup):
            self._provision = action.provision
            self._setup_pending = True
            self._outbound_pending = True
        elif isinstance(action, fsm.ReleaseRun):
            self._setup_pending = False
            self._outbound_pending = False
            self._step = None
            self._output = None
            self._release_pending = True
        elif isinstance(action, fsm.Reject):
            self.trace(
                "reject",
                {"sender": action.sender, "reason": action.reason.value, "detail": action.detail},
            )
        elif isinstance(action, fsm.ProtocolViolation):
            self.trace("protocol_violation", {"state": action.state.name, "kind": action.kind.name})

    def _release_record(self, sequence: int) -> None:
        record = self._record
        if record is None or record.header.sequence != sequence or self._inbound is None:
            return
        self._record = None
        try:  # noqa: SIM105 (contextlib.suppress costs three calls, once a step)
            self._inbound.release(record)
        except EdgeClosed:
            pass

    # -- setup ---------------------------------------------------------------------------
    def run_setup(self, progress: Progress | None = None) -> None:
        """Configure the worker, bind its range, open the receive edge."""
        provision = self._provision
        if not self._setup_pending or provision is None:
            return
        self._setup_pending = False
        steps: tuple[tuple[fsm.SetupPart, Callable[[], None]], ...] = (
            (fsm.SetupPart.WORKER, lambda: self.worker.configure(provision)),
            (fsm.SetupPart.SHARD, lambda: self.worker.bind(provision.gguf_source, progress)),
            (fsm.SetupPart.INBOUND, self._open_inbound),
        )
        for part, work in steps:
            try:
                work()
            except Exception as exc:  # any failure of setup is the stage's fault to report
                self.handle(fsm.SetupFailed(part, f"{type(exc).__name__}: {exc}"))
                return
            if self.trace is not _no_trace:  # once a run: the runtime may time the parts
                self.trace("setup_done", {"part": part.value})
            self.handle(fsm.SetupDone(part))
            if self.machine.state is not fsm.State.PREPARING:
                return

    def _open_inbound(self) -> None:
        assert self._provision is not None
        self._inbound = self.transport.open_inbound(self._provision)

    def try_attach_outbound(self) -> bool:
        """Attach the send end once its consumer's ring exists."""
        if not self._outbound_pending or self._provision is None:
            return False
        try:
            end = self.transport.open_outbound(self._provision)
        except Exception as exc:
            self._outbound_pending = False
            self.handle(fsm.SetupFailed(fsm.SetupPart.OUTBOUND, f"{type(exc).__name__}: {exc}"))
            return False
        if end is None:
            return False
        self._outbound = end
        self._outbound_pending = False
        self.handle(fsm.SetupDone(fsm.SetupPart.OUTBOUND))
        return True

    # -- input -----------------------------------------------------------------------------
    def poll_inbound(self) -> bool:
        """Load the next record if one is published; ``True`` if one was taken."""
        if not self.wants_input or self._inbound is None:
            return False
        try:
            record = self._inbound.try_receive()
        except (EdgeFaultError, EdgeClosed) as exc:
            self.handle(fsm.EdgeFault(self._inbound.check.edge_id, str(exc)))
            return True
        if record is None:
            return False
        self._record = record
        h = record.header
        if self._trace_steps and self.trace is not _no_trace:
            self.trace("loaded", {"edge_id": h.edge_id, "sequence": h.sequence, "rows": h.rows})
        self.handle(fsm.ObjectLoaded(h.run_id, h.edge_id, h.sequence, rows=h.rows))
        return True

    # -- the step ----------------------------------------------------------------------------
    def run_step(self) -> None:
        """Run the worker over the loaded record and try to publish its output."""
        sequence = self._step
        record = self._record
        self._step = None
        if sequence is None or record is None:
            return
        try:
            output = self.worker.execute_step(sequence, self._decode(record))
            self._output = (sequence, *self._encode(output))
        except Exception as exc:  # the worker's failure, reported as StepFailed
            self.handle(fsm.StepFailed(sequence, f"{type(exc).__name__}: {exc}"))
            return
        self.try_publish_output()

    def try_publish_output(self) -> bool:
        """Publish the step's output; on success the step is complete. ``False`` while
        the outbound ring is full."""
        if self._output is None or self._outbound is None:
            return False
        sequence, rows, dtype, payload = self._output
        try:
            sent = self._outbound.try_send(sequence, rows, dtype, payload)
        except EdgeClosed as exc:
            self._output = None
            self.handle(fsm.EdgeFault(self._outbound.edge_id, f"closed: {exc}"))
            return False
        if not sent:
            return False
        self._output = None
        if self._trace_steps and self.trace is not _no_trace:
            self.trace(
                "published", {"edge_id": self._outbound.edge_id, "sequence": sequence, "rows": rows}
            )
        self.handle(fsm.StepCompleted(sequence))
        return True

    def _decode(self, record: Record) -> npt.NDArray[np.generic]:
        provision = self._provision
        assert provision is not None
        return decode_input(provision.inbound.object_spec, record.header.rows, record.payload)

    def _encode(self, output: Any) -> tuple[int, HeaderDType, bytes]:
        provision = self._provision
        assert provision is not None
        return encode_output(provision, output)

    # -- release -------------------------------------------------------------------------
    def run_release(self) -> None:
        """Stop the edge ends and release the worker; then ``Released``.

        The stage closes its inbound edge, whose ring it made (EDGES_AND_WORKERS.md §3),
        and lets go of its outbound edge without closing it: the next stage owns that
        ring, and may still be waiting for its own StopRun, which a closed edge would
        turn into a fault."""
        if not self._release_pending:
            return
        self._release_pending = False
        if self._record is not None and self._inbound is not None:
            self._release_record(self._record.header.sequence)
        if self._inbound is not None:
            self._inbound.close()
        self._inbound = self._outbound = None
        try:
            self.worker.release()
        except Exception as exc:
            self.trace("release_failed", {"detail": f"{type(exc).__name__}: {exc}"})
        self._provision = None
        self.handle(fsm.Released())
