"""The stage machine's handlers: for each (state, event kind) of its table, the next
machine and its actions; and the fault path of a pair the table does not hold."""

from __future__ import annotations

from runplan.fsm.stage_actions import (
    Action,
    BeginSetup,
    CancelTimer,
    DiscardObject,
    ExecuteStep,
    ProtocolViolation,
    Reject,
    RejectReason,
    ReleaseInput,
    ReleaseRun,
    SendToOrchestrator,
    StartTimer,
)
from runplan.fsm.stage_checks import (
    _object_problem,
    _order_problem,
    _provision_problem,
    _run_problem,
    _stop_problem,
)
from runplan.fsm.stage_events import (
    CacheUnavailable,
    ChainFault,
    EdgeFault,
    Event,
    EventKind,
    ObjectLoaded,
    OrchestratorLost,
    Received,
    Released,
    SetupDone,
    SetupFailed,
    State,
    StepCompleted,
    StepFailed,
    Timer,
    TimerFired,
)
from runplan.fsm.stage_machine import _ALL_PARTS, StageMachine, _Result
from runplan.fsm.table import evolver
from runplan.messages import (
    FaultKind,
    FaultReason,
    ProvisionRefused,
    ProvisionStage,
    StageFault,
    StageReady,
    StageStopped,
)

# Members the handlers of every step use, bound once: on Python 3.11 ``State.READY``
# reads through the slow attribute hook of ``EnumType.__getattr__``.
_READY, _EXECUTING, _STEP = State.READY, State.EXECUTING, Timer.STEP
_evolve = evolver(StageMachine)


def _reject(m: StageMachine, sender: str, problem: tuple[RejectReason, str]) -> _Result:
    return m, (Reject(sender, problem[0], problem[1]),)


def _provision(m: StageMachine, e: Received) -> _Result:
    problem = _provision_problem(m, e)
    if problem:
        return _reject(m, e.sender, problem)
    msg = e.message
    assert isinstance(msg, ProvisionStage)
    m = _evolve(
        m,
        state=State.PREPARING,
        provision=msg,
        setup=frozenset(),
        next_sequence=0,
        executing=None,
        fault=None,
        next_chunk=0,
        chunk_count=1,
    )
    return m, (BeginSetup(msg), StartTimer(Timer.SETUP, msg.timeouts.ready_ms))


def _reject_provision(m: StageMachine, e: Received) -> _Result:
    problem = _provision_problem(m, e)
    assert problem is not None  # every active state refuses a provision
    return _reject(m, e.sender, problem)


def _setup_done(m: StageMachine, e: SetupDone) -> _Result:
    m = _evolve(m, setup=m.setup | {e.part})
    if m.setup != _ALL_PARTS:
        return m, ()
    m = _evolve(m, state=State.READY)
    return m, (CancelTimer(Timer.SETUP), SendToOrchestrator(StageReady(*m._ident())))


def _to_faulted(m: StageMachine, reason: FaultReason, *actions: Action) -> _Result:
    m = _evolve(m, state=State.FAULTED, fault=reason, executing=None)
    return m, (*actions, SendToOrchestrator(StageFault(*m._ident(), reason=reason)))


def _setup_failed(m: StageMachine, e: SetupFailed) -> _Result:
    reason = FaultReason(FaultKind.SETUP_FAILURE, f"{e.part.value.lower()}: {e.detail}")
    return _to_faulted(m, reason, CancelTimer(Timer.SETUP))


def _setup_timeout(m: StageMachine, _e: TimerFired) -> _Result:
    missing = sorted(p.value.lower() for p in _ALL_PARTS - m.setup)
    return _to_faulted(m, FaultReason(FaultKind.TIMEOUT, f"setup not done: {missing}"))


def _object_when_ready(m: StageMachine, e: ObjectLoaded) -> _Result:
    problem = _object_problem(m, e)
    if problem:
        return m, (Reject("", *problem), DiscardObject(e.edge_id, e.sequence))
    if e.chunk_index or e.chunk_count != 1 or m.next_chunk:  # a prefill in chunks
        order = _order_problem(m, e)
        if order is not None:
            reason = FaultReason(FaultKind.SEQUENCE_VIOLATION, order)
            return _to_faulted(m, reason, ReleaseInput(e.sequence))
        m = _evolve(m, chunk_count=e.chunk_count)
    elif e.sequence != m.next_sequence:
        reason = FaultReason(
            FaultKind.SEQUENCE_VIOLATION, f"sequence {e.sequence}, expected {m.next_sequence}"
        )
        return _to_faulted(m, reason, ReleaseInput(e.sequence))
    assert m.provision is not None
    p = m.provision
    step_ms = p.timeouts.batch_step_limit_ms(e.rows, p.batch_rows, p.shared_batches)
    m = _evolve(m, state=_EXECUTING, executing=e.sequence)
    execute = ExecuteStep(e.sequence, e.chunk_index, e.chunk_count)
    return m, (execute, StartTimer(_STEP, step_ms))


def _object_out_of_turn(m: StageMachine, e: ObjectLoaded) -> _Result:
    """An object for this run while preparing or executing: the orchestrator never
    injects before readiness nor more than one object at a time, so this is a
    sequence violation."""
    problem = _object_problem(m, e)
    if problem:
        return m, (Reject("", *problem), DiscardObject(e.edge_id, e.sequence))
    detail = f"sequence {e.sequence} arrived while {m.state.name.lower()}"
    actions: tuple[Action, ...] = (ReleaseInput(e.sequence),)
    if m.executing is not None:
        actions += (CancelTimer(Timer.STEP), ReleaseInput(m.executing))
    else:
        actions += (CancelTimer(Timer.SETUP),)
    return _to_faulted(m, FaultReason(FaultKind.SEQUENCE_VIOLATION, detail), *actions)


def _object_discarded(m: StageMachine, e: ObjectLoaded) -> _Result:
    """Faulted or stopping: reject new run work; the slot is released."""
    problem = _object_problem(m, e)
    if problem:
        return m, (Reject("", *problem), DiscardObject(e.edge_id, e.sequence))
    return m, (ReleaseInput(e.sequence),)


def _object_without_run(m: StageMachine, e: ObjectLoaded) -> _Result:
    problem = _run_problem(m, e.run_id)
    assert problem is not None
    return m, (Reject("", *problem), DiscardObject(e.edge_id, e.sequence))


def _step_completed(m: StageMachine, e: StepCompleted) -> _Result:
    if e.sequence != m.executing or e.chunk_index != m.next_chunk:
        return _violation(m, EventKind.STEP_COMPLETED, e)
    if e.chunk_index + 1 < m.chunk_count:  # a chunk of the prefill: the next one
        m = _evolve(m, state=_READY, executing=None, next_chunk=e.chunk_index + 1)
    elif m.chunk_count != 1:  # the last chunk: sequence 0 is complete
        m = _evolve(
            m,
            state=_READY,
            executing=None,
            next_sequence=e.sequence + 1,
            next_chunk=0,
            chunk_count=1,
        )
    else:
        m = _evolve(m, state=_READY, executing=None, next_sequence=e.sequence + 1)
    return m, (CancelTimer(_STEP), ReleaseInput(e.sequence))


def _step_failed(m: StageMachine, e: StepFailed) -> _Result:
    assert m.executing is not None
    reason = FaultReason(FaultKind.STEP_FAILURE, f"sequence {e.sequence}: {e.detail}")
    return _to_faulted(m, reason, CancelTimer(Timer.STEP), ReleaseInput(m.executing))


def _step_timeout(m: StageMachine, _e: TimerFired) -> _Result:
    assert m.executing is not None
    reason = FaultReason(FaultKind.TIMEOUT, f"step {m.executing} ran out of time")
    return _to_faulted(m, reason, ReleaseInput(m.executing))


def _edge_fault(m: StageMachine, e: EdgeFault) -> _Result:
    reason = FaultReason(FaultKind.EDGE_FAULT, f"edge {e.edge_id}: {e.detail}")
    actions: tuple[Action, ...] = ()
    if m.executing is not None:
        actions = (CancelTimer(Timer.STEP), ReleaseInput(m.executing))
    elif m.state is State.PREPARING:
        actions = (CancelTimer(Timer.SETUP),)
    return _to_faulted(m, reason, *actions)


def _cache_unavailable(m: StageMachine, e: CacheUnavailable) -> _Result:
    """The run's KV cache cannot be reserved: refuse the provision and keep nothing of
    the run (its id is not stale: the provision may come again)."""
    run_id, stage_index, node_id = m._ident()
    refused = ProvisionRefused(
        run_id, stage_index, node_id, e.needed_bytes, e.free_bytes, e.budget_bytes
    )
    m = _evolve(
        m,
        state=State.UNPROVISIONED,
        provision=None,
        setup=frozenset(),
        next_sequence=0,
        executing=None,
        fault=None,
        next_chunk=0,
        chunk_count=1,
    )
    return m, (CancelTimer(Timer.SETUP), SendToOrchestrator(refused))


def _chain_fault(m: StageMachine, e: ChainFault) -> _Result:
    actions: tuple[Action, ...] = ()
    if m.executing is not None:
        actions = (CancelTimer(Timer.STEP), ReleaseInput(m.executing))
    elif m.state is State.PREPARING:
        actions = (CancelTimer(Timer.SETUP),)
    return _to_faulted(m, e.reason, *actions)


def _stop(m: StageMachine, e: Received) -> _Result:
    problem = _stop_problem(m, e)
    if problem:
        return _reject(m, e.sender, problem)
    return _begin_stopping(m)


def _begin_stopping(m: StageMachine) -> _Result:
    actions: tuple[Action, ...] = (CancelTimer(Timer.SETUP), CancelTimer(Timer.STEP))
    if m.executing is not None:
        actions += (ReleaseInput(m.executing),)
    m = _evolve(m, state=State.STOPPING, executing=None)
    return m, (*actions, ReleaseRun())


def _stop_again(m: StageMachine, e: Received) -> _Result:
    """A second StopRun while stopping changes nothing (a forged one is rejected)."""
    problem = _stop_problem(m, e)
    return _reject(m, e.sender, problem) if problem else (m, ())


def _orchestrator_lost(m: StageMachine, _e: OrchestratorLost) -> _Result:
    return _begin_stopping(m)


def _released(m: StageMachine, _e: Released) -> _Result:
    stopped = StageStopped(*m._ident())
    assert m.run_id is not None
    m = _evolve(
        m,
        state=State.STOPPED,
        stale_runs=m.stale_runs | {m.run_id},
        provision=None,
        setup=frozenset(),
        executing=None,
    )
    return m, (SendToOrchestrator(stopped),)


def _stop_without_run(m: StageMachine, e: Received) -> _Result:
    problem = _stop_problem(m, e)
    assert problem is not None
    return _reject(m, e.sender, problem)


def _rewire(m: StageMachine, e: Received) -> _Result:
    return _reject(m, e.sender, (RejectReason.REWIRE_FORBIDDEN, "only the plan wires a run"))


def _unexpected(m: StageMachine, e: Received) -> _Result:
    name = type(e.message).__name__
    return _reject(m, e.sender, (RejectReason.UNEXPECTED_MESSAGE, f"{name} is not for stages"))


def _ignore(m: StageMachine, _e: Event) -> _Result:
    """Late news for a run that is faulted or stopping (a step that completes after its
    timeout, a setup part after a failure): nothing more to do."""
    return m, ()


def _violation(m: StageMachine, kind: EventKind, event: Event) -> _Result:
    note = ProtocolViolation(m.state, kind, event)
    if m.state in (State.PREPARING, State.READY, State.EXECUTING):
        reason = FaultReason(FaultKind.PROTOCOL_VIOLATION, f"{kind.name} in {m.state.name}")
        actions: tuple[Action, ...] = (note,)
        if m.executing is not None:
            actions += (CancelTimer(Timer.STEP), ReleaseInput(m.executing))
        elif m.state is State.PREPARING:
            actions += (CancelTimer(Timer.SETUP),)
        return _to_faulted(m, reason, *actions)
    return m, (note,)
