"""The caller's handle of one run on a chain (``chain_runner.ChainRunner.submit``): a
``ChainRun`` whose tokens go to its ``on_token`` (and logits to its ``on_logits``) as they
come, from the loop's thread, whose ``wait()`` gives its ``RunOutcome`` (or raises what
refused it), and whose ``cancel()`` ends it alone; ``ChainRun.former_ids``: its run ids
before it waited for KV memory (``kv_waits``), ``waiting_for_memory``: whether it waits
for KV memory now.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
from attrs import frozen

from runplan import RunPlan
from runplan.command_main import output_refused
from runplan.fsm import orchestrator as fsm
from runtime_core.chain_orchestrator import RunHandle
from runtime_cupy.process.names import run_label

if TYPE_CHECKING:
    from runtime_cupy.process.chain_runner import ChainRunner

# The chain runner's: its log lines keep their logger.
log = logging.getLogger("runtime_cupy.process.chain_runner")

#: ``on_token(token_id)``: a run's next token, from the loop's thread.
OnToken = Callable[[int], None]
#: ``on_logits(logits)``: the raw logits the next token was sampled from (a run whose
#: plan returns logits), just before its ``on_token``, from the loop's thread.
OnLogits = Callable[[npt.NDArray[np.float32]], None]


@frozen
class RunOutcome:
    """How one run on the chain ended: its ``RunFinished`` (``None`` only when the loop
    broke off), its tokens and logits, and its times on the monotonic clock."""

    finished: fsm.RunFinished | None
    tokens: tuple[int, ...]
    logits: tuple[npt.NDArray[np.float32], ...]
    submitted_s: float
    ready_s: float | None  # its readiness barrier passed
    token_times_s: tuple[float, ...]
    ended_s: float


class ChainRun:
    """One run handed to the runner: ``cancel()`` and ``wait()`` from any thread."""

    def __init__(
        self,
        runner: ChainRunner,
        plan: RunPlan,
        prompt: tuple[int, ...],
        on_token: OnToken | None,
        on_done: Callable[[ChainRun], None] | None = None,
        on_logits: OnLogits | None = None,
    ) -> None:
        self.runner = runner
        self.on_done = on_done
        self.on_logits = on_logits
        self.plan = plan
        self.prompt = prompt
        self.on_token = on_token
        self.submitted_s = time.monotonic()
        self.ready_s: float | None = None
        self.token_times: list[float] = []
        self.handle: RunHandle | None = None
        self.outcome: RunOutcome | None = None
        self.error: Exception | None = None  # refused by the chain (PromptError, RunRefused)
        self.former_ids: tuple[str, ...] = ()  # its ids before it waited for KV memory
        #: held by the runner for KV memory (``kv_waits``: a stage refused it), until it
        #: is offered again or ends (set by the loop's thread, read by any)
        self.held_for_memory = False
        # why its caller cancelled it (set before the runner hears of it): a run that a
        # stage refused for KV memory meanwhile is not held, nor offered again
        self.cancelled: str | None = None
        #: why a callback of its caller's raised (loop's thread): it is cancelled so,
        #: and hears of no more tokens (it once ended the loop, and every run with it)
        self.callback_failed: str | None = None
        #: what that callback raised, ``KeyboardInterrupt`` and ``SystemExit`` included,
        #: for its caller to raise again in its own thread (``raise_callback_error``)
        self.callback_error: BaseException | None = None
        self._done = threading.Event()

    @property
    def run_id(self) -> str:
        return self.plan.run_id

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def waiting_for_memory(self) -> bool:
        """Whether it waits for KV memory, not running (any thread): held by the runner
        since a stage refused it (``held_for_memory``), or held by the chain's
        orchestrator until the stages' budgets have room for it (``RunHandle.queued``)."""
        handle = self.handle
        return not self.done and (self.held_for_memory or (handle is not None and handle.queued))

    def cancel(self, why: str = "cancelled") -> None:
        """End this run (its caller went away, a stop string came); the others go on."""
        self.cancelled = self.cancelled or why
        self.runner.cancel(self.run_id, why)

    def wait(self, timeout_s: float | None = None) -> RunOutcome | None:
        """The run's outcome once it ended (``None`` on timeout); raises what refused it."""
        self._done.wait(timeout_s)
        if self.error is not None:
            raise self.error
        return self.outcome

    def _token(self, run_id: str, sequence: int, token_id: int) -> None:
        self.token_times.append(time.monotonic())
        handle = self.handle
        logits = None
        if self.on_logits is not None and handle is not None and handle.logits:
            # Handed over, not kept: a long answer's logits would fill the memory.
            logits = handle.logits.pop()
        if self.callback_failed is not None:
            return
        name = "on_logits"
        try:
            if logits is not None and self.on_logits is not None:
                self.on_logits(logits)
            name = "on_token"
            if self.on_token is not None:
                self.on_token(token_id)
        except BaseException as exc:  # the caller's: this run ends, the chain and others go on
            # KeyboardInterrupt and SystemExit too: they once ended the loop, and with it
            # every run in flight; they are its caller's to raise (raise_callback_error)
            self.callback_failed = f"its {name} raised {type(exc).__name__}: {exc}"
            self.callback_error = exc
            if output_refused(exc) or not isinstance(exc, Exception):
                # where it writes, no one reads or no room; or its caller is stopping: no bug
                log.info("run %s: %s", run_label(self.run_id), self.callback_failed)
            else:
                log.exception("run %s: %s", run_label(self.run_id), self.callback_failed)
            self.cancel(self.callback_failed)

    def raise_callback_error(self) -> None:
        """Raise what its ``on_token`` or ``on_logits`` raised, if one did (the run then
        ended cancelled): for its caller's thread, once the run ended."""
        if self.callback_error is not None:
            raise self.callback_error

    def wait_for_caller(self, on_run: Callable[[ChainRun], None] | None) -> RunOutcome:
        """Its caller's wait (``WarmChain.generate``): ``on_run(self)``, then its outcome;
        whatever ends the wait early (Ctrl-C, an ``on_run`` that raises) cancels it, which
        else went on streaming to a caller gone, in its place and KV memory, until it
        ended. Raises what refused it, or what its callbacks raised."""
        try:
            if on_run is not None:
                on_run(self)
            outcome = self.wait()
        except BaseException as exc:
            if not self.done:
                self.cancel(f"its caller stopped waiting ({type(exc).__name__})")
            raise
        self.raise_callback_error()
        assert outcome is not None  # wait() without a bound returns the outcome or raises
        return outcome

    def _end(self) -> None:
        handle = self.handle
        finished = handle.finished if handle is not None else None
        tokens = handle.tokens if handle is not None else ()
        logits = tuple(handle.logits[: len(tokens)]) if handle is not None else ()
        self.outcome = RunOutcome(
            finished,
            tokens,
            logits,
            self.submitted_s,
            self.ready_s,
            tuple(self.token_times),
            time.monotonic(),
        )
        self._finish()

    def _refused(self, exc: Exception) -> None:
        self.error = exc
        self._finish()

    def _ended_unstarted(self, finished: fsm.RunFinished) -> None:
        """Ended before the chain took it (``finished``: its outcome and fault)."""
        self.outcome = RunOutcome(finished, (), (), self.submitted_s, None, (), time.monotonic())
        self._finish()

    def _finish(self) -> None:
        self.held_for_memory = False
        self._done.set()
        if self.on_done is not None:
            try:
                self.on_done(self)
            except Exception:  # the caller's: the chain goes on
                log.exception("run %s: on_done failed", run_label(self.run_id))
