"""Runs of one chain in one thread on a virtual clock (CONCURRENT_RUNS.md).

Every node runs the real pieces: each stage a ``ChainStageController`` (a stage machine
per run, the batch scheduler, the chain's worker with a KV cache per run), the
orchestrator a ``ChainOrchestrator`` (a machine per run over the chain's token links).
The simulation supplies the environment (``chain_links``: one ring per hop, carrying
every run's records, each arriving a hop after it is published; ``links.Network``:
control messages through ``runplan.wire`` with latency and the plan's message faults;
``chain_nodes``: batches that take the timing model's time for their rows, timers per
run, arrivals, process deaths; ``chain_forgeries``). Everything is traced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from attrs import frozen

from runplan import RunPlan
from runplan.fsm import orchestrator as ofsm
from runplan.fsm import stage as sfsm
from runtime_core.workers.interface import Worker
from runtime_sim.chain_links import ChainRing, SimChainLinks
from runtime_sim.chain_nodes import ChainStageNode, Node, TracedChainStage
from runtime_sim.chain_orchestrator_node import ChainOrchestratorNode, TracedChainOrchestrator
from runtime_sim.clock import Scheduler
from runtime_sim.faults import FaultKind, FaultPlan
from runtime_sim.links import ORCHESTRATOR, Network
from runtime_sim.recoverer import Recoverer
from runtime_sim.timing import StageCost, TimingModel
from runtime_sim.trace import Trace


@frozen
class SimSettings:
    timing: TimingModel = TimingModel()
    control_latency_us: int = 50
    death_notice_us: int = 2_000  # a stage's death reaches the orchestrator
    exit_notice_us: int = 1_000  # the orchestrator's exit reaches a stage
    attach_retry_us: int = 500  # retry attaching to a ring that does not exist yet
    release_us: int = 200  # freeing a run's cache


DEFAULT_SETTINGS = SimSettings()
NO_FAULTS = FaultPlan()


@frozen
class RunSpec:
    """One run of the chain: its plan (run id, sampling, ``max_tokens``, ``prompt_tokens``),
    its prompt, and when its caller asks for it."""

    plan: RunPlan
    prompt: tuple[int, ...]
    arrival_us: int = 0


@frozen
class RunResult:
    """What became of one run, as its caller and the orchestrator saw it."""

    run_id: str
    finished: ofsm.RunFinished | None
    tokens: tuple[int, ...]
    delivered: tuple[tuple[str, int, int], ...]  # (run, sequence, token) its caller got
    logits: tuple[Any, ...]
    refused: str | None  # why the chain would not take it
    arrival_us: int
    ready_us: int | None
    finished_us: int | None
    token_times_us: tuple[int, ...]
    # The run ids it ran under after waiting for KV memory, in turn (``run_id``: the one it
    # arrived with; CONCURRENT_RUNS.md §5).
    offered_as: tuple[str, ...] = ()

    @property
    def last_id(self) -> str:
        """The run id it ended under."""
        return self.offered_as[-1] if self.offered_as else self.run_id

    @property
    def chain_ids(self) -> tuple[str, ...]:
        """Every run id it had on the chain, the first first."""
        return (self.run_id, *self.offered_as)

    @property
    def outcome(self) -> str:
        if self.refused is not None:
            return "refused"
        return self.finished.outcome.value.lower() if self.finished is not None else "unfinished"


@frozen
class ChainResult:
    runs: tuple[RunResult, ...]  # by arrival
    end_us: int
    events: int
    trace: Trace
    alive: tuple[bool, ...]
    held: tuple[tuple[tuple[str, sfsm.State], ...], ...]  # each stage's runs at the end
    kv_reserved: tuple[int, ...]  # each stage's KV bytes still reserved at the end
    batches: tuple[dict[int, int], ...]  # each stage's batches run, by rows (rows -> batches)
    # The orchestrator's count of each stage's batches, from their StageStopped messages.
    batch_counts: dict[int, dict[int, int]]


@frozen
class Parts:
    """The classes a simulation builds its rings, controllers and orchestrator node from,
    and the runner's recovery (``chain_recovery``): the port through which the
    self-test's mutants (``runtime_sim.mutants``) put in subclasses that carry one
    deliberate bug each. ``mutant`` names that bug (``None``:
    the production classes)."""

    ring: type[ChainRing] = ChainRing
    stage_controller: type[TracedChainStage] = TracedChainStage
    orchestrator_controller: type[TracedChainOrchestrator] = TracedChainOrchestrator
    orchestrator: type[ChainOrchestratorNode] = ChainOrchestratorNode
    # What the runner does after a chain fault (``chain_recovery``): decide, re-place, replay.
    recoverer: type[Recoverer] = Recoverer
    mutant: str | None = None


PLAIN = Parts()
#: ``on_token(run_id, sequence, token_id)`` for every run's tokens.
OnToken = Callable[[str, int, int], None]
#: ``on_run_end(index)`` as the ``index``-th run to arrive ends (``ChainSimulation.result_of``).
OnRunEnd = Callable[[int], None]


class ChainSimulation:
    def __init__(
        self,
        runs: Sequence[RunSpec],
        workers: Sequence[Worker],
        costs: list[StageCost],
        *,
        seed: int = 0,
        faults: FaultPlan = NO_FAULTS,
        settings: SimSettings = DEFAULT_SETTINGS,
        parts: Parts = PLAIN,
        on_token: OnToken | None = None,
        on_load: Callable[[int, int, int], None] | None = None,
        on_run_end: OnRunEnd | None = None,
        trace: bool = True,
        wall_clock: bool = False,
        stale_runs: frozenset[str] = frozenset(),
    ) -> None:
        """``stale_runs``: run ids of chains before this one (a recovery's), stale on
        every stage of this chain from its first message. ``on_run_end(index)``: the
        ``index``-th run ended (the orchestrator has its ``RunFinished``), while the
        others may go on (a caller's Ctrl-C then keeps what ended)."""
        if not runs:
            raise ValueError("a chain simulation needs at least one run")
        self.runs = tuple(runs)
        self.plan = runs[0].plan  # the chain's stages, nodes and timeouts
        self.costs = costs
        self.seed = seed
        self.faults = faults
        self.settings = settings
        self.parts = parts
        self.on_token = on_token
        self.on_load = on_load
        self.on_run_end = on_run_end
        self.clock = Scheduler()
        self.trace = Trace(trace)
        self.dropped: list[tuple[str, str, str]] = []
        self.forgeries: list[tuple[str, str, bool, str]] = []
        self.delivered: list[list[tuple[str, int, int]]] = [[] for _ in runs]
        self.previous_run = f"{self.plan.run_id}-previous"
        self.wall_clock = wall_clock
        self.step_wall_s: dict[int, float] = {}
        self.links = SimChainLinks(self)
        self.network = Network(self)
        self.stale_runs = stale_runs
        stopped = frozenset({self.previous_run}) | stale_runs
        self.stages = [
            ChainStageNode(self, i, w, c, stopped)
            for i, (w, c) in enumerate(zip(workers, costs, strict=True))
        ]
        self.orchestrator = parts.orchestrator(self)
        self._nodes: dict[str, Node] = {s.node_id: s for s in self.stages}
        self._nodes[ORCHESTRATOR] = self.orchestrator

    def node(self, node_id: str) -> Node:
        return self._nodes[node_id]

    def run_id(self, index: int) -> str:
        """The run id of the ``index``-th run to arrive (a fault names runs so)."""
        return self.runs[index % len(self.runs)].plan.run_id

    def wall_decode_tokens_per_s(self) -> float | None:
        """Real decode speed of the workers: decode sequences per second of their
        summed step times (what a pipeline with one token in flight would do)."""
        decode = [t for seq, t in self.step_wall_s.items() if seq > 0]
        return len(decode) / sum(decode) if decode and sum(decode) > 0 else None

    def link_delay_us(self, hop: int, run_id: str, sequence: int) -> int:
        """Extra delay of a record: a silent link (an edge stall) holds it far past
        every timeout."""
        for fault in self.faults.of(FaultKind.EDGE_STALL):
            if fault.stage == hop and fault.sequence == sequence:
                t = self.plan.timeouts
                step_ms = t.step_limit_ms(self.plan.model.max_seq_len)
                return 10 * (step_ms * self.plan.stage_count + t.edge_wait_ms) * 1000
        return 0

    def orchestrator_exited(self) -> None:
        now = self.clock.now_us
        self.trace.add(now, ORCHESTRATOR, "sim", "exited")
        for stage in self.stages:
            at = self.network.channel_closed_at(
                ORCHESTRATOR, stage.node_id, now + self.settings.exit_notice_us
            )
            self.clock.at(at, stage.orchestrator_lost)

    def result_of(self, index: int) -> RunResult:
        """What has become of the ``index``-th run to arrive so far (all of it once
        ``run`` returned)."""
        o = self.orchestrator
        spec = self.runs[index]
        run_id = spec.plan.run_id
        handle = o.handles.get(index)
        run = o.sim_runs.get(index)
        last = run.run_id if run is not None else run_id
        return RunResult(
            run_id=run_id,
            finished=run.finished if run is not None else None,
            tokens=handle.tokens if handle is not None else (),
            delivered=tuple(self.delivered[index]),
            logits=tuple(handle.logits) if handle is not None else (),
            refused=o.refused.get(index),
            arrival_us=spec.arrival_us,
            ready_us=o.ready_us.get(last),
            finished_us=o.finished_us.get(last),
            token_times_us=tuple(o.token_times.get(run_id, ())),
            offered_as=(*run.former_ids[1:], last) if run and run.former_ids else (),
        )

    def run(self, *, max_events: int = 2_000_000) -> ChainResult:
        self.clock.after(0, self.orchestrator.start)
        self.clock.run(max_events=max_events)
        o = self.orchestrator
        return ChainResult(
            runs=tuple(self.result_of(i) for i in range(len(self.runs))),
            end_us=self.clock.now_us,
            events=self.clock.events_run,
            trace=self.trace,
            alive=tuple(s.alive for s in self.stages),
            held=tuple(tuple(s.controller.held()) for s in self.stages),
            kv_reserved=tuple(s.worker.kv_reserved_bytes for s in self.stages),
            batches=tuple(dict(s.controller.batch_counts) for s in self.stages),
            batch_counts=o.controller.batch_counts,
        )
