"""What the stage machine asks its runtime to do (its actions), and why it rejects a
message or an object (``RejectReason``)."""

from __future__ import annotations

import enum

from attrs import frozen

from runplan.fsm.stage_events import Event, EventKind, State, Timer
from runplan.messages import (
    ProvisionRefused,
    ProvisionStage,
    StageFault,
    StageReady,
    StageStopped,
)


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
