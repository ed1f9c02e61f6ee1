"""The stage controller of a chain (CONCURRENT_RUNS.md): many runs on one stage.

A chain's stage holds one stage machine (``runplan.fsm.stage``) per run it serves, the
chain's worker (weights bound once, a KV cache per run) and the chain's two links (one
ring per hop, shared by every run). It is control-path only and does no waiting of its
own: ``handle(event)`` feeds machines and carries out their actions at once; the work
that takes time is left for the runtime to run when it chooses, each piece reporting
back as events:

- ``run_setup()`` while ``setup_pending``: per new run, the worker configured and bound
  for the chain (at once when it already is), the run's KV cache reserved
  (``open_run``; no room is ``CacheUnavailable``: the stage answers
  ``ProvisionRefused`` and keeps nothing of the run), the inbound link opened (once per
  chain); ``try_attach_links()`` while ``links_pending``, until the next stage's ring
  exists. A run's INBOUND / OUTBOUND parts are done when it is attached to the links.
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
- ``run_release()`` while ``release_pending``: each stopping run's cache freed
  (``close_run``), ``Released``: ``StageStopped``, and its id joins the stale set. Each
  ``StageStopped`` carries the batches run since the previous one, counted by rows
  (``batches``): the orchestrator learns every batch's size once, whichever run's stop
  reports it.

Joining a new chain (issue 25): ``JoinChain`` from the orchestrator, after the chain was
re-placed around this stage, stops every run the stage still holds of the old chain
(each freed and reported stopped; their ids stay stale), closes both links of the old
chain, and takes the new chain's links from the runtime's ``joins`` port (which knows
the new secret, hence the new names and keys); the worker, its configuration and its
bound weights stay, so the new chain's runs reuse them. A join not from the
orchestrator, for another node, or for another place in the pipeline than the one the
stage holds is rejected and changes nothing (``fsm.join_problem``).

Stale runs: a stopped run's id stays stale (its records, stops and provisions are
rejected as ``STALE_RUN``) among the last ``stale_kept`` runs the stage stopped; an older
one's record or stop is still rejected (``UNKNOWN_RUN``: the stage holds no such run)
and changes nothing. So the set is bounded however long the stage serves.

Faults: a run's own failure (its step's ``StepFailure``, its record, its step timer)
ends that run alone. A fault of what runs share (the inbound link closed or corrupt, the
outbound link closed or stuck, ``execute_batch`` raising) is ``ChainFault`` to every held
run, each answering with its own ``StageFault`` naming the same cause; a provision that
comes after it fails its setup with that cause. A record the stage cannot read (a
header of another version, garbled: ``LinkFault``) is the ``EDGE_FAULT`` of a link
that can no longer be read, its detail naming the record: the stage's link is spent (it
refuses every later provision), so the chain must be made again, as a recovery does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import attrs
from attrs import frozen

from runplan import ProvisionStage
from runplan.fsm import stage as fsm
from runplan.messages import (
    BatchCount,
    FaultKind,
    FaultReason,
    JoinChain,
    ProvisionRefused,
    StageFault,
    StageReady,
    StageStopped,
    StopReason,
    StopRun,
)
from runplan.record_header import HeaderCheck, HeaderDType, ObjectHeader
from runtime_core.batching import BatchScheduler, Candidate
from runtime_core.links import LinkFault, LinkReceiver, LinkSender, Taken
from runtime_core.recent_runs import RECENT_RUNS_KEPT, RecentRuns
from runtime_core.records import decode_input, encode_output
from runtime_core.ring import EdgeClosed
from runtime_core.workers.interface import (
    BatchStep,
    KvCacheUnavailable,
    Progress,
    StepFailure,
    Worker,
)
from runtime_core.workers.worker_runs import same_stage

#: How the detail of a chain fault of the stage's links begins (``EDGE_FAULT``): the
#: link to the stage before (or the orchestrator's token-in) or to the stage after (or
#: token-out) is gone. A run's own bad record names its edge instead (``edge N: ...``).
INBOUND_LINK = "inbound link"
OUTBOUND_LINK = "outbound link"

Trace = Callable[[str, dict[str, Any]], None]
#: Stopped runs whose ids a stage keeps as stale (the most recent ones).
STALE_RUNS_KEPT = RECENT_RUNS_KEPT

_PREPARING = fsm.State.PREPARING
_READY = fsm.State.READY
_EXECUTING = fsm.State.EXECUTING
_QUEUED = (_READY, _EXECUTING)  # a record waits in the run's inbox
_GONE = (fsm.State.UNPROVISIONED, fsm.State.STOPPED)  # the machine holds no run


class ChainTransport(Protocol):
    """Makes a stage's two links, once per chain: the inbound link (its consumer, this
    stage, makes the ring) and the outbound link (``None`` until the next stage's ring
    exists)."""

    def open_inbound(self, provision: ProvisionStage) -> LinkReceiver: ...

    def open_outbound(self, provision: ProvisionStage) -> LinkSender | None: ...


#: ``joins(message)``: the new chain's links of a stage told to join it (the runtime's
#: side of ``JoinChain``: the new secret from the stage's host, the old links let go).
Joins = Callable[[JoinChain], ChainTransport]


class ControlChannel(Protocol):
    def send(self, message: StageReady | StageFault | StageStopped | ProvisionRefused) -> None: ...


class RunTimers(Protocol):
    """Timers per run; the runtime feeds ``RunTimerFired(run_id, timer)`` when one runs
    out."""

    def start(self, run_id: str, timer: fsm.Timer, ms: int) -> None: ...

    def cancel(self, run_id: str, timer: fsm.Timer) -> None: ...


@frozen
class RunTimerFired:
    """A run's timer ran out."""

    run_id: str
    timer: fsm.Timer


#: What a runtime feeds ``ChainStageController.handle``.
ChainStageEvent = fsm.Received | fsm.OrchestratorLost | RunTimerFired


@attrs.define(eq=False)
class RunSlot:
    """One held run: its machine, its provision and header check, the records waiting
    for it (oldest first, each with its load number), the one in the batch, and what of
    its setup is still to do."""

    machine: fsm.StageMachine
    provision: ProvisionStage | None = None
    check: HeaderCheck | None = None
    inbox: deque[tuple[int, Taken]] = attrs.field(factory=deque)
    current: Taken | None = None
    needs_setup: bool = False
    needs_outbound: bool = False

    @property
    def run_id(self) -> str:
        assert self.machine.run_id is not None
        return self.machine.run_id


@frozen
class _Output:
    """A step's output waiting for the outbound link (``payload`` None: nothing to
    write, a last stage's prefill chunk)."""

    run_id: str
    sequence: int
    chunk_index: int
    chunk_count: int
    rows: int
    dtype: HeaderDType
    payload: bytes | None


def _no_trace(kind: str, fields: dict[str, Any]) -> None:
    pass


class ChainStageController:
    """One stage of a chain: a stage machine per held run, the chain's worker and links,
    the batch scheduler."""

    def __init__(
        self,
        node_id: str,
        orchestrator_node_id: str,
        worker: Worker,
        transport: ChainTransport,
        control: ControlChannel,
        timers: RunTimers,
        trace: Trace | None = None,
        stopped_runs: frozenset[str] = frozenset(),
        joins: Joins | None = None,
        stale_kept: int = STALE_RUNS_KEPT,
    ) -> None:
        self.node_id = node_id
        self.orchestrator_node_id = orchestrator_node_id
        self.worker = worker
        self.transport = transport
        self.control = control
        self.timers = timers
        self.trace = trace or _no_trace
        self.runs: dict[str, RunSlot] = {}
        self._stale = RecentRuns(stopped_runs, stale_kept)
        self.joins = joins
        self.joined = 0  # chains joined after the first (JoinChain taken)
        self.chain: ProvisionStage | None = None  # the stage facts the worker is set for
        self._bound = False
        self.scheduler: BatchScheduler | None = None
        self.inbound: LinkReceiver | None = None
        self.outbound: LinkSender | None = None
        self.broken: FaultReason | None = None  # a chain fault: the links cannot be used
        self._loads = 0  # records taken off the inbound link so far
        self._outputs: deque[_Output] = deque()
        self._release: list[str] = []
        self.batches = 0  # worker calls so far
        # Rows of the latest batch (for traces and logs), and the batches run over the
        # stage's life by rows (rows -> batches: at most one entry per batch size, however
        # long the stage serves).
        self.last_batch_rows = 0
        self.batch_counts: dict[int, int] = {}
        self._unreported: dict[int, int] = {}  # rows -> batches not yet in a StageStopped

    # -- state the runtime reads -------------------------------------------------------
    @property
    def setup_pending(self) -> bool:
        return any(s.needs_setup for s in self.runs.values())

    @property
    def links_pending(self) -> bool:
        return self.outbound is None and any(
            s.needs_outbound and not s.needs_setup for s in self.runs.values()
        )

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

    @property
    def release_pending(self) -> bool:
        return bool(self._release)

    # -- events in, actions out -----------------------------------------------------------
    def handle(self, event: ChainStageEvent) -> None:
        """Feed one event: a control message goes to its run's machine (a vacant one
        for a run the stage does not hold), ``OrchestratorLost`` to every run, a timer
        to its run."""
        if isinstance(event, fsm.Received) and isinstance(event.message, JoinChain):
            self._join(event.sender, event.message)
        elif isinstance(event, fsm.Received):
            run_id = getattr(event.message, "run_id", None)
            slot = self.runs.get(run_id) if isinstance(run_id, str) else None
            if slot is not None:
                self._feed(slot, event)
            else:
                self._vacant(event)
        elif isinstance(event, fsm.OrchestratorLost):
            for slot in list(self.runs.values()):
                self._feed(slot, event)
        elif isinstance(event, RunTimerFired):
            slot = self.runs.get(event.run_id)
            if slot is not None:  # a timer of a run that has gone: nothing to do
                self._feed(slot, fsm.TimerFired(event.timer))
        else:
            raise TypeError(f"{type(event).__name__} is not an event of a chain's stage")

    @property
    def stale_runs(self) -> frozenset[str]:
        """The run ids this stage rejects as stale (the last ``stale_kept`` stopped)."""
        return self._stale.stale

    # -- joining a new chain -------------------------------------------------------------
    def _join(self, sender: str, join: JoinChain) -> None:
        chain = self.chain
        place = None if chain is None else (chain.stage_index, chain.stage_count)
        problem = fsm.join_problem(self.node_id, self.orchestrator_node_id, sender, join, place)
        if problem is None and self.joins is None:
            problem = (fsm.RejectReason.INVALID_JOIN, "this stage cannot join another chain")
        if problem is not None:
            self.trace(
                "reject", {"sender": sender, "reason": problem[0].value, "detail": problem[1]}
            )
            return
        assert self.joins is not None
        stop = fsm.Received(self.orchestrator_node_id, StopRun("", StopReason.FAULTED))
        for run_id, slot in list(self.runs.items()):  # the old chain's runs end here
            self._feed(slot, attrs.evolve(stop, message=StopRun(run_id, StopReason.FAULTED)))
        self.run_release()
        for slot in list(self.runs.values()):  # a machine that did not stop: dropped
            self._drop(slot, stale=True)
        if self.inbound is not None:
            self.inbound.close()
        self.inbound = self.outbound = None
        self.broken = None
        self._outputs.clear()
        try:
            self.transport = self.joins(join)
        except Exception as exc:  # no new secret, no such medium: no run can start here
            detail = f"cannot join the new chain: {type(exc).__name__}: {exc}"
            self.broken = FaultReason(FaultKind.EDGE_FAULT, detail)
            self.trace("chain_fault", {"reason": str(self.broken)})
            return
        self.joined += 1
        self.trace(
            "joined",
            {
                "generation": join.generation,
                "stage_index": join.stage_index,
                "stage_count": join.stage_count,
                "weights_kept": self._bound,
            },
        )

    def _vacant(self, event: fsm.Received | fsm.ObjectLoaded) -> None:
        """An event for a run the stage does not hold: a fresh machine (with the stale
        set) rejects it with the MVP's reason, or takes a provision."""
        message = event.message if isinstance(event, fsm.Received) else None
        if isinstance(message, ProvisionStage):
            problem = self._chain_problem(message)
            if problem is not None:
                self.trace(
                    "reject",
                    {
                        "sender": event.sender if isinstance(event, fsm.Received) else "",
                        "reason": fsm.RejectReason.INVALID_PROVISION.value,
                        "detail": problem,
                    },
                )
                return
        machine = fsm.StageMachine.new(self.node_id, self.orchestrator_node_id)
        machine = attrs.evolve(machine, stale_runs=self.stale_runs)
        slot = RunSlot(machine)
        self._feed(slot, event, held=False)
        if slot.machine.state is _PREPARING:
            self.runs[slot.run_id] = slot

    def _chain_problem(self, provision: ProvisionStage) -> str | None:
        """Why a provision cannot join the chain: another stage's facts while runs are
        held, or a place in the pipeline other than the one the links serve."""
        chain = self.chain
        if chain is None:
            return None
        if self.runs and not same_stage(chain, provision):
            return f"does not match the chain's stage {chain.stage_index} while runs are held"
        hop = (provision.stage_index, provision.stage_count)
        if self.inbound is not None and hop != (chain.stage_index, chain.stage_count):
            return f"the chain's links are for stage {chain.stage_index} of {chain.stage_count}"
        return None

    def _feed(self, slot: RunSlot, event: fsm.Event, held: bool = True) -> None:
        before = slot.machine.state
        slot.machine, actions = fsm.step(slot.machine, event)
        after = slot.machine.state
        if after is not before and self.trace is not _no_trace:
            self.trace(
                "state",
                {
                    "run_id": slot.machine.run_id or getattr(slot.provision, "run_id", ""),
                    "from": before._name_,
                    "to": after._name_,
                    "event": type(event).__name__,
                },
            )
        for action in actions:
            self._act(slot, action)
        if held and after in _GONE and slot.provision is not None:
            self._drop(slot, stale=after is fsm.State.STOPPED)

    def _drop(self, slot: RunSlot, *, stale: bool) -> None:
        run_id = slot.provision.run_id if slot.provision is not None else None
        if run_id is None or self.runs.get(run_id) is not slot:
            return
        del self.runs[run_id]
        if stale:
            self._stale.add(run_id)
        else:  # refused: nothing of the run is kept (its cache was never reserved)
            self.worker.close_run(run_id)
        if self.scheduler is not None:
            self.scheduler.forget(run_id)

    def _act(self, slot: RunSlot, action: fsm.Action) -> None:
        run_id = slot.provision.run_id if slot.provision is not None else ""
        if isinstance(action, fsm.StartTimer):
            self.timers.start(run_id, action.timer, action.ms)
        elif isinstance(action, fsm.CancelTimer):
            if run_id:
                self.timers.cancel(run_id, action.timer)
        elif isinstance(action, fsm.ExecuteStep):
            pass  # the batch being formed reads the machine's state
        elif isinstance(action, (fsm.ReleaseInput, fsm.DiscardObject)):
            slot.current = None  # the payload was copied at load: the copy goes
        elif isinstance(action, fsm.SendToOrchestrator):
            message = action.message
            if isinstance(message, StageStopped) and self._unreported:
                message = attrs.evolve(message, batches=self._batch_report())
            self.control.send(message)
        elif isinstance(action, fsm.BeginSetup):
            p = action.provision
            slot.provision = p
            slot.check = HeaderCheck.for_edge(
                p.run_id, p.inbound.edge_id, p.inbound.object_spec, p.model.hidden_dim
            )
            slot.needs_setup = True
            slot.needs_outbound = True
        elif isinstance(action, fsm.ReleaseRun):
            slot.needs_setup = slot.needs_outbound = False
            slot.inbox.clear()
            slot.current = None
            self._release.append(run_id)
        elif isinstance(action, fsm.Reject):
            self.trace(
                "reject",
                {"sender": action.sender, "reason": action.reason.value, "detail": action.detail},
            )
        elif isinstance(action, fsm.ProtocolViolation):
            self.trace(
                "protocol_violation",
                {"run_id": run_id, "state": action.state.name, "kind": action.kind.name},
            )

    def _batch_report(self) -> tuple[BatchCount, ...]:
        """The batches run since the last report, by rows; they are reported now."""
        counts, self._unreported = sorted(self._unreported.items()), {}
        return tuple(BatchCount(rows, batches) for rows, batches in counts)

    # -- setup ------------------------------------------------------------------------------
    def run_setup(self, progress: Progress | None = None) -> None:
        """Set up every run waiting for it, in the order they were provisioned."""
        for slot in [s for s in self.runs.values() if s.needs_setup]:
            slot.needs_setup = False
            self._setup(slot, progress)

    def _setup(self, slot: RunSlot, progress: Progress | None) -> None:
        p = slot.provision
        assert p is not None
        parts: tuple[tuple[fsm.SetupPart, Callable[[], None]], ...] = (
            (fsm.SetupPart.WORKER, lambda: self._configure(p)),
            (fsm.SetupPart.SHARD, lambda: self._bind_and_open(p, progress)),
            (fsm.SetupPart.INBOUND, lambda: self._open_inbound(p)),
        )
        for part, work in parts:
            if slot.machine.state is not _PREPARING:
                return
            try:
                work()
            except KvCacheUnavailable as exc:
                self._feed(
                    slot, fsm.CacheUnavailable(exc.needed_bytes, exc.free_bytes, exc.budget_bytes)
                )
                return
            except Exception as exc:  # any failure of setup is the run's fault to report
                self._feed(slot, fsm.SetupFailed(part, f"{type(exc).__name__}: {exc}"))
                return
            if self.trace is not _no_trace:
                self.trace("setup_done", {"run_id": p.run_id, "part": part.value})
            self._feed(slot, fsm.SetupDone(part))
        if slot.machine.state is _PREPARING and self.outbound is not None:
            slot.needs_outbound = False
            self._feed(slot, fsm.SetupDone(fsm.SetupPart.OUTBOUND))

    def _configure(self, p: ProvisionStage) -> None:
        if self.broken is not None:
            raise RuntimeError(f"the chain is broken: {self.broken}")
        if self.chain is not None and same_stage(self.chain, p):
            return
        self.worker.configure(p)  # other stage facts: no run is held (_chain_problem)
        self.chain = p
        self._bound = False
        self.scheduler = BatchScheduler(p.max_batch_rows)

    def _bind_and_open(self, p: ProvisionStage, progress: Progress | None) -> None:
        if not self._bound:
            self.worker.bind(p.gguf_source, progress)
            self._bound = True
        self.worker.open_run(p)  # KvCacheUnavailable: no room in the budget now

    def _open_inbound(self, p: ProvisionStage) -> None:
        if self.inbound is None:
            self.inbound = self.transport.open_inbound(p)

    def try_attach_links(self) -> bool:
        """Attach the outbound link once the next stage's ring exists; every run waiting
        for it is then attached."""
        waiting = [s for s in self.runs.values() if s.needs_outbound and not s.needs_setup]
        if not waiting:
            return False
        if self.outbound is None:
            chain = self.chain or waiting[0].provision
            assert chain is not None
            try:
                end = self.transport.open_outbound(chain)
            except Exception as exc:
                for slot in waiting:
                    slot.needs_outbound = False
                    detail = f"{type(exc).__name__}: {exc}"
                    self._feed(slot, fsm.SetupFailed(fsm.SetupPart.OUTBOUND, detail))
                return False
            if end is None:
                return False
            self.outbound = end
        for slot in waiting:
            slot.needs_outbound = False
            if slot.machine.state is _PREPARING:
                self._feed(slot, fsm.SetupDone(fsm.SetupPart.OUTBOUND))
        return True

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
        if self.trace is not _no_trace:
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
        if self.trace is not _no_trace:
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
            _Output(
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
        output is out. ``False`` while the outbound ring is full."""
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
                if self.trace is not _no_trace:
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

    # -- release ---------------------------------------------------------------------------
    def run_release(self) -> None:
        """Free each stopping run's cache; then ``Released`` (``StageStopped``)."""
        pending, self._release = self._release, []
        for run_id in pending:
            try:
                self.worker.close_run(run_id)
            except Exception as exc:
                self.trace("release_failed", {"run_id": run_id, "detail": f"{exc}"})
            slot = self.runs.get(run_id)
            if slot is not None:
                self._feed(slot, fsm.Released())

    def close(self) -> None:
        """The chain's end (no run held): the inbound link, whose ring this stage made,
        closes; the worker lets every run go (its weights stay)."""
        if self.inbound is not None:
            self.inbound.close()
        self.inbound = self.outbound = None
        self.worker.release()
        self.chain = None
        self._bound = False

    def held(self) -> Iterator[tuple[str, fsm.State]]:
        """Each held run and its machine's state."""
        for run_id, slot in self.runs.items():
            yield run_id, slot.machine.state


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
