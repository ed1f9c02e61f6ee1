"""A chain of runs in one process, through the chain controllers: one
``ChainStageController`` per stage over any workers, a ``ChainOrchestrator``, the
chain's links in memory (``LocalLinks``), control messages through ``runplan.wire``,
and timers a test fires itself. ``pump()`` runs everything that can run, in one
thread, until nothing more can (deterministic: the same calls give the same
interleaving). Faults enter through the ports: a worker wrapper, a record written on a
link (``forge``), a stage's death (``kill``), a cancelled run."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from runplan import RunPlan, wire
from runplan.fsm import orchestrator as ofsm
from runplan.fsm import stage as sfsm
from runplan.plan import ObjectKind
from runplan.record_header import HeaderDType
from runtime_core.chain_orchestrator import ChainOrchestrator, RunHandle
from runtime_core.chain_orchestrator import RunTimerFired as OrchestratorTimerFired
from runtime_core.chain_stage import ChainStageController, RunTimerFired
from runtime_core.links import LinkSender, LocalLinks
from runtime_core.workers.interface import BatchStep, StepFailure, StepResult, Worker, WorkerError

ORCHESTRATOR = "orch"


class ManualTimers:
    """Timers that run out only when a test says so: the running ones, by run."""

    def __init__(self) -> None:
        self.running: dict[tuple[str, Any], int] = {}

    def start(self, run_id: str, timer: Any, ms: int) -> None:
        self.running[(run_id, timer)] = ms

    def cancel(self, run_id: str, timer: Any) -> None:
        self.running.pop((run_id, timer), None)


@attrs.define
class _Outbox:
    """A control channel's messages, as the wire carries them."""

    sender: str
    queue: deque[tuple[str, bytes]]

    def send(self, *args: Any) -> None:
        if len(args) == 2:  # the orchestrator's: (node_id, message)
            node_id, message = args
            self.queue.append((node_id, wire.dumps(message)))
        else:  # a stage's: (message), from its node (what the channel authenticates)
            self.queue.append((self.sender, wire.dumps(args[0])))


class ChainRuns:
    """Stages of one chain (``stage_count``, nodes ``node-0..`` or ``node_ids``) over
    workers from ``make(stage_index)``, and the orchestrator of its runs; its links are
    ``links`` (default: a ``LocalLinks``)."""

    def __init__(
        self,
        stage_count: int,
        make: Callable[[int], Worker],
        *,
        stopped_runs: frozenset[str] = frozenset(),
        node_ids: Sequence[str] = (),
        links: LocalLinks | None = None,
    ) -> None:
        self.node_ids = list(node_ids) or [f"node-{i}" for i in range(stage_count)]
        assert len(self.node_ids) == stage_count, (self.node_ids, stage_count)
        self.links = links if links is not None else LocalLinks()
        self.to_orchestrator: deque[tuple[str, bytes]] = deque()
        self.to_stages: deque[tuple[str, bytes]] = deque()
        self.stage_timers = [ManualTimers() for _ in range(stage_count)]
        self.orchestrator_timers = ManualTimers()
        self.traces: list[tuple[str, str, dict[str, Any]]] = []
        self.workers = [make(i) for i in range(stage_count)]
        self.stages = [
            ChainStageController(
                self.node_ids[i],
                ORCHESTRATOR,
                self.workers[i],
                self.links,
                _Outbox(self.node_ids[i], self.to_orchestrator),
                self.stage_timers[i],
                trace=self._tracer(self.node_ids[i]),
                stopped_runs=stopped_runs,
            )
            for i in range(stage_count)
        ]
        self.alive = [True] * stage_count
        self.paused: set[int] = set()  # stages that do nothing for now (slow ones)
        self.orchestrator = ChainOrchestrator(
            _Outbox(ORCHESTRATOR, self.to_stages),
            self.links,
            self.orchestrator_timers,
            trace=self._tracer(ORCHESTRATOR),
        )
        self.tokens: dict[str, list[tuple[int, int]]] = {}

    def _tracer(self, actor: str) -> Callable[[str, dict[str, Any]], None]:
        def trace(kind: str, fields: dict[str, Any]) -> None:
            self.traces.append((actor, kind, fields))

        return trace

    def of(self, kind: str, actor: str | None = None) -> list[dict[str, Any]]:
        """The trace events of ``kind`` (of ``actor``)."""
        return [f for a, k, f in self.traces if k == kind and actor in (None, a)]

    # -- runs --------------------------------------------------------------------------
    def add(self, plan: RunPlan, prompt: Sequence[int]) -> RunHandle:
        self.tokens[plan.run_id] = []

        def on_token(run_id: str, sequence: int, token_id: int) -> None:
            self.tokens[run_id].append((sequence, token_id))

        return self.orchestrator.add_run(plan, prompt, on_token=on_token)

    def kill(self, stage_index: int, detail: str) -> None:
        """Stage ``stage_index``'s process is gone: it does nothing more, and the
        orchestrator hears of it."""
        self.alive[stage_index] = False
        self.orchestrator.handle(ofsm.StageDied(stage_index, detail))

    def forge(self, hop: int, run_id: str, edge_id: int, sequence: int, rows: int = 1) -> None:
        """A record of ``run_id`` written on hop ``hop``'s ring (by no stage)."""
        ring = self.links.rings[hop]
        kind = ObjectKind.TOKEN if hop == 0 else ObjectKind.ACTIVATION
        stage = self.stages[min(hop, len(self.stages) - 1)]
        hidden = stage.chain.model.hidden_dim if stage.chain is not None else 1
        if kind is ObjectKind.TOKEN:
            dtype, payload = HeaderDType.U32, bytes(4 * rows)
        else:
            dtype, payload = HeaderDType.F32, bytes(4 * hidden * rows)
        sent = LinkSender(ring, kind).try_send(run_id, edge_id, sequence, rows, dtype, payload)
        assert sent, f"hop {hop} is full"

    def fire(self, stage_index: int | None, run_id: str, timer: Any) -> None:
        """A run's timer runs out (on a stage, or the orchestrator's: ``None``)."""
        if stage_index is None:
            self.orchestrator.handle(OrchestratorTimerFired(run_id, timer))
        else:
            self.stages[stage_index].handle(RunTimerFired(run_id, timer))

    # -- the loop ------------------------------------------------------------------------
    def pump(self, max_rounds: int = 100_000) -> None:
        """Run what can run until nothing can."""
        for _ in range(max_rounds):
            if not self._round():
                return
        raise AssertionError(f"the chain still had work after {max_rounds} rounds")

    def _round(self) -> bool:
        busy = False
        while self.to_stages:
            busy = True
            node_id, data = self.to_stages.popleft()
            i = self.node_ids.index(node_id)
            if self.alive[i]:
                self.stages[i].handle(sfsm.Received(ORCHESTRATOR, wire.loads(data)))
        while self.to_orchestrator:
            busy = True
            sender, data = self.to_orchestrator.popleft()
            self.orchestrator.handle(ofsm.Received(sender, wire.loads(data)))
        o = self.orchestrator
        if o.links_pending:
            busy = o.try_open_links() or busy
        if o.inject_pending:
            busy = o.try_inject() or busy
        while o.wants_tokens and o.poll_tokens():
            busy = True
        for i, stage in enumerate(self.stages):
            if not self.alive[i] or i in self.paused:
                continue
            if stage.setup_pending:
                stage.run_setup()
                busy = True
            if stage.links_pending:
                busy = stage.try_attach_links() or busy
            while stage.wants_input and stage.poll_inbound():
                busy = True
            if stage.batch_ready:
                stage.run_batch()
                busy = True
            if stage.output_pending:
                busy = stage.try_publish_outputs() or busy
            if stage.release_pending:
                stage.run_release()
                busy = True
        return busy


class FailingWorker:
    """A worker whose batch fails, for one run's step (``StepFailure``) or as a whole
    (an exception)."""

    def __init__(self, inner: Worker, fail: Callable[[BatchStep], str | None]) -> None:
        self.inner = inner
        self.fail = fail

    def execute_batch(self, steps: Sequence[BatchStep]) -> tuple[StepResult, ...]:
        for step in steps:
            what = self.fail(step)
            if what == "crash":
                raise WorkerError("the device is gone")
        results = self.inner.execute_batch(steps)
        return tuple(
            StepFailure("injected") if self.fail(s) == "run" else r
            for s, r in zip(steps, results, strict=True)
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Clock:
    """Time of a chain whose stages run in parallel, in rounds of ``ChainRuns._round``:
    a round begins at ``now_ms``; a stage's batch in it ends ``busy[stage]`` ms later
    (``TimedWorker``); ``tick()`` ends the round when its longest batch ends."""

    def __init__(self) -> None:
        self.now_ms = 0
        self.busy: dict[int, int] = {}

    def at(self, stage_index: int | None) -> int:
        """The time on a stage (after its batch of this round), or the orchestrator's."""
        return self.now_ms + (self.busy.get(stage_index, 0) if stage_index is not None else 0)

    def tick(self) -> None:
        self.now_ms += max(self.busy.values(), default=0)
        self.busy.clear()


class ClockTimers:
    """Timers of a stage (or the orchestrator: ``None``) against a ``Clock``: each one
    cancelled later than its limit is an overrun (the timer would have run out first),
    kept as ``(run_id, timer, limit, elapsed)`` (``measured``: every one cancelled)."""

    def __init__(self, clock: Clock, stage_index: int | None) -> None:
        self.clock = clock
        self.stage_index = stage_index
        self.running: dict[tuple[str, Any], tuple[int, int]] = {}
        self.measured: list[tuple[str, Any, int, int]] = []
        self.overruns: list[tuple[str, Any, int, int]] = []

    def start(self, run_id: str, timer: Any, ms: int) -> None:
        self.running[(run_id, timer)] = (self.clock.at(self.stage_index), ms)

    def cancel(self, run_id: str, timer: Any) -> None:
        started = self.running.pop((run_id, timer), None)
        if started is not None:
            elapsed = self.clock.at(self.stage_index) - started[0]
            self.measured.append((run_id, timer, started[1], elapsed))
            if elapsed > started[1]:
                self.overruns.append((run_id, timer, started[1], elapsed))


class TimedWorker:
    """Stage ``stage_index``'s worker, whose every batch takes ``took(rows)`` ms of
    ``clock``, its rows being every step's rows together."""

    def __init__(
        self, inner: Worker, clock: Clock, stage_index: int, took: Callable[[int], int]
    ) -> None:
        self.inner = inner
        self.clock = clock
        self.stage_index = stage_index
        self.took = took

    def execute_batch(self, steps: Sequence[BatchStep]) -> tuple[StepResult, ...]:
        rows = sum(s.data.shape[0] for s in steps)
        self.clock.busy[self.stage_index] = self.took(rows)
        return tuple(self.inner.execute_batch(steps))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
