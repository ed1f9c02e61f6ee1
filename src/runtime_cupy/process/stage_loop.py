"""The loop of a stage process (``stage_process`` is its entry, ``python -m
runtime_cupy.process.stage_process``).

``StageProcess`` runs one ``ChainStageController`` (CONCURRENT_RUNS.md: a stage machine
per run it holds, the chain's worker with a KV cache per run, the chain's two links,
the batch scheduler) in a single-threaded event loop that waits, with a bound, on what
its control channel and its two links hand it (``poller.Watch``: the channel's socket;
a FIFO or a socket per link, as the medium says; a wake-up pipe) and on each run's
timers; then runs setup, batches, publishing and release when the controller asks for
them. It knows no medium and no host: whoever starts it hands it its channel, its links
(``edges.links.ProcessLinks``, named from the chain's id) and, if it has one, a
lifeline.

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

The orchestrator's loss: ``stage_loss`` (``OrchestratorLoss``, a base of
``StageProcess``); the trace and logs: ``stage_traces`` (``StageTraces``, the other).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from pathlib import Path

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
from runtime_core.threads import start_thread
from runtime_core.workers.interface import Worker
from runtime_cupy.edges.links import ProcessLinks
from runtime_cupy.edges.port import EdgeMedium
from runtime_cupy.process.backoff import Backoff
from runtime_cupy.process.control_channel import (
    ChannelBroken,
    ControlChannel,
    Heartbeat,
    Incoming,
    Unreadable,
)
from runtime_cupy.process.keys import chain_id, control_key
from runtime_cupy.process.names import run_label
from runtime_cupy.process.poller import IN, OUT, TROUBLE, Entry, Watch
from runtime_cupy.process.ring_wait import RingWait
from runtime_cupy.process.stage_loss import EXIT_LOST, EXIT_STOPPED, OrchestratorLoss
from runtime_cupy.process.stage_traces import StageTraces
from runtime_cupy.process.timers import RunDeadlines
from runtime_cupy.process.tracing import TraceLog, now_us

IDLE_WAKE_S = 1.0  # wake at least this often (parent check)

# The stage process's: its log lines keep their logger.
log = logging.getLogger("runtime_cupy.process.stage_process")

#: ``media(name, encrypt)``: how an edge of the stage moves bytes (by default, on this
#: machine); ``encrypt``: TCP frames encrypted, not only authenticated.
MakeMedium = Callable[[str, bool], EdgeMedium]
#: ``secrets()``: the next chain's secret, as the stage's host hands it (``BadSecret``,
#: ``OSError`` when none comes).
NextSecret = Callable[[], bytes]


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


class StageProcess(StageTraces, OrchestratorLoss):
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
        # provision says it): a stage frees every hop if the orchestrator is lost.
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
        self._attach = Backoff()  # tries to attach to the neighbours' rings
        self._output_wait = RingWait()  # for an outbound slot
        self._setup_at = 0  # now_us() when setup began, then when its last part ended
        self._bound = False  # the worker bound the chain's weights
        self._held_when_lost = False
        self._place_when_lost: tuple[int, int] | None = None
        self._batch: list[tuple[str, int, int]] = []  # the last batch's steps
        self._waiter = Watch()
        self._control_poll = select.poll()  # the control channel, read without waiting

    # -- joining a new chain ----------------------------------------------------------
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

    # -- the loop --------------------------------------------------------------------
    def run(self) -> int:
        """The loop, to its exit status; ``ThreadUnavailable`` where its watchdog or
        heartbeat thread cannot be started (its channel closed, nothing of the chain's
        made yet)."""
        heartbeat = None
        try:
            if self.lifeline_fd is not None:
                watchdog = threading.Thread(target=self._watch, name="lifeline", daemon=True)
                start_thread(watchdog, "the stage's lifeline watchdog thread")
            if self.heartbeat_s is not None:
                heartbeat = Heartbeat(self.channel, self.heartbeat_s).start()
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
                if self._attach.due(now):
                    if c.try_attach_links():
                        self._attach.succeeded()
                        progress = True
                    else:
                        self._attach.failed(now)
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
                    self._output_wait.clear()
                    progress = True
                else:
                    self._bound_output_wait(time.monotonic())
            else:
                self._output_wait.clear()
            if c.release_pending:
                c.run_release()
                progress = True

    def _edge_wait_s(self) -> float:
        chain = self.controller.chain
        return (chain.timeouts.edge_wait_ms if chain is not None else 10_000) / 1000.0

    def _bound_output_wait(self, now: float) -> None:
        """A full outbound ring is backpressure, for one wait of at most the edge wait
        bound, begun again by every output written."""
        bound = self._edge_wait_s()
        if self._output_wait.refused(now, self.controller.records_published, bound):
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
        if c.links_pending and self._attach.at < until:
            until = self._attach.at
        if self._output_wait.since is not None:
            until = min(until, self._output_wait.since + self._edge_wait_s())
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
