"""One stage process: ``python -m runtime_cupy.process.stage_process ...``, started by the
local-process host (``hosts.local``).

``StageProcess`` runs one ``StageController`` (the stage state machine, its worker and
its two edge ends) in a single-threaded event loop that waits, with a bound, on what
its control channel and its edge ends hand it (``poller.Watch``: the channel's socket;
a FIFO or a socket per edge end, as the medium says; a wake-up pipe) and on its timers;
then runs setup, steps, publishing and release when the controller asks for them. It
knows no medium and no host: whoever starts it hands it its channel, its edges and, if
it has one, a lifeline.

``main`` is the local host's side of a stage process: the stages' secret arrives as one
hex line on standard input; the control channel is an inherited socket
(``--control-fd``); a second inherited descriptor, the read end of a pipe whose write
end only the orchestrator holds (``--lifeline-fd``), reaches end of file the moment the
orchestrator's process is gone, however it went. Either one closing is
``OrchestratorLost``: the stage stops on its own. A watchdog thread waits on the
lifeline; if the loop has not finished ``--stop-ms`` after the loss (a step that runs
on), it removes the run's resources this stage owns and exits.

Resources. A stopping stage frees what it owns: its inbound edge (whose ring it made,
EDGES_AND_WORKERS.md §3), never its outbound edge, which belongs to the next stage and
may still be in use. Only when the orchestrator is lost does the last stage also free
the token-out edge, whose owner is gone; so a run whose orchestrator was killed leaves
nothing behind. SIGINT is ignored (Ctrl-C is the orchestrator's to handle); SIGTERM
stops the stage as a lost orchestrator does.

Warm stages (``--warm``) serve one run after another: after ``StopRun`` the stage
stays, ``STOPPED``, and waits for the next ``ProvisionStage`` (the stage machine allows
``STOPPED -> PREPARING`` and keeps the stopped runs' ids stale). Its worker keeps the
weights it bound (``runtime_core.workers.kept_weights``), so a later run of the same slice
loads nothing: its trace has a ``weights reused`` instant where the first has a
``bind`` span. Each run's trace events are written when the run ends, before
``StageStopped``. A warm stage ends when its orchestrator closes the control channel
(or is lost) while no run is active.

Heartbeats. From the start of its loop to its end a stage beats on its control channel
from a thread of its own (``control_channel.Heartbeat``, every quarter of ``--heartbeat-ms``),
whatever its loop does: a stage whose orchestrator hears nothing for that long is
stopped or hung, never merely busy.

Exit status: 0 after ``StopRun`` (warm: after the channel closed between runs), 3 after
the orchestrator was lost (during a run), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from runplan import GgufSource, ProvisionStage, WorkerCapabilities
from runplan.fsm import stage as fsm
from runplan.messages import ProvisionRefused, StageFault, StageReady, StageStopped
from runplan.plan import EdgeKind
from runtime_core.stage_controller import StageController
from runtime_core.workers.interface import Progress, StepWorker, TraceEvent, Worker, WorkerError
from runtime_core.workers.kept_weights import KeepsWeights
from runtime_cupy.edges.port import MEDIA, EdgeMedium, ProcessEdges
from runtime_cupy.hosts.local import local_medium
from runtime_cupy.process.control_channel import (
    ChannelBroken,
    ControlChannel,
    Heartbeat,
    Incoming,
)
from runtime_cupy.process.keys import BadSecret, control_key, parse_secret, slice_key
from runtime_cupy.process.names import run_label
from runtime_cupy.process.poller import IN, OUT, TROUBLE, Entry, Watch
from runtime_cupy.process.timers import Deadlines
from runtime_cupy.process.tracing import TraceLog, now_us
from runtime_cupy.slices.fetch import SliceFetcher, SliceOrigin
from runtime_cupy.slices.worker import sliced
from runtime_cupy.workers import WORKERS, WorkerUnavailable, make_worker

EXIT_STOPPED = 0
EXIT_USAGE = 2
EXIT_LOST = 3

ATTACH_RETRY_S = 0.002  # retry attaching to the consumer's ring
IDLE_WAKE_S = 1.0  # wake at least this often (parent check)

log = logging.getLogger("runtime_cupy.process.stage_process")

#: ``make_worker(name, trace)``: the worker a stage process runs (by default from the
#: registry), its own events going to ``trace`` (the stage's trace, when it keeps one).
MakeWorker = Callable[[str, TraceEvent | None], Worker]
#: ``media(name, encrypt)``: how an edge of the stage moves bytes (by default, on this
#: machine); ``encrypt``: TCP frames encrypted, not only authenticated.
MakeMedium = Callable[[str, bool], EdgeMedium]


class UnavailableWorker:
    """Stands in for a worker this process cannot load: configuring it fails, so the
    stage reports a setup fault naming the reason instead of dying."""

    capabilities: ClassVar[WorkerCapabilities] = WorkerCapabilities()

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def configure(self, provision: ProvisionStage) -> None:
        raise WorkerError(self.reason)

    def bind(self, gguf_source: GgufSource, progress: Progress | None = None) -> None:
        raise WorkerError(self.reason)

    def execute_step(self, sequence: int, data: Any) -> Any:
        raise WorkerError(self.reason)

    def release(self) -> None:
        pass


# -- the process -------------------------------------------------------------------------


class _Reporter:
    """The controller's control port: frames to the orchestrator. A failed send marks
    the channel broken; the loop then treats the orchestrator as lost."""

    def __init__(self, stage: StageProcess) -> None:
        self.stage = stage

    def send(self, message: StageReady | StageFault | StageStopped | ProvisionRefused) -> None:
        stage = self.stage
        stage.trace.instant(f"send {type(message).__name__}")
        # A stage's fault is the orchestrator's to report (and during teardown, an edge
        # closed by a neighbour that stopped first is expected): logged at INFO here.
        detail = f": {message.reason}" if isinstance(message, StageFault) else ""
        log.info("send %s%s", type(message).__name__, detail)
        if isinstance(message, StageStopped):
            stage.run_ended()  # the run's trace is whole before the orchestrator hears
        if stage.channel.eof:
            return
        try:
            stage.channel.send(message)
        except ChannelBroken as exc:
            log.warning("cannot reach the orchestrator: %s", exc)
            stage.channel_broken = True


class StageProcess:
    def __init__(
        self,
        *,
        stage_index: int,
        node_id: str,
        orchestrator_id: str,
        channel: ControlChannel,
        edges: ProcessEdges,
        worker: StepWorker,
        stop_s: float,
        trace: TraceLog,
        lifeline_fd: int | None = None,
        warm: bool = False,
        trace_file: Path | None = None,
        heartbeat_s: float | None = None,
    ) -> None:
        # ``warm``: serve runs until the channel closes between runs. ``trace_file``:
        # where a warm stage writes each run's trace events when the run ends.
        # ``heartbeat_s``: the orchestrator's bound on this stage's silence (``None``:
        # no heartbeats, for a caller that watches the stage otherwise).
        self.stage_index = stage_index
        self.heartbeat_s = heartbeat_s
        self.warm = warm
        self.trace_file = trace_file
        self.worker = worker
        self.channel = channel
        self.channel_broken = False
        self.lifeline_fd = lifeline_fd
        self.stop_s = stop_s
        self.trace = trace
        self.parent_pid = os.getppid()
        self.edges = edges
        self.timers: Deadlines[fsm.Timer] = Deadlines()
        self.controller = StageController(
            node_id,
            orchestrator_id,
            worker,
            self.edges,
            _Reporter(self),
            self.timers,
            trace=self._on_trace,
            # What every step traces is only logged at INFO or DEBUG, or recorded.
            trace_steps=trace.enabled or log.isEnabledFor(logging.INFO),
        )
        self.lost: str | None = None
        self._lost_flag = threading.Event()  # set by the watchdog or a signal
        self._lost_why = "the orchestrator's process is gone"
        self._done = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # What this stage frees when it goes: run id, its inbound edge, and the
        # token-out edge if it is the last stage (freed only if the orchestrator is lost).
        self._run: tuple[str, int, int | None] | None = None
        self._attach_at = 0.0
        self._output_since: float | None = None
        self._setup_at = 0  # now_us() when setup began, then when its last part ended
        self._lost_in: fsm.State | None = None  # the machine's state when it was lost
        self._waiter = Watch()

    # -- trace and logs --------------------------------------------------------------
    def _on_trace(self, kind: str, fields: dict[str, Any]) -> None:
        # The events of every step (loaded, published, state) come only when INFO logs
        # or the trace are on (``trace_steps``), and are formatted only for those.
        if kind in ("loaded", "published"):
            log.debug("%s %s", kind, fields)
            if self.trace.enabled:
                self.trace.instant(kind, **fields)
        elif kind == "state":
            log.info("%s -> %s (%s)", fields["from"], fields["to"], fields["event"])
            if self.trace.enabled:
                self.trace.instant(f"state {fields['to']}", event=fields["event"])
        elif kind == "reject":
            log.warning(
                "rejected from %r: %s: %s", fields["sender"], fields["reason"], fields["detail"]
            )
            self.trace.instant("reject", **fields)
        elif kind == "protocol_violation":
            log.warning("protocol violation: %s in %s", fields["kind"], fields["state"])
        elif kind == "setup_done":
            self._setup_part_done(fields["part"])
        else:
            log.info("%s %s", kind, fields)

    def _setup_part_done(self, part: str) -> None:
        """Time each part of setup; the shard is a ``bind`` span only when the worker
        read weights (a warm stage's later runs reuse them)."""
        start, self._setup_at = self._setup_at, now_us()
        if part == fsm.SetupPart.SHARD.value:
            worker = self.worker
            if isinstance(worker, KeepsWeights) and worker.weights_reused:
                log.info("weights reused")
                self.trace.instant("weights reused")
            else:
                log.info("bound weights in %.3f s", (self._setup_at - start) / 1e6)
                self.trace.span("bind", start)
        elif self.trace.enabled:
            self.trace.span(part.lower(), start)

    def run_ended(self) -> None:
        """The run is over (StageStopped about to leave): a warm stage writes the run's
        trace events now, for the orchestrator to read once it hears."""
        if self.warm and self.trace.enabled and self.trace_file is not None:
            try:
                self.trace.flush(self.trace_file)
            except OSError as exc:
                log.warning("cannot write the run's trace: %s", exc)

    # -- the loop --------------------------------------------------------------------
    def run(self) -> int:
        if self.lifeline_fd is not None:
            watchdog = threading.Thread(target=self._watch, name="lifeline", daemon=True)
            watchdog.start()
        heartbeat = None
        if self.heartbeat_s is not None:
            heartbeat = Heartbeat(self.channel, self.heartbeat_s).start()
        try:
            while True:
                self._check_lost()
                self._pump()
                state = self.controller.state
                idle = state in (fsm.State.STOPPED, fsm.State.UNPROVISIONED)
                if self.lost is not None and idle:
                    if self.warm and self._lost_in in (fsm.State.STOPPED, fsm.State.UNPROVISIONED):
                        return EXIT_STOPPED  # the chain closed between runs
                    return EXIT_LOST
                if state is fsm.State.STOPPED and not self.warm:
                    return EXIT_STOPPED
                self._wait()
        finally:
            self._done.set()
            if heartbeat is not None:
                heartbeat.stop()
            self.edges.detach()
            self._remove_resources()
            self.channel.close()  # what waits to leave (StageStopped) goes first, bounded

    def _check_lost(self) -> None:
        if self._lost_flag.is_set() and self.lost is None:
            # What the orchestrator wrote before it went (its provision, say) is still in
            # the socket: read it first, so that the stage knows which edges to clean up.
            self._drain_control()
            self._lose(self._lost_why)
        if self.channel_broken:
            self._lose("the control channel broke")

    def _lose(self, why: str) -> None:
        if self.lost is not None:
            return
        self.lost = why
        self._lost_in = self.controller.state
        if self.warm and self._lost_in in (fsm.State.STOPPED, fsm.State.UNPROVISIONED):
            log.info("the chain closed (%s): exiting", why)
        else:
            log.warning("orchestrator lost (%s): stopping", why)
        self.trace.instant("orchestrator lost", why=why)
        self.controller.handle(fsm.OrchestratorLost())

    def _pump(self) -> None:
        c = self.controller
        tracing = self.trace.enabled
        progress = True
        while progress:
            progress = False
            if self._run is None and c.provision is not None:
                p = c.provision
                last = p.outbound.edge_id if p.outbound.kind is EdgeKind.TOKEN_OUT else None
                self._run = (p.run_id, p.inbound.edge_id, last)
            if c.setup_pending:
                start = self._setup_at = now_us()
                run = run_label(c.provision.run_id) if c.provision else "?"
                log.info("setup begins (run %s)", run)
                c.run_setup()
                self.trace.span("setup", start)
                progress = True
            if c.outbound_pending and not c.setup_pending:
                now = time.monotonic()
                if now >= self._attach_at:
                    if c.try_attach_outbound():
                        progress = True
                    else:
                        self._attach_at = now + ATTACH_RETRY_S
            if c.wants_input and c.poll_inbound():
                progress = True
            record = c.record
            if record is not None and c.step_pending:
                sequence, rows = record.header.sequence, record.header.rows
                log.info("step %d begins (%d rows)", sequence, rows)
                start = now_us() if tracing else 0
                c.run_step()
                if tracing:
                    self.trace.span(f"step {sequence}", start, sequence=sequence, rows=rows)
                progress = True
            if c.output_pending and c.state is fsm.State.EXECUTING:
                if c.try_publish_output():
                    self._output_since = None
                    progress = True
                else:
                    self._bound_output_wait(time.monotonic())
            else:
                self._output_since = None
            if c.release_pending:
                c.run_release()
                self.edges.detach()
                self._remove_resources()
                self._run = None  # freed; a warm stage's next run names its own
                self._output_since = None
                progress = True

    def _bound_output_wait(self, now: float) -> None:
        """A full outbound ring is backpressure, for at most the edge wait bound."""
        c = self.controller
        provision = c.provision
        if self._output_since is None:
            self._output_since = now
            return
        if provision is None or c.outbound is None:
            return
        bound = provision.timeouts.edge_wait_ms / 1000.0
        if now - self._output_since > bound:
            self._output_since = None
            c.handle(fsm.EdgeFault(c.outbound.edge_id, f"no free slot within {bound:.3f} s"))

    def _wait(self) -> None:
        c = self.controller
        channel = self.channel
        entries: tuple[Entry, ...] = (
            (self._wake_r, IN),
            *channel.watch(),
            *self.edges.watch(want_input=c.wants_input, want_space=c.output_pending),
        )
        now = time.monotonic()
        until = now + IDLE_WAKE_S
        due = self.timers.next_due()
        if due is not None and due < until:
            until = due
        if c.outbound_pending and not c.setup_pending and self._attach_at < until:
            until = self._attach_at
        if self._output_since is not None and c.provision is not None:
            until = min(until, self._output_since + c.provision.timeouts.edge_wait_ms / 1000.0)
        ready = self._waiter.poll(entries, (until - now) * 1000.0)
        if not ready and os.getppid() != self.parent_pid:  # idle: a last look at the parent
            self._lose("the parent process is gone")
        control = channel.fileno()
        for fd, events in ready:
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            elif fd == control:
                if events & OUT:
                    self._flush_control()
                if events & (IN | TROUBLE):
                    self._read_control()
            else:
                self.edges.ready(fd, events)
        for timer in self.timers.expired(time.monotonic()):
            log.warning("timer %s ran out", timer.name)
            c.handle(fsm.TimerFired(timer))

    def _flush_control(self) -> None:
        try:
            self.channel.flush()
        except ChannelBroken as exc:
            log.warning("cannot reach the orchestrator: %s", exc)
            self.channel_broken = True

    def _drain_control(self) -> None:
        poller = select.poll()
        poller.register(self.channel.fileno(), select.POLLIN)
        while not self.channel.eof and poller.poll(0):
            self._read_control()

    def _read_control(self) -> None:
        for item in self.channel.receive():
            if isinstance(item, Incoming):
                log.info("received %s from %r", type(item.message).__name__, item.sender)
                self.trace.instant(f"recv {type(item.message).__name__}", sender=item.sender)
                self.controller.handle(fsm.Received(item.sender, item.message))
            else:
                log.warning("refused a control frame: %s", item.reason)
                self.trace.instant("refused frame", reason=item.reason)
        if self.channel.eof:
            self._lose("the control channel closed")

    # -- the orchestrator's death -------------------------------------------------------------
    def _watch(self) -> None:
        """Wait on the lifeline; once it ends, wake the loop, and exit if the loop has not
        finished within the stop bound (a step that runs on)."""
        assert self.lifeline_fd is not None
        with contextlib.suppress(OSError):
            while os.read(self.lifeline_fd, 1):
                pass
        if self._done.is_set():
            return
        self.notice_loss("the orchestrator's process is gone (lifeline closed)")
        if self._done.wait(self.stop_s):
            return
        log.error("orchestrator lost and not stopped within %.1f s: exiting now", self.stop_s)
        self._remove_resources()
        with contextlib.suppress(Exception):
            logging.shutdown()
        os._exit(EXIT_LOST)

    def notice_loss(self, why: str) -> None:
        """From another thread or a signal handler: the loop stops at its next turn."""
        self._lost_why = why
        self._lost_flag.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"!")

    def _remove_resources(self) -> None:
        """Free what this stage owns: its inbound edge's resources on this host, and, if
        the orchestrator is lost, the token-out edge's (idempotent, any thread)."""
        if self._run is None:
            return
        run_id, inbound, token_out = self._run
        self.edges.inbound_medium.remove(run_id, inbound)
        if token_out is not None and (self.lost is not None or self._lost_flag.is_set()):
            self.edges.outbound_medium.remove(run_id, token_out)


# -- entry point ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m runtime_cupy.process.stage_process",
        description="One pipeline stage process (started by the runtime_cupy launcher's "
        "local-process host; the stages' secret is read from standard input).",
    )
    p.add_argument(
        "--run-label",
        required=True,
        help="the run's label, or a warm stage's chain's (for logs and ps; never the run "
        "id, which names the run's resources)",
    )
    p.add_argument("--stage-index", type=int, required=True)
    p.add_argument("--node-id", required=True)
    p.add_argument("--orchestrator-id", required=True)
    p.add_argument("--control-fd", type=int, required=True, help="inherited control socket")
    p.add_argument("--lifeline-fd", type=int, required=True, help="inherited lifeline pipe")
    p.add_argument("--worker", choices=WORKERS, default="numpy")
    p.add_argument("--inbound", choices=MEDIA, default="shm", help="how the inbound edge moves")
    p.add_argument("--outbound", choices=MEDIA, default="shm", help="how the outbound edge moves")
    p.add_argument("--stop-ms", type=int, default=10_000)
    p.add_argument(
        "--encrypt-edges",
        action="store_true",
        help="encrypt the frames of TCP edges (AES-256-GCM), not only authenticate them",
    )
    p.add_argument(
        "--heartbeat-ms",
        type=int,
        default=5_000,
        help="the orchestrator's bound on this stage's silence: beat four times as often",
    )
    p.add_argument(
        "--warm",
        action="store_true",
        help="serve one run after another, keeping the bound weights, until the control "
        "channel closes between runs",
    )
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--trace-file", type=Path, default=None)
    p.add_argument(
        "--slice-server",
        default=None,
        help="HOST:PORT of the orchestrator's slice server: where this stage gets its slice "
        "of the model when its host lacks it (runtime_cupy.slices)",
    )
    p.add_argument("--slice-source-key", default=None, help="the plan's source's content key")
    return p


def main(
    argv: Sequence[str] | None = None,
    make: MakeWorker = make_worker,
    media: MakeMedium = local_medium,
) -> int:
    """A stage process of the local host; ``make(name, trace)`` makes its worker (a stage
    entry of another kind may wrap the registry's), ``media(name, encrypt)`` its edges' media
    (another host's stage entry gives its own: ``hosts.ray.stage_entry``)."""
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s stage {args.stage_index} ({args.node_id}, pid {os.getpid()}) "
        "%(levelname)s %(message)s",
    )
    line = sys.stdin.readline()
    sys.stdin.close()
    try:
        secret = parse_secret(line)
    except BadSecret as exc:
        log.error("%s", exc)
        return EXIT_USAGE
    sock = socket.socket(fileno=args.control_fd)
    key = control_key(secret, args.node_id)
    channel = ControlChannel(sock, key, args.node_id, args.orchestrator_id)
    trace = TraceLog(args.node_id, enabled=args.trace_file is not None)
    worker: StepWorker
    try:
        worker = make(args.worker, trace.instant if trace.enabled else None)
    except WorkerUnavailable as exc:
        log.error("%s", exc)
        worker = UnavailableWorker(str(exc))
    if args.slice_server is not None:
        origin = SliceOrigin(args.slice_server, args.slice_source_key or "")
        key = slice_key(secret, args.node_id)
        worker = sliced(worker, SliceFetcher(origin, args.stage_index, key))
    stage = StageProcess(
        stage_index=args.stage_index,
        node_id=args.node_id,
        orchestrator_id=args.orchestrator_id,
        channel=channel,
        edges=ProcessEdges(
            media(args.inbound, args.encrypt_edges),
            media(args.outbound, args.encrypt_edges),
            secret,
        ),
        lifeline_fd=args.lifeline_fd,
        worker=worker,
        stop_s=args.stop_ms / 1000.0,
        trace=trace,
        warm=args.warm,
        trace_file=args.trace_file,
        heartbeat_s=args.heartbeat_ms / 1000.0 if args.heartbeat_ms > 0 else None,
    )
    signal.signal(signal.SIGTERM, lambda *_: stage.notice_loss("SIGTERM"))
    log.info("started (run %s)", args.run_label)
    try:
        code = stage.run()
    finally:
        if args.trace_file is not None:
            with contextlib.suppress(OSError):
                trace.write(args.trace_file)
    log.info("exiting with status %d", code)
    return code


def exit_now(status: int) -> None:
    """Leave at once: the run's resources are freed, and tearing the interpreter down
    (NumPy, mapped weights) would only delay the end of file the orchestrator waits on."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_now(main())
