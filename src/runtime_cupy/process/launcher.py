"""The launcher: runs one plan with the orchestrator in this process and every stage
where its host puts it (PIPELINE_ORCHESTRATION_MVP.md §5-§7).

``ProcessRun(plan, prompt, ...).run()`` starts every stage through a ``StageHost``
(by default ``hosts.local.LocalProcessHost``: one OS process per stage), each with its
control channel and the stages' secret, then drives ``OrchestratorController`` in an
event loop: provisioning, the readiness barrier, the prompt as sequence 0 (there is no
start broadcast), each token consumed and the next injected until EOS or
``max_tokens``. It waits, with a bound, on what the stages' control channels, its own
two token ends and a self-pipe for SIGINT / SIGTERM hand it (``poller.Watch``), and on
its timers.

Each edge moves its bytes through shared memory when both ends share a machine and
through TCP otherwise (``edges``: ``auto``), or through the medium asked for
(``shm``, ``tcp``: TCP on one host, for tests and comparison). TCP edges authenticate
every frame; with ``encrypt_edges`` they encrypt it too (``edges.tcp_seal``).

A host that brings stages on other machines their slices of the model
(``hosts.port.MovesSlices``) is waited for before provisioning: the readiness bound
starts once the slices are in place.

A stage whose control channel reaches end of file has died (however it died, SIGKILL
included): ``StageDied`` faults the run. A stage that has spoken once and then sends
nothing, not even a heartbeat, for ``timeouts.heartbeat_ms`` is stopped or hung
(SIGSTOP, a frozen host): it is killed and ``StageSilent`` faults the run, naming the
stage, its node and how long it was silent, within the bound and not at a step limit.
Any fault, a timer that runs out, or a cancellation tears the run down through the
state machine: no more injections, ``StopRun`` to every provisioned stage,
``StageStopped`` awaited up to the stop timeout. Then, whatever happened (an exception
too), every stage is reaped (killed after a short grace) and every resource of the
run's edges is freed by name through the host, also those whose owner was killed.

Warm stages (``stages=``: handles started before, with ``StageLaunch(warm=True)``, and
the ``secret`` they were started with) are provisioned for the run and kept after it:
nothing is started, and a stage that confirmed ``StageStopped`` is left running for the
next run. One that died, did not confirm its stop in time, or whose fault (but a setup
fault) ended the run is killed and reaped and named in ``ProcessRunResult.broken``, for
its owner to start again (``serve.chain.WarmChain``).
"""

from __future__ import annotations

import contextlib
import logging
import os
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
from runplan.messages import FaultKind, ProvisionStage, StopReason, StopRun
from runplan.plan import EdgePlan, OrchestratorEndpoint
from runplan.shards import SliceParts
from runtime_core.orchestrator_controller import OrchestratorController
from runtime_cupy.edges.choice import choose_medium
from runtime_cupy.edges.port import ProcessEdges
from runtime_cupy.hosts.local import LocalProcessHost, describe_exit
from runtime_cupy.hosts.port import (
    MovesSlices,
    StageHandle,
    StageHost,
    StageLaunch,
    StageProcessInfo,
)
from runtime_cupy.process.control_channel import ChannelBroken, Incoming
from runtime_cupy.process.keys import new_secret
from runtime_cupy.process.poller import IN, OUT, TROUBLE, Entry, Watch
from runtime_cupy.process.timers import Deadlines
from runtime_cupy.process.tracing import Event, TraceLog, chrome_trace

log = logging.getLogger("runtime_cupy.process.launcher")

ORCHESTRATOR = "orchestrator"
RETRY_S = 0.002  # retry opening the token endpoints
IDLE_WAKE_S = 0.5  # look at the stage processes at least this often
EXIT_GRACE_S = 3.0  # after the run ended, how long stages get to exit before they are killed
REAP_S = 5.0  # how long to wait for a killed stage

#: ``on_event(kind, fields)``: what the launcher did (spawned, state, injected, ...).
OnEvent = Callable[[str, dict[str, Any]], None]

__all__ = [
    "ORCHESTRATOR",
    "OnEvent",
    "ProcessRun",
    "ProcessRunResult",
    "StageProcessInfo",
    "describe_exit",
    "trace_document",
]


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
    broken: tuple[int, ...] = ()  # warm stages the run killed or found gone, by index
    encrypted_edges: bool = False  # TCP edges encrypted their frames (else authenticated)


class _Stage:
    """The launcher's state of one stage: its host's handle and what befell it."""

    def __init__(self, handle: StageHandle) -> None:
        self.handle = handle
        self.index = handle.stage_index
        self.node_id = handle.node_id
        self.channel = handle.channel
        self.gone = False  # its death was fed to the machine
        self.broken: str | None = None  # a send failed


class _Channels:
    """The orchestrator controller's ``StageChannels``. A failed send is noted and
    handled by the loop (the machine is not re-entered from inside its own actions)."""

    def __init__(self, run: ProcessRun) -> None:
        self.run = run

    def send(self, node_id: str, message: ProvisionStage | StopRun) -> None:
        stage = self.run.stage_by_node.get(node_id)
        if stage is None or stage.gone or stage.channel.eof:
            return
        self.run.trace.instant(f"send {type(message).__name__}", to=node_id)
        try:
            stage.channel.send(message)
        except ChannelBroken as exc:
            stage.broken = f"control channel broke ({exc})"


class ProcessRun:
    """One run of ``plan``. ``worker`` is the registry's name of the stages' worker
    (``numpy``, ``cuda``); ``devices[i]`` the GPU of stage ``i`` on its machine
    (``None``: none). ``host`` starts the stages (default: ``LocalProcessHost`` with
    ``log_dir`` and ``log_level``); ``edges`` is ``auto``, ``shm`` or ``tcp``.
    ``stages``: warm stages of ``host`` to provision instead of starting new ones, one
    per stage of the plan (same index and node), started with ``secret`` (and
    ``encrypt_edges`` as the run has it). ``encrypt_edges``: TCP edges encrypt their
    frames (AES-256-GCM), not only authenticate them."""

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
        stages: Sequence[StageHandle] | None = None,
        secret: bytes | None = None,
        encrypt_edges: bool = False,
    ) -> None:
        self.plan = plan
        self.encrypt_edges = encrypt_edges
        self.prompt = tuple(int(t) for t in prompt)
        self.worker = worker
        self.devices = tuple(devices) if devices is not None else (None,) * plan.stage_count
        if len(self.devices) != plan.stage_count:
            raise ValueError(f"{len(self.devices)} devices for {plan.stage_count} stages")
        if host is not None and (log_dir is not None or log_level is not None):
            raise ValueError("log_dir and log_level are the default host's; give them to the host")
        self.host: StageHost = host or LocalProcessHost(log_dir=log_dir, log_level=log_level)
        self.media = {e.edge_id: self._medium(e, edges) for e in plan.edges}  # ValueError
        self.on_token = on_token
        self.on_event = on_event
        self.trace = TraceLog(ORCHESTRATOR, enabled=trace)
        self._stage_events: list[Event] = []
        self.warm = tuple(stages) if stages is not None else None
        if self.warm is not None:
            if secret is None:
                raise ValueError("warm stages come with the secret they were started with")
            given = sorted((h.stage_index, h.node_id) for h in self.warm)
            planned = [(s.stage_index, s.node_id) for s in plan.stages]
            if given != planned:
                raise ValueError(f"warm stages {given} are not the plan's stages {planned}")
        self.secret = secret if secret is not None else new_secret()
        self._broken: set[int] = set()
        self.edges = ProcessEdges(
            self.host.medium(self.media[plan.token_out.edge_id], encrypt_edges),
            self.host.medium(self.media[plan.token_in.edge_id], encrypt_edges),
            self.secret,
        )
        self.timers: Deadlines[fsm.Timer] = Deadlines()
        self.stages: list[_Stage] = []
        self.stage_by_node: dict[str, _Stage] = {}
        self.controller = OrchestratorController(
            plan,
            self.prompt,
            _Channels(self),
            self.edges,
            self.timers,
            on_token=self._token,
            trace=self._on_trace,
        )
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # cancel() may come from another thread (or a signal handler on this one) while
        # the run closes its wake-up pipe: it never writes to a descriptor closed (and
        # perhaps reused by then).
        self._wake_lock = threading.RLock()
        self._waiter = Watch()
        self._cancel: list[str] = []  # requests (signal names), in order
        self._cancel_fed = 0
        self._open_at = 0.0
        self._inject_since: float | None = None
        self._ready_s: float | None = None
        self._token_times: list[float] = []
        self._started_s = time.monotonic()

    def _node(self, endpoint: Any) -> str:
        if isinstance(endpoint, OrchestratorEndpoint):
            return self.plan.orchestrator_node_id
        return str(endpoint.node_id)

    def _medium(self, edge: EdgePlan, preference: str) -> str:
        producer, consumer = self._node(edge.producer), self._node(edge.consumer)
        return choose_medium(preference, self.host.same_host(producer, consumer), edge.edge_id)

    # -- events --------------------------------------------------------------------------
    def _emit(self, kind: str, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event(kind, fields)

    def _on_trace(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "state":
            log.info("orchestrator %s -> %s (%s)", fields["from"], fields["to"], fields["event"])
            if fields["to"] == "RUNNING" and self._ready_s is None:
                self._ready_s = time.monotonic()
        elif kind == "reject":
            log.warning(
                "orchestrator rejected %s: %s",
                f"a message from {fields['sender']!r}" if "sender" in fields else "a record",
                fields.get("detail", fields.get("reason")),
            )
        elif kind == "protocol_violation":
            log.warning(
                "orchestrator protocol violation: %s in %s", fields["kind"], fields["state"]
            )
        if self.trace.enabled:
            self.trace.instant(kind, **{k: str(v) for k, v in fields.items()})
        if self.on_event is not None:
            self.on_event(kind, fields)

    def _token(self, sequence: int, token_id: int) -> None:
        self._token_times.append(time.monotonic())
        if self.on_token is not None:
            self.on_token(token_id)

    def cancel(self, why: str = "cancelled") -> None:
        """Ask the run to tear down (any thread, or a signal handler); a second request
        while tearing down stops waiting for the stages."""
        self._cancel.append(why)
        with self._wake_lock, contextlib.suppress(OSError):
            if self._wake_w >= 0:
                os.write(self._wake_w, b"!")

    # -- the run -------------------------------------------------------------------------
    def run(self) -> ProcessRunResult:
        previous = self._install_signals()
        try:
            self._start_all()
            if isinstance(self.host, MovesSlices):
                self.host.wait_for_slices(lambda: bool(self._cancel))
            self.controller.start()
            self._loop()
        finally:
            try:
                self._teardown()
            finally:
                self._restore_signals(previous)
                with self._wake_lock:
                    fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
                    for fd in fds:
                        with contextlib.suppress(OSError):
                            os.close(fd)
        c = self.controller
        finished = c.finished
        tokens = finished.tokens if finished is not None else c.machine.tokens
        return ProcessRunResult(
            finished=finished,
            tokens=tokens,
            logits=tuple(c.logits[: len(tokens)]),
            stages=tuple(s.handle.info() for s in self.stages),
            started_s=self._started_s,
            ready_s=self._ready_s,
            token_times_s=tuple(self._token_times),
            ended_s=time.monotonic(),
            trace=tuple(self._merged_trace()) if self.trace.enabled else None,
            media=tuple(self.media[e.edge_id] for e in self.plan.edges),
            broken=tuple(sorted(self._broken)),
            encrypted_edges=self.encrypt_edges,
        )

    def _install_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum: int, _frame: FrameType | None) -> None:
            self.cancel(f"interrupted ({signal.Signals(signum).name})")

        return {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}

    @staticmethod
    def _restore_signals(previous: dict[int, Any]) -> None:
        for signum, old in previous.items():
            signal.signal(signum, old)

    # -- stages --------------------------------------------------------------------------
    def _start_all(self) -> None:
        if self.warm is not None:
            for warm in sorted(self.warm, key=lambda h: h.stage_index):
                kept = _Stage(warm)
                self.stages.append(kept)
                self.stage_by_node[kept.node_id] = kept
                pid = warm.info().pid
                self._emit("attached", stage_index=kept.index, node_id=kept.node_id, pid=pid)
            return
        plan = self.plan
        for stage in plan.stages:
            launch = StageLaunch(
                run_id=plan.run_id,
                stage_index=stage.stage_index,
                stage_count=plan.stage_count,
                node_id=stage.node_id,
                orchestrator_id=plan.orchestrator_node_id,
                worker=self.worker,
                inbound_medium=self.media[stage.inbound_edge],
                outbound_medium=self.media[stage.outbound_edge],
                stop_ms=plan.timeouts.stop_ms,
                heartbeat_ms=plan.timeouts.heartbeat_ms,
                device=self.devices[stage.stage_index],
                trace=self.trace.enabled,
                encrypt_edges=self.encrypt_edges,
                source=plan.model.gguf_source,
                parts=SliceParts.of_stage(stage),
            )
            handle = _Stage(self.host.start(launch, self.secret))
            self.stages.append(handle)
            self.stage_by_node[handle.node_id] = handle
            pid = handle.handle.info().pid
            log.info("stage %d (%s) started: pid %d", handle.index, handle.node_id, pid)
            self._emit("spawned", stage_index=handle.index, node_id=handle.node_id, pid=pid)

    def _stage_silent(self, stage: _Stage, silent_s: float) -> None:
        """Feed the silence of a stage that sent nothing for longer than the heartbeat
        bound; it is killed first (a stopped process dies of SIGKILL too), so that it
        holds nothing and says nothing more."""
        stage.gone = True
        stage.handle.kill()
        why = f"no heartbeat for {silent_s:.1f} s"
        log.warning("stage %d (%s) is silent: %s; killed", stage.index, stage.node_id, why)
        self.trace.instant("stage silent", stage=stage.index, why=why)
        self._emit("stage_silent", stage_index=stage.index, silent_s=silent_s)
        self.controller.handle(fsm.StageSilent(stage.index, int(silent_s * 1000)))

    def _check_silence(self, now: float) -> None:
        bound = self.plan.timeouts.heartbeat_ms / 1000.0
        for stage in self.stages:
            silent = stage.channel.silent_s(now)
            if not stage.gone and silent is not None and silent > bound:
                self._stage_silent(stage, silent)

    def _stage_died(self, stage: _Stage, note: str | None = None) -> None:
        """Feed the death of a stage whose channel closed or broke (``note``), saying
        how it ended when it has."""
        if stage.gone:
            return
        stage.gone = True
        stopped = stage.index in self.controller.machine.stopped
        if not stopped:  # say how it died (a killed process is reaped at once)
            stage.handle.wait(0.5)
        reason = stage.handle.exit_reason()  # how it ended, if known; else the note
        why = reason or note or describe_exit(None)
        (log.info if stopped else log.warning)(
            "stage %d (%s) is gone: %s", stage.index, stage.node_id, why
        )
        self.trace.instant("stage died", stage=stage.index, why=why)
        self._emit("stage_died", stage_index=stage.index, detail=why)
        self.controller.handle(fsm.StageDied(stage.index, why))

    # -- the loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        c = self.controller
        while c.finished is None:
            for stage in self.stages:
                if stage.broken is not None and not stage.gone:
                    self._stage_died(stage, stage.broken)
            if len(self._cancel) > self._cancel_fed:
                if self._cancel_fed and c.state is fsm.State.TEARING_DOWN:
                    log.warning("asked again: not waiting for the stages any longer")
                    return
                self._cancel_fed = len(self._cancel)
                c.handle(fsm.Cancel(self._cancel[-1]))
            now = time.monotonic()
            if c.endpoints_pending and now >= self._open_at and not c.try_open_endpoints():
                self._open_at = now + RETRY_S
            if c.inject_pending:
                self._inject(now)
            else:
                self._inject_since = None
            while c.wants_tokens and c.poll_tokens():
                pass
            if c.finished is None:
                self._wait()

    def _inject(self, now: float) -> None:
        c = self.controller
        if c.try_inject():
            self._inject_since = None
            return
        if self._inject_since is None:
            self._inject_since = now
        elif now - self._inject_since > self.plan.timeouts.edge_wait_ms / 1000.0:
            self._inject_since = None
            c.handle(fsm.EndpointFault("token-in: no free slot in time"))

    def _wait(self) -> None:
        c = self.controller
        channels: dict[int, _Stage] = {}
        entries: list[Entry] = [(self._wake_r, IN)]
        for stage in self.stages:
            if not stage.gone and stage.channel.fileno() >= 0:
                mine = stage.channel.watch()
                if mine:
                    channels[stage.channel.fileno()] = stage
                    entries += mine
        entries += self.edges.watch(want_input=c.wants_tokens, want_space=c.inject_pending)
        now = time.monotonic()
        until = now + IDLE_WAKE_S
        due = self.timers.next_due()
        if due is not None and due < until:
            until = due
        bound = self.plan.timeouts.heartbeat_ms / 1000.0
        for stage in self.stages:
            heard = stage.channel.heard_s
            if not stage.gone and heard is not None:
                until = min(until, heard + bound)
        if c.endpoints_pending:
            until = min(until, self._open_at)
        if self._inject_since is not None:
            until = min(until, self._inject_since + self.plan.timeouts.edge_wait_ms / 1000.0)
        ready = self._waiter.poll(tuple(entries), (until - now) * 1000.0)
        for fd, events in ready:
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            elif fd in channels:
                stage = channels[fd]
                if events & OUT:
                    try:
                        stage.channel.flush()
                    except ChannelBroken as exc:
                        stage.broken = f"control channel broke ({exc})"
                if events & (IN | TROUBLE):
                    self._read_control(stage)
            else:
                self.edges.ready(fd, events)
        for timer in self.timers.expired(time.monotonic()):
            log.warning("orchestrator timer %s ran out", timer.name)
            c.handle(fsm.TimerFired(timer))
        self._check_silence(time.monotonic())  # after reading: what waited was heard
        if not ready:
            for stage in self.stages:  # a stage gone without closing its channel
                if not stage.gone and stage.handle.exited():
                    self._stage_died(stage)

    def _read_control(self, stage: _Stage) -> None:
        for item in stage.channel.receive():
            if isinstance(item, Incoming) and item.sender != stage.node_id:
                log.warning(
                    "refused a frame on stage %d's channel signed as %r", stage.index, item.sender
                )
            elif isinstance(item, Incoming):
                name = type(item.message).__name__
                log.info("received %s from %r", name, item.sender)
                self.trace.instant(f"recv {name}", sender=item.sender)
                self._emit("received", sender=item.sender, message=item.message)
                self.controller.handle(fsm.Received(item.sender, item.message))
            else:
                log.warning("refused a frame from stage %d: %s", stage.index, item.reason)
        if stage.channel.eof:
            self._stage_died(stage)

    # -- teardown ------------------------------------------------------------------------
    def _teardown(self) -> None:
        """Stop, reap and clean up, whatever state the run is in."""
        c = self.controller
        if c.finished is None:  # broke off: tell every live stage to stop, best effort
            stop = StopRun(self.plan.run_id, StopReason.CANCELLED)
            for stage in self.stages:
                with contextlib.suppress(OSError):
                    if not stage.gone and not stage.channel.eof:
                        stage.channel.send(stop)
        for stage in self.stages:  # what waits to leave (a StopRun) goes now
            with contextlib.suppress(OSError):
                stage.channel.flush()
        if self.warm is not None:
            self._let_go_warm()
        else:
            self._reap_all()
        self.edges.detach()
        self._waiter.forget()
        self.host.cleanup(self.plan.run_id, [e.edge_id for e in self.plan.edges])
        for stage in self.stages:
            self._stage_events += stage.handle.trace_events()

    def _let_go_warm(self) -> None:
        """Keep every warm stage that confirmed its stop; kill and reap the others. A
        stage whose fault ended the run is killed too, unless the fault was its setup
        (a name taken, no room for a ring, a file missing): setup failed before any
        step ran and the stage released the run, so its process is sound, and starting
        it again would find what it found."""
        c = self.controller
        fault_stage = c.finished.fault_stage if c.finished is not None else None
        fault = c.finished.fault if c.finished is not None else None
        if fault is not None and fault.kind is FaultKind.SETUP_FAILURE:
            fault_stage = None
        for stage in self.stages:
            kept = (
                stage.index in c.machine.stopped
                and stage.index != fault_stage
                and not stage.gone
                and stage.broken is None
                and not stage.channel.eof
                and not stage.handle.exited()
            )
            if not kept:
                self._broken.add(stage.index)
        for stage in self.stages:
            if stage.index in self._broken and not stage.handle.exited():
                log.warning(
                    "stage %d (%s): killing it (%s)",
                    stage.index,
                    stage.node_id,
                    "its fault ended the run"
                    if stage.index == fault_stage
                    else "it did not confirm its stop",
                )
                stage.handle.kill()
        for stage in self.stages:
            if stage.index in self._broken:
                stage.handle.wait(REAP_S)

    def _reap_all(self) -> None:
        c = self.controller
        unconfirmed = set(c.finished.unconfirmed_stages) if c.finished is not None else set()
        deadline = time.monotonic() + (EXIT_GRACE_S if c.finished is not None else 0.5)
        for stage in self.stages:
            if stage.index not in unconfirmed:
                stage.handle.wait(deadline - time.monotonic())
        for stage in self.stages:
            if not stage.handle.exited():
                log.warning("stage %d (%s) did not exit: killing it", stage.index, stage.node_id)
                stage.handle.kill()
        for stage in self.stages:
            stage.handle.wait(REAP_S)
            stage.handle.close()

    def _merged_trace(self) -> list[Event]:
        return self.trace.metadata() + self.trace.events + self._stage_events


def trace_document(result: ProcessRunResult) -> dict[str, Any]:
    """The Chrome trace of a run recorded with ``trace=True``."""
    return chrome_trace(list(result.trace or ()))
