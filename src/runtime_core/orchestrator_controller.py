"""The orchestrator's controller: drives ``runplan.fsm.orchestrator`` with the control
channels to the stages and the two token edges (PIPELINE_ORCHESTRATION_MVP.md §5).

Like the stage controller it does no waiting of its own: ``handle(event)`` feeds the
machine and carries out its actions; the runtime calls ``try_open_endpoints()`` until
both token ends exist, ``try_inject()`` while an injection waits for ring space, and
``poll_tokens()`` while the run is running. Generated tokens stream out through
``on_token``; the run's end is ``finished`` (the machine's ``RunFinished``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from runplan import RunPlan
from runplan.fsm import orchestrator as fsm
from runplan.messages import ProvisionStage, StopRun
from runplan.record_header import HeaderCheck, HeaderDType, HeaderRejection
from runtime_core.edge_ends import EdgeFaultError, ReceiveEnd, SendEnd
from runtime_core.records import read_token, token_payload
from runtime_core.ring import EdgeClosed

Trace = Callable[[str, dict[str, Any]], None]

# Enum members read on every event, bound once: on Python 3.11 ``Enum.MEMBER`` goes
# through the slow attribute hook of ``EnumType.__getattr__`` (about 0.1 us a read).
_RUNNING = fsm.State.RUNNING
_HEADER_U32 = HeaderDType.U32


class OrchestratorTransport(Protocol):
    """The orchestrator's token ends: it consumes token-out (allocating that ring) and
    produces token-in (attaching to stage 0's ring, ``None`` until it exists)."""

    def open_token_out(self, plan: RunPlan) -> ReceiveEnd: ...

    def open_token_in(self, plan: RunPlan) -> SendEnd | None: ...


class StageChannels(Protocol):
    def send(self, node_id: str, message: ProvisionStage | StopRun) -> None: ...


class Timers(Protocol):
    def start(self, timer: fsm.Timer, ms: int) -> None: ...

    def cancel(self, timer: fsm.Timer) -> None: ...


def _no_trace(kind: str, fields: dict[str, Any]) -> None:
    pass


class OrchestratorController:
    def __init__(
        self,
        plan: RunPlan,
        prompt_ids: tuple[int, ...],
        channels: StageChannels,
        transport: OrchestratorTransport,
        timers: Timers,
        on_token: Callable[[int, int], None] | None = None,
        trace: Trace | None = None,
    ) -> None:
        self.plan = plan
        self.machine = fsm.OrchestratorMachine.for_plan(plan, prompt_ids)
        self.channels = channels
        self.transport = transport
        self.timers = timers
        self.on_token = on_token
        self.trace = trace or _no_trace
        self.token_in: SendEnd | None = None
        self.token_out: ReceiveEnd | None = None
        self._endpoints_pending = False
        self._inject: tuple[int, tuple[int, ...]] | None = None  # waiting for ring space
        self.logits: list[npt.NDArray[np.float32]] = []
        self.finished: fsm.RunFinished | None = None

    @property
    def state(self) -> fsm.State:
        return self.machine.state

    @property
    def endpoints_pending(self) -> bool:
        return self._endpoints_pending

    @property
    def inject_pending(self) -> bool:
        return self._inject is not None

    @property
    def wants_tokens(self) -> bool:
        return self.machine.state is _RUNNING and self.token_out is not None

    def handle(self, event: fsm.Event) -> None:
        before = self.machine.state
        self.machine, actions = fsm.step(self.machine, event)
        if self.machine.state is not before and self.trace is not _no_trace:
            self.trace(
                "state",
                {
                    "from": before._name_,
                    "to": self.machine.state._name_,
                    "event": type(event).__name__,
                },
            )
        for action in actions:
            self._act(action)

    def _act(self, action: fsm.Action) -> None:
        # The action classes are unrelated, so the order of the tests is free: the
        # actions of every token come first.
        if isinstance(action, fsm.DeliverToken):
            if self.on_token is not None:
                self.on_token(action.sequence, action.token_id)
        elif isinstance(action, fsm.CancelTimer):
            self.timers.cancel(action.timer)
        elif isinstance(action, fsm.InjectTokens):
            self._inject = (action.sequence, action.token_ids)
            self.try_inject()
        elif isinstance(action, fsm.StartTimer):
            self.timers.start(action.timer, action.ms)
        elif isinstance(action, fsm.OpenTokenEndpoints):
            self._endpoints_pending = True
        elif isinstance(action, (fsm.SendProvision, fsm.SendStopRun)):
            self.channels.send(action.node_id, action.message)
        elif isinstance(action, fsm.CloseTokenEndpoints):
            self._endpoints_pending = False
            self._inject = None
            for end in (self.token_in, self.token_out):
                if end is not None:
                    end.close()
        elif isinstance(action, fsm.RunFinished):
            self.finished = action
        elif isinstance(action, fsm.Rejected):
            self.trace("reject", {"sender": action.sender, "reason": action.reason})
        elif isinstance(action, fsm.ProtocolViolation):
            self.trace("protocol_violation", {"state": action.state.name, "kind": action.kind.name})

    def start(self) -> None:
        self.handle(fsm.Start())

    def try_open_endpoints(self) -> bool:
        """Make the token-out ring and attach to token-in; ``EndpointsReady`` when both
        exist."""
        if not self._endpoints_pending:
            return False
        try:
            if self.token_out is None:
                self.token_out = self.transport.open_token_out(self.plan)
            if self.token_in is None:
                self.token_in = self.transport.open_token_in(self.plan)
        except Exception as exc:
            self._endpoints_pending = False
            self.handle(fsm.EndpointFault(f"{type(exc).__name__}: {exc}"))
            return False
        if self.token_in is None:
            return False
        self._endpoints_pending = False
        self.handle(fsm.EndpointsReady())
        return True

    def try_inject(self) -> bool:
        """Write the waiting token object; ``False`` while token-in is full."""
        if self._inject is None or self.token_in is None:
            return False
        sequence, ids = self._inject
        payload = token_payload(ids)
        try:
            sent = self.token_in.try_send(sequence, len(ids), _HEADER_U32, payload)
        except EdgeClosed as exc:
            self._inject = None
            edge = self.plan.token_in.edge_id
            self.handle(fsm.EndpointFault(f"token-in (edge {edge}) closed: {exc}"))
            return False
        if sent:
            self._inject = None
            if self.trace is not _no_trace:
                self.trace("injected", {"sequence": sequence, "rows": len(ids)})
        return sent

    def poll_tokens(self) -> bool:
        """Consume the next token object if one is published; ``True`` if one was."""
        if not self.wants_tokens or self.token_out is None:
            return False
        end = self.token_out
        try:
            record = end.try_receive()
        except (EdgeFaultError, EdgeClosed) as exc:
            edge = self.plan.token_out.edge_id
            self.handle(fsm.EndpointFault(f"token-out (edge {edge}): {exc}"))
            return True
        if record is None:
            return False
        check: HeaderCheck = end.check
        problem = check.validate(record.header, self.machine.injected)
        if problem is not None:
            end.release(record)
            if problem[0] in (HeaderRejection.RUN_ID_MISMATCH, HeaderRejection.EDGE_ID_MISMATCH):
                # Not this run's or this edge's record: refused, nothing else changes
                # (as a stage refuses one, PIPELINE_ORCHESTRATION_MVP.md §10).
                self.trace("reject", {"reason": problem[0].value, "detail": problem[1]})
                return True
            self.handle(fsm.EndpointFault(f"token-out: {problem[0].value}: {problem[1]}"))
            return True
        token, logits = read_token(check.object_spec, record.payload)  # a checked record
        if logits is not None:
            self.logits.append(logits)
        end.release(record)
        if self.trace is not _no_trace:
            self.trace("consumed", {"sequence": record.header.sequence, "token_id": token})
        self.handle(fsm.TokenConsumed(record.header.sequence, token))
        return True
