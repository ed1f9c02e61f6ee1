"""RUNPLAN_CONTRACT.md, "Edge Assignment"."""

from __future__ import annotations

from collections import Counter

import attrs
from hypothesis import given

from runplan import (
    EdgeKind,
    OrchestratorEndpoint,
    RunPlan,
    StageEndpoint,
    plan_run,
    provision_all,
)
from tests.strategies import PlanInputs, valid_plan_inputs


def _plan(inputs: PlanInputs) -> RunPlan:
    plan = plan_run(inputs.facts, inputs.config, inputs.pool, **inputs.kwargs())
    assert isinstance(plan, RunPlan), plan
    return plan


@given(valid_plan_inputs())
def test_every_edge_id_is_unique_within_the_run(inputs: PlanInputs) -> None:
    plan = _plan(inputs)
    assert max(Counter(e.edge_id for e in plan.edges).values()) == 1


@given(valid_plan_inputs())
def test_every_edge_has_exactly_one_producer_and_one_consumer(inputs: PlanInputs) -> None:
    plan = _plan(inputs)
    endpoint_types = (OrchestratorEndpoint, StageEndpoint)
    for e in plan.edges:
        assert isinstance(e.producer, endpoint_types)
        assert isinstance(e.consumer, endpoint_types)
        assert e.producer != e.consumer
    # Each stage produces exactly one edge and consumes exactly one edge.
    produced = Counter(e.producer for e in plan.edges if isinstance(e.producer, StageEndpoint))
    consumed = Counter(e.consumer for e in plan.edges if isinstance(e.consumer, StageEndpoint))
    assert set(produced.values()) == {1} and set(consumed.values()) == {1}
    assert len(produced) == len(consumed) == plan.stage_count


@given(valid_plan_inputs())
def test_token_in_edge_is_orchestrator_to_stage_0(inputs: PlanInputs) -> None:
    plan = _plan(inputs)
    token_in = [e for e in plan.edges if e.kind is EdgeKind.TOKEN_IN]
    assert len(token_in) == 1
    (e,) = token_in
    assert e.producer == OrchestratorEndpoint(inputs.pool.orchestrator_node_id)
    assert e.consumer == StageEndpoint(plan.stages[0].node_id, 0)
    assert plan.stages[0].inbound_edge == e.edge_id


@given(valid_plan_inputs())
def test_activation_edge_i_is_stage_i_to_stage_i_plus_1(inputs: PlanInputs) -> None:
    plan = _plan(inputs)
    activations = [e for e in plan.edges if e.kind is EdgeKind.ACTIVATION]
    assert len(activations) == plan.stage_count - 1
    for i, stage in enumerate(plan.stages[:-1]):
        (e,) = [a for a in activations if a.edge_id == stage.outbound_edge]
        nxt = plan.stages[i + 1]
        assert e.producer == StageEndpoint(stage.node_id, i)
        assert e.consumer == StageEndpoint(nxt.node_id, i + 1)
        assert nxt.inbound_edge == e.edge_id


@given(valid_plan_inputs())
def test_token_out_edge_is_stage_n_minus_1_to_orchestrator(inputs: PlanInputs) -> None:
    plan = _plan(inputs)
    token_out = [e for e in plan.edges if e.kind is EdgeKind.TOKEN_OUT]
    assert len(token_out) == 1
    (e,) = token_out
    last = plan.stages[-1]
    assert e.producer == StageEndpoint(last.node_id, plan.stage_count - 1)
    assert e.consumer == OrchestratorEndpoint(inputs.pool.orchestrator_node_id)
    assert last.outbound_edge == e.edge_id


@given(valid_plan_inputs())
def test_stages_do_not_derive_edge_ids_from_names_hashes_layer_ranges_or_peers(
    inputs: PlanInputs,
) -> None:
    plan = _plan(inputs)
    # A stage is handed its edge ids: its provision names exactly the plan's edges
    # that it produces and consumes, so it has nothing to derive.
    for stage, msg in zip(plan.stages, provision_all(plan), strict=True):
        assert msg.inbound.edge_id == stage.inbound_edge
        assert msg.outbound.edge_id == stage.outbound_edge
        assert plan.edge(msg.inbound.edge_id).consumer == StageEndpoint(
            stage.node_id, stage.stage_index
        )
        assert plan.edge(msg.outbound.edge_id).producer == StageEndpoint(
            stage.node_id, stage.stage_index
        )
    # And the ids are the planner's own: renaming every node leaves them unchanged,
    # so they are not derived from node names.
    rename = {n.node_id: f"renamed-{n.node_id}" for n in inputs.pool.nodes}
    pool = attrs.evolve(
        inputs.pool,
        nodes=tuple(attrs.evolve(n, node_id=rename[n.node_id]) for n in inputs.pool.nodes),
    )
    placement = attrs.evolve(
        inputs.placement,
        nodes=tuple(rename[n] for n in inputs.placement.nodes),
        assignments=tuple(
            attrs.evolve(a, node_id=rename[a.node_id]) for a in inputs.placement.assignments
        ),
    )
    renamed = plan_run(
        inputs.facts, inputs.config, pool, stage_count=inputs.stage_count, placement=placement
    )
    assert isinstance(renamed, RunPlan)
    assert [e.edge_id for e in renamed.edges] == [e.edge_id for e in plan.edges]
