"""The shipped clause suite against planners that break the contract on even and
by-memory placements only: the suite's own tests, called with each wrong planner as
its ``runplan_planner``, fail. (``test_plugin.py`` runs the suite the way a service's
CI does, in a pytest of its own; this calls its tests in process.)"""

from __future__ import annotations

import attrs
import pytest

from runplan import (
    ModelFacts,
    NodePool,
    NodeSpec,
    Placement,
    PlacementStrategy,
    PlanRejection,
    RunPlan,
    RuntimeConfig,
    StageAssignment,
    plan_run,
)
from runplan.contract import Planner
from runplan.layers import split_even
from runplan.testing.strategies import PLENTY
from runplan.testing.suite import test_authority, test_formation


def trusts_listed_nodes(
    facts: ModelFacts,
    config: RuntimeConfig,
    pool: NodePool,
    stage_count: int,
    placement: Placement,
) -> RunPlan | PlanRejection:
    """Plans an even or by-memory placement on whatever nodes it lists: a node the pool
    lacks, one listed twice or the orchestrator's becomes a fresh node of the pool."""
    if placement.strategy is PlacementStrategy.EXPLICIT:
        return plan_run(facts, config, pool, stage_count=stage_count, placement=placement)
    known = {n.node_id for n in pool.nodes}
    nodes, used, extra = [], set(), []
    for i, listed in enumerate(placement.nodes):
        node_id = listed
        if listed not in known or listed in used or listed == pool.orchestrator_node_id:
            node_id = f"stand-in-{i}"
            extra.append(NodeSpec(node_id, PLENTY))
        used.add(node_id)
        nodes.append(node_id)
    pool = attrs.evolve(pool, nodes=(*pool.nodes, *extra))
    placement = attrs.evolve(placement, nodes=tuple(nodes))
    return plan_run(facts, config, pool, stage_count=stage_count, placement=placement)


def reverses_listed_nodes(
    facts: ModelFacts,
    config: RuntimeConfig,
    pool: NodePool,
    stage_count: int,
    placement: Placement,
) -> RunPlan | PlanRejection:
    """Plans an even or by-memory placement with its nodes in reverse order."""
    if placement.strategy is not PlacementStrategy.EXPLICIT:
        placement = attrs.evolve(placement, nodes=placement.nodes[::-1])
    return plan_run(facts, config, pool, stage_count=stage_count, placement=placement)


def _fails(suite_test: object, planner: Planner) -> None:
    with pytest.raises(AssertionError, match="is broken"):
        suite_test(runplan_planner=planner)  # type: ignore[operator]


def test_a_planner_that_plans_on_unknown_nodes_of_an_even_placement_fails() -> None:
    _fails(test_authority.test_unknown_node_id_rejects, trusts_listed_nodes)


def test_a_planner_that_plans_on_duplicate_nodes_of_an_even_placement_fails() -> None:
    _fails(test_authority.test_duplicate_stage_assignment_rejects, trusts_listed_nodes)


def test_a_planner_that_reverses_the_nodes_of_an_even_placement_fails() -> None:
    _fails(
        test_formation.test_planner_emits_exactly_one_runplan_or_a_typed_rejection,
        reverses_listed_nodes,
    )


@pytest.mark.parametrize("planner", [trusts_listed_nodes, reverses_listed_nodes])
def test_the_wrong_planners_plan_what_plan_run_plans_of_explicit_rows(planner: Planner) -> None:
    """Each planner above is wrong only on even and by-memory placements."""
    from tests.support.strategies import small_plan_inputs

    facts, config, pool = small_plan_inputs(2)
    nodes = [n.node_id for n in pool.nodes[:2]]
    placement = Placement.even(nodes)
    explicit = Placement(
        assignments=tuple(
            StageAssignment(i, nodes[i], start, end)
            for i, (start, end) in enumerate(split_even(facts.num_layers, 2))
        )
    )
    plan = planner(facts, config, pool, stage_count=2, placement=explicit)
    assert isinstance(plan, RunPlan)
    assert plan == plan_run(facts, config, pool, stage_count=2, placement=placement)
