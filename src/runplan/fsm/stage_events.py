"""The stage machine's states, setup parts and timers, the events it is fed, and each
event's kind (the key of its transition table, ``runplan.fsm.stage.TABLE``)."""

from __future__ import annotations

import enum

from attrs import frozen

from runplan.messages import ControlMessage, FaultReason, ProvisionStage, RewireEdge, StopRun


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
