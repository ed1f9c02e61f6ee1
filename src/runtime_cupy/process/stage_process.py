"""One stage process: ``python -m runtime_cupy.process.stage_process ...``, started by the
local-process host (``hosts.local``) or a cluster host's supervisor.

``StageProcess`` runs one ``ChainStageController`` (CONCURRENT_RUNS.md: a stage machine
per run it holds, the chain's worker with a KV cache per run, the chain's two links,
the batch scheduler) in a single-threaded event loop that waits, with a bound, on what
its control channel and its two links hand it (``poller.Watch``: the channel's socket;
a FIFO or a socket per link, as the medium says; a wake-up pipe) and on each run's
timers; then runs setup, batches, publishing and release when the controller asks for
them. It knows no medium and no host: whoever starts it hands it its channel, its links
(``edges.links.ProcessLinks``, named from the chain's id) and, if it has one, a
lifeline.

``main`` is the local host's side of a stage process: the chain's secret arrives as one
hex line on standard input (the chain's id is derived from it, ``keys.chain_id``); the
control channel is an inherited socket (``--control-fd``); a second inherited
descriptor, the read end of a pipe whose write end only the orchestrator holds
(``--lifeline-fd``), reaches end of file the moment the orchestrator's process is
gone, however it went. Either one closing is ``OrchestratorLost`` for every run held:
the stage stops them and ends, sending nothing more (an orchestrator still there, as
when a Ray stage's supervisor died, sees a lost stage and may recover from it); it logs
the loss once, naming what closed (which lifeline: the pid holding its write end), since
when, and when the orchestrator was last heard from. A
watchdog thread waits on the lifeline; if the loop has not finished ``--stop-ms`` after
the loss (a batch that runs on), it removes the chain's resources this stage owns and
exits.

Resources. The stage makes its inbound link's ring once, when the first run comes
(EDGES_AND_WORKERS.md §3), and frees it when it ends, never its outbound link, which
belongs to the next stage. Only when the orchestrator is lost does the last stage also
free token-out, whose owner is gone; so a chain whose orchestrator was killed leaves
nothing behind. SIGINT is ignored (Ctrl-C is the orchestrator's to handle); SIGTERM
and SIGHUP (its terminal gone with the orchestrator) stop the stage as a lost
orchestrator does.

Every stage serves runs until its control channel closes: several at once, one after
another (a run's id stays stale once it stopped). Its worker binds the weights once for
the chain (a later run's trace has a ``weights reused`` instant where the first has a
``bind`` span). A stage told to join a new chain (``JoinChain``: its chain was re-placed
around it, issue 25) takes the new chain's secret from its host (``secrets``: a local
stage reads it as one more hex line on its standard input, which stays open for it),
lets go of the old chain's links (freeing the hop it made) and makes the new chain's,
named and keyed from the new secret; its worker keeps its weights. With
``--trace-file`` the trace events are written when each run ends, before its
``StageStopped``, and at the end.

Heartbeats. From the start of its loop to its end a stage beats on its control channel
from a thread of its own (``control_channel.Heartbeat``, every quarter of
``--heartbeat-ms``), whatever its loop does: a stage whose orchestrator hears nothing
for that long is stopped or hung, never merely busy.

Exit status: 0 after the channel closed while no run was held, 3 after the
orchestrator was lost while runs were held, 2 on bad usage.
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
from runplan.messages import (
    FaultKind,
    FaultReason,
    JoinChain,
    ProvisionRefused,
    StageFault,
    StageReady,
    StageStopped,
)
from runtime_core.chain_stage import ChainStageController, RunTimerFired
from runtime_core.workers.interface import BatchStep, Progress, TraceEvent, Worker, WorkerError
from runtime_core.workers.kept_weights import KeepsWeights
from runtime_cupy.edges.links import ProcessLinks
from runtime_cupy.edges.port import MEDIA, EdgeMedium
from runtime_cupy.hosts.local import local_medium
from runtime_cupy.process.control_channel import (
    ChannelBroken,
    ControlChannel,
    Heartbeat,
    Incoming,
    Unreadable,
)
from runtime_cupy.process.keys import BadSecret, chain_id, control_key, parse_secret, slice_key
from runtime_cupy.process.names import run_label
from runtime_cupy.process.poller import IN, OUT, TROUBLE, Entry, Watch
from runtime_cupy.process.timers import RunDeadlines
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
#: ``secrets()``: the next chain's secret, as the stage's host hands it (``BadSecret``,
#: ``OSError`` when none comes).
NextSecret = Callable[[], bytes]
#: How long a stage told to join a new chain waits for its secret from its host.
SECRET_WAIT_S = 10.0


class NoSecret(OSError):
    """The host handed the stage no secret (in time, or at all)."""


def secret_lines(fd: int, timeout_s: float = SECRET_WAIT_S) -> NextSecret:
    """The secrets a local host writes on descriptor ``fd`` (the stage's standard
    input), one hex line each, the first at the start; each read waits at most
    ``timeout_s``."""
    pending = bytearray()

    def next_secret() -> bytes:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise NoSecret(f"no secret from the host within {timeout_s:.0f} s")
            chunk = os.read(fd, 4096)
            if not chunk:  # closed: what came is the last line (BadSecret says what)
                line, pending[:] = bytes(pending), b""
                return parse_secret(line.decode("ascii", "replace"))
            pending.extend(chunk)
        line, _, rest = bytes(pending).partition(b"\n")
        pending[:] = rest
        return parse_secret(line.decode("ascii", "replace"))

    return next_secret


class UnavailableWorker:
    """Stands in for a worker this process cannot load: configuring it fails, so each
    run's setup faults naming the reason instead of the stage dying."""

    capabilities: ClassVar[WorkerCapabilities] = WorkerCapabilities()
    kv_reserved_bytes = 0

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def configure(self, provision: ProvisionStage) -> None:
        raise WorkerError(self.reason)

    def bind(self, gguf_source: GgufSource, progress: Progress | None = None) -> None:
        raise WorkerError(self.reason)

    def execute_step(self, sequence: int, data: Any) -> Any:
        raise WorkerError(self.reason)

    def open_run(self, provision: ProvisionStage) -> None:
        raise WorkerError(self.reason)

    def execute_batch(self, steps: Sequence[BatchStep]) -> tuple[Any, ...]:
        raise WorkerError(self.reason)

    def close_run(self, run_id: str) -> None:
        pass

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
        stage.trace.instant(f"send {type(message).__name__}", run=run_label(message.run_id))
        # A stage's fault is the orchestrator's to report (and during teardown, a link
        # closed by a neighbour that stopped first is expected): logged at INFO here.
        detail = f": {message.reason}" if isinstance(message, StageFault) else ""
        log.info("send %s (run %s)%s", type(message).__name__, run_label(message.run_id), detail)
        if isinstance(message, StageStopped):
            stage.run_ended()  # the run's trace is whole before the orchestrator hears
        if stage.channel.eof:
            return
        if stage.lost is not None:
            # The stage took its orchestrator for lost (its lifeline closed, SIGTERM,
            # its frame unreadable): it says nothing more, and ends. An orchestrator that
            # is still there (a Ray stage whose supervisor died, a stage terminated by
            # another hand) sees the stage go as a stage lost, which it may recover from,
            # not a stage that stopped its runs unasked (a protocol violation).
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
        stage_count: int | None = None,
        orchestrator_id: str,
        channel: ControlChannel,
        links: ProcessLinks,
        worker: Worker,
        stop_s: float,
        trace: TraceLog,
        lifeline_fd: int | None = None,
        trace_file: Path | None = None,
        heartbeat_s: float | None = None,
        secrets: NextSecret | None = None,
        media: MakeMedium | None = None,
        encrypt_edges: bool = False,
    ) -> None:
        # ``trace_file``: where the stage writes its trace events when each run ends.
        # ``heartbeat_s``: the orchestrator's bound on this stage's silence (``None``:
        # no heartbeats, for a caller that watches the stage otherwise).
        # ``stage_count``: the chain's length when the launcher said it (else known once a
        # provision says it): the last stage frees token-out if the orchestrator is lost.
        # ``secrets`` and ``media``: the next chain's secret from the host and the links'
        # media, for a stage that may join a new chain (``JoinChain``; without them it
        # refuses to).
        self.stage_index = stage_index
        self.stage_count = stage_count
        self.heartbeat_s = heartbeat_s
        self.trace_file = trace_file
        self.worker = worker
        self.channel = channel
        self.channel_broken = False
        self.lifeline_fd = lifeline_fd
        self.stop_s = stop_s
        self.trace = trace
        self.parent_pid = os.getppid()
        self.links = links
        self.secrets = secrets
        self.media = media
        self.encrypt_edges = encrypt_edges
        self.timers: RunDeadlines[fsm.Timer] = RunDeadlines()
        joins = self._join if secrets is not None and media is not None else None
        self.controller = ChainStageController(
            node_id,
            orchestrator_id,
            worker,
            links,
            _Reporter(self),
            self.timers,
            trace=self._on_trace,
            joins=joins,
        )
        self.lost: str | None = None
        self._lost_flag = threading.Event()  # set by the watchdog or a signal
        self._lost_why = "the orchestrator's process is gone"
        self._lost_since: tuple[float, float] | None = None  # (wall, monotonic) first noticed
        self._done = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._attach_at = 0.0
        self._output_since: float | None = None
        self._setup_at = 0  # now_us() when setup began, then when its last part ended
        self._bound = False  # the worker bound the chain's weights
        self._held_when_lost = False
        self._place_when_lost: tuple[int, int] | None = None
        self._batch: list[tuple[str, int, int]] = []  # the last batch's steps
        self._waiter = Watch()
        self._control_poll = select.poll()  # the control channel, read without waiting

    # -- trace and logs --------------------------------------------------------------
    def _on_trace(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "batch":
            self._batch = list(
                zip(fields["runs"], fields["sequences"], fields["step_rows"], strict=True)
            )
            if log.isEnabledFor(logging.INFO):
                for run_id, sequence, rows in self._batch:
                    label = run_label(run_id)
                    log.info("step %d begins (run %s, %d rows)", sequence, label, rows)
        if kind in ("loaded", "published", "batch"):
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s %s", kind, fields)
            if self.trace.enabled:
                self.trace.instant(kind, **fields)
        elif kind == "state":
            log.info(
                "run %s: %s -> %s (%s)",
                run_label(fields["run_id"]) if fields["run_id"] else "?",
                fields["from"],
                fields["to"],
                fields["event"],
            )
            if self.trace.enabled:
                self.trace.instant(f"state {fields['to']}", event=fields["event"])
        elif kind == "reject":
            log.warning(
                "rejected from %r: %s: %s",
                fields.get("sender", ""),
                fields["reason"],
                fields.get("detail", ""),
            )
            self.trace.instant("reject", **{k: str(v) for k, v in fields.items()})
        elif kind == "protocol_violation":
            log.warning("protocol violation: %s in %s", fields["kind"], fields["state"])
        elif kind == "setup_done":
            self._setup_part_done(fields["part"])
        elif kind == "chain_fault":
            log.warning("chain fault: %s", fields["reason"])
            self.trace.instant("chain fault", reason=fields["reason"])
        else:
            log.info("%s %s", kind, fields)

    def _join(self, join: JoinChain) -> ProcessLinks:
        """The controller's ``joins`` port: the new chain's links, from the secret the
        host hands this stage now; the old chain's links let go (the hop this stage made
        freed)."""
        assert self.secrets is not None and self.media is not None
        secret = self.secrets()  # BadSecret, NoSecret: the controller reports it
        # the control channel's key too, the new secret's from the frame after JoinChain
        # on (the orchestrator's end has changed already)
        self.channel.rekey(control_key(secret, self.channel.local_id))
        links = ProcessLinks(
            self.media(join.inbound_medium, self.encrypt_edges),
            self.media(join.outbound_medium, self.encrypt_edges),
            secret,
            chain_id(secret),
        )
        old, self.links = self.links, links
        old.remove_inbound()
        old.detach()
        self._waiter.forget()
        self.stage_index, self.stage_count = join.stage_index, join.stage_count
        log.info(
            "joined chain generation %d as stage %d of %d (weights kept)",
            join.generation,
            join.stage_index,
            join.stage_count,
        )
        self.trace.instant("joined chain", generation=join.generation)
        return links

    def _setup_part_done(self, part: str) -> None:
        """Time each part of setup; the shard is a ``bind`` span only when the worker
        read weights (the chain's later runs reuse them)."""
        start, self._setup_at = self._setup_at, now_us()
        if part == fsm.SetupPart.SHARD.value:
            worker = self.worker
            if self._bound or (isinstance(worker, KeepsWeights) and worker.weights_reused):
                log.info("weights reused")
                self.trace.instant("weights reused")
            else:
                log.info("bound weights in %.3f s", (self._setup_at - start) / 1e6)
                self.trace.span("bind", start)
            self._bound = True
        elif self.trace.enabled:
            self.trace.span(part.lower(), start)

    def run_ended(self) -> None:
        """A run is over (its StageStopped about to leave): the trace events so far are
        written now, for the orchestrator to read once it hears."""
        if self.trace.enabled and self.trace_file is not None:
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
                if self.lost is not None and not self.controller.runs:
                    return EXIT_LOST if self._held_when_lost else EXIT_STOPPED
                self._wait()
        finally:
            self._done.set()
            if heartbeat is not None:
                heartbeat.stop()
            self._remove_resources()  # while the controller still knows the chain's length
            with contextlib.suppress(Exception):
                self.controller.close()
            self.links.detach()
            self.channel.close()  # what waits to leave (StageStopped) goes first, bounded

    def _check_lost(self) -> None:
        if self._lost_flag.is_set() and self.lost is None:
            # What the orchestrator wrote before it went (a provision, say) is still in
            # the socket: read it first, so that the stage knows what it holds.
            self._drain_control()
            self._lose(self._lost_why)
        if self.channel_broken:
            self._lose("the control channel broke")

    def _lose(self, why: str) -> None:
        if self.lost is not None:
            return
        self.lost = why
        self._held_when_lost = bool(self.controller.runs)
        # Before the runs go (a run's provision may be all that says the chain's length).
        self._place_when_lost = self._place()
        # Said once: the loop loses its orchestrator once, whatever closes after.
        if self._held_when_lost:
            log.warning("orchestrator lost (%s): stopping its runs", self._loss_detail(why))
        else:
            log.info("the chain closed (%s): exiting", self._loss_detail(why))
        self.trace.instant("orchestrator lost", why=why)
        self.controller.handle(fsm.OrchestratorLost())

    def _pump(self) -> None:
        """Everything the controller can do now, until it can do nothing more. Before
        each turn, the control messages already come are read: a stage that has a
        batch to run after every batch (runs decoding at once) still reads a
        ``StopRun`` or a provision after the worker call in progress, not once its
        runs go idle (``Timeouts.stop_limit_ms``)."""
        c = self.controller
        tracing = self.trace.enabled
        progress = True
        while progress:
            progress = False
            self._drain_control()
            if c.setup_pending:
                start = self._setup_at = now_us()
                log.info("setup begins (%d runs held)", len(c.runs))
                c.run_setup()
                self.trace.span("setup", start)
                progress = True
            if c.links_pending:
                now = time.monotonic()
                if now >= self._attach_at:
                    if c.try_attach_links():
                        progress = True
                    else:
                        self._attach_at = now + ATTACH_RETRY_S
            while c.wants_input and c.poll_inbound():
                progress = True
            if c.batch_ready:
                start = now_us() if tracing else 0
                batches = c.batches
                c.run_batch()
                if tracing and c.batches > batches:
                    self.trace.span("batch", start, rows=c.last_batch_rows, runs=len(self._batch))
                    for run_id, sequence, rows in self._batch:  # each step ran in it
                        label = run_label(run_id)
                        self.trace.span(f"step {sequence}", start, run=label, rows=rows)
                if c.batches > batches:
                    log.debug("batch %d: %d rows", c.batches, c.last_batch_rows)
                progress = True
            if c.output_pending:
                if c.try_publish_outputs():
                    self._output_since = None
                    progress = True
                else:
                    self._bound_output_wait(time.monotonic())
            else:
                self._output_since = None
            if c.release_pending:
                c.run_release()
                progress = True

    def _edge_wait_s(self) -> float:
        chain = self.controller.chain
        return (chain.timeouts.edge_wait_ms if chain is not None else 10_000) / 1000.0

    def _bound_output_wait(self, now: float) -> None:
        """A full outbound ring is backpressure, for at most the edge wait bound."""
        if self._output_since is None:
            self._output_since = now
            return
        bound = self._edge_wait_s()
        if now - self._output_since > bound:
            self._output_since = None
            self.controller.output_stuck(int(bound * 1000))

    def _wait(self) -> None:
        c = self.controller
        channel = self.channel
        entries: tuple[Entry, ...] = (
            (self._wake_r, IN),
            *channel.watch(),
            *self.links.watch(want_input=c.wants_input, want_space=c.output_pending),
        )
        now = time.monotonic()
        until = now + IDLE_WAKE_S
        due = self.timers.next_due()
        if due is not None and due < until:
            until = due
        if c.links_pending and self._attach_at < until:
            until = self._attach_at
        if self._output_since is not None:
            until = min(until, self._output_since + self._edge_wait_s())
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
                self.links.ready(fd, events)
        for run_id, timer in self.timers.expired(time.monotonic()):
            log.warning("run %s: timer %s ran out", run_label(run_id), timer.name)
            c.handle(RunTimerFired(run_id, timer))

    def _flush_control(self) -> None:
        try:
            self.channel.flush()
        except ChannelBroken as exc:
            log.warning("cannot reach the orchestrator: %s", exc)
            self.channel_broken = True

    def _drain_control(self) -> None:
        """Read what the control channel holds now, without waiting."""
        if self.channel.eof or self.channel.fileno() < 0:
            return
        self._control_poll.register(self.channel.fileno(), select.POLLIN)
        while not self.channel.eof and self._control_poll.poll(0):
            self._read_control()

    def _read_control(self) -> None:
        items = self.channel.receive()
        while items:
            joining = self.channel.rekey_due  # the items end with a JoinChain
            for item in items:
                if isinstance(item, Incoming):
                    log.info("received %s from %r", type(item.message).__name__, item.sender)
                    self.trace.instant(f"recv {type(item.message).__name__}", sender=item.sender)
                    self.controller.handle(fsm.Received(item.sender, item.message))
                elif isinstance(item, Unreadable):  # signed by the orchestrator: no stranger
                    log.error("cannot read the orchestrator's frame: %s", item.reason)
                    # A protocol fault, not a lost stage: the runs it holds end naming it
                    # (heard before the channel closes), so that a recovery does not
                    # re-place a stage that would read the next frame no better.
                    detail = f"the orchestrator's frame could not be read ({item.reason})"
                    self.controller.chain_fault(FaultReason(FaultKind.PROTOCOL_VIOLATION, detail))
                    self._lose(f"its frame could not be read ({item.reason})")
                else:
                    log.warning("refused a control frame: %s", item.reason)
                    self.trace.instant("refused frame", reason=item.reason)
            if not joining:
                break
            # the channel decoded nothing after the JoinChain: _join re-keyed it, or the
            # stage could not join and the old key goes on; then what came after it
            if self.channel.rekey_due:
                self.channel.keep_key()
            items = self.channel.buffered()
        if self.channel.eof:
            self._lose("the control channel closed")

    # -- the orchestrator's death -------------------------------------------------------------
    def _watch(self) -> None:
        """Wait on the lifeline; once it ends, wake the loop, and exit if the loop has not
        finished within the stop bound (a batch that runs on)."""
        assert self.lifeline_fd is not None
        with contextlib.suppress(OSError):
            while os.read(self.lifeline_fd, 1):
                pass
        if self._done.is_set():
            return
        self.notice_loss(self._lifeline_closed())
        if self._done.wait(self.stop_s):
            return
        if self.lost is None:  # the loop never got to say it (a batch that runs on)
            why = self._loss_detail(self._lost_why)
            log.error("orchestrator lost (%s), not stopped within %.1f s: exiting now",
                      why, self.stop_s)  # fmt: skip
        else:
            log.error("not stopped within %.1f s of the loss: exiting now", self.stop_s)
        self._remove_resources()
        with contextlib.suppress(Exception):
            logging.shutdown()
        os._exit(EXIT_LOST)

    def _lifeline_closed(self) -> str:
        """Which lifeline closed: its write end is held by the process that started this
        stage (the orchestrator on one host, the stage's supervisor on a Ray host)."""
        return f"its lifeline closed (its write end held by pid {self.parent_pid})"

    def _loss_detail(self, why: str) -> str:
        """``why``, since when (the first notice of the loss, local time) and when the
        orchestrator was last heard from before it."""
        if self._lost_since is None:  # the channel's end, seen by the loop itself
            self._lost_since = (time.time(), time.monotonic())
        wall, mono = self._lost_since
        since = time.strftime("%H:%M:%S", time.localtime(wall)) + f".{int(wall * 1000) % 1000:03d}"
        heard = self.channel.heard_s
        last = (
            "nothing heard from it before"
            if heard is None
            else f"last heard from it {max(0.0, mono - heard):.1f} s before"
        )
        return f"{why}; since {since}, {last}"

    def notice_loss(self, why: str) -> None:
        """From another thread or a signal handler: the loop stops at its next turn."""
        if self._lost_since is None:
            self._lost_since = (time.time(), time.monotonic())
        self._lost_why = why
        self._lost_flag.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"!")

    def _remove_resources(self) -> None:
        """Free what this stage owns: its inbound link's resources on this host, and, if
        the orchestrator is lost and this is the last stage, token-out's (idempotent,
        any thread)."""
        links = self.links
        links.remove_inbound()
        place = self._place()
        if (self.lost is not None or self._lost_flag.is_set()) and place is not None:
            index, count = place
            if index == count - 1:
                links.remove_hops((count,))

    def _place(self) -> tuple[int, int] | None:
        """This stage's index and the chain's stage count, as the launcher said them, else
        once a provision said them (any thread)."""
        if self.stage_count is not None:
            return self.stage_index, self.stage_count
        if self._place_when_lost is not None:
            return self._place_when_lost
        c = self.controller
        known = c.chain or next(
            (s.provision for s in list(c.runs.values()) if s.provision is not None), None
        )
        return None if known is None else (known.stage_index, known.stage_count)


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
    p.add_argument(
        "--stage-count",
        type=int,
        default=None,
        help="the chain's stages (the last stage frees token-out if the orchestrator is lost)",
    )
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
        help="encrypt the frames of TCP edges (AES-256-GCM), not only authenticate them, "
        "and ask for the slice (--slice-server) encrypted",
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
        help="accepted for older launchers: every stage serves runs (several at once, one "
        "after another, keeping its bound weights) until its control channel closes",
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
    secrets = secret_lines(sys.stdin.fileno())  # the first now, a new chain's later
    try:
        secret = secrets()
    except (BadSecret, NoSecret) as exc:
        log.error("%s", exc)
        return EXIT_USAGE
    sock = socket.socket(fileno=args.control_fd)
    key = control_key(secret, args.node_id)
    channel = ControlChannel(sock, key, args.node_id, args.orchestrator_id)
    trace = TraceLog(args.node_id, enabled=args.trace_file is not None)
    worker: Worker
    try:
        worker = make(args.worker, trace.instant if trace.enabled else None)
    except WorkerUnavailable as exc:
        log.error("%s", exc)
        worker = UnavailableWorker(str(exc))
    if args.slice_server is not None:
        origin = SliceOrigin(args.slice_server, args.slice_source_key or "")
        key = slice_key(secret, args.node_id)
        fetcher = SliceFetcher(origin, args.stage_index, key, encrypt=args.encrypt_edges)
        worker = sliced(worker, fetcher)
    stage = StageProcess(
        stage_index=args.stage_index,
        stage_count=args.stage_count,
        node_id=args.node_id,
        orchestrator_id=args.orchestrator_id,
        channel=channel,
        links=ProcessLinks(
            media(args.inbound, args.encrypt_edges),
            media(args.outbound, args.encrypt_edges),
            secret,
            chain_id(secret),
        ),
        lifeline_fd=args.lifeline_fd,
        worker=worker,
        stop_s=args.stop_ms / 1000.0,
        trace=trace,
        trace_file=args.trace_file,
        heartbeat_s=args.heartbeat_ms / 1000.0 if args.heartbeat_ms > 0 else None,
        secrets=secrets,
        media=media,
        encrypt_edges=args.encrypt_edges,
    )
    # SIGTERM, and SIGHUP (the terminal of the session it was started from went away,
    # with its orchestrator), stop the stage as a lost orchestrator does: its resources
    # freed, not left behind by the signal's default.
    for lost in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(lost, lambda number, _: stage.notice_loss(signal.Signals(number).name))
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
