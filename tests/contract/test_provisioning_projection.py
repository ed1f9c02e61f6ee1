"""RUNPLAN_CONTRACT.md, "Provisioning Projection"."""

from __future__ import annotations

import copy
from typing import Any

import attrs
from hypothesis import given

from runplan import (
    InboundEdgeProvision,
    OutboundEdgeProvision,
    ProvisionStage,
    RunPlan,
    plan_run,
    provision_all,
    provision_stage,
)
from tests.strategies import PlanInputs, valid_plan_inputs


def _plan(inputs: PlanInputs) -> RunPlan:
    plan = plan_run(inputs.facts, inputs.config, inputs.pool, **inputs.kwargs())
    assert isinstance(plan, RunPlan), plan
    return plan


def _strings(value: Any) -> set[str]:
    """Every string anywhere inside a value class."""
    if isinstance(value, str):
        return {value}
    if attrs.has(type(value)):
        return set().union(*(_strings(getattr(value, f.name)) for f in attrs.fields(type(value))))
    if isinstance(value, tuple | list):
        return set().union(set(), *(_strings(v) for v in value))
    return set()


@given(valid_plan_inputs())
def test_deriving_provision_stage_is_deterministic(inputs: PlanInputs) -> None:
    plan = _plan(inputs)
    first = provision_all(plan)
    assert provision_all(copy.deepcopy(plan)) == first
    assert tuple(provision_stage(plan, i) for i in range(plan.stage_count)) == first


@given(valid_plan_inputs())
def test_a_stage_receives_only_its_own_layer_range(inputs: PlanInputs) -> None:
    plan = _plan(inputs)
    for stage, msg in zip(plan.stages, provision_all(plan), strict=True):
        assert (msg.stage_index, msg.layer_start, msg.layer_end_exclusive) == (
            stage.stage_index,
            stage.layer_start,
            stage.layer_end_exclusive,
        )
        # No other field of the message holds layer bounds.
        layer_fields = {f.name for f in attrs.fields(ProvisionStage) if "layer" in f.name}
        assert layer_fields == {"layer_start", "layer_end_exclusive"}


@given(valid_plan_inputs())
def test_a_stage_receives_exactly_one_inbound_and_one_outbound_edge_provision(
    inputs: PlanInputs,
) -> None:
    plan = _plan(inputs)
    for msg in provision_all(plan):
        edge_fields = [
            f.name
            for f in attrs.fields(ProvisionStage)
            if f.type in ("InboundEdgeProvision", "OutboundEdgeProvision")
            or f.type in (InboundEdgeProvision, OutboundEdgeProvision)
        ]
        assert edge_fields == ["inbound", "outbound"]
        assert isinstance(msg.inbound, InboundEdgeProvision)
        assert isinstance(msg.outbound, OutboundEdgeProvision)
        assert msg.inbound.edge_id != msg.outbound.edge_id


@given(valid_plan_inputs())
def test_outbound_provision_contains_the_consumer_node_id(inputs: PlanInputs) -> None:
    plan = _plan(inputs)
    msgs = provision_all(plan)
    for i, msg in enumerate(msgs):
        if i + 1 < len(msgs):
            assert msg.outbound.consumer_node_id == plan.stages[i + 1].node_id
        else:
            assert msg.outbound.consumer_node_id == inputs.pool.orchestrator_node_id


@given(valid_plan_inputs())
def test_inbound_provision_does_not_require_producer_actor_address(inputs: PlanInputs) -> None:
    plan = _plan(inputs)
    producer_fields = {f.name for f in attrs.fields(InboundEdgeProvision)} & {
        "producer",
        "producer_node_id",
        "producer_address",
        "address",
    }
    assert producer_fields == set()
    for i, msg in enumerate(provision_all(plan)):
        producer = plan.edge(msg.inbound.edge_id).producer.node_id
        if producer != plan.stages[i].node_id:
            assert producer not in _strings(msg.inbound)


@given(valid_plan_inputs())
def test_no_provision_message_contains_remote_actor_addresses_for_data_flow(
    inputs: PlanInputs,
) -> None:
    plan = _plan(inputs)
    all_nodes = {n.node_id for n in inputs.pool.nodes} | {inputs.pool.orchestrator_node_id}
    for msg in provision_all(plan):
        named = _strings(msg) & all_nodes
        # The stage's own node and the consumer's node id; nothing else that names a peer.
        assert named <= {msg.node_id, msg.outbound.consumer_node_id}


@given(valid_plan_inputs())
def test_sampling_reaches_the_last_stage_only_and_timeouts_every_stage(
    inputs: PlanInputs,
) -> None:
    plan = _plan(inputs)
    msgs = provision_all(plan)
    for msg in msgs:
        assert msg.timeouts == inputs.config.timeouts
    assert msgs[-1].sampling == inputs.config.sampling
    assert msgs[-1].return_logits == inputs.config.return_logits
    assert all(m.sampling is None and not m.return_logits for m in msgs[:-1])
