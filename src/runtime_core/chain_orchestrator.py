"""The orchestrator of a chain (CONCURRENT_RUNS.md): many runs over one chain's links.

Each run is an MVP run in full, driven by its own ``runplan.fsm.orchestrator`` machine:
its plan, provisions, readiness barrier, sequences, one outcome, ``StopRun`` to every
stage. The runs share the chain's control channels and its two token links (token-in,
whose ring stage 0 makes; token-out, whose ring this side makes). Like the other
controllers it does no waiting of its own: ``handle(event)`` feeds machines and carries
out their actions; the runtime calls ``try_open_links()`` while ``links_pending``,
``try_inject()`` while ``inject_pending`` and ``poll_tokens()`` while ``wants_tokens``.

- ``add_run(plan, prompt, on_token=...)`` starts a run, or holds it (QUEUED) while the
  runs in flight leave some stage's KV budget without room for its cache (the plan's
  ``kv_bytes`` against ``kv_budget_bytes``, stage by stage); it starts when runs in
  flight end, first held, first started. A run whose cache exceeds a stage's whole
  budget is refused at once (``RunRefused``): it could never run.
- Token-in and token-out, their records and their faults: ``token_links``
  (``TokenLinks``, this orchestrator's base).
- A run's token timer that runs out is fed with the tokens the chain delivered to
  any run since it started (``tokens_delivered``) and the most runs in flight at once
  meanwhile (``running``): the run's machine starts it again while the chain
  delivers tokens, as many times a token as there were runs in flight
  (``token_restart_limit``), and faults the run once none came for its bound or the
  restarts are spent.
- Control messages (``StageReady``, ``StageFault``, ``StageStopped``,
  ``ProvisionRefused``) go to their run's machine; one for no held run is rejected.
  The batches a ``StageStopped`` reports (the stage's since its previous one, by rows)
  are added to ``batch_counts`` when it comes from one of its run's stages, once
  (``batch_reports``): also when it comes after its run ended without it (its stop
  bound ran out while that stage was slow to stop).
- A chain fault ends every run: ``StageDied`` (the runtime's notice that a stage
  process or host is gone, its detail naming stage, node, host and cause) and a broken
  token link go to every run in flight, each ending ``FAULTED`` with that reason; runs
  still held end at once with the same reason (they were never provisioned).
- ``cancel(run_id)`` ends one run (``CANCELLED``); the others go on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import numpy as np
import numpy.typing as npt
from attrs import frozen

from runplan import RunPlan
from runplan.fsm import orchestrator as fsm
from runplan.messages import (
    FaultKind,
    FaultReason,
    ProvisionStage,
    StageStopped,
    StopReason,
    StopRun,
)
from runplan.picklable_error import PicklableError
from runplan.record_header import HeaderCheck
from runtime_core.batch_reports import BatchReports
from runtime_core.controller_trace import Trace, no_trace
from runtime_core.links import LinkReceiver, LinkSender
from runtime_core.recent_runs import RECENT_RUNS_KEPT, RecentRuns
from runtime_core.token_links import OrchestratorLinks, TokenLinks, TokenRecord

#: ``on_token(run_id, sequence, token_id)``: a generated token for the caller.
OnToken = Callable[[str, int, int], None]

_DONE = fsm.State.DONE


class StageChannels(Protocol):
    def send(self, node_id: str, message: ProvisionStage | StopRun) -> None: ...


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


class RunRefused(PicklableError, ValueError):
    """A run the chain can never take: its KV cache exceeds a stage's whole budget, or
    its run id is one the chain already has or had."""

    def __init__(self, run_id: str, reason: str) -> None:
        self.run_id = run_id
        self.reason = reason
        super().__init__(f"run {run_id!r} refused: {reason}")


@attrs.define(eq=False)
class RunHandle:
    """One run on the chain: its plan and machine, its logits (when it asks for them),
    and its end (``finished``)."""

    plan: RunPlan
    machine: fsm.OrchestratorMachine
    on_token: OnToken | None = None
    logits: list[npt.NDArray[np.float32]] = attrs.field(factory=list)
    finished: fsm.RunFinished | None = None
    queued: bool = False  # held until the stages' budgets have room
    needs_links: bool = False  # attached to the token links once they are open
    unsent_chunks: int = 0  # chunks of the prompt not yet on token-in
    check: HeaderCheck | None = None  # token-out records of this run
    token_timer_from: int = 0  # the chain's tokens_delivered when its token timer started
    token_timer_runs: int = 1  # the most runs in flight since its token timer started

    @property
    def run_id(self) -> str:
        return self.plan.run_id

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.finished.tokens if self.finished is not None else self.machine.tokens


#: Finished runs whose ids the orchestrator keeps: more than a stage keeps stale
#: (``RECENT_RUNS_KEPT``), so that a stage never holds as stale an id the orchestrator
#: would accept again.
FINISHED_RUNS_KEPT = 2 * RECENT_RUNS_KEPT


class ChainOrchestrator(TokenLinks):
    """Many runs over one chain."""

    def __init__(
        self,
        channels: StageChannels,
        links: OrchestratorLinks,
        timers: RunTimers,
        trace: Trace | None = None,
    ) -> None:
        self.channels = channels
        self.links = links
        self.timers = timers
        self.trace = trace or no_trace
        self.runs: dict[str, RunHandle] = {}  # in flight and held, in the order added
        #: the ids of the runs that started and finished on this chain, the most recent
        #: (twice as many as a stage keeps stale: an id forgotten here is forgotten by
        #: every stage); a reused id among them is refused, a record of one rejected as
        #: stale. A run that never started (held, then ended) left no trace on the
        #: stages: its id is not kept.
        self.done = RecentRuns(kept=FINISHED_RUNS_KEPT)
        self.token_in: LinkSender | None = None
        self.token_out: LinkReceiver | None = None
        self._decodes: deque[TokenRecord] = deque()  # fed-back tokens waiting for token-in
        self._chunks: deque[TokenRecord] = deque()  # prompt records waiting for token-in
        self.records_sent = 0  # token-in records written so far
        self.tokens_delivered = 0  # token-out records fed to their runs so far
        self._reserved: dict[int, int] = {}  # stage index -> KV bytes of runs in flight
        self.running = 0  # runs started and not yet ended (held runs excluded)
        self.broken: FaultReason | None = None  # a chain fault: no run starts any more
        self.broken_stage: int | None = None  # the stage it names, if it names one
        #: Batches each stage reported, and the stops of ended runs that may still
        #: report some (``batch_reports``).
        self.reports = BatchReports(FINISHED_RUNS_KEPT)

    # -- runs ----------------------------------------------------------------------------
    def add_run(
        self, plan: RunPlan, prompt: Sequence[int], *, on_token: OnToken | None = None
    ) -> RunHandle:
        """Start a run of ``plan`` on ``prompt``, or hold it until the stages have room
        for its KV cache. ``PromptError`` for a prompt the run cannot take;
        ``RunRefused`` for a run that could never run (or a run id already used)."""
        machine = fsm.OrchestratorMachine.for_plan(plan, tuple(prompt))
        run_id = plan.run_id
        if run_id in self.runs or run_id in self.done:
            raise RunRefused(run_id, "the chain already has a run of this id")
        for stage in plan.stages:
            if stage.kv_bytes > stage.kv_budget_bytes:
                raise RunRefused(
                    run_id,
                    f"its KV cache needs {stage.kv_bytes} bytes on stage {stage.stage_index} "
                    f"({stage.node_id!r}), whose whole budget is {stage.kv_budget_bytes}",
                )
        handle = RunHandle(plan, machine, on_token)
        self.runs[run_id] = handle
        if self.broken is not None:
            self._end_unstarted(handle, self.fault_finished())
        elif self._fits(plan) and not any(h.queued for h in self.runs.values()):
            self._start(handle)
        else:
            handle.queued = True
            self.trace("queued", {"run_id": run_id})
        return handle

    def _fits(self, plan: RunPlan) -> bool:
        return all(
            self._reserved.get(s.stage_index, 0) + s.kv_bytes <= s.kv_budget_bytes
            for s in plan.stages
        )

    def _start(self, handle: RunHandle) -> None:
        handle.queued = False
        self.running += 1
        for other in self.runs.values():  # each token timer running sees one more run
            other.token_timer_runs = max(other.token_timer_runs, self.running)
        for s in handle.plan.stages:
            self._reserved[s.stage_index] = self._reserved.get(s.stage_index, 0) + s.kv_bytes
        edge = handle.plan.token_out
        handle.check = HeaderCheck.for_edge(
            handle.run_id, edge.edge_id, edge.object_spec, handle.plan.model.hidden_dim
        )
        self._feed(handle, fsm.Start())

    def _admit(self) -> None:
        """Start held runs, first held first, while they fit."""
        for handle in list(self.runs.values()):
            if handle.queued:
                if self.broken is not None or not self._fits(handle.plan):
                    return
                self._start(handle)

    @property
    def batch_counts(self) -> dict[int, dict[int, int]]:
        """Batches each stage reported (stage index -> rows -> batches). Replaced, never
        changed in place: another thread may read it whole at any time."""
        return self.reports.counts

    def kv_reserved(self) -> dict[int, int]:
        """KV-cache bytes the runs in flight hold on each stage (the planner's figures,
        as the stages reserve them), by stage index."""
        return dict(self._reserved)

    def cancel(self, run_id: str, detail: str = "") -> None:
        """End one run at the caller's request (``CANCELLED``); the others go on."""
        handle = self.runs.get(run_id)
        if handle is None:
            return
        if handle.queued:
            self._end_unstarted(handle, fsm.RunFinished(StopReason.CANCELLED, (), None, None, ()))
        else:
            self._feed(handle, fsm.Cancel(detail or "the caller cancelled"))

    def _end_unstarted(self, handle: RunHandle, finished: fsm.RunFinished) -> None:
        """A run that never started ends so: nothing was provisioned."""
        handle.queued = False
        handle.finished = finished
        self._retire(handle)

    def fault_finished(self) -> fsm.RunFinished:
        """How a run the chain had not started ends once the chain is broken: faulted
        with the chain's fault and the stage it names, as the runs in flight end (runs
        waiting for KV memory once named no stage, blaming the orchestrator)."""
        assert self.broken is not None
        return fsm.RunFinished(StopReason.FAULTED, (), self.broken, self.broken_stage, ())

    def _retire(self, handle: RunHandle) -> None:
        if self.runs.pop(handle.run_id, None) is None:
            return
        self._drop_records(handle.run_id)
        if handle.check is not None:  # it started: its id is kept, its reservation goes
            self.done.add(handle.run_id)
            m = handle.machine
            self.reports.awaiting(handle.run_id, {i: m.node_ids[i] for i in m.awaiting_stop})
            self.running -= 1
            for s in handle.plan.stages:
                self._reserved[s.stage_index] -= s.kv_bytes
        self.trace("finished", {"run_id": handle.run_id, "outcome": _outcome(handle)})
        self._admit()

    # -- events in, actions out -------------------------------------------------------------
    def handle(self, event: fsm.Received | fsm.StageDied | fsm.StageSilent | RunTimerFired) -> None:
        """Feed one event: a control message to its run's machine, a stage's death to
        every run (a chain fault), a timer to its run."""
        if isinstance(event, fsm.Received):
            run_id = getattr(event.message, "run_id", None)
            handle = self.runs.get(run_id) if isinstance(run_id, str) else None
            if handle is None or handle.queued:
                reason = "a finished run" if run_id in self.done else "no run of this chain"
                if isinstance(event.message, StageStopped) and run_id in self.done:
                    late = self.reports.late(event.sender, event.message)
                    if late is None:  # its batches counted: the run ended without them
                        self.trace("late_stop", {"run_id": run_id, "sender": event.sender})
                        return
                    reason += f" ({late})"
                self.trace(
                    "reject",
                    {
                        "sender": event.sender,
                        "reason": f"{type(event.message).__name__} of {reason}",
                    },
                )
                return
            if isinstance(event.message, StageStopped) and event.message.batches:
                self._count_batches(handle, event)
            self._feed(handle, event)
        elif isinstance(event, fsm.StageDied):
            detail = f"stage {event.stage_index}: {event.detail}".rstrip(": ")
            self._chain_fault(FaultReason(FaultKind.PROCESS_DIED, detail), event)
        elif isinstance(event, fsm.StageSilent):
            detail = f"stage {event.stage_index}: {event.why()}"
            self._chain_fault(FaultReason(FaultKind.STAGE_SILENT, detail), event)
        elif isinstance(event, RunTimerFired):
            handle = self.runs.get(event.run_id)
            if handle is not None and not handle.queued:
                delivered, runs = 0, 1
                if event.timer is fsm.Timer.TOKEN:
                    delivered = self.tokens_delivered - handle.token_timer_from
                    runs = handle.token_timer_runs
                self._feed(handle, fsm.TimerFired(event.timer, delivered, runs))
        else:
            raise TypeError(f"{type(event).__name__} is not an event of a chain's orchestrator")

    def _count_batches(self, handle: RunHandle, event: fsm.Received) -> None:
        """Add the batches a ``StageStopped`` of one of the run's stages reports (one
        of another sender, or of rows or counts below 1, is rejected and not added)."""
        message = event.message
        assert isinstance(message, StageStopped)
        problem = fsm.stage_message_problem(handle.machine, event)
        if problem is None and message.stage_index in handle.machine.stopped:
            # a duplicate (or a copy reordered after it): its batches are counted once
            problem = f"stage {message.stage_index} already stopped this run"
        if problem is None:
            problem = self.reports.add(message)
        if problem is not None:
            self.trace("reject", {"sender": event.sender, "reason": f"StageStopped: {problem}"})

    def _chain_fault(self, reason: FaultReason, event: fsm.Event) -> None:
        """Every run in flight gets ``event``; runs still held end with ``reason``."""
        if self.broken is None:
            self.broken = reason
            if isinstance(event, (fsm.StageDied, fsm.StageSilent)):
                self.broken_stage = event.stage_index
        self.trace("chain_fault", {"reason": str(reason)})
        for handle in list(self.runs.values()):
            if handle.queued:
                self._end_unstarted(handle, self.fault_finished())
            else:
                self._feed(handle, event)

    def _feed(self, handle: RunHandle, event: fsm.Event) -> None:
        before = handle.machine.state
        handle.machine, actions = fsm.step(handle.machine, event)
        if handle.machine.state is not before and self.trace is not no_trace:
            self.trace(
                "state",
                {
                    "run_id": handle.run_id,
                    "from": before._name_,
                    "to": handle.machine.state._name_,
                    "event": type(event).__name__,
                },
            )
        for action in actions:
            self._act(handle, action)
        if handle.machine.state is _DONE:
            self._retire(handle)

    def _act(self, handle: RunHandle, action: fsm.Action) -> None:
        run_id = handle.run_id
        if isinstance(action, fsm.DeliverToken):
            if handle.on_token is not None:
                handle.on_token(run_id, action.sequence, action.token_id)
        elif isinstance(action, fsm.CancelTimer):
            self.timers.cancel(run_id, action.timer)
        elif isinstance(action, fsm.StartTimer):
            if action.timer is fsm.Timer.TOKEN:
                handle.token_timer_from = self.tokens_delivered
                handle.token_timer_runs = self.running
            self.timers.start(run_id, action.timer, action.ms)
        elif isinstance(action, fsm.InjectTokens):
            self._queue(handle, action)
        elif isinstance(action, fsm.OpenTokenEndpoints):
            handle.needs_links = True
        elif isinstance(action, (fsm.SendProvision, fsm.SendStopRun)):
            self.channels.send(action.node_id, action.message)
        elif isinstance(action, fsm.CloseTokenEndpoints):
            # The chain's links stay: only the run's records still waiting go.
            handle.needs_links = False
            self._drop_records(run_id)
        elif isinstance(action, fsm.RunFinished):
            handle.finished = action
        elif isinstance(action, fsm.Rejected):
            self.trace(
                "reject", {"run_id": run_id, "sender": action.sender, "reason": action.reason}
            )
        elif isinstance(action, fsm.ProtocolViolation):
            self.trace(
                "protocol_violation",
                {"run_id": run_id, "state": action.state.name, "kind": action.kind.name},
            )

    def stage_unreadable(self, stage_index: int, detail: str) -> None:
        """The runtime's notice that stage ``stage_index`` sent a control frame it cannot
        read (another version, a defect) and is ended for it: a chain fault whose reason
        (``broken``) is ``PROTOCOL_VIOLATION``, which a recovery does not retry; every
        run in flight ends as for a stage gone, ``detail`` naming the frame's problem.
        Before the stage's death is noted (the first reason stands)."""
        text = f"stage {stage_index}: {detail}"
        event = fsm.StageDied(stage_index, detail)
        self._chain_fault(FaultReason(FaultKind.PROTOCOL_VIOLATION, text), event)


def _outcome(handle: RunHandle) -> str:
    return handle.finished.outcome.value if handle.finished is not None else "?"
