"""The stage controller's state machine (PIPELINE_ORCHESTRATION_MVP.md §6, §10), sans
I/O: ``step(machine, event) -> (machine, actions)``.

One machine per run on a stage node (a stage of a chain holds one per run it serves,
CONCURRENT_RUNS.md). It accepts provisioning only from the orchestrator authorized for
its node, rejects (with a typed reason, changing nothing) unknown and stale run ids,
duplicate provisioning, objects on edges its provision does not name, rewiring
requests, and messages a stage never receives. ``StopRun`` for the active run is
authoritative in every state. ``STOPPED`` ends a run; the node may then be provisioned
for a new run (never for a stopped one).

A prefill may come in chunks (header version 2): chunk ``j`` of sequence 0 executes
only after chunk ``j - 1``, and sequence 0 is complete after its last chunk. A stage
that cannot reserve the run's KV cache while preparing (``CacheUnavailable``) refuses
the provision (``ProvisionRefused``) and goes back to ``UNPROVISIONED`` keeping nothing
of the run (its id is not made stale). A fault of what the run shares with the chain's
other runs (a link, the worker as a whole) reaches it as ``ChainFault``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from attrs import frozen

from runplan.fsm.table import Transition, by_value, evolver, mermaid
from runplan.messages import (
    ControlMessage,
    FaultKind,
    FaultReason,
    JoinChain,
    ProvisionRefused,
    ProvisionStage,
    RewireEdge,
    StageFault,
    StageReady,
    StageStopped,
    StopRun,
)


class State(enum.Enum):
    UNPROVISIONED = "UNPROVISIONED"
    PREPARING = "PREPARING"
    READY = "READY"
    EXECUTING = "EXECUTING"
    FAULTED = "FAULTED"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"


class SetupPart(enum.Enum):
    WORKER = "WORKER"  # worker configured for the stage
    SHARD = "SHARD"  # the layer range loaded and bound
    INBOUND = "INBOUND"  # receive edge established
    OUTBOUND = "OUTBOUND"  # send edge attached to its consumer


class Timer(enum.Enum):
    SETUP = "SETUP"  # timeouts.ready_ms
    STEP = "STEP"  # timeouts.batch_step_limit_ms(rows, the provision's batch_rows, ...)


class RejectReason(enum.Enum):
    UNAUTHORIZED_SENDER = "UNAUTHORIZED_SENDER"  # not the orchestrator of this node
    WRONG_NODE = "WRONG_NODE"  # a provision for another node
    UNKNOWN_RUN = "UNKNOWN_RUN"  # never provisioned on this node
    STALE_RUN = "STALE_RUN"  # a run this node served and stopped
    DUPLICATE_PROVISION = "DUPLICATE_PROVISION"  # the active run, provisioned again
    RUN_ALREADY_ACTIVE = "RUN_ALREADY_ACTIVE"  # another run while one is active
    INVALID_PROVISION = "INVALID_PROVISION"  # a provision that contradicts itself
    UNKNOWN_EDGE = "UNKNOWN_EDGE"  # an object on an edge the provision does not name
    REWIRE_FORBIDDEN = "REWIRE_FORBIDDEN"  # only the plan wires a run
    UNEXPECTED_MESSAGE = "UNEXPECTED_MESSAGE"  # a message kind stages never receive
    INVALID_JOIN = "INVALID_JOIN"  # a JoinChain for a place the stage does not hold


# -- events ------------------------------------------------------------------


@frozen
class Received:
    """A control message from ``sender`` (the node id the transport authenticated)."""

    sender: str
    message: ControlMessage


@frozen
class SetupDone:
    part: SetupPart


@frozen
class SetupFailed:
    part: SetupPart
    detail: str


@frozen
class ObjectLoaded:
    """The inbound end loaded a record with a well-formed header (chunk ``chunk_index``
    of ``chunk_count`` of its sequence: 0 of 1 but for a chunked prefill)."""

    run_id: str
    edge_id: int
    sequence: int
    chunk_index: int = 0
    chunk_count: int = 1
    rows: int = 1  # the record's rows: its step's time limit grows with them


@frozen
class StepCompleted:
    """The step wrote its output object (same sequence and chunk) to the outbound edge
    (a last stage's chunk before the last writes nothing)."""

    sequence: int
    chunk_index: int = 0


@frozen
class StepFailed:
    sequence: int
    detail: str


@frozen
class EdgeFault:
    """An edge end broke: closed, a wait ran out, or a record failed validation."""

    edge_id: int
    detail: str


@frozen
class TimerFired:
    timer: Timer


@frozen
class CacheUnavailable:
    """The worker could not reserve the run's KV cache: the budget has ``free_bytes``
    of ``budget_bytes`` left, the run needs ``needed_bytes``."""

    needed_bytes: int
    free_bytes: int
    budget_bytes: int


@frozen
class ChainFault:
    """A fault of what the run shares with the chain's other runs (a link closed or
    corrupt, the worker failed as a whole): every run of the stage gets it."""

    reason: FaultReason


@frozen
class Released:
    """The runtime finished ``ReleaseRun``: edges closed, worker released."""


@frozen
class OrchestratorLost:
    """The control channel to the orchestrator closed (the orchestrator is gone)."""


Event = (
    Received
    | SetupDone
    | SetupFailed
    | ObjectLoaded
    | StepCompleted
    | StepFailed
    | EdgeFault
    | TimerFired
    | Released
    | OrchestratorLost
    | CacheUnavailable
    | ChainFault
)


class EventKind(enum.Enum):
    PROVISION = "PROVISION"
    STOP_RUN = "STOP_RUN"
    REWIRE = "REWIRE"
    OTHER_MESSAGE = "OTHER_MESSAGE"
    SETUP_DONE = "SETUP_DONE"
    SETUP_FAILED = "SETUP_FAILED"
    OBJECT_LOADED = "OBJECT_LOADED"
    STEP_COMPLETED = "STEP_COMPLETED"
    STEP_FAILED = "STEP_FAILED"
    EDGE_FAULT = "EDGE_FAULT"
    SETUP_TIMEOUT = "SETUP_TIMEOUT"
    STEP_TIMEOUT = "STEP_TIMEOUT"
    RELEASED = "RELEASED"
    ORCHESTRATOR_LOST = "ORCHESTRATOR_LOST"
    CACHE_UNAVAILABLE = "CACHE_UNAVAILABLE"
    CHAIN_FAULT = "CHAIN_FAULT"


_MESSAGE_KINDS = {
    ProvisionStage: EventKind.PROVISION,
    StopRun: EventKind.STOP_RUN,
    RewireEdge: EventKind.REWIRE,
}
_EVENT_KINDS = {
    SetupDone: EventKind.SETUP_DONE,
    SetupFailed: EventKind.SETUP_FAILED,
    ObjectLoaded: EventKind.OBJECT_LOADED,
    StepCompleted: EventKind.STEP_COMPLETED,
    StepFailed: EventKind.STEP_FAILED,
    EdgeFault: EventKind.EDGE_FAULT,
    Released: EventKind.RELEASED,
    OrchestratorLost: EventKind.ORCHESTRATOR_LOST,
    CacheUnavailable: EventKind.CACHE_UNAVAILABLE,
    ChainFault: EventKind.CHAIN_FAULT,
}


def event_kind(event: Event) -> EventKind:
    if isinstance(event, Received):
        return _MESSAGE_KINDS.get(type(event.message), EventKind.OTHER_MESSAGE)
    if isinstance(event, TimerFired):
        return EventKind.SETUP_TIMEOUT if event.timer is Timer.SETUP else EventKind.STEP_TIMEOUT
    return _EVENT_KINDS[type(event)]


# -- actions -----------------------------------------------------------------


@frozen
class BeginSetup:
    """Configure the worker, load and bind the range, establish the receive edge and
    attach the send edge; report ``SetupDone(part)`` for each or ``SetupFailed``."""

    provision: ProvisionStage


@frozen
class SendToOrchestrator:
    message: StageReady | StageFault | StageStopped | ProvisionRefused


@frozen
class ExecuteStep:
    """Run exactly one step over the loaded inbound object ``sequence`` (chunk
    ``chunk_index`` of ``chunk_count``)."""

    sequence: int
    chunk_index: int = 0
    chunk_count: int = 1


@frozen
class ReleaseInput:
    """Release the inbound slot of ``sequence`` (its step is over, or the stage faulted)."""

    sequence: int


@frozen
class DiscardObject:
    """Drop an object that was refused; nothing of it is consumed."""

    edge_id: int
    sequence: int


@frozen
class ReleaseRun:
    """Close both edge ends, release per-run device objects, reset the worker; report
    ``Released``."""


@frozen
class StartTimer:
    timer: Timer
    ms: int


@frozen
class CancelTimer:
    timer: Timer


@frozen
class Reject:
    """A message or object refused; the machine is unchanged."""

    sender: str
    reason: RejectReason
    detail: str


@frozen
class ProtocolViolation:
    state: State
    kind: EventKind
    event: Event


Action = (
    BeginSetup
    | SendToOrchestrator
    | ExecuteStep
    | ReleaseInput
    | DiscardObject
    | ReleaseRun
    | StartTimer
    | CancelTimer
    | Reject
    | ProtocolViolation
)

_ALL_PARTS = frozenset(SetupPart)
_ACTIVE = frozenset({State.PREPARING, State.READY, State.EXECUTING, State.FAULTED, State.STOPPING})


# -- the machine ---------------------------------------------------------------


@frozen
class StageMachine:
    state: State
    node_id: str
    orchestrator_node_id: str  # the only sender whose provisioning this node accepts
    provision: ProvisionStage | None = None
    setup: frozenset[SetupPart] = frozenset()
    next_sequence: int = 0
    executing: int | None = None
    stale_runs: frozenset[str] = frozenset()
    fault: FaultReason | None = None
    # The prefill in chunks: the chunk of sequence 0 to load next (while executing: the
    # one running), and the count chunk 0 gave.
    next_chunk: int = 0
    chunk_count: int = 1

    @classmethod
    def new(cls, node_id: str, orchestrator_node_id: str) -> StageMachine:
        return cls(State.UNPROVISIONED, node_id, orchestrator_node_id)

    @property
    def run_id(self) -> str | None:
        return self.provision.run_id if self.provision is not None else None

    def _ident(self) -> tuple[str, int, str]:
        assert self.provision is not None
        return self.provision.run_id, self.provision.stage_index, self.node_id


_Result = tuple[StageMachine, tuple[Action, ...]]
# Members the handlers of every step use, bound once: on Python 3.11 ``State.READY``
# reads through the slow attribute hook of ``EnumType.__getattr__``.
_READY, _EXECUTING, _STEP = State.READY, State.EXECUTING, Timer.STEP
_evolve = evolver(StageMachine)


def step(machine: StageMachine, event: Event) -> _Result:
    """Feed one event; never raises for any (state, event) pair."""
    kind = event_kind(event)
    transition = _BY_VALUE.get((machine.state._value_, kind._value_))
    if transition is None:
        return _violation(machine, kind, event)
    return transition.handler(machine, event)


# -- checks --------------------------------------------------------------------


def _run_problem(m: StageMachine, run_id: str) -> tuple[RejectReason, str] | None:
    """Why ``run_id`` is not this node's active run, or None if it is."""
    if run_id == m.run_id and m.state in _ACTIVE:
        return None
    if run_id in m.stale_runs:
        return RejectReason.STALE_RUN, f"run {run_id!r} has stopped on this node"
    return RejectReason.UNKNOWN_RUN, f"run {run_id!r} was never provisioned on this node"


def _provision_problem(m: StageMachine, e: Received) -> tuple[RejectReason, str] | None:
    msg = e.message
    assert isinstance(msg, ProvisionStage)
    if e.sender != m.orchestrator_node_id:
        return RejectReason.UNAUTHORIZED_SENDER, f"{e.sender!r} is not this node's orchestrator"
    if msg.node_id != m.node_id:
        return RejectReason.WRONG_NODE, f"provision for {msg.node_id!r}, this is {m.node_id!r}"
    if msg.run_id in m.stale_runs:
        return RejectReason.STALE_RUN, f"run {msg.run_id!r} has stopped on this node"
    if m.state in _ACTIVE:
        if msg.run_id == m.run_id:
            return RejectReason.DUPLICATE_PROVISION, f"run {msg.run_id!r} is already active"
        return RejectReason.RUN_ALREADY_ACTIVE, f"run {m.run_id!r} is active"
    if not (
        0 <= msg.stage_index < msg.stage_count
        and 0 <= msg.layer_start < msg.layer_end_exclusive
        and msg.inbound.edge_id != msg.outbound.edge_id
        and (msg.sampling is not None) == msg.is_last
    ):
        return RejectReason.INVALID_PROVISION, "stage index, layer range or edges contradict"
    return None


def join_problem(
    node_id: str,
    orchestrator_node_id: str,
    sender: str,
    join: JoinChain,
    place: tuple[int, int] | None,
) -> tuple[RejectReason, str] | None:
    """Why a stage (``node_id``, serving the chain's stage ``place``: its index and the
    chain's stage count, ``None`` before any provision said it) refuses ``join``, or
    ``None`` if it takes it. A join is about the stage, not a run, so no run machine
    takes it (``UNEXPECTED_MESSAGE`` there): the stage's controller checks it here."""
    if sender != orchestrator_node_id:
        return RejectReason.UNAUTHORIZED_SENDER, f"{sender!r} is not this node's orchestrator"
    if join.node_id != node_id:
        return RejectReason.WRONG_NODE, f"a join for {join.node_id!r}, this is {node_id!r}"
    if not 0 <= join.stage_index < join.stage_count:
        return RejectReason.INVALID_JOIN, (
            f"stage {join.stage_index} of {join.stage_count} is no stage of a chain"
        )
    if place is not None and place != (join.stage_index, join.stage_count):
        return RejectReason.INVALID_JOIN, (
            f"a join as stage {join.stage_index} of {join.stage_count}; this stage holds the "
            f"layers of stage {place[0]} of {place[1]} (a stage whose place changes starts anew)"
        )
    return None


def _reject(m: StageMachine, sender: str, problem: tuple[RejectReason, str]) -> _Result:
    return m, (Reject(sender, problem[0], problem[1]),)


def _stop_problem(m: StageMachine, e: Received) -> tuple[RejectReason, str] | None:
    assert isinstance(e.message, StopRun)
    if e.sender != m.orchestrator_node_id:
        return RejectReason.UNAUTHORIZED_SENDER, f"{e.sender!r} is not this node's orchestrator"
    return _run_problem(m, e.message.run_id)


def _object_problem(m: StageMachine, e: ObjectLoaded) -> tuple[RejectReason, str] | None:
    problem = _run_problem(m, e.run_id)
    if problem:
        return problem
    assert m.provision is not None
    if e.edge_id != m.provision.inbound.edge_id:
        return RejectReason.UNKNOWN_EDGE, f"edge {e.edge_id} is not this stage's inbound edge"
    return None


# -- handlers ------------------------------------------------------------------


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


def _order_problem(m: StageMachine, e: ObjectLoaded) -> str | None:
    """Why the object is not the next of the run: its sequence, or (sequence 0) its
    chunk: chunk ``j`` only after chunk ``j - 1``, each of the count chunk 0 gave."""
    if e.sequence != m.next_sequence:
        return f"sequence {e.sequence}, expected {m.next_sequence}"
    if e.sequence > 0:
        return f"sequence {e.sequence} in chunks ({e.chunk_count}): only a prefill is chunked"
    if e.chunk_index == m.next_chunk and (e.chunk_index == 0 or e.chunk_count == m.chunk_count):
        return None
    expected = f"chunk {m.next_chunk}" + (f" of {m.chunk_count}" if m.next_chunk else "")
    return f"sequence {e.sequence} chunk {e.chunk_index} of {e.chunk_count}, expected {expected}"


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


# -- the table -----------------------------------------------------------------

_S = State
_K = EventKind
_T = Transition
_NO_RUN = (_S.UNPROVISIONED, _S.STOPPED)
_FAULT = "emit StageFault"
_LATE = (  # news of a step or setup that no longer matters once faulted or stopping
    _K.SETUP_DONE,
    _K.SETUP_FAILED,
    _K.SETUP_TIMEOUT,
    _K.STEP_COMPLETED,
    _K.STEP_FAILED,
    _K.STEP_TIMEOUT,
    _K.EDGE_FAULT,
    _K.CACHE_UNAVAILABLE,
    _K.CHAIN_FAULT,
)

TABLE: Mapping[tuple[State, EventKind], Transition[State]] = {
    # Messages a stage refuses in every state.
    **{(s, _K.REWIRE): _T(_rewire, {s: ""}) for s in _S},
    **{(s, _K.OTHER_MESSAGE): _T(_unexpected, {s: ""}) for s in _S},
    # Without an active run: provisioning from the authorized orchestrator only.
    **{
        (s, _K.PROVISION): _T(
            _provision, {s: "", _S.PREPARING: "ProvisionStage from the authorized orchestrator"}
        )
        for s in _NO_RUN
    },
    **{(s, _K.STOP_RUN): _T(_stop_without_run, {s: ""}) for s in _NO_RUN},
    **{(s, _K.OBJECT_LOADED): _T(_object_without_run, {s: ""}) for s in _NO_RUN},
    **{(s, _K.ORCHESTRATOR_LOST): _T(_ignore, {s: ""}) for s in _NO_RUN},
    **{(s, _K.CHAIN_FAULT): _T(_ignore, {s: ""}) for s in _NO_RUN},
    # A fault of what the chain's runs share faults every active run.
    **{
        (s, _K.CHAIN_FAULT): _T(_chain_fault, {_S.FAULTED: "chain fault: StageFault"})
        for s in (_S.PREPARING, _S.READY, _S.EXECUTING)
    },
    # With an active run: no second provisioning; StopRun is authoritative.
    **{(s, _K.PROVISION): _T(_reject_provision, {s: ""}) for s in _ACTIVE},
    **{
        (s, _K.STOP_RUN): _T(_stop, {s: "", _S.STOPPING: "StopRun for the active run"})
        for s in (_S.PREPARING, _S.READY, _S.EXECUTING, _S.FAULTED)
    },
    **{
        (s, _K.ORCHESTRATOR_LOST): _T(_orchestrator_lost, {_S.STOPPING: "stop on its own"})
        for s in (_S.PREPARING, _S.READY, _S.EXECUTING, _S.FAULTED)
    },
    # Preparing
    (_S.PREPARING, _K.SETUP_DONE): _T(
        _setup_done,
        {_S.PREPARING: "", _S.READY: "worker, shard and both edge ends ready: StageReady"},
    ),
    (_S.PREPARING, _K.SETUP_FAILED): _T(_setup_failed, {_S.FAULTED: _FAULT}),
    (_S.PREPARING, _K.SETUP_TIMEOUT): _T(_setup_timeout, {_S.FAULTED: _FAULT}),
    (_S.PREPARING, _K.EDGE_FAULT): _T(_edge_fault, {_S.FAULTED: _FAULT}),
    (_S.PREPARING, _K.CACHE_UNAVAILABLE): _T(
        _cache_unavailable, {_S.UNPROVISIONED: "KV cache not reserved: ProvisionRefused"}
    ),
    (_S.PREPARING, _K.OBJECT_LOADED): _T(
        _object_out_of_turn, {_S.PREPARING: "", _S.FAULTED: "sequence violation"}
    ),
    # Ready
    (_S.READY, _K.OBJECT_LOADED): _T(
        _object_when_ready,
        {
            _S.READY: "",
            _S.EXECUTING: "next sequence (or chunk): ExecuteStep",
            _S.FAULTED: "other sequence (or chunk): sequence violation",
        },
    ),
    (_S.READY, _K.EDGE_FAULT): _T(_edge_fault, {_S.FAULTED: _FAULT}),
    # Executing
    (_S.EXECUTING, _K.STEP_COMPLETED): _T(
        _step_completed,
        {
            _S.READY: "release the input slot (a chunk: the next one)",
            _S.FAULTED: "not the step run",
        },
    ),
    (_S.EXECUTING, _K.STEP_FAILED): _T(_step_failed, {_S.FAULTED: _FAULT}),
    (_S.EXECUTING, _K.STEP_TIMEOUT): _T(_step_timeout, {_S.FAULTED: _FAULT}),
    (_S.EXECUTING, _K.EDGE_FAULT): _T(_edge_fault, {_S.FAULTED: _FAULT}),
    (_S.EXECUTING, _K.OBJECT_LOADED): _T(
        _object_out_of_turn, {_S.EXECUTING: "", _S.FAULTED: "sequence violation"}
    ),
    # Faulted: reject new run work, wait for StopRun.
    (_S.FAULTED, _K.OBJECT_LOADED): _T(_object_discarded, {_S.FAULTED: ""}),
    **{(_S.FAULTED, k): _T(_ignore, {_S.FAULTED: ""}) for k in _LATE},
    # Stopping: edges closing, worker releasing.
    (_S.STOPPING, _K.RELEASED): _T(_released, {_S.STOPPED: "released: StageStopped"}),
    (_S.STOPPING, _K.STOP_RUN): _T(_stop_again, {_S.STOPPING: ""}),
    (_S.STOPPING, _K.OBJECT_LOADED): _T(_object_discarded, {_S.STOPPING: ""}),
    **{(_S.STOPPING, k): _T(_ignore, {_S.STOPPING: ""}) for k in (*_LATE, _K.ORCHESTRATOR_LOST)},
}

_BY_VALUE = by_value(TABLE)


def diagram() -> str:
    return mermaid("Stage FSM (runplan.fsm.stage.TABLE)", State.UNPROVISIONED, TABLE)
