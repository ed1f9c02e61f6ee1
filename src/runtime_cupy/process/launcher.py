"""The launcher: runs one plan with the orchestrator in this process and every stage
where its host puts it (PIPELINE_ORCHESTRATION_MVP.md §5-§7).

``ProcessRun(plan, prompt, ...).run()`` is a chain with one run
(``chain_runner.ChainRunner``): it starts every stage of the plan through a
``StageHost`` (by default ``hosts.local.LocalProcessHost``: one OS process per stage),
hands the chain the run, drives the chain's loop in this thread until the run ends
(provisioning, the readiness barrier, the prompt as sequence 0, each token consumed
and the next injected until EOS or ``max_tokens``), then closes the chain: every stage
reaped (killed after a short grace) and every resource of the chain's links freed by
name through the host, also those whose owner was killed, whatever happened (an
exception too). The caller's signal handlers stay: Ctrl-C's ``KeyboardInterrupt``
(or whatever the caller's own handler raises) tears the run down and then goes on to the
caller (a second one meanwhile stops waiting for the stages: they are killed at once;
more meanwhile are held until every stage is reaped and the links freed). With
``handle_signals`` (the command line's), SIGINT / SIGTERM in the main thread cancel the
run instead, which ends ``cancelled`` naming the signal (``interrupted_by``); a second
one stops waiting for the stages. A signal this process ignores stays ignored (a
non-interactive shell starts its background jobs with SIGINT ignored, so that a Ctrl-C
meant for the script in the foreground does not reach them; Python keeps it ignored too).

Each link moves its bytes through shared memory when both ends share a machine and
through TCP otherwise (``edges``: ``auto``), or through the medium asked for
(``shm``, ``tcp``: TCP on one host, for tests and comparison). TCP links authenticate
every frame; with ``encrypt_edges`` they encrypt it too (``edges.tcp_seal``).

A host that brings stages on other machines their slices of the model
(``hosts.port.MovesSlices``) is waited for before the run is handed to the chain: the
readiness bound starts once the slices are in place.

Faults are the chain runner's: a stage that dies or goes silent faults the run naming
the stage, its node, its host and the cause. A stage that cannot reserve the run's KV
cache (``ProvisionRefused``) has it offered again once, alone, under a new run id (a
stage may still hold what the planner counts free), as the chain runner offers any run
refused with no other run holding memory (CONCURRENT_RUNS.md §5); refused again, the run
ends ``KV_CACHE_UNAVAILABLE``, its fault naming what it needs, what was free and the
stage's whole budget, and that it never fits. A stage that cannot be started at all (no
descriptor left for its pipes, no memory for its process) faults the run with
``SETUP_FAILURE`` saying why, the stages started before it stopped.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from attrs import frozen

from runplan import RunPlan
from runplan.fsm import orchestrator as fsm
from runplan.messages import FaultKind, FaultReason
from runplan.resource_limits import with_limit
from runtime_cupy.hosts.local import LocalProcessHost, describe_exit
from runtime_cupy.hosts.port import MovesSlices, StageHost, StageProcessInfo
from runtime_cupy.process.chain_run import ChainRun, RunOutcome
from runtime_cupy.process.chain_runner import ORCHESTRATOR, ChainRunner, OnEvent
from runtime_cupy.process.names import new_run_id
from runtime_cupy.process.tracing import Event, chrome_trace

__all__ = [
    "ORCHESTRATOR",
    "OnEvent",
    "ProcessRun",
    "ProcessRunResult",
    "StageProcessInfo",
    "describe_exit",
    "trace_document",
]


log = logging.getLogger("runtime_cupy.launcher")


@frozen
class ProcessRunResult:
    finished: fsm.RunFinished | None  # None only if the loop broke off (a second Ctrl-C)
    tokens: tuple[int, ...]
    logits: tuple[Any, ...]
    stages: tuple[StageProcessInfo, ...]
    started_s: float  # monotonic: stages being started
    ready_s: float | None  # the readiness barrier passed
    token_times_s: tuple[float, ...]  # each token consumed
    ended_s: float  # torn down and cleaned up
    trace: tuple[Event, ...] | None
    media: tuple[str, ...] = ()  # how each edge moved its bytes, in plan order
    encrypted_edges: bool = False  # TCP links encrypted their frames (else authenticated)
    chain_id: str = ""  # names the run's links (one per hop) on its hosts
    interrupted_by: str | None = None  # the signal that cancelled it (handle_signals)


class ProcessRun:
    """One run of ``plan``: a chain of its stages with this one run
    (``chain_runner.ChainRunner``). ``worker`` is the registry's name of the stages'
    worker (``numpy``, ``cuda``); ``devices[i]`` the GPU of stage ``i`` on its machine
    (``None``: none). ``host`` starts the stages (default: ``LocalProcessHost`` with
    ``log_dir`` and ``log_level``); ``edges`` is ``auto``, ``shm`` or ``tcp``.
    ``encrypt_edges``: TCP links encrypt their frames (AES-256-GCM), not only
    authenticate them. ``handle_signals``: SIGINT / SIGTERM cancel the run while it runs
    in the main thread (the command line's; by default the caller's handlers act)."""

    def __init__(
        self,
        plan: RunPlan,
        prompt: Sequence[int],
        *,
        worker: str = "numpy",
        devices: Sequence[int | None] | None = None,
        host: StageHost | None = None,
        edges: str = "auto",
        on_token: Callable[[int], None] | None = None,
        on_event: OnEvent | None = None,
        log_dir: Path | None = None,
        log_level: str | None = None,
        trace: bool = False,
        encrypt_edges: bool = False,
        handle_signals: bool = False,
    ) -> None:
        self.plan = plan
        self.handle_signals = handle_signals
        self.encrypt_edges = encrypt_edges
        self.prompt = tuple(int(t) for t in prompt)
        if host is not None and (log_dir is not None or log_level is not None):
            raise ValueError("log_dir and log_level are the default host's; give them to the host")
        self.host: StageHost = host or LocalProcessHost(log_dir=log_dir, log_level=log_level)
        self.on_token = on_token
        self.runner = ChainRunner(
            plan,
            worker=worker,
            devices=devices,
            host=self.host,
            edges=edges,
            encrypt_edges=encrypt_edges,
            trace=trace,
            on_event=on_event,
            run_ids=new_run_id,  # the run offered again for KV memory: a new id
        )  # ValueError for edges or devices that cannot be
        self.chain_id = self.runner.chain_id
        self.secret = self.runner.secret
        self._cancel: list[str] = []
        self._signal: str | None = None  # the first signal that cancelled the run
        self._cancel_lock = threading.Lock()
        self._run: ChainRun | None = None
        self._started_s = time.monotonic()

    def cancel(self, why: str = "cancelled") -> None:
        """Ask the run to tear down (any thread, or a signal handler); a second request
        while tearing down stops waiting for the stages."""
        self._cancel.append(why)
        if len(self._cancel) > 1:
            self.runner.request_close(abandon=True)
        else:
            self.runner.cancel(self.plan.run_id, why)

    # -- the run -------------------------------------------------------------------------
    def run(self) -> ProcessRunResult:
        previous = self._install_signals()
        runner = self.runner
        events: list[Event] = []
        run: ChainRun | None = None
        try:
            try:
                unstarted = self._start()
                if unstarted is None:
                    if isinstance(self.host, MovesSlices):  # the slices in place first
                        self.host.wait_for_slices(lambda: bool(self._cancel))
                    run = self._run = runner.submit(self.plan, self.prompt, self.on_token)
                    if self._cancel:
                        runner.cancel(self.plan.run_id, self._cancel[0])
                    runner.loop(until=lambda: run.done)
                    if runner.trace.enabled:  # what each stage wrote when the run ended
                        events += runner.trace_events()
            finally:  # interrupted (again and again) while it waits: it stops waiting,
                # finishes and raises the first interrupt after
                try:
                    runner.request_close(abandon=len(self._cancel) > 1)
                finally:
                    runner.close()
        finally:
            self._restore_signals(previous)
        if run is not None:  # its on_token raised: the run torn down, its caller hears it
            run.raise_callback_error()
        outcome = run.wait(0) if run is not None else None
        finished = outcome.finished if outcome is not None else unstarted
        return ProcessRunResult(
            finished=finished,
            tokens=outcome.tokens if outcome is not None else (),
            logits=outcome.logits if outcome is not None else (),
            stages=tuple(h.info() for h in runner.handles()),
            started_s=self._started_s,
            ready_s=outcome.ready_s if outcome is not None else None,
            token_times_s=outcome.token_times_s if outcome is not None else (),
            ended_s=time.monotonic(),
            trace=tuple(events + runner.trace_events()) if runner.trace.enabled else None,
            media=runner.media_names,
            encrypted_edges=self.encrypt_edges,
            chain_id=self.chain_id,
            interrupted_by=self._signal,
        )

    def _start(self) -> fsm.RunFinished | None:
        """Start the chain's stages; the run's end, faulted with ``SETUP_FAILURE``, if
        one cannot be started (``OSError``: no descriptor left for its pipes, no memory
        for its process, ...; the limit met named where one is: ``resource_limits``;
        those started are stopped by ``close``)."""
        try:
            self.runner.start()
        except OSError as exc:
            detail = with_limit(f"the stages could not be started: {exc}", exc.errno, spawning=True)
            log.warning("%s", detail)
            reason = FaultReason(FaultKind.SETUP_FAILURE, detail)
            return fsm.RunFinished(fsm.Outcome.FAULTED, (), reason, None, ())
        return None

    def _install_signals(self) -> dict[int, Any]:
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum: int, _frame: FrameType | None) -> None:
            name = signal.Signals(signum).name
            self._signal = self._signal or name
            if self._cancel:
                log.warning("%s again: the stages are stopped now, without waiting", name)
            else:  # a stage in a long step answers after it: say what happens meanwhile
                log.warning("%s: stopping the run (interrupt again to stop waiting)", name)
            self.cancel(f"interrupted ({name})")

        return {
            s: signal.signal(s, handler)
            for s in (signal.SIGINT, signal.SIGTERM)
            if signal.getsignal(s) != signal.SIG_IGN
        }

    @staticmethod
    def _restore_signals(previous: dict[int, Any]) -> None:
        for signum, old in previous.items():
            signal.signal(signum, old)


def run_result(runner: ChainRunner, outcome: RunOutcome) -> ProcessRunResult:
    """One run's result on ``runner``'s chain, as ``ProcessRun`` gives it."""
    return ProcessRunResult(
        finished=outcome.finished,
        tokens=outcome.tokens,
        logits=outcome.logits,
        stages=tuple(h.info() for h in runner.handles()),
        started_s=outcome.submitted_s,
        ready_s=outcome.ready_s,
        token_times_s=outcome.token_times_s,
        ended_s=outcome.ended_s,
        trace=tuple(runner.trace_events()) if runner.trace.enabled else None,
        media=runner.media_names,
        encrypted_edges=runner.encrypt_edges,
        chain_id=runner.chain_id,
    )


def trace_document(result: ProcessRunResult) -> dict[str, Any]:
    """The Chrome trace of a run recorded with ``trace=True``."""
    return chrome_trace(list(result.trace or ()))
