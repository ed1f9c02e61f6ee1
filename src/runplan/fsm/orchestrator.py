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
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from attrs import frozen

from runplan.config import Timeouts, run_positions
from runplan.fsm.table import Transition, by_value, evolver, mermaid
from runplan.messages import (
    ControlMessage,
    FaultKind,
    FaultReason,
    ProvisionRefused,
    ProvisionStage,
    StageFault,
    StageReady,
    StageStopped,
    StopReason,
    StopRun,
)
from runplan.plan import RunPlan
from runplan.provision import provision_all

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


# -- events ------------------------------------------------------------------


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
    timer: Timer


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


# -- actions -----------------------------------------------------------------


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


# -- the machine ---------------------------------------------------------------


@frozen
class OrchestratorMachine:
    state: State
    run_id: str
    node_ids: tuple[str, ...]  # stage index -> node id
    provisions: tuple[ProvisionStage, ...]
    prompt: tuple[int, ...]
    max_tokens: int
    eos_token_id: int
    vocab_size: int
    timeouts: Timeouts
    provisioned: frozenset[int] = frozenset()
    ready: frozenset[int] = frozenset()
    endpoints_ready: bool = False
    dead: frozenset[int] = frozenset()  # stages gone: died, or silent (and killed)
    stopped: frozenset[int] = frozenset()
    injected: int = -1  # last sequence injected
    consumed: tuple[int, ...] = ()  # token ids consumed, sequence order (EOS included)
    outcome: Outcome | None = None
    fault: FaultReason | None = None
    fault_stage: int | None = None
    refused: frozenset[int] = frozenset()  # stages that refused the provision
    prefill_chunk: int = 0  # rows per chunk of the prompt (0: one record)

    @classmethod
    def for_plan(cls, plan: RunPlan, prompt: tuple[int, ...]) -> OrchestratorMachine:
        """The machine of one run of ``plan`` on ``prompt``; ``PromptError`` if the
        prompt cannot be run (no tokens, an id outside the vocabulary, or more
        positions than the KV cache holds)."""
        check_prompt(plan, prompt)
        return cls(
            state=State.PLANNED,
            run_id=plan.run_id,
            node_ids=tuple(s.node_id for s in plan.stages),
            provisions=provision_all(plan),
            prompt=tuple(prompt),
            max_tokens=plan.max_tokens,
            eos_token_id=plan.model.eos_token_id,
            vocab_size=plan.model.vocab_size,
            timeouts=plan.timeouts,
            prefill_chunk=plan.prefill_chunk,
        )

    @property
    def tokens(self) -> tuple[int, ...]:
        """Generated tokens, EOS excluded."""
        return tuple(t for t in self.consumed if t != self.eos_token_id)

    @property
    def awaiting_stop(self) -> frozenset[int]:
        return self.provisioned - self.dead - self.stopped - self.refused

    @property
    def prefill_chunks(self) -> int:
        """Records the prompt travels in."""
        size = self.prefill_chunk
        return 1 if size <= 0 else -(-len(self.prompt) // size)

    @property
    def batch_rows(self) -> int:
        """Rows of the largest batch the run's records may share on a stage (0: they
        run alone)."""
        return max((p.batch_rows for p in self.provisions), default=0)

    @property
    def shared_batches(self) -> int:
        """Batches a step of the run may wait through on a stage it shares (the most of
        any stage's, ``ProvisionStage.shared_batches``)."""
        return max((p.shared_batches for p in self.provisions), default=1)

    @property
    def prompt_record_rows(self) -> int:
        """Rows of the run's longest record: the prompt, or its first chunk."""
        chunked = self.prefill_chunks > 1
        return min(self.prefill_chunk, len(self.prompt)) if chunked else len(self.prompt)

    def _token_ms(self, sequence: int = 1) -> int:
        """The bound on one token (``Timeouts.token_limit_ms``): a step per stage, and
        for sequence 0 one more step per chunk after the first (the chunks pipeline
        through the stages), each within the limit of the rows of the longest record
        (the prompt, or its first chunk; a decoded token's record has one row) or, with
        other runs sharing the stages, of the largest batch, waiting through
        ``shared_batches`` batches a step."""
        stages = len(self.node_ids)
        if sequence != 0:
            return self.timeouts.token_limit_ms(stages, 1, 1, self.batch_rows, self.shared_batches)
        rows, chunks = self.prompt_record_rows, self.prefill_chunks
        batches = self.shared_batches
        return self.timeouts.token_limit_ms(stages, chunks, rows, self.batch_rows, batches)

    def _stop_ms(self) -> int:
        """The bound on the teardown (``Timeouts.stop_limit_ms``): each stage may be in
        a step of the run's longest record, or in a batch of the largest, when its
        ``StopRun`` comes."""
        return self.timeouts.stop_limit_ms(self.prompt_record_rows, self.batch_rows)


_Result = tuple[OrchestratorMachine, tuple[Action, ...]]
# Bound once for the handler of every token: on Python 3.11 ``Timer.TOKEN`` reads
# through the slow attribute hook of ``EnumType.__getattr__``.
_TOKEN = Timer.TOKEN
_evolve = evolver(OrchestratorMachine)


class PromptError(ValueError):
    """A prompt a run cannot take."""


def check_prompt(plan: RunPlan, prompt: tuple[int, ...]) -> None:
    """Raise ``PromptError`` unless every id is in the vocabulary and the prompt plus
    ``max_tokens - 1`` fed-back tokens fit the positions the run's stages reserve
    (``kv_positions``, within ``max_seq_len``)."""
    vocab = plan.model.vocab_size
    if not prompt:
        raise PromptError("the prompt has no tokens")
    for i, token in enumerate(prompt):
        if type(token) is not int or not 0 <= token < vocab:
            raise PromptError(
                f"prompt token {i} is {token!r}, outside the vocabulary 0..{vocab - 1}"
            )
    positions = run_positions(len(prompt), plan.max_tokens)
    if positions > plan.model.max_seq_len:
        raise PromptError(
            f"{len(prompt)} prompt tokens + {plan.max_tokens} tokens to generate need "
            f"{positions} positions; the plan's max_seq_len is {plan.model.max_seq_len}"
        )
    if positions > plan.kv_positions:
        raise PromptError(
            f"{len(prompt)} prompt tokens + {plan.max_tokens} tokens to generate need "
            f"{positions} positions; the run's stages reserve {plan.kv_positions} "
            "(RuntimeConfig.prompt_tokens)"
        )


def step(machine: OrchestratorMachine, event: Event) -> _Result:
    """Feed one event; never raises for any (state, event) pair."""
    kind = event_kind(event)
    transition = _BY_VALUE.get((machine.state._value_, kind._value_))
    if transition is None:
        return _violation(machine, kind, event)
    return transition.handler(machine, event)


# -- handlers ------------------------------------------------------------------


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


def _token_timeout(m: OrchestratorMachine, _e: TimerFired) -> _Result:
    return _fault(m, FaultKind.TIMEOUT, f"token {m.injected} not produced in time")


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
    eos = e.token_id == m.eos_token_id
    delivered: tuple[Action, ...] = () if eos else (DeliverToken(e.sequence, e.token_id),)
    if eos or len(consumed) >= m.max_tokens:
        return _teardown(_evolve(m, consumed=consumed), StopReason.COMPLETED, actions=delivered)
    m = _evolve(m, consumed=consumed, injected=e.sequence + 1)
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
    (_S.RUNNING, _K.TOKEN_TIMEOUT): _T(_token_timeout, _FAULT),
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
