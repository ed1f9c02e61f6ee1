"""The orchestrator's run-level state machine (PIPELINE_ORCHESTRATION_MVP.md §5), sans
I/O: ``step(machine, event) -> (machine, actions)``. The runtime carries out the
actions and feeds back what happened as events; timeouts and process deaths arrive
as events too, so the machine never reads a clock.

States: ``PLANNED`` (the plan exists) -> ``WAITING_READY`` (provisions sent, token
endpoints opening) -> ``RUNNING`` (prompt injected) -> ``TEARING_DOWN`` -> ``DONE``.
The spec's ``Completed`` / ``Faulted`` states are the run's ``outcome``, decided on
entering ``TEARING_DOWN``; ``cancelled`` is the third outcome (the caller tore the run
down). Exactly one outcome per run; the first decided stands.

One machine per run: an orchestrator of a chain drives one per run in flight
(CONCURRENT_RUNS.md). A stage that cannot reserve the run's KV cache answers its
provision with ``ProvisionRefused``: the run faults (``KV_CACHE_UNAVAILABLE``), and that
stage, which keeps nothing of it, gets no ``StopRun`` and is not waited for. The prompt
may travel in chunks (``InjectTokens.chunk_rows``, the plan's ``prefill_chunk``); the
token timer of sequence 0 then covers every chunk through the pipeline.

The token timer bounds the wait for the run's next token. With other runs in flight
its record may wait through more batches than the bound counts (behind their prefill
chunks, or among more decoding runs than a batch holds), so when it runs out and the
chain delivered tokens to any run since it started (``TimerFired.delivered``), the
timer starts again, ``token_restart_limit`` times a token at most (the most runs in
flight while it waited, ``TimerFired.runs``; the count resets when the token is
consumed); a chain that delivered none for the whole bound, or a
token past its restarts (its record lost while other runs go on), faults the run.
"""

from __future__ import annotations

from collections.abc import Mapping

from runplan.fsm.orchestrator_actions import (
    Action,
    CancelTimer,
    CloseTokenEndpoints,
    DeliverToken,
    InjectTokens,
    OpenTokenEndpoints,
    ProtocolViolation,
    Rejected,
    RunFinished,
    SendProvision,
    SendStopRun,
    StartTimer,
)
from runplan.fsm.orchestrator_events import (
    Cancel,
    EndpointFault,
    EndpointsReady,
    Event,
    EventKind,
    Outcome,
    Received,
    StageDied,
    StageSilent,
    Start,
    State,
    Timer,
    TimerFired,
    TokenConsumed,
    event_kind,
)
from runplan.fsm.orchestrator_handlers import (
    _cancel,
    _cancel_before_start,
    _died_in_teardown,
    _drop,
    _endpoint_fault,
    _endpoints_ready,
    _ignore_ready,
    _provision_refused,
    _ready_timeout,
    _refused_in_teardown,
    _refused_when_running,
    _reject_message,
    _stage_died,
    _stage_fault,
    _stage_ready,
    _stage_silent,
    _stage_stopped_early,
    _start,
    _stop_timeout,
    _stopped,
    _token,
    _token_timeout,
    _violation,
    stage_message_problem,
)
from runplan.fsm.orchestrator_machine import (
    OrchestratorMachine,
    PromptError,
    _Result,
    check_prompt,
)
from runplan.fsm.table import Transition, by_value, mermaid

# The machine's vocabulary, importable from here, its home.
__all__ = [
    "TABLE",
    "Action",
    "Cancel",
    "CancelTimer",
    "CloseTokenEndpoints",
    "DeliverToken",
    "EndpointFault",
    "EndpointsReady",
    "Event",
    "EventKind",
    "InjectTokens",
    "OpenTokenEndpoints",
    "OrchestratorMachine",
    "Outcome",
    "PromptError",
    "ProtocolViolation",
    "Received",
    "Rejected",
    "RunFinished",
    "SendProvision",
    "SendStopRun",
    "StageDied",
    "StageSilent",
    "Start",
    "StartTimer",
    "State",
    "Timer",
    "TimerFired",
    "TokenConsumed",
    "check_prompt",
    "diagram",
    "event_kind",
    "stage_message_problem",
    "step",
]


def step(machine: OrchestratorMachine, event: Event) -> _Result:
    """Feed one event; never raises for any (state, event) pair."""
    kind = event_kind(event)
    transition = _BY_VALUE.get((machine.state._value_, kind._value_))
    if transition is None:
        return _violation(machine, kind, event)
    return transition.handler(machine, event)


# -- the table -----------------------------------------------------------------

_S = State
_K = EventKind
_T = Transition
_FAULT = {_S.TEARING_DOWN: "fault: StopRun to every stage", _S.DONE: "fault, no stage left"}
# Messages from the wrong sender or about another run are rejected: no state change.
_W = {_S.WAITING_READY: "", **_FAULT}
_R = {_S.RUNNING: "", **_FAULT}
_CANCEL = {_S.TEARING_DOWN: "cancelled: StopRun to every stage", _S.DONE: "cancelled"}

TABLE: Mapping[tuple[State, EventKind], Transition[State]] = {
    (_S.PLANNED, _K.START): _T(_start, {_S.WAITING_READY: "ProvisionStage to every stage"}),
    (_S.PLANNED, _K.CANCEL): _T(_cancel_before_start, {_S.DONE: "cancelled"}),
    (_S.PLANNED, _K.OTHER_MESSAGE): _T(_reject_message, {_S.PLANNED: ""}),
    **{
        (_S.WAITING_READY, k): _T(
            handler,
            {_S.WAITING_READY: "", _S.RUNNING: "all ready: inject the prompt as sequence 0"},
        )
        for k, handler in ((_K.STAGE_READY, _stage_ready), (_K.ENDPOINTS_READY, _endpoints_ready))
    },
    (_S.WAITING_READY, _K.STAGE_FAULT): _T(_stage_fault, _W),
    (_S.WAITING_READY, _K.STAGE_STOPPED): _T(_stage_stopped_early, _W),
    (_S.WAITING_READY, _K.PROVISION_REFUSED): _T(
        _provision_refused,
        {
            _S.WAITING_READY: "",
            _S.TEARING_DOWN: "KV cache refused: fault, StopRun to the other stages",
            _S.DONE: "KV cache refused, no stage left",
        },
    ),
    (_S.WAITING_READY, _K.STAGE_DIED): _T(_stage_died, _W),
    (_S.WAITING_READY, _K.STAGE_SILENT): _T(_stage_silent, _W),
    (_S.WAITING_READY, _K.ENDPOINT_FAULT): _T(_endpoint_fault, _FAULT),
    (_S.WAITING_READY, _K.READY_TIMEOUT): _T(_ready_timeout, _FAULT),
    (_S.WAITING_READY, _K.CANCEL): _T(_cancel, _CANCEL),
    (_S.WAITING_READY, _K.OTHER_MESSAGE): _T(_reject_message, {_S.WAITING_READY: ""}),
    (_S.RUNNING, _K.TOKEN): _T(
        _token,
        {
            _S.RUNNING: "token k consumed: inject k + 1",
            _S.TEARING_DOWN: "EOS or max_tokens: completed; out of sequence: fault",
            _S.DONE: "completed, no stage left",
        },
    ),
    (_S.RUNNING, _K.STAGE_READY): _T(_ignore_ready, {_S.RUNNING: ""}),
    (_S.RUNNING, _K.STAGE_FAULT): _T(_stage_fault, _R),
    (_S.RUNNING, _K.STAGE_STOPPED): _T(_stage_stopped_early, _R),
    (_S.RUNNING, _K.PROVISION_REFUSED): _T(_refused_when_running, {_S.RUNNING: ""}),
    (_S.RUNNING, _K.STAGE_DIED): _T(_stage_died, _R),
    (_S.RUNNING, _K.STAGE_SILENT): _T(_stage_silent, _R),
    (_S.RUNNING, _K.ENDPOINT_FAULT): _T(_endpoint_fault, _FAULT),
    (_S.RUNNING, _K.TOKEN_TIMEOUT): _T(
        _token_timeout,
        {
            _S.RUNNING: "the chain delivered tokens meanwhile: the timer starts again "
            "(token_restart_limit times a token)",
            **_FAULT,
        },
    ),
    (_S.RUNNING, _K.CANCEL): _T(_cancel, _CANCEL),
    (_S.RUNNING, _K.OTHER_MESSAGE): _T(_reject_message, {_S.RUNNING: ""}),
    (_S.TEARING_DOWN, _K.STAGE_STOPPED): _T(
        _stopped, {_S.TEARING_DOWN: "", _S.DONE: "every live stage stopped"}
    ),
    **{
        (_S.TEARING_DOWN, k): _T(
            _died_in_teardown, {_S.TEARING_DOWN: "", _S.DONE: "no live stage left"}
        )
        for k in (_K.STAGE_DIED, _K.STAGE_SILENT)
    },
    (_S.TEARING_DOWN, _K.STOP_TIMEOUT): _T(_stop_timeout, {_S.DONE: "stop timeout"}),
    (_S.TEARING_DOWN, _K.PROVISION_REFUSED): _T(
        _refused_in_teardown, {_S.TEARING_DOWN: "", _S.DONE: "no stage left to wait for"}
    ),
    **{
        (_S.TEARING_DOWN, k): _T(_drop, {_S.TEARING_DOWN: ""})
        for k in (
            _K.STAGE_READY,
            _K.STAGE_FAULT,
            _K.TOKEN,
            _K.ENDPOINT_FAULT,
            _K.ENDPOINTS_READY,
            _K.READY_TIMEOUT,
            _K.TOKEN_TIMEOUT,
            _K.CANCEL,
        )
    },
    (_S.TEARING_DOWN, _K.OTHER_MESSAGE): _T(_reject_message, {_S.TEARING_DOWN: ""}),
    **{
        (_S.DONE, k): _T(_drop, {_S.DONE: ""})
        for k in EventKind
        if k not in (_K.START, _K.OTHER_MESSAGE)
    },
    (_S.DONE, _K.OTHER_MESSAGE): _T(_reject_message, {_S.DONE: ""}),
}

_BY_VALUE = by_value(TABLE)


def diagram() -> str:
    return mermaid("Orchestrator run FSM (runplan.fsm.orchestrator.TABLE)", State.PLANNED, TABLE)
