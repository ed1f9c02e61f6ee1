"""The launcher: runs one plan with one OS process per stage and the orchestrator in
this process (PIPELINE_ORCHESTRATION_MVP.md §5-§7).

``ProcessRun(plan, prompt, ...).run()`` starts every stage as ``python -m
runtime_cupy.stage`` with an authenticated control channel (a socket pair) and a
lifeline pipe, then drives ``OrchestratorController`` in an event loop: provisioning,
the readiness barrier, the prompt as sequence 0 (there is no start broadcast), each
token consumed and the next injected until EOS or ``max_tokens``. It waits, with a
bound, on the stages' control sockets, the token-out ring's wake-up, the token-in
ring's (while an injection waits for space), its timers and a self-pipe for SIGINT /
SIGTERM.

A stage whose control channel reaches end of file has died (however it died, SIGKILL
included): ``StageDied`` faults the run. Any fault, a timer that runs out, or a
cancellation tears the run down through the state machine: no more injections,
``StopRun`` to every provisioned stage, ``StageStopped`` awaited up to the stop
timeout. Then, whatever happened (an exception too), every stage process is reaped
(SIGKILL after a short grace) and every shared-memory segment and FIFO of the run is
unlinked by name, also those whose owner was killed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import IO, Any

from attrs import frozen

import runplan
import runtime_core
import runtime_cupy
from runplan import RunPlan
from runplan.fsm import orchestrator as fsm
from runplan.messages import ProvisionStage, StopReason, StopRun
from runtime_core.orchestrator import OrchestratorController
from runtime_cupy.control import ControlChannel, Incoming, new_key
from runtime_cupy.edges.shm import FifoSignal, ProcessEdges, ShmRing, Watch, remove_run
from runtime_cupy.timers import Deadlines
from runtime_cupy.tracing import Event, TraceLog, chrome_trace, read_events

log = logging.getLogger("runtime_cupy.launcher")

ORCHESTRATOR = "orchestrator"
RETRY_S = 0.002  # retry opening the token endpoints
IDLE_WAKE_S = 0.5  # look at the stage processes at least this often
EXIT_GRACE_S = 3.0  # after the run ended, how long stages get to exit before SIGKILL
REAP_S = 5.0  # how long to wait for a killed process

#: ``on_event(kind, fields)``: what the launcher did (spawned, state, injected, ...).
OnEvent = Callable[[str, dict[str, Any]], None]


@frozen
class StageProcessInfo:
    stage_index: int
    node_id: str
    pid: int
    device: int | None
    returncode: int | None  # after reaping; negative: the signal that ended it


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


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "its control channel closed"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _pythonpath() -> str:
    """This process's package folders first, so stages import the same code."""
    dirs: list[str] = []
    for module in (runtime_cupy, runtime_core, runplan):
        folder = str(Path(module.__file__ or ".").resolve().parent.parent)
        if folder not in dirs:
            dirs.append(folder)
    rest = os.environ.get("PYTHONPATH")
    return os.pathsep.join(dirs + ([rest] if rest else []))


class _Stage:
    """The launcher's handle on one stage process."""

    def __init__(
        self,
        index: int,
        node_id: str,
        proc: subprocess.Popen[bytes],
        channel: ControlChannel,
        lifeline: int,
        device: int | None,
    ) -> None:
        self.index = index
        self.node_id = node_id
        self.proc = proc
        self.channel = channel
        self.lifeline = lifeline
        self.device = device
        self.gone = False  # its death was fed to the machine
        self.broken: str | None = None  # a send failed

    def info(self) -> StageProcessInfo:
        return StageProcessInfo(
            self.index, self.node_id, self.proc.pid, self.device, self.proc.returncode
        )


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
        except OSError as exc:
            stage.broken = f"control channel broke ({exc})"


class ProcessRun:
    """One run of ``plan`` in stage processes. ``worker`` is ``numpy`` or ``cuda``;
    ``devices[i]`` the GPU of stage ``i`` (``None``: none). ``stage_faults[i]`` lists
    faults stage ``i`` plays on purpose (tests: see ``runtime_cupy.stage``).
    ``log_dir``: each stage's log goes to ``stage-<i>.log`` there (else to this
    process's standard error)."""

    def __init__(
        self,
        plan: RunPlan,
        prompt: Sequence[int],
        *,
        worker: str = "numpy",
        devices: Sequence[int | None] | None = None,
        on_token: Callable[[int], None] | None = None,
        on_event: OnEvent | None = None,
        log_dir: Path | None = None,
        log_level: str | None = None,
        trace: bool = False,
        stage_faults: Mapping[int, Sequence[str]] | None = None,
    ) -> None:
        self.plan = plan
        self.prompt = tuple(int(t) for t in prompt)
        self.worker = worker
        self.devices = tuple(devices) if devices is not None else (None,) * plan.stage_count
        if len(self.devices) != plan.stage_count:
            raise ValueError(f"{len(self.devices)} devices for {plan.stage_count} stages")
        self.on_token = on_token
        self.on_event = on_event
        self.log_dir = log_dir
        self.log_level = log_level or ("INFO" if log_dir is not None else "WARNING")
        self.stage_faults = dict(stage_faults or {})
        self.trace = TraceLog(ORCHESTRATOR, enabled=trace)
        self._trace_dir: Path | None = None
        self._stage_events: list[Event] = []
        self.key = new_key()
        self.edges = ProcessEdges()
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
        self._waiter = Watch(self._wake_r)
        self._cancel: list[str] = []  # requests (signal names), in order
        self._cancel_fed = 0
        self._open_at = 0.0
        self._inject_since: float | None = None
        self._ready_s: float | None = None
        self._token_times: list[float] = []
        self._started_s = time.monotonic()

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
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"!")

    # -- the run -------------------------------------------------------------------------
    def run(self) -> ProcessRunResult:
        previous = self._install_signals()
        try:
            self._spawn_all()
            self.controller.start()
            self._loop()
        finally:
            try:
                self._teardown()
            finally:
                self._restore_signals(previous)
                for fd in (self._wake_r, self._wake_w):
                    with contextlib.suppress(OSError):
                        os.close(fd)
        c = self.controller
        finished = c.finished
        tokens = finished.tokens if finished is not None else c.machine.tokens
        return ProcessRunResult(
            finished=finished,
            tokens=tokens,
            logits=tuple(c.logits[: len(tokens)]),
            stages=tuple(s.info() for s in self.stages),
            started_s=self._started_s,
            ready_s=self._ready_s,
            token_times_s=tuple(self._token_times),
            ended_s=time.monotonic(),
            trace=tuple(self._merged_trace()) if self.trace.enabled else None,
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

    # -- processes -----------------------------------------------------------------------
    def _spawn_all(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = _pythonpath()
        # BLAS thread pools spin while idle: several stage processes with a pool the size
        # of the machine each starve the one stage that computes. Split the cores.
        threads = str(max(1, _cpus() // self.plan.stage_count))
        for name in _THREAD_VARIABLES:
            env.setdefault(name, threads)
        if self.trace.enabled:
            self._trace_dir = Path(tempfile.mkdtemp(prefix="gguf-pipeline-trace-"))
        for stage in self.plan.stages:
            self._spawn(stage.stage_index, stage.node_id, env)

    def _spawn(self, index: int, node_id: str, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        life_r, life_w = os.pipe()
        device = self.devices[index]
        cmd = [
            sys.executable, "-m", "runtime_cupy.stage",
            "--run-id", self.plan.run_id,
            "--stage-index", str(index),
            "--node-id", node_id,
            "--orchestrator-id", self.plan.orchestrator_node_id,
            "--control-fd", str(theirs.fileno()),
            "--lifeline-fd", str(life_r),
            "--worker", self.worker,
            "--stop-ms", str(self.plan.timeouts.stop_ms),
            "--log-level", self.log_level,
        ]  # fmt: skip
        if self._trace_dir is not None:
            cmd += ["--trace-file", str(self._trace_dir / f"stage-{index}.json")]
        for fault in self.stage_faults.get(index, ()):
            cmd += ["--inject-fault", fault]
        stage_env = dict(env)
        if device is not None:
            stage_env["CUDA_VISIBLE_DEVICES"] = str(device)
        out: IO[bytes] | int = 2
        if self.log_dir is not None:
            out = (self.log_dir / f"stage-{index}.log").open("ab")
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=out,
                pass_fds=(theirs.fileno(), life_r),
                env=stage_env,
            )
        except BaseException:
            ours.close()
            os.close(life_w)
            raise
        finally:
            theirs.close()
            os.close(life_r)
            if not isinstance(out, int):
                out.close()
        assert proc.stdin is not None
        with contextlib.suppress(OSError):  # a stage that died at once shows at its socket
            proc.stdin.write(self.key.hex().encode("ascii") + b"\n")
        with contextlib.suppress(OSError):
            proc.stdin.close()
        channel = ControlChannel(ours, self.key, self.plan.orchestrator_node_id, node_id)
        handle = _Stage(index, node_id, proc, channel, life_w, device)
        self.stages.append(handle)
        self.stage_by_node[node_id] = handle
        log.info("stage %d (%s) started: pid %d", index, node_id, proc.pid)
        self._emit("spawned", stage_index=index, node_id=node_id, pid=proc.pid)

    def _stage_died(self, stage: _Stage, note: str | None = None) -> None:
        """Feed the death of a stage whose channel closed or broke (``note``), saying
        how its process ended when it has."""
        if stage.gone:
            return
        stage.gone = True
        stopped = stage.index in self.controller.machine.stopped
        if not stopped:  # say how it died (a killed process is reaped at once)
            with contextlib.suppress(subprocess.TimeoutExpired):
                stage.proc.wait(0.5)
        if stage.proc.poll() is not None or note is None:
            why = describe_exit(stage.proc.returncode)
        else:
            why = note
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
        for stage in self.stages:
            if not stage.gone and not stage.channel.eof:
                channels[stage.channel.fileno()] = stage
        data: FifoSignal | None = None
        space: FifoSignal | None = None
        if c.wants_tokens and c.token_out is not None and isinstance(c.token_out.ring, ShmRing):
            data = c.token_out.ring.data_signal
        if c.inject_pending and c.token_in is not None and isinstance(c.token_in.ring, ShmRing):
            space = c.token_in.ring.space_signal
        data_fd = -1 if data is None else data.fileno()
        space_fd = -1 if space is None else space.fileno()
        watched = (data_fd, space_fd, *channels)
        now = time.monotonic()
        until = now + IDLE_WAKE_S
        due = self.timers.next_due()
        if due is not None and due < until:
            until = due
        if c.endpoints_pending:
            until = min(until, self._open_at)
        if self._inject_since is not None:
            until = min(until, self._inject_since + self.plan.timeouts.edge_wait_ms / 1000.0)
        ready = self._waiter.poll(watched, max(0.0, until - now) * 1000.0)
        for fd, _ in ready:
            if fd == data_fd and data is not None:
                data.drain()
            elif fd == space_fd and space is not None:
                space.drain()
            elif fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            elif fd in channels:
                self._read_control(channels[fd])
        for timer in self.timers.expired(time.monotonic()):
            log.warning("orchestrator timer %s ran out", timer.name)
            c.handle(fsm.TimerFired(timer))
        if not ready:
            for stage in self.stages:  # a process gone without closing its channel
                if not stage.gone and stage.proc.poll() is not None:
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
        unconfirmed = set(c.finished.unconfirmed_stages) if c.finished is not None else set()
        deadline = time.monotonic() + (EXIT_GRACE_S if c.finished is not None else 0.5)
        for stage in self.stages:
            if stage.index in unconfirmed:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                stage.proc.wait(max(0.0, deadline - time.monotonic()))
        for stage in self.stages:
            if stage.proc.poll() is None:
                log.warning("stage %d (%s) did not exit: SIGKILL", stage.index, stage.node_id)
                with contextlib.suppress(ProcessLookupError):
                    stage.proc.kill()
        for stage in self.stages:
            with contextlib.suppress(subprocess.TimeoutExpired):
                stage.proc.wait(REAP_S)
            stage.channel.close()
            with contextlib.suppress(OSError):
                os.close(stage.lifeline)
        self.edges.close()
        remove_run(self.plan.run_id, [e.edge_id for e in self.plan.edges])
        self._collect_stage_traces()

    def _collect_stage_traces(self) -> None:
        folder, self._trace_dir = self._trace_dir, None
        if folder is None:
            return
        for stage in self.stages:
            path = folder / f"stage-{stage.index}.json"
            self._stage_events += read_events(path)
            with contextlib.suppress(OSError):
                path.unlink()
        with contextlib.suppress(OSError):
            folder.rmdir()

    def _merged_trace(self) -> list[Event]:
        return self.trace.metadata() + self.trace.events + self._stage_events


def trace_document(result: ProcessRunResult) -> dict[str, Any]:
    """The Chrome trace of a run recorded with ``trace=True``."""
    return chrome_trace(list(result.trace or ()))
