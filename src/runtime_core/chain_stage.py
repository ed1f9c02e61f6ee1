"""The stage controller of a chain (CONCURRENT_RUNS.md): many runs on one stage.

A chain's stage holds one stage machine (``runplan.fsm.stage``) per run it serves, the
chain's worker (weights bound once, a KV cache per run) and the chain's two links (one
ring per hop, shared by every run). It is control-path only and does no waiting of its
own: ``handle(event)`` feeds machines and carries out their actions at once; the work
that takes time is left for the runtime to run when it chooses, each piece reporting
back as events:

- ``run_setup()`` and ``try_attach_links()``: a run's setup (``stage_setup``:
  ``StageSetup``, this controller's base).
- ``poll_inbound()``, ``run_batch()``, ``try_publish_outputs()``: records in, batches,
  outputs out (``stage_data_path``: ``StageDataPath``, this controller's base).
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
ends that run alone. A fault of what runs share is ``ChainFault`` to every held run
(``stage_data_path``); a provision that comes after it fails its setup with that cause.
A record the stage cannot read spends the stage's link (it refuses every later
provision), so the chain must be made again, as a recovery does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol

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
from runplan.record_header import HeaderCheck
from runtime_core.batching import BatchScheduler
from runtime_core.controller_trace import Trace, no_trace
from runtime_core.links import LinkReceiver, LinkSender, Taken
from runtime_core.recent_runs import RECENT_RUNS_KEPT, RecentRuns
from runtime_core.stage_data_path import StageDataPath, StepOutput
from runtime_core.stage_setup import StageSetup
from runtime_core.workers.interface import Worker
from runtime_core.workers.worker_runs import same_stage

#: Stopped runs whose ids a stage keeps as stale (the most recent ones).
STALE_RUNS_KEPT = RECENT_RUNS_KEPT

_PREPARING = fsm.State.PREPARING
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


class ChainStageController(StageSetup, StageDataPath):
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
        self.trace = trace or no_trace
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
        self._outputs: deque[StepOutput] = deque()
        self.records_published = 0  # outputs written on the outbound link so far
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
        if after is not before and self.trace is not no_trace:
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
