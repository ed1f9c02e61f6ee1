"""What the simulated runner does after a chain fault (issue 25), over the pieces the
real runtime uses: the recovery policy's decisions (``runtime_core.recovery``), the
re-placement (``runplan.replacement.replace_lost``) and each run's replay
(``runtime_core.replay.plan_replay``). No decision is the simulator's own: a
``Recoverer`` only hands each question to its shared answer. It is a part of the
simulation (``Parts.recoverer``), so the self-test's mutants can put in a runner with
one deliberate bug (``runtime_sim.mutants``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from runplan import ModelFacts, NodePool, Placement, RunPlan, RuntimeConfig
from runplan.fsm.orchestrator_actions import RunFinished
from runplan.messages import FaultReason
from runplan.replacement import Replacement, Unplaceable, replace_lost
from runtime_core.recovery import ChainRecovery, RecoveryPolicy
from runtime_core.replay import Interrupted, Replay, ReplayRefused, plan_replay


class Recoverer:
    """The runner's three steps after a chain fault, for a cluster of ``pool`` (every
    node, the chain's and the spares) running one model (``facts``), deciding with
    ``policy``."""

    def __init__(self, policy: RecoveryPolicy, facts: ModelFacts, pool: NodePool) -> None:
        self.policy = policy
        self.facts = facts
        self.pool = pool

    def live_pool(self, lost_nodes: Iterable[str]) -> NodePool:
        """The cluster less the hosts it lost."""
        lost = set(lost_nodes)
        return NodePool(
            self.pool.orchestrator_node_id,
            tuple(n for n in self.pool.nodes if n.node_id not in lost),
        )

    def decide(
        self,
        ended: Sequence[tuple[Interrupted, RunFinished]],
        stage_count: int,
        chain_fault: FaultReason | None,
    ) -> ChainRecovery:
        """The policy's decision for every run the chain's fault ended."""
        return self.policy.decide_chain(ended, stage_count, chain_fault=chain_fault)

    def replace(
        self,
        plan: RunPlan,
        config: RuntimeConfig,
        lost_nodes: Sequence[str],
        lost_stages: Sequence[int],
    ) -> Replacement | Unplaceable:
        """The chain of ``plan`` re-placed over the live nodes, for ``config`` (a new
        run id)."""
        return replace_lost(
            plan,
            self.facts,
            config,
            self.live_pool(lost_nodes),
            lost_nodes=lost_nodes,
            lost_stages=lost_stages,
        )

    def replay(
        self,
        interrupted: Interrupted,
        run_id: str,
        base: RuntimeConfig,
        lost_nodes: Sequence[str],
        placement: Placement,
    ) -> tuple[Replay, RunPlan] | ReplayRefused:
        """The replay of ``interrupted`` as run ``run_id`` on the re-placed chain
        (``placement``), planned with its run's settings ``base``."""
        return plan_replay(
            interrupted, run_id, self.facts, base, self.live_pool(lost_nodes), placement
        )
