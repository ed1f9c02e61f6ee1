"""The token links of a chain's orchestrator (``chain_orchestrator.ChainOrchestrator``,
whose base ``TokenLinks`` is; CONCURRENT_RUNS.md): token-in, whose ring stage 0 makes,
and token-out, whose ring this side makes, shared by every run. The runtime calls
``try_open_links()`` while ``links_pending``, ``try_inject()`` while ``inject_pending``
and ``poll_tokens()`` while ``wants_tokens``.

- Token-in carries the records of every run: a run's prompt (in chunks of the plan's
  ``prefill_chunk`` rows: chunk ``j`` of ``P``, in order), then each fed-back token
  after the one before it was consumed. Fed-back tokens go first, in the order they
  were asked for, then prompt chunks in theirs: a decoding run's next token never
  waits behind another run's long prompt (a ring of a few slots would otherwise let it
  in only after every chunk of that prompt). A run's own order stands: its token 0
  comes only after its last chunk was written.
- Token-out records are routed by their run id: a record of a run this side does not
  hold (unknown, or finished) is rejected, logged and dropped, and the link stays up; a
  held run's record on another edge likewise; one that fails its run's checks (its
  sequence, kind, extent; token 0 before the prompt's last chunk was written) is that
  run's endpoint fault.
- A broken token link is a chain fault; a token-out record it cannot read (another
  header version, garbled) breaks the chain too, its fault (``broken``)
  ``PROTOCOL_VIOLATION``, not a lost link's.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Protocol

from attrs import frozen

from runplan import RunPlan
from runplan.fsm import orchestrator as fsm
from runplan.messages import FaultKind, FaultReason
from runplan.record_header import HeaderDType, HeaderRejection
from runplan.resource_limits import error_with_limit
from runtime_core.controller_trace import Trace, no_trace
from runtime_core.links import LinkFault, LinkReceiver, LinkSender
from runtime_core.recent_runs import RecentRuns
from runtime_core.records import read_token, token_payload
from runtime_core.ring import EdgeClosed

if TYPE_CHECKING:
    from runtime_core.chain_orchestrator import RunHandle

_RUNNING = fsm.State.RUNNING
_U32 = HeaderDType.U32
_NOT_THIS_RUN = (HeaderRejection.RUN_ID_MISMATCH, HeaderRejection.EDGE_ID_MISMATCH)


class OrchestratorLinks(Protocol):
    """The orchestrator's ends of a chain: token-out (it makes the ring) and token-in
    (``None`` until stage 0's ring exists)."""

    def open_token_out(self, plan: RunPlan) -> LinkReceiver: ...

    def open_token_in(self, plan: RunPlan) -> LinkSender | None: ...


@frozen
class TokenRecord:
    """A token-in record waiting for room on the link."""

    run_id: str
    sequence: int
    ids: tuple[int, ...]
    chunk_index: int
    chunk_count: int


class TokenLinks:
    """The token links of a ``ChainOrchestrator``, its base: what the orchestrator holds
    of them is set by ``ChainOrchestrator.__init__``."""

    links: OrchestratorLinks
    trace: Trace
    runs: dict[str, RunHandle]
    done: RecentRuns
    token_in: LinkSender | None
    token_out: LinkReceiver | None
    _decodes: deque[TokenRecord]
    _chunks: deque[TokenRecord]
    #: token-in records written so far: a runtime bounding one wait on a full ring
    #: (``Timeouts.edge_wait_ms``) starts it again when this grows
    records_sent: int
    #: tokens taken off token-out and fed to their runs, every run's: a run's token
    #: timer that runs out after this grew starts again (``fsm.TimerFired.delivered``)
    tokens_delivered: int
    broken: FaultReason | None

    if TYPE_CHECKING:

        def _feed(self, handle: RunHandle, event: fsm.Event) -> None: ...

        def _chain_fault(self, reason: FaultReason, event: fsm.Event) -> None: ...

    def _queue(self, handle: RunHandle, action: fsm.InjectTokens) -> None:
        ids, size = action.token_ids, action.chunk_rows
        if action.sequence == 0 and 0 < size < len(ids):
            count = -(-len(ids) // size)
            chunks = [ids[j * size : (j + 1) * size] for j in range(count)]
        else:
            count, chunks = 1, [ids]
        queue = self._chunks if action.sequence == 0 else self._decodes
        for j, chunk in enumerate(chunks):
            queue.append(TokenRecord(handle.run_id, action.sequence, chunk, j, count))
        if action.sequence == 0:
            handle.unsent_chunks = count
        self.try_inject()

    def _drop_records(self, run_id: str) -> None:
        """A run's records still waiting for token-in go."""
        self._decodes = deque(r for r in self._decodes if r.run_id != run_id)
        self._chunks = deque(r for r in self._chunks if r.run_id != run_id)

    def _next_record(self) -> deque[TokenRecord] | None:
        """The queue whose first record goes next: fed-back tokens before prompt
        chunks."""
        return self._decodes or self._chunks or None

    # -- the links ---------------------------------------------------------------------------
    @property
    def links_pending(self) -> bool:
        return bool(self._waiting_links())

    def _waiting_links(self) -> list[RunHandle]:
        return [
            h
            for h in self.runs.values()
            if h.needs_links and h.machine.state is fsm.State.WAITING_READY
        ]

    def try_open_links(self) -> bool:
        """Make the token-out ring and attach to token-in, once for the chain; every
        run waiting for them gets ``EndpointsReady``."""
        waiting = self._waiting_links()
        if not waiting:
            return False
        plan = waiting[0].plan
        try:
            if self.token_out is None:
                self.token_out = self.links.open_token_out(plan)
            if self.token_in is None:
                self.token_in = self.links.open_token_in(plan)
        except Exception as exc:
            reason = FaultReason(FaultKind.EDGE_FAULT, f"token links: {error_with_limit(exc)}")
            self._chain_fault(reason, fsm.EndpointFault(str(reason.detail)))
            return False
        if self.token_in is None:
            return False
        for handle in waiting:
            handle.needs_links = False
            if handle.run_id in self.runs:
                self._feed(handle, fsm.EndpointsReady())
        return True

    @property
    def inject_pending(self) -> bool:
        return self._next_record() is not None and self.token_in is not None

    def try_inject(self) -> bool:
        """Write the waiting token-in records (fed-back tokens first); ``False`` while
        the link is full (``records_sent`` counts those written, this call's too)."""
        while (queue := self._next_record()) is not None and self.token_in is not None:
            record = queue[0]
            handle = self.runs.get(record.run_id)
            if handle is None or handle.machine.state is not _RUNNING:
                queue.popleft()
                continue
            try:
                sent = self.token_in.try_send(
                    record.run_id,
                    handle.plan.token_in.edge_id,
                    record.sequence,
                    len(record.ids),
                    _U32,
                    token_payload(record.ids),
                    record.chunk_index,
                    record.chunk_count,
                )
            except EdgeClosed as exc:
                self._link_fault(f"token-in (hop 0) closed: {exc}")
                return False
            if not sent:
                return False
            queue.popleft()
            self.records_sent += 1
            if record.sequence == 0:
                handle.unsent_chunks -= 1
            if self.trace is not no_trace:
                fields = {"run_id": record.run_id, "sequence": record.sequence}
                self.trace("injected", {**fields, "rows": len(record.ids)})
        return True

    @property
    def wants_tokens(self) -> bool:
        return self.token_out is not None and self.broken is None

    def poll_tokens(self) -> bool:
        """Take one token-out record and route it; ``True`` if one was taken (or the
        link broke)."""
        if not self.wants_tokens or self.token_out is None:
            return False
        try:
            taken = self.token_out.try_take()
        except LinkFault as exc:  # another version, a garbled header: not a lost link
            detail = f"token-out (hop {handle_hops(self.runs)}): a record it cannot read: {exc}"
            unreadable = FaultReason(FaultKind.PROTOCOL_VIOLATION, detail)
            self._chain_fault(unreadable, fsm.EndpointFault(detail))
            return True
        except EdgeClosed as exc:
            self._link_fault(f"token-out (hop {handle_hops(self.runs)}): {exc}")
            return True
        if taken is None:
            return False
        h = taken.header
        handle = self.runs.get(h.run_id)
        if handle is None or handle.check is None:
            reason = "STALE_RUN" if h.run_id in self.done else "UNKNOWN_RUN"
            self.trace("reject", {"run_id": h.run_id, "reason": reason, "sequence": h.sequence})
            return True
        if handle.machine.state is not _RUNNING:
            return True  # a record of a run already decided: nothing to do
        problem = handle.check.validate(h, handle.machine.injected)
        if problem is not None and problem[0] in _NOT_THIS_RUN:
            self.trace("reject", {"run_id": h.run_id, "reason": problem[0].value})
            return True
        if problem is None and h.sequence == 0 and handle.unsent_chunks > 0:
            problem = (
                HeaderRejection.SEQUENCE_OUT_OF_ORDER,
                "token 0 before the prompt's last chunk",
            )
        if problem is not None:
            detail = f"token-out: {problem[0].value}: {problem[1]}"
            self._feed(handle, fsm.EndpointFault(detail))
            return True
        token, logits = read_token(handle.check.object_spec, taken.payload)
        if logits is not None:
            handle.logits.append(logits)
        if self.trace is not no_trace:
            self.trace("consumed", {"run_id": h.run_id, "sequence": h.sequence, "token_id": token})
        self.tokens_delivered += 1
        self._feed(handle, fsm.TokenConsumed(h.sequence, token))
        return True

    def link_fault(self, detail: str) -> None:
        """The runtime's notice that a token link is stuck or gone (a chain fault)."""
        self._link_fault(detail)

    def _link_fault(self, detail: str) -> None:
        self._chain_fault(FaultReason(FaultKind.EDGE_FAULT, detail), fsm.EndpointFault(detail))

    def close(self) -> None:
        """The chain's end: the token-out ring (this side made it) closes."""
        if self.token_out is not None:
            self.token_out.close()
        self.token_in = self.token_out = None


def handle_hops(runs: dict[str, RunHandle]) -> str:
    """Token-out's hop (the chain's stage count), from any run held; ``?`` if none."""
    for handle in runs.values():
        return str(handle.plan.stage_count)
    return "?"
