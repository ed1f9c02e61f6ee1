"""RUNPLAN_CONTRACT.md, "RunPlan Formation"."""

from __future__ import annotations

import copy

import attrs
from hypothesis import given
from hypothesis import strategies as st

from runplan import PlanRejection, RunPlan, check_plan, plan_run
from runplan.rejections import REJECTIONS
from tests.strategies import PlanInputs, valid_plan_inputs


def _plan(inputs: PlanInputs) -> RunPlan | PlanRejection:
    return plan_run(inputs.facts, inputs.config, inputs.pool, **inputs.kwargs())


@st.composite
def any_plan_inputs(draw: st.DrawFn) -> PlanInputs:
    """Valid inputs, or valid inputs with one field broken."""
    inputs = draw(valid_plan_inputs())
    breakage = draw(st.sampled_from(["none", "stages", "memory", "layers", "node", "dtype"]))
    if breakage == "stages":
        return attrs.evolve(inputs, stage_count=draw(st.integers(-2, 80)))
    if breakage == "memory":
        nodes = tuple(
            attrs.evolve(n, memory_bytes=draw(st.integers(0, 2**20))) for n in inputs.pool.nodes
        )
        return attrs.evolve(inputs, pool=attrs.evolve(inputs.pool, nodes=nodes))
    if breakage == "layers":
        facts = attrs.evolve(inputs.facts, num_layers=draw(st.integers(0, 80)))
        return attrs.evolve(inputs, facts=facts)
    if breakage == "node":
        nodes = inputs.pool.nodes[1:]
        return attrs.evolve(inputs, pool=attrs.evolve(inputs.pool, nodes=nodes))
    if breakage == "dtype":
        config = attrs.evolve(inputs.config, activation_dtype_width_bytes=draw(st.integers(0, 9)))
        return attrs.evolve(inputs, config=config)
    return inputs


@given(any_plan_inputs())
def test_planner_emits_exactly_one_runplan_or_typed_rejection(inputs: PlanInputs) -> None:
    result = _plan(inputs)
    assert isinstance(result, RunPlan | PlanRejection)
    if isinstance(result, PlanRejection):
        assert type(result) is REJECTIONS[result.code]
        assert attrs.has(type(result))  # a frozen value carrying the offending values
        assert str(result).startswith(result.code)


@given(any_plan_inputs())
def test_planner_never_emits_a_partial_plan(inputs: PlanInputs) -> None:
    result = _plan(inputs)
    if isinstance(result, RunPlan):
        # Whatever plan_run emits keeps every guarantee of the contract, whole.
        assert check_plan(result) is result
        assert len(result.stages) == inputs.stage_count
        assert len(result.edges) == inputs.stage_count + 1


@given(any_plan_inputs())
def test_planner_never_mutates_the_candidate_pool(inputs: PlanInputs) -> None:
    before = copy.deepcopy(inputs)
    _plan(inputs)
    assert inputs == before


@given(valid_plan_inputs())
def test_same_inputs_give_an_equal_plan(inputs: PlanInputs) -> None:
    first = _plan(inputs)
    second = _plan(copy.deepcopy(inputs))
    assert isinstance(first, RunPlan)
    assert first == second


@given(valid_plan_inputs())
def test_planner_derives_no_hidden_topology(inputs: PlanInputs) -> None:
    plan = _plan(inputs)
    assert isinstance(plan, RunPlan)
    pool_ids = {n.node_id for n in inputs.pool.nodes}
    endpoints = {e.producer.node_id for e in plan.edges} | {e.consumer.node_id for e in plan.edges}
    # Every node the plan names is a stage node from the pool or the orchestrator...
    assert {s.node_id for s in plan.stages} <= pool_ids
    assert endpoints == {s.node_id for s in plan.stages} | {inputs.pool.orchestrator_node_id}
    # ...and the only stages and edges are the pipeline's.
    assert [s.stage_index for s in plan.stages] == list(range(inputs.stage_count))
