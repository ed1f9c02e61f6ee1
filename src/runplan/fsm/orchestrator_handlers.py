"""The orchestrator machine's handlers: for each (state, event kind) of its table, the
next machine and its actions; the check of a stage's message (``stage_message_problem``);
and the fault path of a pair the table does not hold."""

from __future__ import annotations

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
)
from runplan.fsm.orchestrator_machine import OrchestratorMachine, _Result
from runplan.fsm.table import evolver
from runplan.messages import (
    FaultKind,
    FaultReason,
    ProvisionRefused,
    StageFault,
    StageReady,
    StageStopped,
    StopReason,
    StopRun,
)

# Bound once for the handler of every token: on Python 3.11 ``Timer.TOKEN`` reads
# through the slow attribute hook of ``EnumType.__getattr__``.
_TOKEN = Timer.TOKEN
_evolve = evolver(OrchestratorMachine)


def _start(m: OrchestratorMachine, _e: Start) -> _Result:
    sends = tuple(SendProvision(i, m.node_ids[i], msg) for i, msg in enumerate(m.provisions))
    m = _evolve(m, state=State.WAITING_READY, provisioned=frozenset(range(len(sends))))
    return m, (OpenTokenEndpoints(), *sends, StartTimer(Timer.READY, m.timeouts.ready_ms))


def stage_message_problem(m: OrchestratorMachine, e: Received) -> str | None:
    """Why a stage's message is not one of this run's stages (its run id, stage index,
    node id and sender), or ``None``."""
    msg = e.message
    assert isinstance(msg, StageReady | StageFault | StageStopped | ProvisionRefused)
    if msg.run_id != m.run_id:
        return f"run id {msg.run_id!r} is not this run's ({m.run_id!r})"
    if not 0 <= msg.stage_index < len(m.node_ids):
        return f"no stage {msg.stage_index} in this run"
    node = m.node_ids[msg.stage_index]
    if msg.node_id != node or e.sender != node:
        return f"stage {msg.stage_index} runs on {node!r}, not {msg.node_id!r} / {e.sender!r}"
    return None


def _maybe_run(m: OrchestratorMachine, actions: tuple[Action, ...]) -> _Result:
    """The readiness barrier: inject the prompt only once every stage reported ready
    and the local token endpoints are ready."""
    if m.endpoints_ready and len(m.ready) == len(m.node_ids):
        m = _evolve(m, state=State.RUNNING, injected=0)
        return m, (
            *actions,
            CancelTimer(Timer.READY),
            InjectTokens(0, m.prompt, m.prefill_chunk if m.prefill_chunks > 1 else 0),
            StartTimer(Timer.TOKEN, m._token_ms(0)),
        )
    return m, actions


def _stage_ready(m: OrchestratorMachine, e: Received) -> _Result:
    problem = stage_message_problem(m, e)
    if problem:
        return m, (Rejected(e.sender, e.message, problem),)
    assert isinstance(e.message, StageReady)
    return _maybe_run(_evolve(m, ready=m.ready | {e.message.stage_index}), ())


def _endpoints_ready(m: OrchestratorMachine, _e: EndpointsReady) -> _Result:
    return _maybe_run(_evolve(m, endpoints_ready=True), ())


def _ignore_ready(m: OrchestratorMachine, e: Received) -> _Result:
    problem = stage_message_problem(m, e)
    return m, ((Rejected(e.sender, e.message, problem),) if problem else ())


def _teardown(
    m: OrchestratorMachine,
    outcome: Outcome,
    fault: FaultReason | None = None,
    fault_stage: int | None = None,
    actions: tuple[Action, ...] = (),
) -> _Result:
    """Stop injecting, record the one outcome, send StopRun to every provisioned stage,
    and wait for them (or the stop timeout); the token endpoints close at the end."""
    m = _evolve(m, state=State.TEARING_DOWN, outcome=outcome, fault=fault, fault_stage=fault_stage)
    stop = StopRun(m.run_id, outcome)
    sends = tuple(SendStopRun(i, m.node_ids[i], stop) for i in sorted(m.provisioned - m.refused))
    out: tuple[Action, ...] = (
        *actions,
        CancelTimer(Timer.READY),
        CancelTimer(Timer.TOKEN),
        *sends,
    )
    if not m.awaiting_stop:
        return _finish(m, out)
    return m, (*out, StartTimer(Timer.STOP, m._stop_ms()))


def _finish(m: OrchestratorMachine, actions: tuple[Action, ...]) -> _Result:
    outcome = m.outcome
    assert outcome is not None
    m = _evolve(m, state=State.DONE)
    done = RunFinished(outcome, m.tokens, m.fault, m.fault_stage, tuple(sorted(m.awaiting_stop)))
    # The token endpoints close last: closing them earlier would fault a stage still
    # waiting on token-in before its StopRun arrives (§5: StopRun first).
    return m, (*actions, CloseTokenEndpoints(), done)


def _fault(
    m: OrchestratorMachine, kind: FaultKind, detail: str, stage: int | None = None
) -> _Result:
    return _teardown(m, StopReason.FAULTED, FaultReason(kind, detail), stage)


def _stage_fault(m: OrchestratorMachine, e: Received) -> _Result:
    problem = stage_message_problem(m, e)
    if problem:
        return m, (Rejected(e.sender, e.message, problem),)
    assert isinstance(e.message, StageFault)
    return _teardown(m, StopReason.FAULTED, e.message.reason, e.message.stage_index)


def _refusal_detail(msg: ProvisionRefused, node_id: str) -> str:
    never = (
        " (more than its whole budget: it never fits)"
        if msg.needed_bytes > msg.budget_bytes
        else ""
    )
    return (
        f"stage {msg.stage_index} on {node_id!r}: the run's KV cache needs {msg.needed_bytes} "
        f"bytes, {msg.free_bytes} of {msg.budget_bytes} free{never}"
    )


def _provision_refused(m: OrchestratorMachine, e: Received) -> _Result:
    """A stage cannot reserve the run's KV cache: the run faults; that stage holds
    nothing of it, so it gets no StopRun and is not waited for."""
    problem = stage_message_problem(m, e)
    if problem:
        return m, (Rejected(e.sender, e.message, problem),)
    msg = e.message
    assert isinstance(msg, ProvisionRefused)
    m = _evolve(m, refused=m.refused | {msg.stage_index})
    reason = FaultReason(FaultKind.KV_CACHE_UNAVAILABLE, _refusal_detail(msg, msg.node_id))
    return _teardown(m, StopReason.FAULTED, reason, msg.stage_index)


def _refused_in_teardown(m: OrchestratorMachine, e: Received) -> _Result:
    """A refusal that crossed the StopRun: that stage will send no StageStopped."""
    problem = stage_message_problem(m, e)
    if problem:
        return m, (Rejected(e.sender, e.message, problem),)
    assert isinstance(e.message, ProvisionRefused)
    m = _evolve(m, refused=m.refused | {e.message.stage_index})
    if not m.awaiting_stop:
        return _finish(m, (CancelTimer(Timer.STOP),))
    return m, ()


def _refused_when_running(m: OrchestratorMachine, e: Received) -> _Result:
    """Every stage reported ready: none can refuse the provision any more."""
    problem = stage_message_problem(m, e) or "the stage reported ready: it cannot refuse now"
    return m, (Rejected(e.sender, e.message, problem),)


def _stage_stopped_early(m: OrchestratorMachine, e: Received) -> _Result:
    problem = stage_message_problem(m, e)
    if problem:
        return m, (Rejected(e.sender, e.message, problem),)
    assert isinstance(e.message, StageStopped)
    i = e.message.stage_index
    m = _evolve(m, stopped=m.stopped | {i})
    return _fault(m, FaultKind.PROTOCOL_VIOLATION, "stage stopped during the run", i)


def _stage_died(m: OrchestratorMachine, e: StageDied) -> _Result:
    if not 0 <= e.stage_index < len(m.node_ids):
        return m, ()
    m = _evolve(m, dead=m.dead | {e.stage_index})
    detail = f"stage {e.stage_index} on {m.node_ids[e.stage_index]!r}: {e.detail}".rstrip(": ")
    return _fault(m, FaultKind.PROCESS_DIED, detail, e.stage_index)


def _stage_silent(m: OrchestratorMachine, e: StageSilent) -> _Result:
    if not 0 <= e.stage_index < len(m.node_ids):
        return m, ()
    m = _evolve(m, dead=m.dead | {e.stage_index})
    node = m.node_ids[e.stage_index]
    detail = f"stage {e.stage_index} on {node!r}: {e.why()}"
    return _fault(m, FaultKind.STAGE_SILENT, detail, e.stage_index)


def _endpoint_fault(m: OrchestratorMachine, e: EndpointFault) -> _Result:
    return _fault(m, FaultKind.EDGE_FAULT, f"orchestrator token endpoint: {e.detail}")


def _ready_timeout(m: OrchestratorMachine, _e: TimerFired) -> _Result:
    missing = sorted(set(range(len(m.node_ids))) - m.ready)
    return _fault(m, FaultKind.TIMEOUT, f"stages {missing} not ready in time")


def _token_timeout(m: OrchestratorMachine, e: TimerFired) -> _Result:
    """The token's bound ran out. If the chain delivered tokens (to any run) since the
    timer started, it is alive and the token may wait behind other runs' records: the
    timer starts again with the same bound, ``token_restart_limit`` times a token at
    most (the most runs in flight while it waited). A chain that delivered none is
    stuck; a token past its restarts is lost."""
    if e.runs > m.token_runs:
        m = _evolve(m, token_runs=e.runs)
    if e.delivered > 0 and m.token_restarts < m.token_restart_limit:
        m = _evolve(m, token_restarts=m.token_restarts + 1)
        return m, (StartTimer(_TOKEN, m._token_ms(m.injected)),)
    detail = f"token {m.injected} not produced in time"
    if e.delivered > 0:
        detail += (
            f" (its timer started again {m.token_restarts} times while other runs got "
            f"tokens, {m.token_runs} runs in flight at most)"
        )
    return _fault(m, FaultKind.TIMEOUT, detail)


def _token(m: OrchestratorMachine, e: TokenConsumed) -> _Result:
    if e.sequence != m.injected:
        return _fault(
            m,
            FaultKind.SEQUENCE_VIOLATION,
            f"token sequence {e.sequence}, expected {m.injected}",
        )
    if not 0 <= e.token_id < m.vocab_size:
        return _fault(m, FaultKind.EDGE_FAULT, f"token id {e.token_id} outside the vocabulary")
    consumed = m.consumed + (e.token_id,)  # noqa: RUF005 (one copy, not two: a run grows it per token)
    eos = m.ends_run(e.token_id)  # EOS, or another end of generation (end of turn, ...)
    delivered: tuple[Action, ...] = () if eos else (DeliverToken(e.sequence, e.token_id),)
    if eos or len(consumed) >= m.max_tokens:
        return _teardown(_evolve(m, consumed=consumed), StopReason.COMPLETED, actions=delivered)
    m = _evolve(m, consumed=consumed, injected=e.sequence + 1, token_restarts=0, token_runs=1)
    return m, (
        *delivered,
        CancelTimer(_TOKEN),
        InjectTokens(e.sequence + 1, (e.token_id,)),
        StartTimer(_TOKEN, m._token_ms(e.sequence + 1)),
    )


def _cancel(m: OrchestratorMachine, e: Cancel) -> _Result:
    return _teardown(m, StopReason.CANCELLED)


def _cancel_before_start(m: OrchestratorMachine, _e: Cancel) -> _Result:
    return _finish(_evolve(m, outcome=StopReason.CANCELLED), ())


def _stopped(m: OrchestratorMachine, e: Received) -> _Result:
    problem = stage_message_problem(m, e)
    if problem:
        return m, (Rejected(e.sender, e.message, problem),)
    assert isinstance(e.message, StageStopped)
    m = _evolve(m, stopped=m.stopped | {e.message.stage_index})
    if not m.awaiting_stop:
        return _finish(m, (CancelTimer(Timer.STOP),))
    return m, ()


def _died_in_teardown(m: OrchestratorMachine, e: StageDied | StageSilent) -> _Result:
    if not 0 <= e.stage_index < len(m.node_ids):
        return m, ()
    m = _evolve(m, dead=m.dead | {e.stage_index})
    if not m.awaiting_stop:
        return _finish(m, (CancelTimer(Timer.STOP),))
    return m, ()


def _stop_timeout(m: OrchestratorMachine, _e: TimerFired) -> _Result:
    return _finish(m, ())


def _drop(m: OrchestratorMachine, _e: Event) -> _Result:
    """Late news of a run already decided (a fault after another, a token after the
    fault): the first outcome stands."""
    return m, ()


def _reject_message(m: OrchestratorMachine, e: Received) -> _Result:
    return m, (Rejected(e.sender, e.message, "not a message an orchestrator accepts"),)


def _violation(m: OrchestratorMachine, kind: EventKind, event: Event) -> _Result:
    note = ProtocolViolation(m.state, kind, event)
    if m.state in (State.WAITING_READY, State.RUNNING):
        return _teardown(
            m,
            StopReason.FAULTED,
            FaultReason(FaultKind.PROTOCOL_VIOLATION, f"{kind.name} in {m.state.name}"),
            actions=(note,),
        )
    return m, (note,)
