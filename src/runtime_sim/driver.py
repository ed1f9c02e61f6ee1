"""One run of a plan in one thread on a virtual clock.

Every node runs the real pieces: the orchestrator and stage state machines, their
controllers, the workers and the rings. The simulation supplies the environment
(``links``: control links with latency, control messages through ``runplan.wire``,
ring records that take a hop's time to arrive; ``nodes``: step and load times from the
timing model, timers, process deaths; ``faults`` and ``forgeries``: the faults of a
``FaultPlan``). Everything is traced (``trace``, ``traced_controllers``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attrs import frozen

from runplan import RunPlan
from runplan.fsm import orchestrator as ofsm
from runplan.fsm import stage as sfsm
from runplan.plan import EdgePlan
from runtime_core.workers.interface import Worker
from runtime_sim.clock import Scheduler
from runtime_sim.faults import FaultKind, FaultPlan
from runtime_sim.links import ORCHESTRATOR, Network, SimEdges, SimRing
from runtime_sim.nodes import Node, OrchestratorNode, StageNode
from runtime_sim.timing import StageCost, TimingModel
from runtime_sim.trace import Trace
from runtime_sim.traced_controllers import TracedOrchestratorController, TracedStageController


@frozen
class SimSettings:
    timing: TimingModel = TimingModel()
    control_latency_us: int = 50
    death_notice_us: int = 2_000  # a stage's death reaches the orchestrator
    exit_notice_us: int = 1_000  # the orchestrator's exit reaches a stage
    attach_retry_us: int = 500  # retry attaching to a ring that does not exist yet
    release_us: int = 200  # closing edges, releasing the worker


DEFAULT_SETTINGS = SimSettings()
NO_FAULTS = FaultPlan()


@frozen
class SimResult:
    finished: ofsm.RunFinished | None
    tokens: tuple[int, ...]
    logits: tuple[Any, ...]
    end_us: int  # when the last simulated event ran
    finished_us: int | None  # when the run reached its terminal outcome
    first_token_us: int | None
    ready_us: int | None
    token_times_us: tuple[int, ...]
    events: int
    trace: Trace
    stage_states: tuple[sfsm.State, ...]
    alive: tuple[bool, ...]


@frozen
class Parts:
    """The classes a simulation builds its rings and nodes from: a port through which
    the self-test's mutants (``runtime_sim.mutants``) put in subclasses that carry one
    deliberate bug each. ``mutant`` names that bug (``None``: the production classes;
    a mutant's controllers run even without a trace)."""

    ring: type[SimRing] = SimRing
    stage_controller: type[TracedStageController] = TracedStageController
    orchestrator_controller: type[TracedOrchestratorController] = TracedOrchestratorController
    orchestrator: type[OrchestratorNode] = OrchestratorNode
    mutant: str | None = None


PLAIN = Parts()


class Simulation:
    def __init__(
        self,
        plan: RunPlan,
        prompt_ids: tuple[int, ...],
        workers: list[Worker],
        costs: list[StageCost],
        *,
        seed: int = 0,
        faults: FaultPlan = NO_FAULTS,
        settings: SimSettings = DEFAULT_SETTINGS,
        parts: Parts = PLAIN,
        on_token: Callable[[int, int], None] | None = None,
        on_load: Callable[[int, int, int], None] | None = None,
        trace: bool = True,
        wall_clock: bool = False,
    ) -> None:
        self.plan = plan
        self.costs = costs
        self.seed = seed
        self.faults = faults
        self.stalls = bool(faults.of(FaultKind.EDGE_STALL))
        self.settings = settings
        self.parts = parts
        self.clock = Scheduler()
        self.trace = Trace(trace)
        self.dropped: list[tuple[str, str, str]] = []
        self.forgeries: list[tuple[str, str, bool, str]] = []
        self.previous_run = f"{plan.run_id}-previous"
        self.on_load = on_load
        # Real seconds the workers spent per sequence, summed over stages (when measured).
        self.wall_clock = wall_clock
        self.step_wall_s: dict[int, float] = {}
        self.edges = SimEdges(self)
        self.network = Network(self)
        stopped = frozenset({self.previous_run})
        self.stages = [
            StageNode(self, i, w, c, stopped)
            for i, (w, c) in enumerate(zip(workers, costs, strict=True))
        ]
        self.orchestrator = parts.orchestrator(self, prompt_ids, on_token)
        self._nodes: dict[str, Node] = {s.node_id: s for s in self.stages}
        self._nodes[ORCHESTRATOR] = self.orchestrator

    def node(self, node_id: str) -> Node:
        return self._nodes[node_id]

    def wall_decode_tokens_per_s(self) -> float | None:
        """Real decode speed of the workers: decode sequences per second of their
        summed step times (what a pipeline with one token in flight would do)."""
        decode = [t for seq, t in self.step_wall_s.items() if seq > 0]
        return len(decode) / sum(decode) if decode and sum(decode) > 0 else None

    def stall_for(self, edge: EdgePlan, sequence: int) -> int:
        """Extra delay of a record: an edge stall far past every timeout."""
        for fault in self.faults.of(FaultKind.EDGE_STALL):
            consumer = edge.consumer
            if getattr(consumer, "stage_index", None) == fault.stage and sequence == fault.sequence:
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

    def run(self, *, max_events: int = 2_000_000) -> SimResult:
        self.clock.after(0, self.orchestrator.start)
        self.clock.run(max_events=max_events)
        orch = self.orchestrator.controller
        finished = orch.finished
        tokens = finished.tokens if finished is not None else orch.machine.tokens
        logits = tuple(orch.logits[: len(tokens)])
        return SimResult(
            finished=finished,
            tokens=tokens,
            logits=logits,
            end_us=self.clock.now_us,
            finished_us=self.orchestrator.finished_us,
            first_token_us=self.orchestrator.first_token_us,
            ready_us=self.orchestrator.ready_us,
            token_times_us=tuple(self.orchestrator.token_times),
            events=self.clock.events_run,
            trace=self.trace,
            stage_states=tuple(s.controller.state for s in self.stages),
            alive=tuple(s.alive for s in self.stages),
        )
