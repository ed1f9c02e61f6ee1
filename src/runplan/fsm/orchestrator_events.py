"""The orchestrator machine's states, timers and outcomes, the events it is fed, and
each event's kind (the key of its transition table, ``runplan.fsm.orchestrator.TABLE``)."""

from __future__ import annotations

import enum

from attrs import frozen

from runplan.messages import (
    ControlMessage,
    ProvisionRefused,
    StageFault,
    StageReady,
    StageStopped,
    StopReason,
)

Outcome = StopReason


class State(enum.Enum):
    PLANNED = "PLANNED"
    WAITING_READY = "WAITING_READY"
    RUNNING = "RUNNING"
    TEARING_DOWN = "TEARING_DOWN"
    DONE = "DONE"


class Timer(enum.Enum):
    READY = "READY"  # provisioning to the readiness barrier (timeouts.ready_ms)
    TOKEN = "TOKEN"  # injecting a token object to consuming its token (timeouts.token_limit_ms)
    STOP = "STOP"  # StopRun to every StageStopped (timeouts.stop_limit_ms)


@frozen
class Start:
    """Provision every stage and open the local token endpoints."""


@frozen
class EndpointsReady:
    """The local token producer (token-in) and consumer (token-out) are ready."""


@frozen
class Received:
    """A control message from ``sender`` (the node id the transport authenticated)."""

    sender: str
    message: ControlMessage


@frozen
class TokenConsumed:
    """The token object ``sequence`` was read off the token-out edge."""

    sequence: int
    token_id: int


@frozen
class EndpointFault:
    """A local token endpoint broke (the edge closed, a wait ran out, a bad record)."""

    detail: str


@frozen
class StageDied:
    """The process of stage ``stage_index`` is gone."""

    stage_index: int
    detail: str = ""


@frozen
class StageSilent:
    """Stage ``stage_index`` sent nothing, not even a heartbeat, for ``silent_ms``
    (longer than the heartbeat bound): stopped or hung, it is taken for gone (the
    runtime kills it). ``heard``: False for a stage that has not said a word since it
    started (its run not ready in ``silent_ms``)."""

    stage_index: int
    silent_ms: int
    heard: bool = True

    def why(self) -> str:
        """What the fault says of the stage."""
        if self.heard:
            return f"no heartbeat for {self.silent_ms / 1000:.1f} s"
        return (
            f"not a word since it started, and its run not ready in {self.silent_ms / 1000:.1f} s"
        )


@frozen
class TimerFired:
    """A timer of the run ran out. For the token timer, what the runtime counted since
    this timer was started (0 and 1 for the other timers): ``delivered``, the tokens
    the chain delivered to any of its runs; ``runs``, the most runs the chain held in
    flight at once, this one included. A chain that delivers tokens is alive: the run's
    token may wait behind other runs' records, and its timer starts again, as many
    times a token at most as there were runs in flight while it waited
    (``OrchestratorMachine.token_restart_limit``)."""

    timer: Timer
    delivered: int = 0
    runs: int = 1


@frozen
class Cancel:
    """The caller tears the run down (Ctrl-C, a cancelled request)."""

    detail: str = ""


Event = (
    Start
    | EndpointsReady
    | Received
    | TokenConsumed
    | EndpointFault
    | StageDied
    | StageSilent
    | TimerFired
    | Cancel
)


class EventKind(enum.Enum):
    START = "START"
    ENDPOINTS_READY = "ENDPOINTS_READY"
    STAGE_READY = "STAGE_READY"
    STAGE_FAULT = "STAGE_FAULT"
    STAGE_STOPPED = "STAGE_STOPPED"
    PROVISION_REFUSED = "PROVISION_REFUSED"  # a stage cannot reserve the run's KV cache
    OTHER_MESSAGE = "OTHER_MESSAGE"  # a message kind an orchestrator never receives
    TOKEN = "TOKEN"
    ENDPOINT_FAULT = "ENDPOINT_FAULT"
    STAGE_DIED = "STAGE_DIED"
    STAGE_SILENT = "STAGE_SILENT"
    READY_TIMEOUT = "READY_TIMEOUT"
    TOKEN_TIMEOUT = "TOKEN_TIMEOUT"
    STOP_TIMEOUT = "STOP_TIMEOUT"
    CANCEL = "CANCEL"


_MESSAGE_KINDS = {
    StageReady: EventKind.STAGE_READY,
    StageFault: EventKind.STAGE_FAULT,
    StageStopped: EventKind.STAGE_STOPPED,
    ProvisionRefused: EventKind.PROVISION_REFUSED,
}
_TIMER_KINDS = {
    Timer.READY: EventKind.READY_TIMEOUT,
    Timer.TOKEN: EventKind.TOKEN_TIMEOUT,
    Timer.STOP: EventKind.STOP_TIMEOUT,
}
_EVENT_KINDS = {
    Start: EventKind.START,
    EndpointsReady: EventKind.ENDPOINTS_READY,
    TokenConsumed: EventKind.TOKEN,
    EndpointFault: EventKind.ENDPOINT_FAULT,
    StageDied: EventKind.STAGE_DIED,
    StageSilent: EventKind.STAGE_SILENT,
    Cancel: EventKind.CANCEL,
}


def event_kind(event: Event) -> EventKind:
    if isinstance(event, Received):
        return _MESSAGE_KINDS.get(type(event.message), EventKind.OTHER_MESSAGE)
    if isinstance(event, TimerFired):
        return _TIMER_KINDS[event.timer]
    return _EVENT_KINDS[type(event)]
