"""The end of a chain runner (``chain_runner.ChainRunner``, whose base ``ChainClose``
is): ``close()`` cancels what runs and waits for the stages' ``StageStopped`` (each
run's stop bound), closes the control channels (the stages exit), reaps every stage
(killed after ``EXIT_GRACE_S``, at once once the close is abandoned) and frees every
resource of the chain's links by name through the host, also those whose owner was
killed.

Whatever breaks into it, the close goes to its end. A Ctrl-C while it waits, and every
further one, abandons the waits (the stages are killed at once); the close goes on, and
raises the first interrupt once done (``runtime_core.interrupt.to_the_end``). Each step
is done once (the stages' handles let go of one by one), and the runner is ``closed``
only when every step is done: a close broken off by an error is finished by the next.
(It once marked itself closed before it waited for the stages to exit: a second Ctrl-C
in that wait left the stage that did not answer, and its descriptors, for the life of
the process, and every later ``close`` returned at once.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from runplan import RunPlan
from runtime_core.chain_orchestrator import ChainOrchestrator
from runtime_core.interrupt import to_the_end
from runtime_cupy.edges.links import ProcessLinks, chain_hops
from runtime_cupy.hosts.port import StageHost
from runtime_cupy.process.chain_error import ChainClosing
from runtime_cupy.process.poller import Watch
from runtime_cupy.process.tracing import Event

if TYPE_CHECKING:
    from runtime_cupy.process.chain_run import ChainRun
    from runtime_cupy.process.chain_stages import RunnerStage

# The chain runner's: its log lines keep their logger.
log = logging.getLogger("runtime_cupy.process.chain_runner")

EXIT_GRACE_S = 3.0  # after the chain closed, how long stages get to exit before a kill
GRACE_LOOK_S = 0.1  # within the grace, how often to look whether it was abandoned
REAP_S = 5.0  # how long to wait for a killed stage


class ChainClose:
    """The end of a ``ChainRunner``, its base: what the runner holds is set by
    ``ChainRunner.__init__``."""

    template: RunPlan
    host: StageHost
    chain_id: str
    stages: list[RunnerStage]
    orchestrator: ChainOrchestrator
    links: ProcessLinks
    _waiter: Watch
    _lock: threading.Lock
    _runs: dict[str, ChainRun]
    _adds: list[ChainRun]
    _abandon: bool
    _over: bool
    _wake_r: int
    _wake_w: int
    _stage_events: list[Event]
    closed: bool
    _closed_steps: set[str]  # of close(): each done once
    _reaped: set[int]  # the stages close() reaped (and let go of), by index

    if TYPE_CHECKING:

        def loop(self, until: Callable[[], bool] | None = None) -> None: ...
        def request_close(self, *, abandon: bool = False) -> None: ...
        def _end_held(self) -> None: ...

    def close(self) -> None:
        """Cancel what runs (waiting for the stages' stops unless abandoned), then stop
        every stage, reap it (killed after a grace, at once if abandoned) and free the
        chain's links by name. From the loop's thread, once ``loop`` returned (or was
        never run). Idempotent. Interrupted (Ctrl-C, again and again), it stops waiting
        (abandoned: the stages killed at once), does the rest and then raises the first
        interrupt; broken off by an error, it is not closed, and the next ``close`` does
        what is left, each step once."""
        if self.closed:
            return
        interrupt = to_the_end(self._close_steps, lambda: self.request_close(abandon=True))
        if interrupt is not None:
            raise interrupt

    def _close_steps(self) -> None:
        steps: tuple[tuple[str, Callable[[], None]], ...] = (
            ("runs", self._stop_runs),
            ("ended", self._end_all),
            ("channels", self._close_channels),
            ("grace", self._exit_grace),
            ("killed", self._kill_the_rest),
            ("reaped", self._reap),
            ("freed", self._free_links),
        )
        for name, step in steps:
            if name not in self._closed_steps:
                step()
                self._closed_steps.add(name)
        self.closed = True

    def _stop_runs(self) -> None:
        if self._runs or self._adds:
            self.request_close()
            with contextlib.suppress(Exception):
                self.loop()

    def _end_all(self) -> None:
        with self._lock:
            self._over = True  # submit ends a run at once from now on
        while self._runs:  # the loop broke off: they end unfinished
            self._runs.pop(next(iter(self._runs)))._end()
        self._end_held()
        while self._adds:
            self._adds.pop(0)._refused(ChainClosing("the chain is closing"))

    def _close_channels(self) -> None:
        for stage in self.stages:  # what waits to leave goes, then the channel closes
            with contextlib.suppress(OSError):
                stage.handle.channel.flush()
            with contextlib.suppress(OSError):
                stage.handle.channel.close()

    def _exit_grace(self) -> None:
        """The stages get ``EXIT_GRACE_S`` to exit, unless abandoned (also meanwhile)."""
        deadline = time.monotonic() + EXIT_GRACE_S
        for stage in self.stages:
            while not self._abandon and not stage.handle.wait(
                min(GRACE_LOOK_S, deadline - time.monotonic())
            ):
                if time.monotonic() >= deadline:
                    return

    def _kill_the_rest(self) -> None:
        for stage in self.stages:
            if not stage.handle.exited():
                why = "not waited for (abandoned)" if self._abandon else "did not exit"
                log.warning("stage %d (%s) %s: killing it", stage.index, stage.node_id, why)
                stage.handle.kill()

    def _reap(self) -> None:
        for stage in self.stages:
            if stage.index not in self._reaped:
                stage.handle.wait(REAP_S)
                self._stage_events += stage.handle.trace_events()
                stage.handle.close()
                self._reaped.add(stage.index)

    def _free_links(self) -> None:
        self.orchestrator.close()
        self.links.detach()
        self._waiter.forget()
        self.host.cleanup(self.chain_id, chain_hops(self.template.stage_count))
        with self._lock:
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
            for fd in fds:
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
