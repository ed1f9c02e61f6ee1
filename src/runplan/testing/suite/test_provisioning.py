"""RUNPLAN_CONTRACT.md, "Provisioning Projection". The provisions are those
``provision_all`` derives from the planner's plan."""

from __future__ import annotations

from hypothesis import given

from runplan.contract import PlanInputs, Planner
from runplan.provision import provision_all
from runplan.testing import assertions as a
from runplan.testing.strategies import valid_plan_inputs
from runplan.testing.suite._support import planned, suite_settings


@suite_settings
@given(inputs=valid_plan_inputs())
def test_deriving_provision_stage_is_deterministic(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    plan = planned(runplan_planner, inputs)
    a.assert_deriving_provision_stage_is_deterministic(plan, provision_all(plan), inputs=inputs)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_a_stage_receives_only_its_own_layer_range(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    plan = planned(runplan_planner, inputs)
    a.assert_a_stage_receives_only_its_own_layer_range(plan, inputs=inputs)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_a_stage_receives_one_inbound_and_one_outbound_edge_provision(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    plan = planned(runplan_planner, inputs)
    a.assert_a_stage_receives_one_inbound_and_one_outbound_edge_provision(plan, inputs=inputs)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_outbound_provision_contains_the_consumer_node_id(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    plan = planned(runplan_planner, inputs)
    a.assert_outbound_provision_contains_the_consumer_node_id(plan, inputs=inputs)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_inbound_provision_does_not_require_producer_address(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    plan = planned(runplan_planner, inputs)
    a.assert_inbound_provision_does_not_require_producer_address(plan, inputs=inputs)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_no_provision_contains_remote_actor_addresses(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    plan = planned(runplan_planner, inputs)
    a.assert_no_provision_contains_remote_actor_addresses(plan, inputs=inputs)
