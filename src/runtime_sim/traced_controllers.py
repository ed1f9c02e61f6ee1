"""The controllers of traced nodes: each event a machine handles and each action it
takes goes into the simulation's trace (described by ``trace.describe``) before it is
carried out, state changes as they happen."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from runplan.fsm import orchestrator as ofsm
from runplan.fsm import stage as sfsm
from runtime_core.orchestrator_controller import OrchestratorController
from runtime_core.stage_controller import StageController
from runtime_core.workers.interface import Worker
from runtime_sim.links import ORCHESTRATOR, ToOrchestrator, ToStages
from runtime_sim.trace import DESCRIBERS, learn_describer

if TYPE_CHECKING:
    from runtime_sim.driver import Simulation
    from runtime_sim.nodes import OrchestratorNode, StageNode


def state_tracer(sim: Simulation, actor: str) -> Callable[[str, dict[str, Any]], None] | None:
    """The controllers' trace callback: a state change is recorded when the machine
    moves, before its actions are carried out. None (no callback) without a trace."""
    if not sim.trace.enabled:
        return None
    log = sim.trace.entries  # Trace.add's list
    clock = sim.clock

    def trace(kind: str, fields: dict[str, Any]) -> None:
        if kind == "state":
            log.append((clock.now_us, actor, "state", fields["to"], ()))

    return trace


class TracedStageController(StageController):
    """A stage's controller whose events and actions are traced, and that tells its node
    when setup begins (for kills before ready). A node with neither a trace nor such a
    kill runs a plain ``StageController``; the self-test's mutants subclass this one."""

    def __init__(self, node: StageNode, worker: Worker, stopped_runs: frozenset[str]) -> None:
        sim = node.sim
        super().__init__(
            node.node_id,
            ORCHESTRATOR,
            worker,
            sim.edges,
            ToOrchestrator(sim, node.node_id),
            node.timers,
            trace=state_tracer(sim, node.node_id),
            stopped_runs=stopped_runs,
        )
        self.node = node
        self._clock = sim.clock
        self._log = sim.trace.entries if sim.trace.enabled else None  # Trace.add's list

    def handle(self, event: sfsm.Event) -> None:
        log = self._log
        if log is not None:
            cls = type(event)
            detail = (DESCRIBERS.get(cls) or learn_describer(cls))(event)
            log.append((self._clock.now_us, self.node.node_id, "ev", cls.__name__, detail))
        super().handle(event)

    def _act(self, action: sfsm.Action) -> None:
        self._trace_action(action)
        super()._act(action)
        if isinstance(action, sfsm.BeginSetup):
            self.node.on_provisioned()

    def _trace_action(self, action: sfsm.Action) -> None:
        log = self._log
        if log is not None:
            cls = type(action)
            detail = (DESCRIBERS.get(cls) or learn_describer(cls))(action)
            log.append((self._clock.now_us, self.node.node_id, "act", cls.__name__, detail))


class TracedOrchestratorController(OrchestratorController):
    """The orchestrator's controller, traced (a plain ``OrchestratorController``
    without a trace; the self-test's mutants subclass this one)."""

    def __init__(
        self,
        node: OrchestratorNode,
        prompt_ids: tuple[int, ...],
        on_token: Callable[[int, int], None],
    ) -> None:
        sim = node.sim
        super().__init__(
            sim.plan,
            prompt_ids,
            ToStages(sim),
            sim.edges,
            node.timers,
            on_token=on_token,
            trace=state_tracer(sim, ORCHESTRATOR),
        )
        self.node = node
        self._clock = sim.clock
        self._log = sim.trace.entries if sim.trace.enabled else None  # Trace.add's list

    def handle(self, event: ofsm.Event) -> None:
        log = self._log
        if log is not None:
            cls = type(event)
            detail = (DESCRIBERS.get(cls) or learn_describer(cls))(event)
            log.append((self._clock.now_us, ORCHESTRATOR, "ev", cls.__name__, detail))
        super().handle(event)

    def _act(self, action: ofsm.Action) -> None:
        log = self._log
        if log is not None:
            cls = type(action)
            detail = (DESCRIBERS.get(cls) or learn_describer(cls))(action)
            log.append((self._clock.now_us, ORCHESTRATOR, "act", cls.__name__, detail))
        super()._act(action)
