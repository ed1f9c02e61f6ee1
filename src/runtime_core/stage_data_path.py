"""The records of a chain's stage (``chain_stage.ChainStageController``, whose base
``StageDataPath`` is; CONCURRENT_RUNS.md): taken off the inbound link, run in batches,
their outputs written on the outbound link, each piece reporting back to its run's
machine; and the faults of what every run shares.

- ``poll_inbound()`` while ``wants_input``: one record off the inbound link (its payload
  copied, its slot released: ``runtime_core.links``), routed by its run id. A record of a
  run the stage does not hold (unknown, stale, not provisioned here) goes to a *vacant*
  machine, which rejects it with the MVP's reason and changes nothing; a held run's
  record on another edge is rejected the same way by its machine; a held run's record
  that fails its own header checks (kind, dtype, extent, rows, more rows than
  ``max_batch_rows``) is that run's edge fault. A READY or EXECUTING run's record waits
  in the run's inbox, in link order; any other run's is fed to its machine at once
  (PREPARING: a sequence violation; FAULTED, STOPPING: discarded).
- ``run_batch()`` while ``batch_ready``: the scheduler (``runtime_core.batching``) picks
  at most one record per READY run, each its run's next, up to ``max_batch_rows`` rows;
  each goes to its machine as ``ObjectLoaded`` (which issues ``ExecuteStep`` or faults
  that run), and the accepted steps go to the worker in one ``execute_batch`` call.
  ``try_publish_outputs()`` then writes the outputs on the outbound link in batch order
  (a full ring is backpressure; ``output_stuck()`` when the runtime's ``edge_wait_ms``
  bound on it runs out); each run's ``StepCompleted`` comes when its output is out (at
  once for a last stage's prefill chunk before the last, which writes nothing). One batch
  at a time: the next is formed only when every output of this one is out.

Faults: a fault of what runs share (the inbound link closed or corrupt, the outbound
link closed or stuck, ``execute_batch`` raising) is ``ChainFault`` to every held run
(``chain_fault``), each answering with its own ``StageFault`` naming the same cause. A
record the stage cannot read (a header of another version, garbled: ``LinkFault``) is
the ``EDGE_FAULT`` of a link that can no longer be read, its detail naming the record.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from attrs import frozen

from runplan import ProvisionStage
from runplan.fsm import stage as fsm
from runplan.messages import FaultKind, FaultReason
from runplan.record_header import HeaderDType, ObjectHeader
from runtime_core.batching import BatchScheduler, Candidate
from runtime_core.controller_trace import Trace, no_trace
from runtime_core.links import LinkFault, LinkReceiver, LinkSender, Taken
from runtime_core.records import decode_input, encode_output
from runtime_core.ring import EdgeClosed
from runtime_core.workers.interface import BatchStep, StepFailure, Worker

if TYPE_CHECKING:
    from runtime_core.chain_stage import RunSlot

#: How the detail of a chain fault of the stage's links begins (``EDGE_FAULT``): the
#: link to the stage before (or the orchestrator's token-in) or to the stage after (or
#: token-out) is gone. A run's own bad record names its edge instead (``edge N: ...``).
INBOUND_LINK = "inbound link"
OUTBOUND_LINK = "outbound link"

_READY = fsm.State.READY
_EXECUTING = fsm.State.EXECUTING
_QUEUED = (_READY, _EXECUTING)  # a record waits in the run's inbox


@frozen
class StepOutput:
    """A step's output waiting for the outbound link (``payload`` None: nothing to
    write, a last stage's prefill chunk)."""

    run_id: str
    sequence: int
    chunk_index: int
    chunk_count: int
    rows: int
    dtype: HeaderDType
    payload: bytes | None


class StageDataPath:
    """The records of a ``ChainStageController``, its base: what the controller holds is
    set by ``ChainStageController.__init__``."""

    worker: Worker
    trace: Trace
    runs: dict[str, RunSlot]
    chain: ProvisionStage | None
    scheduler: BatchScheduler | None
    inbound: LinkReceiver | None
    outbound: LinkSender | None
    broken: FaultReason | None
    _loads: int
    _outputs: deque[StepOutput]
    #: outputs written on the outbound link so far: a runtime bounding one wait on a
    #: full ring (``Timeouts.edge_wait_ms``) starts it again when this grows
    records_published: int
    batches: int
    last_batch_rows: int
    batch_counts: dict[int, int]
    _unreported: dict[int, int]

    if TYPE_CHECKING:

        def _feed(self, slot: RunSlot, event: fsm.Event, held: bool = True) -> None: ...

        def _vacant(self, event: fsm.Received | fsm.ObjectLoaded) -> None: ...

    # -- state the runtime reads -------------------------------------------------------
    @property
    def wants_input(self) -> bool:
        return self.inbound is not None and self.broken is None

    @property
    def batch_ready(self) -> bool:
        if self._outputs or self.outbound is None or self.broken is not None:
            return False
        return any(s.inbox and s.machine.state is _READY for s in self.runs.values())

    @property
    def output_pending(self) -> bool:
        return bool(self._outputs)

    # -- input ----------------------------------------------------------------------------
    def poll_inbound(self) -> bool:
        """Take one record off the inbound link and route it; ``True`` if one was taken
        (or the link broke)."""
        if not self.wants_input or self.inbound is None:
            return False
        try:
            taken = self.inbound.try_take()
        except LinkFault as exc:  # another version, a garbled header: the link is spent
            detail = f"{self._link('inbound')}: a record it cannot read: {exc}"
            self.chain_fault(FaultReason(FaultKind.EDGE_FAULT, detail))
            return True
        except EdgeClosed as exc:
            self.chain_fault(FaultReason(FaultKind.EDGE_FAULT, f"{self._link('inbound')}: {exc}"))
            return True
        if taken is None:
            return False
        self._loads += 1
        h = taken.header
        slot = self.runs.get(h.run_id)
        if slot is None or slot.check is None or slot.provision is None:
            self._vacant(_loaded(h))
            return True
        if h.edge_id != slot.check.edge_id:  # the machine rejects it: changes nothing
            self._feed(slot, _loaded(h))
            return True
        problem = _record_problem(slot, h)
        if problem is not None:
            self._feed(slot, fsm.EdgeFault(h.edge_id, f"record {h.sequence}: {problem}"))
            return True
        if self.trace is not no_trace:
            fields = {"run_id": h.run_id, "sequence": h.sequence, "rows": h.rows}
            self.trace("loaded", {**fields, "chunk": h.chunk_index, "chunks": h.chunk_count})
        if slot.machine.state in _QUEUED:
            slot.inbox.append((self._loads, taken))
        else:
            slot.current = taken
            self._feed(slot, _loaded(h))
            slot.current = None
        return True

    # -- the batch ---------------------------------------------------------------------------
    def run_batch(self) -> None:
        """Form one batch, run it in one worker call, and try to publish its outputs."""
        if not self.batch_ready or self.scheduler is None:
            return
        candidates = [
            Candidate(s.run_id, s.inbox[0][0], s.inbox[0][1].header.rows, _prefill(s.inbox[0][1]))
            for s in self.runs.values()
            if s.inbox and s.machine.state is _READY
        ]
        steps: list[BatchStep] = []
        for chosen in self.scheduler.choose(candidates):
            slot = self.runs[chosen.run_id]
            _, taken = slot.inbox.popleft()
            slot.current = taken
            self._feed(slot, _loaded(taken.header))
            if slot.machine.state is not _EXECUTING or slot.provision is None:
                continue  # the record broke the run's order: it faulted
            h = taken.header
            data = decode_input(slot.provision.inbound.object_spec, h.rows, taken.payload)
            steps.append(BatchStep(h.run_id, h.sequence, h.chunk_index, h.chunk_count, data))
        if not steps:
            return
        self.batches += 1
        rows = sum(s.data.shape[0] for s in steps)
        self.last_batch_rows = rows
        self.batch_counts[rows] = self.batch_counts.get(rows, 0) + 1
        self._unreported[rows] = self._unreported.get(rows, 0) + 1
        if self.trace is not no_trace:
            self.trace(
                "batch",
                {
                    "runs": [s.run_id for s in steps],
                    "sequences": [s.sequence for s in steps],
                    "step_rows": [s.data.shape[0] for s in steps],
                    "rows": rows,
                },
            )
        try:
            results = self.worker.execute_batch(steps)
            if len(results) != len(steps):
                raise RuntimeError(f"{len(results)} results for {len(steps)} steps")
        except Exception as exc:  # the worker failed as a whole: every run's fault
            detail = f"the worker failed a batch: {type(exc).__name__}: {exc}"
            self.chain_fault(FaultReason(FaultKind.STEP_FAILURE, detail))
            return
        for step, result in zip(steps, results, strict=True):
            self._take_result(step, result)
        self.try_publish_outputs()

    def _take_result(self, step: BatchStep, result: Any) -> None:
        slot = self.runs.get(step.run_id)
        if slot is None or slot.machine.state is not _EXECUTING or slot.provision is None:
            return  # the run faulted or stopped meanwhile: its output goes nowhere
        if isinstance(result, StepFailure):
            self._feed(slot, fsm.StepFailed(step.sequence, result.detail))
            return
        rows, dtype, payload = 0, HeaderDType.U32, None
        if result is not None:
            try:
                rows, dtype, payload = encode_output(slot.provision, result)
            except ValueError as exc:
                self._feed(slot, fsm.StepFailed(step.sequence, f"ValueError: {exc}"))
                return
        self._outputs.append(
            StepOutput(
                step.run_id,
                step.sequence,
                step.chunk_index,
                step.chunk_count,
                rows,
                dtype,
                payload,
            )
        )

    def try_publish_outputs(self) -> bool:
        """Write the batch's outputs, in order; each run's step is complete when its
        output is out. ``False`` while the outbound ring is full (``records_published``
        counts those written, this call's too)."""
        while self._outputs:
            out = self._outputs[0]
            slot = self.runs.get(out.run_id)
            if (
                slot is None
                or slot.machine.state is not _EXECUTING
                or slot.machine.executing != out.sequence
                or slot.provision is None
            ):
                self._outputs.popleft()  # the run faulted or stopped: its output is dropped
                continue
            if out.payload is not None:
                assert self.outbound is not None
                try:
                    sent = self.outbound.try_send(
                        out.run_id,
                        slot.provision.outbound.edge_id,
                        out.sequence,
                        out.rows,
                        out.dtype,
                        out.payload,
                        out.chunk_index,
                        out.chunk_count,
                    )
                except EdgeClosed as exc:
                    self.chain_fault(
                        FaultReason(FaultKind.EDGE_FAULT, f"{self._link('outbound')}: {exc}")
                    )
                    return False
                if not sent:
                    return False
                self.records_published += 1
                if self.trace is not no_trace:
                    fields = {"run_id": out.run_id, "sequence": out.sequence, "rows": out.rows}
                    self.trace("published", fields)
            self._outputs.popleft()
            self._feed(slot, fsm.StepCompleted(out.sequence, out.chunk_index))
        return True

    def output_stuck(self, waited_ms: int) -> None:
        """The runtime's bound on a full outbound ring (``edge_wait_ms``) ran out: the
        next stage does not take records, a fault of the chain."""
        if self._outputs:
            detail = f"{self._link('outbound')}: no free slot within {waited_ms} ms"
            self.chain_fault(FaultReason(FaultKind.EDGE_FAULT, detail))

    def _link(self, end: str) -> str:
        """A link's name in a fault: ``inbound link (hop i)``; hop ``i`` feeds stage
        ``i``."""
        name = OUTBOUND_LINK if end == "outbound" else INBOUND_LINK
        if self.chain is None:
            return name
        hop = self.chain.stage_index + (end == "outbound")
        return f"{name} (hop {hop})"

    def chain_fault(self, reason: FaultReason) -> None:
        """A fault of what every run shares: each held run faults with ``reason``."""
        if self.broken is None:
            self.broken = reason
        self.trace("chain_fault", {"reason": str(reason)})
        self._outputs.clear()
        for slot in list(self.runs.values()):
            self._feed(slot, fsm.ChainFault(reason))


def _record_problem(slot: RunSlot, h: ObjectHeader) -> str | None:
    """Why a record of a held run on its edge is no record of that run: its header
    checks (kind, dtype, extent, rows, a chunk only at sequence 0), or more rows than a
    batch holds."""
    assert slot.check is not None and slot.provision is not None
    problem = slot.check.validate_shape(h)
    if problem is not None:
        return f"{problem[0].value}: {problem[1]}"
    limit = slot.provision.max_batch_rows
    if h.rows > limit:
        return f"{h.rows} rows, a batch holds {limit} (max_batch_rows)"
    return None


def _loaded(h: ObjectHeader) -> fsm.ObjectLoaded:
    return fsm.ObjectLoaded(
        h.run_id, h.edge_id, h.sequence, h.chunk_index, h.chunk_count, rows=h.rows
    )


def _prefill(taken: Taken) -> bool:
    return taken.header.sequence == 0
