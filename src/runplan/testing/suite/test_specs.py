"""RUNPLAN_CONTRACT.md, "Object/Ring Spec Consistency"."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from runplan.contract import PlanInputs, Planner
from runplan.testing import assertions as a
from runplan.testing.strategies import (
    Contradiction,
    invalid_spec_inputs,
    tamperings,
    valid_plan_inputs,
)
from runplan.testing.suite._support import (
    check_plan_rejects,
    planned,
    suite_settings,
    whole,
)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_every_edge_has_an_object_spec_and_a_ring_spec(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    plan = planned(runplan_planner, inputs)
    a.assert_every_edge_has_an_object_spec_and_a_ring_spec(plan, inputs=inputs)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_activation_max_extent_follows_the_model_facts(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    plan = planned(runplan_planner, inputs)
    a.assert_activation_max_extent_follows_the_model_facts(plan, inputs=inputs)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_token_edges_use_token_specs_and_activation_edges_activation_specs(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    plan = planned(runplan_planner, inputs)
    a.assert_token_edges_use_token_specs_and_activation_edges_activation_specs(plan, inputs=inputs)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_specs_are_copied_consistently_into_stage_provisions(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    plan = planned(runplan_planner, inputs)
    a.assert_specs_are_copied_consistently_into_stage_provisions(plan, inputs=inputs)


@suite_settings
@given(contradiction=invalid_spec_inputs())
def test_invalid_extent_alignment_dtype_width_or_layout_rejects(
    runplan_planner: Planner, contradiction: Contradiction
) -> None:
    c = contradiction
    result = c.inputs.plan_with(runplan_planner)
    a.assert_rejected(result, c.rejection, clause=c.clause, values=c.values)


@suite_settings
@given(inputs=valid_plan_inputs(), data=st.data())
def test_invalid_extent_alignment_dtype_width_or_layout_rejects__on_a_checked_plan(
    runplan_planner: Planner, inputs: PlanInputs, data: st.DataObject
) -> None:
    plan = whole(runplan_planner, inputs)
    clause = "invalid_extent_alignment_dtype_width_or_layout_rejects"
    check_plan_rejects(data.draw(tamperings(plan, breaking=clause)))
