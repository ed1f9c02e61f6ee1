"""Runs handed to a chain runner and handed back (``chain_runner.ChainRunner``, whose
base ``RunHandoffs`` is): what any thread hands the loop (runs, cancels, a request to
close) through a lock-guarded queue and a byte on the wake-up pipe, taken by the loop at
its next turn; runs that ended handed back to their callers; and a run handed over once
the loop returned for good, ended at once.

Runs that wait for KV memory (``kv_waits``, new ids from the runner's ``run_ids``): a
run that a stage refused (``ProvisionRefused``) while other runs held KV cache on it
does not end; it is offered again, under a new run id, when another run on
the chain ends (``ChainRun.former_ids``: its ids before). One that could never fit ends
faulted, its fault naming its size against the stage's whole budget.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import TYPE_CHECKING

from runplan import RunPlan
from runplan.fsm import orchestrator as fsm
from runplan.messages import FaultKind, StopReason
from runtime_core.chain_orchestrator import ChainOrchestrator, RunRefused
from runtime_core.kv_waits import KvWaits
from runtime_cupy.process.chain_error import ChainClosing
from runtime_cupy.process.names import run_label

if TYPE_CHECKING:
    from runtime_cupy.process.chain_run import ChainRun

# The chain runner's: its log lines keep their logger.
log = logging.getLogger("runtime_cupy.process.chain_runner")


class RunHandoffs:
    """The runs handed to a ``ChainRunner`` and back, its base: what the runner holds of
    them is set by ``ChainRunner.__init__``."""

    template: RunPlan
    orchestrator: ChainOrchestrator
    _lock: threading.Lock
    _adds: list[ChainRun]
    _cancels: list[tuple[str, str]]
    _runs: dict[str, ChainRun]
    kv_waits: KvWaits[ChainRun]
    _closing: bool
    _abandon: bool
    _over: bool
    _wake_w: int
    dead: str | None

    def _end_late(self, run: ChainRun) -> None:
        """A run handed over once the loop returned for good (the chain dead, closing or
        closed): it ends at once, as the loop's next turn would have ended it, faulted
        with the chain's fault (``ChainOrchestrator.add_run``'s) or refused as closing.
        It waited for ever: a stage that died as the chain came up ended the loop before
        the run that binds the stages was handed over."""
        broken = self.orchestrator.broken
        if broken is not None and not self._closing:
            log.info("run %s: the chain is dead: %s", run_label(run.run_id), self.dead)
            run._ended_unstarted(self.orchestrator.fault_finished())
        else:
            run._refused(
                ChainClosing(f"the chain is closing{f': {self.dead}' if self.dead else ''}")
            )

    def cancel(self, run_id: str, why: str = "cancelled") -> None:
        """End one run (any thread, or a signal handler)."""
        with self._lock:
            self._cancels.append((run_id, why))
        self._wake()

    def request_close(self, *, abandon: bool = False) -> None:
        """Ask the loop to cancel every run and return once they ended (any thread);
        ``abandon``: return at once, not waiting for the stages' stops."""
        self._closing = True
        self._abandon = self._abandon or abandon
        self._wake()

    def _wake(self) -> None:
        # Under the lock that close() takes to close the pipe: never a write to a
        # descriptor closed (and perhaps reused by then).
        with self._lock, contextlib.suppress(OSError):
            if self._wake_w >= 0:
                os.write(self._wake_w, b"!")

    def _end_loop(self, *, abandon: bool = False) -> bool:
        """Whether the loop returns for good now: not while a run handed over waits to be
        taken (unless ``abandon``); from then on ``submit`` ends a run at once."""
        with self._lock:
            if self._adds and not abandon:
                return False
            self._over = True
            return True

    def _take_handoffs(self) -> None:
        with self._lock:
            adds, self._adds = self._adds, []
            cancels, self._cancels = self._cancels, []
        o = self.orchestrator
        for run in adds:
            if self._closing:
                run._refused(ChainClosing("the chain is closing"))
                continue
            if run.plan.token_out.ring_spec != self.template.token_out.ring_spec:
                run._refused(
                    RunRefused(
                        run.run_id,
                        "its token-out records (with or without logits) are not the chain's",
                    )
                )
                continue
            try:
                run.handle = o.add_run(run.plan, run.prompt, on_token=run._token)
            except ValueError as exc:  # PromptError, RunRefused
                run._refused(exc)
                continue
            self._runs[run.run_id] = run
            log.info("run %s added (%d in flight)", run_label(run.run_id), len(self._runs))
        for run_id, why in cancels:
            held = self.kv_waits.take(run_id)
            if held is not None:
                finished = fsm.RunFinished(StopReason.CANCELLED, (), None, None, ())
                held._ended_unstarted(finished)
                continue
            o.cancel(self._current_id(run_id), why)

    def _current_id(self, run_id: str) -> str:
        """The id of the run that had ``run_id`` before it waited for KV memory and was
        offered again (``run_id`` itself when none did)."""
        if run_id in self.orchestrator.runs:
            return run_id
        again = next((r for r in self._runs.values() if run_id in r.former_ids), None)
        return again.run_id if again is not None else run_id

    def _end_runs(self) -> None:
        waits = self.kv_waits
        # not in the turn the chain broke either (``dead`` is set after this, from
        # ``broken``): its runs end with the chain's fault, none is held
        live = not self._closing and self.dead is None and self.orchestrator.broken is None
        for run_id, run in list(self._runs.items()):
            if run.handle is not None and run.handle.finished is not None:
                del self._runs[run_id]
                if live and run.cancelled is None and waits.holds(run):
                    run.held_for_memory = True
                    log.info("run %s waits for KV memory", run_label(run_id))
                    continue
                waits.forget(run)
                _cancelled_as_refused(run)
                run._end()
                waits.ended()
        if live:
            again = waits.due()
            if not again and not self._runs and not self._adds_pending():
                again = waits.first()  # nothing left to end and free memory
            for run in again:
                self._offer_again(run)

    def _adds_pending(self) -> bool:
        with self._lock:
            return bool(self._adds)

    def _offer_again(self, run: ChainRun) -> None:
        """A run held for KV memory is offered to the chain again (its new run id)."""
        run.held_for_memory = False
        if run.cancelled is not None:  # cancelled while it was held: it ends so
            self.kv_waits.forget(run)
            run._ended_unstarted(fsm.RunFinished(StopReason.CANCELLED, (), None, None, ()))
            return
        try:
            run.handle = self.orchestrator.add_run(run.plan, run.prompt, on_token=run._token)
        except ValueError as exc:  # not for the plan it was first added with
            self.kv_waits.forget(run)
            run._refused(exc)
            return
        self._runs[run.run_id] = run
        log.info("run %s offered again for KV memory", run_label(run.run_id))

    def _end_held(self) -> None:
        """The chain closes or is dead: the runs held for KV memory end (cancelled, or
        faulted with the chain's fault)."""
        if self.kv_waits is None:
            return
        broken = self.orchestrator.broken
        for run in self.kv_waits.take_all():
            if broken is not None and not self._closing:
                run._ended_unstarted(self.orchestrator.fault_finished())
            else:
                finished = fsm.RunFinished(StopReason.CANCELLED, (), None, None, ())
                run._ended_unstarted(finished)


def _cancelled_as_refused(run: ChainRun) -> None:
    """A run its caller cancelled as a stage refused it for KV memory ends cancelled
    (not offered again, not faulted): what its caller asked."""
    handle = run.handle
    finished = handle.finished if handle is not None else None
    if run.cancelled is None or handle is None or finished is None or handle.tokens:
        return
    if finished.fault is not None and finished.fault.kind is FaultKind.KV_CACHE_UNAVAILABLE:
        handle.finished = fsm.RunFinished(StopReason.CANCELLED, (), None, None, ())
