"""RUNPLAN_CONTRACT.md, "Layer Assignment"."""

from __future__ import annotations

from hypothesis import given

from runplan import RunPlan, plan_run
from tests.strategies import PlanInputs, valid_plan_inputs


def _plan(inputs: PlanInputs) -> RunPlan:
    plan = plan_run(inputs.facts, inputs.config, inputs.pool, **inputs.kwargs())
    assert isinstance(plan, RunPlan), plan
    return plan


@given(valid_plan_inputs())
def test_stage_ranges_are_contiguous(inputs: PlanInputs) -> None:
    plan = _plan(inputs)
    for before, after in zip(plan.stages, plan.stages[1:], strict=False):
        assert before.layer_end_exclusive == after.layer_start


@given(valid_plan_inputs())
def test_stage_ranges_do_not_overlap(inputs: PlanInputs) -> None:
    plan = _plan(inputs)
    owners: dict[int, int] = {}
    for s in plan.stages:
        for layer in range(s.layer_start, s.layer_end_exclusive):
            assert layer not in owners, (
                f"layer {layer} in stages {owners[layer]} and {s.stage_index}"
            )
            owners[layer] = s.stage_index


@given(valid_plan_inputs())
def test_union_covers_the_intended_gguf_block_range(inputs: PlanInputs) -> None:
    plan = _plan(inputs)
    covered = set()
    for s in plan.stages:
        covered |= set(range(s.layer_start, s.layer_end_exclusive))
    assert covered == set(range(inputs.facts.num_layers))
    assert plan.model.num_layers == inputs.facts.num_layers


@given(valid_plan_inputs())
def test_every_stage_has_exactly_one_non_empty_range(inputs: PlanInputs) -> None:
    plan = _plan(inputs)
    for s in plan.stages:
        assert 0 <= s.layer_start < s.layer_end_exclusive <= inputs.facts.num_layers


@given(valid_plan_inputs())
def test_stage_indices_are_0_to_stage_count_minus_1(inputs: PlanInputs) -> None:
    plan = _plan(inputs)
    assert [s.stage_index for s in plan.stages] == list(range(inputs.stage_count))
    assert {s.stage_count for s in plan.stages} == {inputs.stage_count}


@given(valid_plan_inputs())
def test_explicit_assignments_are_kept_as_given(inputs: PlanInputs) -> None:
    plan = _plan(inputs)
    for a in inputs.placement.assignments:
        s = plan.stages[a.stage_index]
        assert (s.node_id, s.layer_start, s.layer_end_exclusive) == (
            a.node_id,
            a.layer_start,
            a.layer_end_exclusive,
        )
    for i, node_id in enumerate(inputs.placement.nodes):
        assert plan.stages[i].node_id == node_id
