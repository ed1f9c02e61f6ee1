"""RUNPLAN_CONTRACT.md, "Provisioning Projection": the shipped clause suite against
``plan_run``, the shape of the provision messages, and what they carry of the config."""

from __future__ import annotations

import attrs
import pytest
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
from runplan.testing.suite.test_provisioning import *  # noqa: F403
from tests.support.strategies import PlanInputs, valid_plan_inputs


def test_a_provision_has_one_layer_range_one_inbound_and_one_outbound_edge_and_no_producer() -> (
    None
):
    layer_fields = {f.name for f in attrs.fields(ProvisionStage) if "layer" in f.name}
    assert layer_fields == {"layer_start", "layer_end_exclusive"}
    edge_fields = [
        f.name
        for f in attrs.fields(ProvisionStage)
        if f.type in ("InboundEdgeProvision", "OutboundEdgeProvision")
        or f.type in (InboundEdgeProvision, OutboundEdgeProvision)
    ]
    assert edge_fields == ["inbound", "outbound"]
    inbound = {f.name for f in attrs.fields(InboundEdgeProvision)}
    assert inbound == {"edge_id", "kind", "object_spec", "ring_spec"}  # nothing of a producer


@given(valid_plan_inputs())
def test_sampling_reaches_the_last_stage_only_and_timeouts_every_stage(
    inputs: PlanInputs,
) -> None:
    plan = plan_run(inputs.facts, inputs.config, inputs.pool, **inputs.kwargs())
    assert isinstance(plan, RunPlan), plan
    msgs = provision_all(plan)
    for msg in msgs:
        assert msg.timeouts == inputs.config.timeouts
    assert msgs[-1].sampling == inputs.config.sampling
    assert msgs[-1].return_logits == inputs.config.return_logits
    assert all(m.sampling is None and not m.return_logits for m in msgs[:-1])


@pytest.mark.parametrize("plan", [None, "plan", 3])
def test_provisioning_what_is_not_a_plan_is_a_type_error_naming_the_argument(plan: object) -> None:
    with pytest.raises(TypeError, match="plan must be RunPlan"):
        provision_all(plan)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="plan must be RunPlan"):
        provision_stage(plan, 0)  # type: ignore[arg-type]
