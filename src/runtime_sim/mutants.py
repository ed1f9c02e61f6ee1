"""Deliberate bugs for ``explore --self-test``: the checker must catch each by the rule
it breaks (``explore.MUTANT_RULES``). Each mutant is a subclass of one production part,
put into a simulation through its ``Parts`` port (``parts_for``); no production class
knows of them."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Sequence
from typing import Any, cast

import attrs

from runplan import NodePool, Placement, RunPlan, RuntimeConfig
from runplan.fsm import orchestrator as ofsm
from runplan.fsm import stage as sfsm
from runplan.fsm.orchestrator_actions import RunFinished
from runplan.messages import BatchCount, FaultReason, StageReady
from runplan.plan import RingSpec
from runplan.record_header import HeaderDType
from runplan.replacement import Replacement, Unplaceable
from runtime_core.chain_orchestrator import RunHandle
from runtime_core.chain_stage import RunSlot
from runtime_core.links import LinkSender
from runtime_core.records import token_payload
from runtime_core.recovery import ChainRecovery
from runtime_core.replay import Interrupted, Replay, ReplayRefused
from runtime_core.workers.interface import BatchStep, StepResult, Worker
from runtime_sim.chain_driver import ChainSimulation, Parts
from runtime_sim.chain_links import ChainRing
from runtime_sim.chain_nodes import TracedChainStage
from runtime_sim.chain_orchestrator_node import TracedChainOrchestrator
from runtime_sim.recoverer import Recoverer


class Mutation(enum.Enum):
    """Deliberate bugs for ``explore --self-test``: the checker must catch each."""

    INJECT_BEFORE_READY = "INJECT_BEFORE_READY"  # a prompt goes out before the barrier
    SKIP_STOP_RUN = "SKIP_STOP_RUN"  # teardown forgets stage 0
    SEQUENCE_SHIFT = "SEQUENCE_SHIFT"  # stage 0 labels an output with the next sequence
    LATE_RELEASE = "LATE_RELEASE"  # the last stage holds a slot past its load
    READY_BEFORE_BIND = "READY_BEFORE_BIND"  # stage 0 reports ready before its weights
    CROSS_RUN_LEAK = "CROSS_RUN_LEAK"  # one run's token goes to another run's caller
    REORDERED_STEPS = "REORDERED_STEPS"  # a batch takes one run's records out of order
    BATCHES_REPORTED_TWICE = "BATCHES_REPORTED_TWICE"  # a stop reports batches reported before
    MIXED_ROWS = "MIXED_ROWS"  # a batch hands one run's rows to another run's step
    # a recovery's (issue 25)
    REPLAY_RESTARTS_SAMPLER = "REPLAY_RESTARTS_SAMPLER"  # a replay draws from the start
    REPLAY_DROPS_DELIVERED = "REPLAY_DROPS_DELIVERED"  # a replay's prompt lacks the delivered
    STALE_RUN_ACCEPTED = "STALE_RUN_ACCEPTED"  # a re-placed chain's stages forget stale ids
    REUSES_LOST_HOST = "REUSES_LOST_HOST"  # the runner re-places onto the host it lost
    FORGETS_A_RUN = "FORGETS_A_RUN"  # the runner neither replays nor ends one recovered run


#: The mutants a recovery shows: the self-test runs them on scenarios with a loss.
RECOVERY_MUTATIONS = frozenset(
    {
        Mutation.REPLAY_RESTARTS_SAMPLER,
        Mutation.REPLAY_DROPS_DELIVERED,
        Mutation.STALE_RUN_ACCEPTED,
        Mutation.REUSES_LOST_HOST,
        Mutation.FORGETS_A_RUN,
    }
)


class InjectBeforeReady(TracedChainOrchestrator):
    """A run's prompt goes out as soon as token-in exists, before the readiness barrier."""

    def try_open_links(self) -> bool:
        waiting = self._waiting_links()
        opened = super().try_open_links()
        if opened and self.token_in is not None:
            for handle in waiting:
                if handle.machine.state is not ofsm.State.RUNNING:
                    prompt = handle.machine.prompt
                    edge = handle.plan.token_in.edge_id
                    payload = token_payload(prompt)
                    self.token_in.try_send(
                        handle.run_id, edge, 0, len(prompt), HeaderDType.U32, payload
                    )
        return opened


class SkipStopRun(TracedChainOrchestrator):
    """Stage 0 never hears of a run's teardown."""

    def _act(self, handle: RunHandle, action: ofsm.Action) -> None:
        if isinstance(action, ofsm.SendStopRun) and action.stage_index == 0:
            return
        super()._act(handle, action)


class _ShiftingSender(LinkSender):
    """Labels the first record it writes with the next sequence."""

    def __init__(self, inner: LinkSender) -> None:
        super().__init__(inner.ring, inner.kind)
        self.shifted = False

    def try_send(self, run_id: str, edge_id: int, sequence: int, *rest: Any) -> bool:
        if not self.shifted:
            self.shifted = True
            sequence += 1
        return super().try_send(run_id, edge_id, sequence, *rest)


class SequenceShift(TracedChainStage):
    """Stage 0 labels its first output with the next sequence."""

    def try_attach_links(self) -> bool:
        attached = super().try_attach_links()
        out = self.outbound
        if self.node.index == 0 and out is not None and not isinstance(out, _ShiftingSender):
            self.outbound = _ShiftingSender(out)
        return attached


class LateRelease(ChainRing):
    """The last stage's inbound ring frees a record's slot a step's time after its load
    (as a slot held until its step ends would be), not at load."""

    def __init__(self, sim: ChainSimulation, hop: int, spec: RingSpec) -> None:
        super().__init__(sim, hop, spec)
        self.late = hop == len(sim.stages) - 1
        consumer = sim.stages[hop] if hop < len(sim.stages) else None
        self.hold_us = int(sim.settings.timing.step_us(consumer.cost, 1)) if consumer else 0

    def release(self, index: int) -> None:
        if self.late:
            self.sim.clock.after(self.hold_us, lambda: super(LateRelease, self).release(index))
        else:
            super().release(index)


class ReadyBeforeBind(TracedChainStage):
    """Stage 0 reports a run ready as its setup begins, before its weights are bound."""

    def _act(self, slot: RunSlot, action: sfsm.Action) -> None:
        super()._act(slot, action)
        if self.node.index == 0 and isinstance(action, sfsm.BeginSetup):
            p = action.provision
            ready = StageReady(p.run_id, p.stage_index, self.node_id)
            super()._act(slot, sfsm.SendToOrchestrator(ready))


class CrossRunLeak(TracedChainOrchestrator):
    """One token of a run is delivered to the caller of another run in flight."""

    leaked = False

    def _act(self, handle: RunHandle, action: ofsm.Action) -> None:
        if isinstance(action, ofsm.DeliverToken) and not self.leaked:
            other = next((h for h in self.runs.values() if h is not handle), None)
            if other is not None and other.on_token is not None:
                self.leaked = True
                other.on_token(handle.run_id, action.sequence, action.token_id)
                return
        super()._act(handle, action)


class ReorderedSteps(TracedChainStage):
    """A batch takes a run's second loaded record before its first (once)."""

    reordered = False

    def run_batch(self) -> None:
        if not self.reordered:
            for slot in self.runs.values():
                if len(slot.inbox) >= 2 and slot.machine.state is sfsm.State.READY:
                    slot.inbox[0], slot.inbox[1] = slot.inbox[1], slot.inbox[0]
                    self.reordered = True
                    break
        super().run_batch()


class _MixingWorker:
    """A worker whose batches give two steps of the same shape each other's rows (its
    first such pair)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def execute_batch(self, steps: Sequence[BatchStep]) -> tuple[StepResult, ...]:
        mixed = list(steps)
        for i, (a, b) in enumerate(itertools.pairwise(steps)):
            if a.data.shape == b.data.shape:
                mixed[i : i + 2] = [attrs.evolve(a, data=b.data), attrs.evolve(b, data=a.data)]
                break
        return tuple(self.inner.execute_batch(mixed))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class MixedRows(TracedChainStage):
    """A stage whose batches compute one run's step on another run's rows: each run's
    records are in order and each output labelled right, but what it carries is not
    that run's."""

    def __init__(self, node: Any, worker: Any, stopped_runs: frozenset[str]) -> None:
        super().__init__(node, cast(Worker, _MixingWorker(worker)), stopped_runs)


class BatchesReportedTwice(TracedChainStage):
    """Each ``StageStopped`` reports every batch the stage ran, not those since the last
    one."""

    def _batch_report(self) -> tuple[BatchCount, ...]:
        ran = sorted(self.batch_counts.items())
        self._unreported = {}
        return tuple(BatchCount(rows, batches) for rows, batches in ran)


class _AlteredReplay(Recoverer):
    """A recoverer whose replays ``alter`` changes after planning them as it should."""

    def replay(
        self,
        interrupted: Interrupted,
        run_id: str,
        base: RuntimeConfig,
        lost_nodes: Sequence[str],
        placement: Placement,
    ) -> tuple[Replay, RunPlan] | ReplayRefused:
        planned = super().replay(interrupted, run_id, base, lost_nodes, placement)
        if isinstance(planned, ReplayRefused):
            return planned
        return self.alter(interrupted, *planned)

    def alter(
        self, interrupted: Interrupted, replay: Replay, plan: RunPlan
    ) -> tuple[Replay, RunPlan]:
        raise NotImplementedError


class RestartsSampler(_AlteredReplay):
    """A replay's sampler starts over (``tokens_delivered`` 0) instead of resuming
    after the tokens its stream delivered."""

    def alter(
        self, interrupted: Interrupted, replay: Replay, plan: RunPlan
    ) -> tuple[Replay, RunPlan]:
        fresh = attrs.evolve(plan.sampling, tokens_delivered=0)
        return attrs.evolve(replay, sampling=fresh), attrs.evolve(plan, sampling=fresh)


class DropsDelivered(_AlteredReplay):
    """A replay's prompt is its run's prompt alone: the tokens its stream delivered are
    not fed back (its sampler still resumes after them)."""

    def alter(
        self, interrupted: Interrupted, replay: Replay, plan: RunPlan
    ) -> tuple[Replay, RunPlan]:
        return attrs.evolve(replay, prompt=interrupted.prompt), plan


class AcceptsStaleRuns(TracedChainStage):
    """A stage that is not told the run ids of the chains before its own."""

    def __init__(self, node: Any, worker: Any, stopped_runs: frozenset[str]) -> None:
        super().__init__(node, worker, frozenset())


class ReusesLostHost(Recoverer):
    """The runner forgets which hosts it lost: it re-places over the whole cluster."""

    def live_pool(self, lost_nodes: Iterable[str]) -> NodePool:
        return self.pool

    def replace(
        self,
        plan: RunPlan,
        config: RuntimeConfig,
        lost_nodes: Sequence[str],
        lost_stages: Sequence[int],
    ) -> Replacement | Unplaceable:
        return super().replace(plan, config, (), lost_stages)


class ForgetsARun(Recoverer):
    """The runner loses one run the policy recovers: it is neither replayed nor ended."""

    def decide(
        self,
        ended: Sequence[tuple[Interrupted, RunFinished]],
        stage_count: int,
        chain_fault: FaultReason | None,
    ) -> ChainRecovery:
        decision = super().decide(ended, stage_count, chain_fault)
        if not decision.recover:
            return decision
        return attrs.evolve(decision, recover=decision.recover[:-1])


def parts_for(mutation: Mutation) -> Parts:
    """A simulation's parts with ``mutation``'s bug in one of them."""
    name = mutation.value
    if mutation is Mutation.INJECT_BEFORE_READY:
        return Parts(orchestrator_controller=InjectBeforeReady, mutant=name)
    if mutation is Mutation.SKIP_STOP_RUN:
        return Parts(orchestrator_controller=SkipStopRun, mutant=name)
    if mutation is Mutation.SEQUENCE_SHIFT:
        return Parts(stage_controller=SequenceShift, mutant=name)
    if mutation is Mutation.LATE_RELEASE:
        return Parts(ring=LateRelease, mutant=name)
    if mutation is Mutation.CROSS_RUN_LEAK:
        return Parts(orchestrator_controller=CrossRunLeak, mutant=name)
    if mutation is Mutation.REORDERED_STEPS:
        return Parts(stage_controller=ReorderedSteps, mutant=name)
    if mutation is Mutation.REPLAY_RESTARTS_SAMPLER:
        return Parts(recoverer=RestartsSampler, mutant=name)
    if mutation is Mutation.REPLAY_DROPS_DELIVERED:
        return Parts(recoverer=DropsDelivered, mutant=name)
    if mutation is Mutation.STALE_RUN_ACCEPTED:
        return Parts(stage_controller=AcceptsStaleRuns, mutant=name)
    if mutation is Mutation.REUSES_LOST_HOST:
        return Parts(recoverer=ReusesLostHost, mutant=name)
    if mutation is Mutation.FORGETS_A_RUN:
        return Parts(recoverer=ForgetsARun, mutant=name)
    if mutation is Mutation.BATCHES_REPORTED_TWICE:
        return Parts(stage_controller=BatchesReportedTwice, mutant=name)
    if mutation is Mutation.MIXED_ROWS:
        return Parts(stage_controller=MixedRows, mutant=name)
    return Parts(stage_controller=ReadyBeforeBind, mutant=name)
