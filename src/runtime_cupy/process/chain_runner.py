"""The chain runner: the stages of one chain, started once, and the orchestrator of
every run on it (CONCURRENT_RUNS.md), in one event loop.

``ChainRunner(template, ...)`` starts every stage of ``template``'s layout through a
``StageHost`` (by default ``hosts.local.LocalProcessHost``: one OS process per stage),
each with its control channel and the chain's secret (from which every party derives
the chain's id, ``keys.chain_id``, that names the chain's links: one per hop,
``edges.links``). ``loop()`` then drives ``ChainOrchestrator``: it waits, with a bound,
on the stages' control channels, its two token links and a wake-up pipe, and on each
run's timers. Runs are handed in from any thread (``submit``: a ``ChainRun`` whose
tokens go to its ``on_token`` as they come and whose ``wait()`` gives its outcome;
``ChainRun.cancel``), through a lock-guarded queue and a byte on the wake-up pipe; the
loop adds them at its next turn, so a run joins the stages' batches at their next step
and leaves when it ends.

The caller's handle of a run (``ChainRun``, ``RunOutcome``) is ``chain_run``'s; the
stages, started or kept from a re-placed chain and watched, are ``chain_stages``'s
(``ChainStages``, a base of the runner); the runs handed in and back, and those that wait
for KV memory, are ``chain_handoffs``'s (``RunHandoffs``, another base); the close is
``chain_close``'s (``ChainClose``, the third).

Faults. A run's own fault ends that run alone. A stage whose control channel reaches end
of file has died (however it died, SIGKILL included): ``StageDied``, and a stage that
sends nothing, not even a heartbeat, for ``timeouts.heartbeat_ms`` is killed and is
``StageSilent``; either one, or a token link that breaks or stays full past
``edge_wait_ms``, is a fault of the chain: every run in flight ends ``FAULTED`` naming
the stage, its node, its host and the cause, and the chain is ``dead``: its owner makes
a new one (``serve.chain.WarmChain``). ``close()`` (``chain_close``'s) cancels what runs,
waits for the stages' ``StageStopped``, closes the control channels, reaps every stage
(killed after a grace) and frees every resource of the chain's links by name, to its end
however often Ctrl-C breaks into it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from runplan import RunPlan
from runplan.fsm import orchestrator as fsm
from runplan.messages import StageReady
from runplan.plan import EdgePlan, OrchestratorEndpoint
from runtime_core.chain_orchestrator import ChainOrchestrator, RunTimerFired
from runtime_core.kv_waits import KvWaits
from runtime_core.runs import token_ids
from runtime_cupy.edges.choice import choose_medium
from runtime_cupy.edges.links import ProcessLinks
from runtime_cupy.hosts.local import LocalProcessHost
from runtime_cupy.hosts.port import JoinsChains, StageHandle, StageHost
from runtime_cupy.process.backoff import Backoff
from runtime_cupy.process.chain_close import ChainClose
from runtime_cupy.process.chain_handoffs import RunHandoffs
from runtime_cupy.process.chain_run import ChainRun, OnLogits, OnToken
from runtime_cupy.process.chain_stages import ChainStages, RunnerChannels, RunnerStage
from runtime_cupy.process.control_channel import ChannelBroken
from runtime_cupy.process.keys import chain_id, new_secret
from runtime_cupy.process.names import new_run_id, run_label
from runtime_cupy.process.poller import IN, OUT, TROUBLE, Entry, Watch
from runtime_cupy.process.ring_wait import RingWait
from runtime_cupy.process.timers import RunDeadlines
from runtime_cupy.process.tracing import Event, TraceLog

log = logging.getLogger("runtime_cupy.process.chain_runner")

ORCHESTRATOR = "orchestrator"
IDLE_WAKE_S = 0.5  # look at the stage processes at least this often

#: ``on_event(kind, fields)``: what the runner did (spawned, state, injected, ...).
OnEvent = Callable[[str, dict[str, Any]], None]


def ready_stage(kind: str, fields: Mapping[str, Any]) -> int | None:
    """The stage an ``on_event`` says is ready for its run (its ``StageReady``
    received: its slice loaded and bound), else ``None``."""
    message = fields.get("message")
    return message.stage_index if kind == "received" and isinstance(message, StageReady) else None


class ChainRunner(ChainStages, RunHandoffs, ChainClose):
    """The stages of ``template``'s layout (every run on the chain has the same stage
    facts: nodes, layer ranges, GGUF source, cache length, budgets) and the loop of the
    runs on them. ``worker`` is the registry's name of the stages' worker; ``devices[i]``
    the GPU of stage ``i`` on its machine; ``host`` starts the stages; ``edges`` is
    ``auto``, ``shm`` or ``tcp`` (``encrypt_edges``: TCP links encrypt their frames, not
    only authenticate them)."""

    def __init__(
        self,
        template: RunPlan,
        *,
        worker: str = "numpy",
        devices: Sequence[int | None] | None = None,
        host: StageHost | None = None,
        edges: str = "auto",
        encrypt_edges: bool = False,
        trace: bool = False,
        on_event: OnEvent | None = None,
        secret: bytes | None = None,
        kept: Mapping[int, StageHandle] | None = None,
        generation: int = 0,
        run_ids: Callable[[], str] = new_run_id,
    ) -> None:
        # ``kept``: stages of a chain this one replaces, by stage index, that join this
        # chain instead of being started (``hosts.port.JoinsChains`` handles of the same
        # node, index and layers); ``generation``: the chain's re-placements so far.
        self.template = template
        self.kept = dict(kept or {})
        self.generation = generation
        for index, handle in self.kept.items():
            stage = template.stages[index] if 0 <= index < template.stage_count else None
            if (
                stage is None
                or stage.node_id != handle.node_id
                or not isinstance(handle, JoinsChains)
            ):
                raise ValueError(f"stage {index} ({handle.node_id!r}) cannot join this chain")
        self.worker = worker
        self.devices = tuple(devices) if devices is not None else (None,) * template.stage_count
        if len(self.devices) != template.stage_count:
            raise ValueError(f"{len(self.devices)} devices for {template.stage_count} stages")
        self.host: StageHost = host or LocalProcessHost()
        self.encrypt_edges = encrypt_edges
        self.media = {e.edge_id: self._medium(e, edges) for e in template.edges}  # ValueError
        self.secret = secret if secret is not None else new_secret()
        self.chain_id = chain_id(self.secret)
        self.on_event = on_event
        self.trace = TraceLog(ORCHESTRATOR, enabled=trace)
        self._stage_events: list[Event] = []
        self._trace_from = 0  # the orchestrator's events before it were handed out
        self.links = ProcessLinks(
            self.host.medium(self.media[template.token_out.edge_id], encrypt_edges),
            self.host.medium(self.media[template.token_in.edge_id], encrypt_edges),
            self.secret,
            self.chain_id,
        )
        self.timers: RunDeadlines[fsm.Timer] = RunDeadlines()
        self.stages: list[RunnerStage] = []
        self.stage_by_node: dict[str, RunnerStage] = {}
        self.orchestrator = ChainOrchestrator(
            RunnerChannels(self), self.links, self.timers, trace=self._on_trace
        )
        self._lock = threading.Lock()
        self._adds: list[ChainRun] = []
        self._cancels: list[tuple[str, str]] = []
        self._runs: dict[str, ChainRun] = {}  # submitted and not yet ended
        #: Runs refused for KV memory that wait for another run's end (``kv_waits``),
        #: each offered again under a new id from ``run_ids``
        self.kv_waits: KvWaits[ChainRun] = KvWaits(run_ids)
        self._closing = False
        self._abandon = False
        self._over = False  # the loop returned for good: nothing takes a run handed over
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._waiter = Watch()
        self._open = Backoff()  # tries to open the token links
        self._inject_wait = RingWait()  # for a token-in slot
        self.closed = False
        self._closed_steps = set()  # of close() (chain_close): each done once
        self._reaped = set()  # the stages close() reaped, by index
        #: Why the chain cannot serve any more (a chain fault), once it cannot.
        self.dead: str | None = None

    def _medium(self, edge: EdgePlan, preference: str) -> str:
        def node(endpoint: Any) -> str:
            if isinstance(endpoint, OrchestratorEndpoint):
                return self.template.orchestrator_node_id
            return str(endpoint.node_id)

        same = self.host.same_host(node(edge.producer), node(edge.consumer))
        return choose_medium(preference, same, edge.edge_id)

    @property
    def media_names(self) -> tuple[str, ...]:
        """How each edge of the layout moves its bytes, in plan order."""
        return tuple(self.media[e.edge_id] for e in self.template.edges)

    # -- events ----------------------------------------------------------------------------
    def _emit(self, kind: str, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event(kind, fields)

    def _on_trace(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "state":
            run = self._runs.get(str(fields.get("run_id")))
            log.info(
                "run %s: %s -> %s (%s)",
                run_label(str(fields.get("run_id"))),
                fields["from"],
                fields["to"],
                fields["event"],
            )
            if fields["to"] == "RUNNING" and run is not None and run.ready_s is None:
                run.ready_s = time.monotonic()
        elif kind == "reject":
            # a record of a run that has ended (STALE_RUN): one in flight when the run was
            # cancelled or finished, the expected end of a cancel (a chat's Ctrl-C), not
            # an operator's concern; the other refusals are
            stale = fields.get("reason") == "STALE_RUN"
            log.log(
                logging.INFO if stale else logging.WARNING,
                "orchestrator rejected %s",
                {k: str(v) for k, v in fields.items()},
            )
        elif kind == "protocol_violation":
            log.warning(
                "orchestrator protocol violation: %s in %s", fields["kind"], fields["state"]
            )
        elif kind == "chain_fault":
            log.warning("chain fault: %s", fields["reason"])
        if self.trace.enabled:
            self.trace.instant(kind, **{k: str(v) for k, v in fields.items()})
        if self.on_event is not None:
            self.on_event(kind, fields)

    # -- any thread --------------------------------------------------------------------------
    def submit(
        self,
        plan: RunPlan,
        prompt: Sequence[int],
        on_token: OnToken | None = None,
        *,
        on_done: Callable[[ChainRun], None] | None = None,
        on_logits: OnLogits | None = None,
    ) -> ChainRun:
        """Hand a run to the loop (any thread); it starts at the loop's next turn, or
        ends at once refused (``ChainRun.wait`` raises ``PromptError`` or
        ``RunRefused``) or faulted (the chain is dead or closing). ``on_done(run)``
        when it ended (from the loop's thread); ``on_logits`` takes each token's logits
        (a plan that returns them), which the run's outcome then does not hold."""
        ids = token_ids(prompt)  # 5.9 is refused, not run as 5, and True as 1
        run = ChainRun(self, plan, ids, on_token, on_done, on_logits)
        with self._lock:
            late = self._over
            if not late:
                self._adds.append(run)
        if late:
            self._end_late(run)
        else:
            self._wake()
        return run

    def batch_counts(self) -> dict[int, dict[int, int]]:
        """The batches each stage reported so far in its ``StageStopped`` messages:
        stage index -> rows -> batches (any thread; not to be changed)."""
        return self.orchestrator.batch_counts

    def kv_in_use(self) -> tuple[tuple[int, int, int], ...]:
        """Each stage's KV cache held by the runs in flight: ``(stage_index, bytes,
        budget_bytes)`` (any thread)."""
        held = self.orchestrator.kv_reserved()
        return tuple(
            (s.stage_index, held.get(s.stage_index, 0), s.kv_budget_bytes)
            for s in self.template.stages
        )

    @property
    def in_flight(self) -> int:
        """Runs submitted and not yet ended."""
        return len(self._runs) + len(self._adds) + len(self.kv_waits)

    # -- the loop ---------------------------------------------------------------------------
    def loop(self, until: Callable[[], bool] | None = None) -> None:
        """Drive the chain until ``until()`` holds, or until it was asked to close (or is
        dead) and no run is left (in the thread that owns the runner)."""
        o = self.orchestrator
        cancelled_all = False
        with self._lock:
            self._over = False
        while True:
            self._take_handoffs()
            for stage in self.stages:
                if stage.broken is not None and not stage.gone:
                    self._stage_died(stage, stage.broken)
            if self._closing and not cancelled_all:
                cancelled_all = True
                for run_id in list(o.runs):
                    o.cancel(run_id, "the chain is closing")
            now = time.monotonic()
            if o.links_pending and self._open.due(now):
                if o.try_open_links():
                    self._open.succeeded()
                else:
                    self._open.failed(now)
            if o.inject_pending:
                self._inject(now)
            else:
                self._inject_wait.clear()
            while o.wants_tokens and o.poll_tokens():
                pass
            self._end_runs()
            if o.broken is not None and self.dead is None:
                self.dead = str(o.broken)
            if self._closing or self.dead is not None:
                self._end_held()
            if until is not None and until():
                return
            if (self._closing or self.dead is not None) and not self._runs and self._end_loop():
                return
            if self._abandon and self._end_loop(abandon=True):
                return
            self._wait()

    def _inject(self, now: float) -> None:
        """Write what waits for token-in; a full ring is backpressure for one wait
        (``edge_wait_ms``), begun again by every record written."""
        o = self.orchestrator
        if o.try_inject():
            self._inject_wait.clear()
        elif self._inject_wait.refused(now, o.records_sent, self._edge_wait_s):
            o.link_fault("token-in: no free slot in time")

    @property
    def _edge_wait_s(self) -> float:
        return self.template.timeouts.edge_wait_ms / 1000.0

    def _wait(self) -> None:
        o = self.orchestrator
        channels: dict[int, RunnerStage] = {}
        entries: list[Entry] = [(self._wake_r, IN)]
        for stage in self.stages:
            channel = stage.handle.channel
            if not stage.gone and channel.fileno() >= 0:
                mine = channel.watch()
                if mine:
                    channels[channel.fileno()] = stage
                    entries += mine
        entries += self.links.watch(want_input=o.wants_tokens, want_space=o.inject_pending)
        now = time.monotonic()
        until = now + IDLE_WAKE_S
        due = self.timers.next_due()
        if due is not None and due < until:
            until = due
        bound = self.template.timeouts.heartbeat_ms / 1000.0
        for stage in self.stages:
            heard = stage.handle.channel.heard_s
            if not stage.gone and heard is not None:
                until = min(until, heard + bound)
        if o.links_pending:
            until = min(until, self._open.at)
        inject_due = self._inject_wait.due(self._edge_wait_s)
        if inject_due is not None:
            until = min(until, inject_due)
        ready = self._waiter.poll(tuple(entries), (until - now) * 1000.0)
        for fd, events in ready:
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            elif fd in channels:
                stage = channels[fd]
                if events & OUT:
                    try:
                        stage.handle.channel.flush()
                    except ChannelBroken as exc:
                        stage.broken = f"control channel broke ({exc})"
                if events & (IN | TROUBLE):
                    self._read_control(stage)
            else:
                self.links.ready(fd, events)
        for run_id, timer in self.timers.expired(time.monotonic()):
            log.warning("run %s: orchestrator timer %s ran out", run_label(run_id), timer.name)
            if timer is fsm.Timer.READY:  # first: the silent stage is the fault, named
                self._silence_the_unheard()
            o.handle(RunTimerFired(run_id, timer))
        self._check_silence(time.monotonic())  # after reading: what waited was heard
        if not ready:
            for stage in self.stages:  # a stage gone without closing its channel
                if not stage.gone and stage.handle.exited():
                    self._stage_died(stage)

    # -- the end ---------------------------------------------------------------------------
    def trace_events(self) -> list[Event]:
        """The Chrome trace events of the orchestrator and of every stage since the last
        call (the first call's: since the chain started)."""
        if not self.closed:
            for stage in self.stages:
                self._stage_events += stage.handle.trace_events()
        mine, self._trace_from = self.trace.events[self._trace_from :], len(self.trace.events)
        theirs, self._stage_events = self._stage_events, []
        return self.trace.metadata() + mine + theirs
