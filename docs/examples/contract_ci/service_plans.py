"""A service's own planner, as the README's "Use the contract in your CI" runs it:
``plan_run`` over the service's pools, except that a by-memory placement puts the
biggest node first (the first stage also holds the embedding)."""

from __future__ import annotations

from runplan import (
    ModelFacts,
    NodePool,
    Placement,
    PlacementStrategy,
    PlanRejection,
    RunPlan,
    RuntimeConfig,
    plan_run,
)


def build_plan(
    facts: ModelFacts,
    config: RuntimeConfig,
    pool: NodePool,
    stage_count: int,
    placement: Placement,
) -> RunPlan | PlanRejection:
    if placement.strategy is PlacementStrategy.BY_MEMORY:
        memory = {n.node_id: n.memory_bytes for n in pool.nodes}
        biggest_first = sorted(placement.nodes, key=lambda n: -memory.get(n, 0))
        placement = Placement.by_memory(biggest_first)
    return plan_run(facts, config, pool, stage_count=stage_count, placement=placement)
