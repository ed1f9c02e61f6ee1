"""What the orchestrator machine asks its runtime to do (its actions), ``RunFinished``
the last of a run."""

from __future__ import annotations

from attrs import frozen

from runplan.fsm.orchestrator_events import Event, EventKind, Outcome, State, Timer
from runplan.messages import ControlMessage, FaultReason, ProvisionStage, StopRun


@frozen
class OpenTokenEndpoints:
    """Create the token-in producer and the token-out consumer; report
    ``EndpointsReady`` or ``EndpointFault``."""


@frozen
class SendProvision:
    stage_index: int
    node_id: str
    message: ProvisionStage


@frozen
class InjectTokens:
    """Write the token object ``sequence`` (the prompt at 0, one id after) on token-in;
    ``chunk_rows > 0``: the prompt as records of at most that many rows, in order."""

    sequence: int
    token_ids: tuple[int, ...]
    chunk_rows: int = 0


@frozen
class DeliverToken:
    """A generated token for the caller (EOS is not delivered)."""

    sequence: int
    token_id: int


@frozen
class SendStopRun:
    stage_index: int
    node_id: str
    message: StopRun


@frozen
class CloseTokenEndpoints:
    pass


@frozen
class StartTimer:
    timer: Timer
    ms: int


@frozen
class CancelTimer:
    timer: Timer


@frozen
class Rejected:
    """A message not accepted (wrong run, wrong sender, unknown stage): logged only."""

    sender: str
    message: ControlMessage
    reason: str


@frozen
class ProtocolViolation:
    """An event the table has no entry for in this state (logged; in a live run it also
    faults the run)."""

    state: State
    kind: EventKind
    event: Event


@frozen
class RunFinished:
    """The run is over: its one outcome, the generated tokens, the fault if any, and
    the stages that did not confirm ``StageStopped`` before the stop timeout."""

    outcome: Outcome
    tokens: tuple[int, ...]
    fault: FaultReason | None
    fault_stage: int | None
    unconfirmed_stages: tuple[int, ...]


Action = (
    OpenTokenEndpoints
    | SendProvision
    | InjectTokens
    | DeliverToken
    | SendStopRun
    | CloseTokenEndpoints
    | StartTimer
    | CancelTimer
    | Rejected
    | ProtocolViolation
    | RunFinished
)
