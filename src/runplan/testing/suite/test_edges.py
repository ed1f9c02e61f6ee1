"""RUNPLAN_CONTRACT.md, "Edge Assignment"."""

from __future__ import annotations

import attrs
from hypothesis import given
from hypothesis import strategies as st

from runplan.contract import CLAUSE, PlanInputs, Planner
from runplan.provision import provision_all
from runplan.testing import assertions as a
from runplan.testing.strategies import tamperings, valid_plan_inputs
from runplan.testing.suite._support import (
    check_plan_rejects,
    planned,
    suite_settings,
    whole,
)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_every_edge_id_is_unique_within_the_run(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    a.assert_every_edge_id_is_unique_within_the_run(planned(runplan_planner, inputs))


@suite_settings
@given(inputs=valid_plan_inputs(), data=st.data())
def test_every_edge_id_is_unique_within_the_run__on_a_checked_plan(
    runplan_planner: Planner, inputs: PlanInputs, data: st.DataObject
) -> None:
    plan = whole(runplan_planner, inputs)
    t = data.draw(tamperings(plan, breaking="every_edge_id_is_unique_within_the_run"))
    check_plan_rejects(t)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_every_edge_has_exactly_one_producer_and_one_consumer(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    plan = planned(runplan_planner, inputs)
    a.assert_every_edge_has_exactly_one_producer_and_one_consumer(plan, inputs=inputs)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_token_in_edge_is_orchestrator_to_stage_0(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    plan = planned(runplan_planner, inputs)
    a.assert_token_in_edge_is_orchestrator_to_stage_0(plan, inputs=inputs)
    a.assert_planner_never_mutates_the_pool_or_derives_hidden_topology(plan, inputs=inputs)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_activation_edge_i_is_stage_i_to_stage_i_plus_1(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    plan = planned(runplan_planner, inputs)
    a.assert_activation_edge_i_is_stage_i_to_stage_i_plus_1(plan, inputs=inputs)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_token_out_edge_is_stage_n_minus_1_to_orchestrator(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    plan = planned(runplan_planner, inputs)
    a.assert_token_out_edge_is_stage_n_minus_1_to_orchestrator(plan, inputs=inputs)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_stages_do_not_derive_edge_ids(runplan_planner: Planner, inputs: PlanInputs) -> None:
    plan = planned(runplan_planner, inputs)
    # A stage is handed its edge ids: its provision names the plan's edges it consumes
    # and produces, so it has nothing to derive.
    a.assert_stages_do_not_derive_edge_ids(plan, provision_all(plan), inputs=inputs)
    # And the ids are the planner's own: renaming every node leaves them unchanged, so
    # nothing a stage knows of its peers' names could stand in for them.
    rename = {n.node_id: f"renamed-{n.node_id}" for n in inputs.pool.nodes}
    pool = attrs.evolve(
        inputs.pool,
        nodes=tuple(attrs.evolve(n, node_id=rename[n.node_id]) for n in inputs.pool.nodes),
    )
    placement = attrs.evolve(
        inputs.placement,
        nodes=tuple(rename[n] for n in inputs.placement.nodes),
        assignments=tuple(
            attrs.evolve(x, node_id=rename[x.node_id]) for x in inputs.placement.assignments
        ),
    )
    renamed = planned(runplan_planner, attrs.evolve(inputs, pool=pool, placement=placement))
    assert [e.edge_id for e in renamed.edges] == [e.edge_id for e in plan.edges], (
        f"{CLAUSE['stages_do_not_derive_edge_ids'].quote()} is broken: renaming the nodes "
        "changed the edge ids"
    )
