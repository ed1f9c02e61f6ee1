"""A chain that recovers (issue 25): after a fault that loses a stage's process, host
or link, the runner re-places the chain over the cluster's live nodes and replays every
run the fault interrupted, each continuing its caller's stream.

``RecoveringSimulation`` runs one ``ChainSimulation`` per chain: the first on the
scenario's runs and faults; once it is over, the recovery policy decides for every run
that ended (``runtime_core.recovery``, the value the real runtime uses), the chain is
re-placed (``runplan.replacement.replace_lost``: a spare first, else the planner over
the remaining nodes, else ``Unplaceable``), and each recovered run is replayed
(``runtime_core.replay.plan_replay``) on a new chain whose stages hold every earlier run
id stale. A loss during a recovery is a fault of that new chain (``RecoveryAction.
losses``), recovered the same way while the policy allows. Each chain runs on its own
virtual clock from 0: the time between chains (detection, re-plan, bind) is the
process runtime's to measure, not modelled here.

Before a re-placed chain's first message, every stage of it gets a late provision of
the first run of every chain before (stale), addressed to it
(``chain_forgeries.forge_stale_provision``); the checker (``recovery_checker``)
requires each to be refused as ``STALE_RUN``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
from attrs import frozen

from runplan import ModelFacts, NodePool, RunPlan, RuntimeConfig, provision_stage
from runplan.fsm.orchestrator_actions import RunFinished
from runplan.replacement import Replacement, Unplaceable
from runtime_core.recovery import ChainRecovery, End, EndReason, RecoveryPolicy
from runtime_core.replay import Interrupted, Replay, ReplayRefused
from runtime_core.workers.interface import Worker
from runtime_sim.chain_driver import NO_FAULTS, PLAIN, ChainResult, ChainSimulation, Parts, RunSpec
from runtime_sim.chain_forgeries import forge_stale_provision
from runtime_sim.faults import Fault, FaultPlan
from runtime_sim.timing import StageCost


@frozen
class RecoveryAction:
    """A scenario's recovery: the cluster (the chain's nodes and any spares), the model,
    each run's settings (by arrival: the base of its replays), whether a stage that dies
    takes its host out of the cluster, and the losses during recoveries (``losses[n]``
    strikes the chain of recovery ``n + 1``; its stage taken modulo that chain's)."""

    pool: NodePool
    facts: ModelFacts
    configs: tuple[RuntimeConfig, ...]
    host_lost: bool
    losses: tuple[Fault, ...] = ()
    policy: RecoveryPolicy = RecoveryPolicy()


#: How one stream ended: a policy's ``End``, a refused replay, or no placement.
StreamEnd = End | ReplayRefused | Unplaceable


@attrs.define(eq=False)
class Stream:
    """One caller's stream: its original run (by arrival), the runs that served it in
    turn (one per chain), the tokens it received, and how it ended."""

    index: int
    spec: RunSpec
    run_ids: list[str] = attrs.field(factory=list)
    replays: list[Replay] = attrs.field(factory=list)
    tokens: list[int] = attrs.field(factory=list)
    end: StreamEnd | None = None
    last: str = "unfinished"  # the outcome of the run that served it last

    @property
    def recovered(self) -> int:
        return len(self.replays)

    @property
    def outcome(self) -> str:
        """``completed`` when the stream got every token it was to get (also when the
        fault came after its last token), else the outcome of its last run, or
        ``faulted`` when a recovery ended it (spent, refused, unplaceable)."""
        end = self.end
        if isinstance(end, End) and end.reason is EndReason.ALREADY_ENDED:
            return "completed"
        if end is None or (isinstance(end, End) and end.reason is EndReason.NOT_FAULTED):
            return self.last
        return "faulted"


@attrs.define(eq=False)
class Epoch:
    """One chain: its simulation and result, the stream each run serves (by the run's
    index), the policy's decision when it ended, the re-placement that followed, the
    stale provisions its stages were sent (node, run id, the reason each was refused)."""

    sim: ChainSimulation
    result: ChainResult
    streams: tuple[int, ...]
    decision: ChainRecovery | None = None
    replacement: Replacement | Unplaceable | None = None
    stale_forgeries: list[tuple[str, str, str]] = attrs.field(factory=list)


@frozen
class RecoveryRun:
    epochs: tuple[Epoch, ...]
    streams: tuple[Stream, ...]
    action: RecoveryAction | None


#: The stage workers and costs of a chain's plan.
WorkersFor = Callable[[RunPlan], Sequence[Worker]]
CostsFor = Callable[[RunPlan], list[StageCost]]


class RecoveringSimulation:
    """Runs ``runs`` with ``faults`` on a chain, and, with ``action``, recovers them
    after a loss; without it, one chain as ``ChainSimulation`` runs it."""

    def __init__(
        self,
        runs: Sequence[RunSpec],
        workers: WorkersFor,
        costs: CostsFor,
        *,
        seed: int = 0,
        faults: FaultPlan = NO_FAULTS,
        action: RecoveryAction | None = None,
        parts: Parts = PLAIN,
    ) -> None:
        if action is not None and len(action.configs) != len(runs):
            raise ValueError(
                f"the recovery action has {len(action.configs)} run settings for {len(runs)} runs"
            )
        self.runs = tuple(runs)
        self.workers = workers
        self.costs = costs
        self.seed = seed
        self.faults = faults
        self.action = action
        self.parts = parts

    def chain(
        self, specs: Sequence[RunSpec], faults: FaultPlan, stale: frozenset[str]
    ) -> ChainSimulation:
        """A chain of ``specs`` (their plans share its stages) struck by ``faults``, its
        stages holding ``stale`` run ids stale."""
        plan = specs[0].plan
        return ChainSimulation(
            specs,
            self.workers(plan),
            self.costs(plan),
            seed=self.seed,
            faults=faults,
            parts=self.parts,
            stale_runs=stale,
        )

    def run(self) -> RecoveryRun:
        streams = [Stream(i, spec) for i, spec in enumerate(self.runs)]
        sim = self.chain(self.runs, self.faults, frozenset())
        epoch = Epoch(sim, sim.run(), tuple(range(len(self.runs))))
        epochs = [epoch]
        self._collect(epoch, streams)
        action = self.action
        if action is not None:
            recovery = _Recovery(self, action, streams)
            while (following := recovery.after(epochs)) is not None:
                epochs.append(following)
                self._collect(following, streams)
        return RecoveryRun(tuple(epochs), tuple(streams), action)

    @staticmethod
    def _collect(epoch: Epoch, streams: list[Stream]) -> None:
        """Each run's tokens onto its stream, in stream order (a replay's run starts at
        its stream's next token)."""
        for s, r in zip(epoch.streams, epoch.result.runs, strict=True):
            stream = streams[s]
            stream.run_ids.append(r.run_id)
            stream.tokens.extend(r.tokens)
            stream.last = r.outcome


class _Recovery:
    """The runner's state across chains: the hosts it lost, the run ids gone stale."""

    def __init__(
        self, sim: RecoveringSimulation, action: RecoveryAction, streams: list[Stream]
    ) -> None:
        self.sim = sim
        self.action = action
        self.streams = streams
        self.recoverer = sim.parts.recoverer(action.policy, action.facts, action.pool)
        self.lost_hosts: set[str] = set()
        self.stale: set[str] = set()

    def after(self, epochs: list[Epoch]) -> Epoch | None:
        """The chain that follows the last of ``epochs`` (run), or ``None`` when no run
        is recovered: the policy's decision for every run that ended, the re-placement,
        each recovered run's replay."""
        epoch = epochs[-1]
        sim, result, action, recoverer = epoch.sim, epoch.result, self.action, self.recoverer
        # Each run of this chain: its stream, its spec, its result.
        by_run = {
            spec.plan.run_id: (self.streams[s], spec, r)
            for s, spec, r in zip(epoch.streams, sim.runs, result.runs, strict=True)
        }
        ended = [
            (_interrupted(stream, spec, r.finished), r.finished)
            for stream, spec, r in by_run.values()
            if r.finished is not None
        ]
        decision = recoverer.decide(
            [(i, f) for i, f in ended if f is not None],
            sim.plan.stage_count,
            sim.orchestrator.controller.broken,
        )
        epoch.decision = decision
        for end in decision.end:
            by_run[end.run_id][0].end = end
        if not decision.recover:
            return None
        if action.host_lost:
            self.lost_hosts |= dead_hosts(epoch)
        lost = sorted(self.lost_hosts)
        n = len(epochs)
        new = recoverer.replace(
            sim.plan,
            attrs.evolve(action.configs[0], run_id=f"placement-{n}"),
            lost,
            decision.lost_stages,
        )
        epoch.replacement = new
        if isinstance(new, Unplaceable):
            for r in decision.recover:
                by_run[r.run_id][0].end = new
            return None
        # every id a run had on those chains (one offered again after waiting for KV
        # memory had several)
        self.stale |= {i for e in epochs for r in e.result.runs for i in r.chain_ids}
        specs: list[RunSpec] = []
        served: list[int] = []
        for r in decision.recover:
            stream, spec, run = by_run[r.run_id]
            interrupted = _interrupted(stream, spec, run.finished)
            run_id = f"{stream.run_ids[0]}~r{interrupted.recoveries + 1}"
            base = action.configs[stream.index]
            planned = recoverer.replay(interrupted, run_id, base, lost, new.placement)
            if isinstance(planned, ReplayRefused):
                stream.end = planned
                continue
            replay, plan = planned
            stream.replays.append(replay)
            specs.append(RunSpec(plan, replay.prompt, 0))
            served.append(stream.index)
        if not specs:
            return None
        faults = NO_FAULTS
        if n - 1 < len(action.losses):
            loss = action.losses[n - 1]
            faults = FaultPlan((attrs.evolve(loss, stage=loss.stage % new.plan.stage_count),))
        chain = self.sim.chain(specs, faults, frozenset(self.stale))
        forgeries = _forge_stale(chain, [e.sim.plan for e in epochs])
        following = Epoch(chain, chain.run(), tuple(served))
        following.stale_forgeries = forgeries
        return following


def _interrupted(stream: Stream, spec: RunSpec, finished: RunFinished | None) -> Interrupted:
    """What the caller had of the run ``spec`` that now serves ``stream``."""
    run_tokens = finished.tokens if finished is not None else ()
    if not stream.replays:
        return Interrupted.of_plan(spec.plan, spec.prompt, run_tokens)
    return Interrupted.of_replay(stream.replays[-1], spec.plan, run_tokens)


def _forge_stale(
    sim: ChainSimulation, stale_plans: Sequence[RunPlan]
) -> list[tuple[str, str, str]]:
    """At a re-placed chain's first instant, each stage gets a late provision of the
    first run of every chain before (stale), addressed to it: (node, run id, the reason
    it is refused with), filled in as the chain runs."""
    forgeries: list[tuple[str, str, str]] = []

    def forge() -> None:
        for plan in stale_plans:
            for node in sim.stages:
                stale = provision_stage(plan, min(node.index, plan.stage_count - 1))
                reason = forge_stale_provision(sim, node, stale)
                forgeries.append((node.node_id, stale.run_id, reason))

    sim.clock.at(0, forge)
    return forgeries


def dead_hosts(epoch: Epoch) -> set[str]:
    """The nodes of the chain's stages that died."""
    stages, alive = epoch.sim.stages, epoch.result.alive
    return {s.node_id for s, up in zip(stages, alive, strict=True) if not up}
