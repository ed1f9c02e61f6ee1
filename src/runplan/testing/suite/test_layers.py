"""RUNPLAN_CONTRACT.md, "Layer Assignment"."""

from __future__ import annotations

from hypothesis import given

from runplan.contract import PlanInputs, Planner
from runplan.testing import assertions as a
from runplan.testing.strategies import valid_plan_inputs
from runplan.testing.suite._support import planned, suite_settings


@suite_settings
@given(inputs=valid_plan_inputs())
def test_stage_ranges_are_contiguous(runplan_planner: Planner, inputs: PlanInputs) -> None:
    a.assert_stage_ranges_are_contiguous(planned(runplan_planner, inputs), inputs=inputs)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_stage_ranges_do_not_overlap(runplan_planner: Planner, inputs: PlanInputs) -> None:
    a.assert_stage_ranges_do_not_overlap(planned(runplan_planner, inputs), inputs=inputs)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_union_covers_the_intended_gguf_block_range(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    plan = planned(runplan_planner, inputs)
    a.assert_union_covers_the_intended_gguf_block_range(plan, inputs=inputs)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_every_stage_has_exactly_one_non_empty_range(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    plan = planned(runplan_planner, inputs)
    a.assert_every_stage_has_exactly_one_non_empty_range(plan, inputs=inputs)


@suite_settings
@given(inputs=valid_plan_inputs())
def test_stage_indices_are_0_to_stage_count_minus_1(
    runplan_planner: Planner, inputs: PlanInputs
) -> None:
    plan = planned(runplan_planner, inputs)
    a.assert_stage_indices_are_0_to_stage_count_minus_1(plan, inputs=inputs)
