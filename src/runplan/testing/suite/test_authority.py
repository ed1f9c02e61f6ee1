"""RUNPLAN_CONTRACT.md, "Authority / Rejection": contradictory inputs reject, and no
plan is emitted."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from runplan.contract import PlanInputs, Planner
from runplan.provision import provision_all
from runplan.testing import assertions as a
from runplan.testing.strategies import (
    Contradiction,
    duplicate_node_inputs,
    duplicate_stage_inputs,
    inconsistent_facts_inputs,
    invalid_layer_range_inputs,
    invalid_stage_count_inputs,
    missing_stage_inputs,
    tamperings,
    unknown_node_inputs,
    valid_plan_inputs,
)
from runplan.testing.suite._support import (
    check_plan_rejects,
    planned,
    suite_settings,
    whole,
)


def _rejects(planner: Planner, c: Contradiction) -> None:
    a.assert_rejected(c.inputs.plan_with(planner), c.rejection, clause=c.clause, values=c.values)


@suite_settings
@given(contradiction=unknown_node_inputs())
def test_unknown_node_id_rejects(runplan_planner: Planner, contradiction: Contradiction) -> None:
    _rejects(runplan_planner, contradiction)


@suite_settings
@given(contradiction=duplicate_stage_inputs() | duplicate_node_inputs())
def test_duplicate_stage_assignment_rejects(
    runplan_planner: Planner, contradiction: Contradiction
) -> None:
    _rejects(runplan_planner, contradiction)


@suite_settings
@given(contradiction=missing_stage_inputs())
def test_missing_stage_rejects(runplan_planner: Planner, contradiction: Contradiction) -> None:
    _rejects(runplan_planner, contradiction)


@suite_settings
@given(contradiction=invalid_stage_count_inputs())
def test_invalid_stage_count_rejects(
    runplan_planner: Planner, contradiction: Contradiction
) -> None:
    _rejects(runplan_planner, contradiction)


@suite_settings
@given(contradiction=invalid_layer_range_inputs())
def test_layer_ranges_with_a_gap_an_overlap_or_beyond_the_model_reject(
    runplan_planner: Planner, contradiction: Contradiction
) -> None:
    """Explicit ranges that would break a Layer Assignment clause reject."""
    _rejects(runplan_planner, contradiction)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_edge_endpoint_mismatch_rejects(runplan_planner: Planner, inputs: PlanInputs) -> None:
    a.assert_edge_endpoint_mismatch_rejects(planned(runplan_planner, inputs), inputs=inputs)


@suite_settings
@given(inputs=valid_plan_inputs(), data=st.data())
def test_edge_endpoint_mismatch_rejects__on_a_checked_plan(
    runplan_planner: Planner, inputs: PlanInputs, data: st.DataObject
) -> None:
    plan = whole(runplan_planner, inputs)
    check_plan_rejects(data.draw(tamperings(plan, breaking="edge_endpoint_mismatch_rejects")))


@suite_settings
@given(contradiction=inconsistent_facts_inputs())
def test_inconsistent_model_facts_reject(
    runplan_planner: Planner, contradiction: Contradiction
) -> None:
    _rejects(runplan_planner, contradiction)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_planner_is_the_only_source_of_assignment(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    plan = planned(runplan_planner, inputs)
    # Stages are provisioned from the plan alone: the plan as it travels (the wire)
    # yields the very same provisions, and they agree with the plan.
    a.assert_planner_is_the_only_source_of_assignment(plan, provision_all(plan), inputs=inputs)
    a.assert_specs_are_copied_consistently_into_stage_provisions(plan, inputs=inputs)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_authority_clauses_hold_on_the_plans_of_valid_inputs(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    """What the planner plans names only pool nodes, assigns each stage once, misses
    none, counts its stages right, and agrees with the model facts."""
    plan = planned(runplan_planner, inputs)
    for check in (
        a.assert_unknown_node_id_rejects,
        a.assert_duplicate_stage_assignment_rejects,
        a.assert_missing_stage_rejects,
        a.assert_invalid_stage_count_rejects,
        a.assert_inconsistent_model_facts_reject,
    ):
        check(plan, inputs=inputs)
