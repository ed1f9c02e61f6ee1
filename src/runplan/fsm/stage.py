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

from collections.abc import Mapping

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
from runplan.fsm.stage_checks import join_problem
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
    SetupPart,
    State,
    StepCompleted,
    StepFailed,
    Timer,
    TimerFired,
    event_kind,
)
from runplan.fsm.stage_handlers import (
    _cache_unavailable,
    _chain_fault,
    _edge_fault,
    _ignore,
    _object_discarded,
    _object_out_of_turn,
    _object_when_ready,
    _object_without_run,
    _orchestrator_lost,
    _provision,
    _reject_provision,
    _released,
    _rewire,
    _setup_done,
    _setup_failed,
    _setup_timeout,
    _step_completed,
    _step_failed,
    _step_timeout,
    _stop,
    _stop_again,
    _stop_without_run,
    _unexpected,
    _violation,
)
from runplan.fsm.stage_machine import _ACTIVE, StageMachine, _Result
from runplan.fsm.table import Transition, by_value, mermaid

# The machine's vocabulary, importable from here, its home.
__all__ = [
    "TABLE",
    "Action",
    "BeginSetup",
    "CacheUnavailable",
    "CancelTimer",
    "ChainFault",
    "DiscardObject",
    "EdgeFault",
    "Event",
    "EventKind",
    "ExecuteStep",
    "ObjectLoaded",
    "OrchestratorLost",
    "ProtocolViolation",
    "Received",
    "Reject",
    "RejectReason",
    "ReleaseInput",
    "ReleaseRun",
    "Released",
    "SendToOrchestrator",
    "SetupDone",
    "SetupFailed",
    "SetupPart",
    "StageMachine",
    "StartTimer",
    "State",
    "StepCompleted",
    "StepFailed",
    "Timer",
    "TimerFired",
    "diagram",
    "event_kind",
    "join_problem",
    "step",
]


def step(machine: StageMachine, event: Event) -> _Result:
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
