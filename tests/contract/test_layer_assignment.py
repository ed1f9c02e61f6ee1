"""RUNPLAN_CONTRACT.md, "Layer Assignment": the shipped clause suite against
``plan_run``, and how ``plan_run`` keeps explicit placements."""

from __future__ import annotations

from hypothesis import given

from runplan import RunPlan, plan_run
from runplan.testing.suite.test_layers import *  # noqa: F403
from tests.support.strategies import PlanInputs, valid_plan_inputs


@given(valid_plan_inputs())
def test_explicit_assignments_are_kept_as_given(inputs: PlanInputs) -> None:
    plan = plan_run(inputs.facts, inputs.config, inputs.pool, **inputs.kwargs())
    assert isinstance(plan, RunPlan), plan
    for a in inputs.placement.assignments:
        s = plan.stages[a.stage_index]
        assert (s.node_id, s.layer_start, s.layer_end_exclusive) == (
            a.node_id,
            a.layer_start,
            a.layer_end_exclusive,
        )
    for i, node_id in enumerate(inputs.placement.nodes):
        assert plan.stages[i].node_id == node_id
