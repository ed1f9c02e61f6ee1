"""Deliberate bugs for ``explore --self-test``: the checker must catch each by the rule
it breaks (``explore.MUTANT_RULES``). Each mutant is a subclass of one production part,
put into a simulation through its ``Parts`` port (``parts_for``); no production class
knows of them."""

from __future__ import annotations

import enum

from runplan.fsm import orchestrator as ofsm
from runplan.fsm import stage as sfsm
from runplan.messages import StageReady
from runplan.plan import EdgePlan
from runtime_core.stage_controller import StageController
from runtime_core.workers.interface import Worker
from runtime_sim.driver import Parts, Simulation
from runtime_sim.links import SimRing
from runtime_sim.nodes import OrchestratorNode, StageNode
from runtime_sim.trace import describe
from runtime_sim.traced_controllers import TracedOrchestratorController, TracedStageController


class Mutation(enum.Enum):
    """Deliberate bugs for ``explore --self-test``: the checker must catch each."""

    INJECT_BEFORE_READY = "INJECT_BEFORE_READY"  # the prompt goes out before the barrier
    SKIP_STOP_RUN = "SKIP_STOP_RUN"  # teardown forgets stage 0
    SEQUENCE_SHIFT = "SEQUENCE_SHIFT"  # stage 0 labels its output with the next sequence
    EARLY_SLOT_REUSE = "EARLY_SLOT_REUSE"  # the last stage frees its slot before the step
    READY_BEFORE_BIND = "READY_BEFORE_BIND"  # stage 0 reports ready before its weights


class InjectBeforeReady(OrchestratorNode):
    """The prompt goes out as soon as token-in exists, before the readiness barrier."""

    def start(self) -> None:
        self.controller.start()
        self.controller._inject = (0, self.controller.machine.prompt)
        self.wake()


class SkipStopRun(TracedOrchestratorController):
    """Stage 0 never hears of the teardown."""

    def _act(self, action: ofsm.Action) -> None:
        if isinstance(action, ofsm.SendStopRun) and action.stage_index == 0:
            return
        super()._act(action)


class SequenceShift(TracedStageController):
    """Stage 0 labels its first output with the next sequence."""

    def __init__(self, node: StageNode, worker: Worker, stopped_runs: frozenset[str]) -> None:
        super().__init__(node, worker, stopped_runs)
        self._shifted = False

    def try_publish_output(self) -> bool:
        if self.node.index == 0 and self._output is not None and not self._shifted:
            sequence, *rest = self._output
            self._output = (sequence + 1, *rest)  # type: ignore[assignment]
            self._shifted = True
        return super().try_publish_output()


class EarlySlotReuse(SimRing):
    """The last stage's inbound ring frees a slot when its record is acquired, before the
    step that reads it."""

    def __init__(self, sim: Simulation, edge: EdgePlan) -> None:
        super().__init__(sim, edge)
        self.early = edge.edge_id == sim.plan.stages[-1].inbound_edge
        self.release_calls = 0  # releases the consumer asked for
        self.freed_early: set[int] = set()  # records freed on acquire

    def try_acquire(self) -> int | None:
        n = self._acquired
        index = super().try_acquire()
        if index is not None and self.early:
            super().release(index)
            self.freed_early.add(n)
        return index

    def release(self, index: int) -> None:
        n = self.release_calls
        self.release_calls += 1
        if n not in self.freed_early:
            super().release(index)


class ReadyBeforeBind(TracedStageController):
    """Stage 0 reports ready as its setup begins, before its weights are bound."""

    def _act(self, action: sfsm.Action) -> None:
        node = self.node
        if node.index != 0 or not isinstance(action, sfsm.BeginSetup):
            super()._act(action)
            return
        sim = node.sim
        self._trace_action(action)
        StageController._act(self, action)
        provision = action.provision
        ready = sfsm.SendToOrchestrator(
            StageReady(provision.run_id, provision.stage_index, node.node_id)
        )
        sim.trace.add(sim.clock.now_us, node.node_id, "act", "SendToOrchestrator", *describe(ready))
        StageController._act(self, ready)


def parts_for(mutation: Mutation) -> Parts:
    """A simulation's parts with ``mutation``'s bug in one of them."""
    name = mutation.value
    if mutation is Mutation.INJECT_BEFORE_READY:
        return Parts(orchestrator=InjectBeforeReady, mutant=name)
    if mutation is Mutation.SKIP_STOP_RUN:
        return Parts(orchestrator_controller=SkipStopRun, mutant=name)
    if mutation is Mutation.SEQUENCE_SHIFT:
        return Parts(stage_controller=SequenceShift, mutant=name)
    if mutation is Mutation.EARLY_SLOT_REUSE:
        return Parts(ring=EarlySlotReuse, mutant=name)
    return Parts(stage_controller=ReadyBeforeBind, mutant=name)
