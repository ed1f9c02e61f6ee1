"""RUNPLAN_CONTRACT.md, "RunPlan Formation"."""

from __future__ import annotations

import copy

from hypothesis import given

from runplan.check import check_plan
from runplan.contract import CLAUSE, PlanInputs, Planner
from runplan.plan import RunPlan
from runplan.provision import provision_all
from runplan.testing import assertions as a
from runplan.testing.strategies import any_plan_inputs, valid_plan_inputs
from runplan.testing.suite._support import planned, suite_settings


@suite_settings
@given(inputs=any_plan_inputs())
def test_planner_emits_exactly_one_runplan_or_a_typed_rejection(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    result = inputs.plan_with(runplan_planner)
    a.assert_planner_emits_exactly_one_runplan_or_a_typed_rejection(result, inputs=inputs)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_planner_emits_exactly_one_runplan_or_a_typed_rejection__same_inputs_same_plan(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    first = planned(runplan_planner, inputs)
    second = copy.deepcopy(inputs).plan_with(runplan_planner)
    assert first == second, (
        CLAUSE["planner_emits_exactly_one_runplan_or_a_typed_rejection"].quote()
        + " is broken: the same inputs gave two different plans"
    )


@suite_settings
@given(inputs=any_plan_inputs())
def test_planner_never_emits_a_partial_plan(runplan_planner: Planner, inputs: PlanInputs) -> None:
    result = inputs.plan_with(runplan_planner)
    if isinstance(result, RunPlan):
        # Whatever the planner emits keeps every guarantee of the contract, whole.
        a.assert_planner_never_emits_a_partial_plan(result, inputs=inputs)
        assert check_plan(result) is result, (
            f"{CLAUSE['planner_never_emits_a_partial_plan'].quote()} is broken: "
            f"check_plan rejects the plan: {check_plan(result)}"
        )


@suite_settings
@given(inputs=any_plan_inputs())
def test_planner_never_mutates_the_pool_or_derives_hidden_topology(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    before = copy.deepcopy(inputs)
    result = inputs.plan_with(runplan_planner)
    assert inputs == before, (
        CLAUSE["planner_never_mutates_the_pool_or_derives_hidden_topology"].quote()
        + " is broken: planning changed its inputs"
    )
    if isinstance(result, RunPlan):
        a.assert_planner_never_mutates_the_pool_or_derives_hidden_topology(
            result, provision_all(result), inputs=inputs
        )
