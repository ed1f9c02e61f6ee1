"""RUNPLAN_CONTRACT.md, "Object/Ring Spec Consistency"."""

from __future__ import annotations

import attrs
from hypothesis import given
from hypothesis import strategies as st

from runplan import (
    DTypeFamily,
    EdgeKind,
    Layout,
    ObjectKind,
    ObjectSpec,
    RingSpec,
    RunPlan,
    check_plan,
    plan_run,
    provision_all,
)
from runplan.plan import OBJECT_HEADER_BYTES
from runplan.rejections import (
    InvalidAlignment,
    InvalidDtypeWidth,
    InvalidExtent,
    UnsupportedLayout,
)
from tests.strategies import PlanInputs, valid_plan_inputs


def _plan(inputs: PlanInputs) -> RunPlan:
    plan = plan_run(inputs.facts, inputs.config, inputs.pool, **inputs.kwargs())
    assert isinstance(plan, RunPlan), plan
    return plan


def _with_edge(plan: RunPlan, index: int, **changes: object) -> RunPlan:
    edges = list(plan.edges)
    edges[index] = attrs.evolve(edges[index], **changes)
    return attrs.evolve(plan, edges=tuple(edges))


@given(valid_plan_inputs())
def test_every_edge_has_an_object_spec_and_a_ring_spec(inputs: PlanInputs) -> None:
    plan = _plan(inputs)
    for e in plan.edges:
        assert isinstance(e.object_spec, ObjectSpec)
        assert isinstance(e.ring_spec, RingSpec)
        assert e.ring_spec.slot_count == inputs.config.ring_slot_count >= 1
        assert e.ring_spec.alignment == inputs.config.ring_alignment
        assert e.ring_spec.slot_bytes % e.ring_spec.alignment == 0
        assert e.ring_spec.slot_bytes >= OBJECT_HEADER_BYTES + e.object_spec.max_extent


@given(valid_plan_inputs())
def test_activation_max_extent_follows_the_model_facts(inputs: PlanInputs) -> None:
    plan = _plan(inputs)
    facts, config = inputs.facts, inputs.config
    expected = facts.max_seq_len * facts.hidden_dim * config.activation_dtype_width_bytes
    for e in plan.edges:
        if e.kind is EdgeKind.ACTIVATION:
            assert e.object_spec.max_extent == expected
            assert e.object_spec.dtype_width_bytes == config.activation_dtype_width_bytes
            assert e.object_spec.dtype_family is config.activation_dtype_family


@given(valid_plan_inputs())
def test_token_edges_use_token_specs_and_activation_edges_activation_specs(
    inputs: PlanInputs,
) -> None:
    plan = _plan(inputs)
    vocab = inputs.facts.vocab_size
    for e in plan.edges:
        spec = e.object_spec
        if e.kind is EdgeKind.ACTIVATION:
            assert (spec.kind, spec.layout) == (ObjectKind.ACTIVATION, Layout.ROW_MAJOR)
            continue
        assert spec.kind is ObjectKind.TOKEN
        assert (spec.dtype_family, spec.dtype_width_bytes) == (DTypeFamily.UINT, 4)
        if e.kind is EdgeKind.TOKEN_IN:
            assert spec.max_extent == inputs.facts.max_seq_len * 4
        elif inputs.config.return_logits:
            assert spec.layout is Layout.TOKEN_ID_WITH_LOGITS
            assert spec.max_extent == 4 + 4 * vocab
        else:
            assert spec.layout is Layout.TOKEN_IDS and spec.max_extent == 4


@given(valid_plan_inputs())
def test_specs_are_copied_consistently_into_stage_provisions(inputs: PlanInputs) -> None:
    plan = _plan(inputs)
    for msg in provision_all(plan):
        inbound, outbound = plan.edge(msg.inbound.edge_id), plan.edge(msg.outbound.edge_id)
        assert (msg.inbound.kind, msg.inbound.object_spec, msg.inbound.ring_spec) == (
            inbound.kind,
            inbound.object_spec,
            inbound.ring_spec,
        )
        assert (msg.outbound.kind, msg.outbound.object_spec, msg.outbound.ring_spec) == (
            outbound.kind,
            outbound.object_spec,
            outbound.ring_spec,
        )
        assert msg.model.hidden_dim == plan.model.hidden_dim
        assert msg.model.max_seq_len == plan.model.max_seq_len
        assert (msg.model.dtype_family, msg.model.dtype_width_bytes) == (
            plan.model.dtype_family,
            plan.model.dtype_width_bytes,
        )


# -- invalid extent, alignment, dtype width, unsupported layout reject -----------


@given(valid_plan_inputs(), st.integers(0, 0) | st.integers(2**64, 2**70))
def test_invalid_extent_rejects_the_plan(inputs: PlanInputs, seq_len: int) -> None:
    facts = attrs.evolve(inputs.facts, max_seq_len=seq_len)
    result = plan_run(facts, inputs.config, inputs.pool, **inputs.kwargs())
    assert isinstance(result, InvalidExtent)


@given(valid_plan_inputs(), st.data())
def test_invalid_extent_on_a_checked_plan_rejects(inputs: PlanInputs, data: st.DataObject) -> None:
    plan = _plan(inputs)
    index = data.draw(st.integers(0, len(plan.edges) - 1))
    spec = plan.edges[index].object_spec
    bad = data.draw(
        st.integers(0, 0) | st.integers(1, 2**66).filter(lambda x: x != spec.max_extent)
    )
    result = check_plan(_with_edge(plan, index, object_spec=attrs.evolve(spec, max_extent=bad)))
    assert isinstance(result, InvalidExtent)
    assert result.value == bad


@given(valid_plan_inputs(), st.integers(-8, 2**12).filter(lambda a: a <= 0 or a & (a - 1)))
def test_invalid_alignment_rejects_the_plan(inputs: PlanInputs, alignment: int) -> None:
    config = attrs.evolve(inputs.config, ring_alignment=alignment)
    result = plan_run(inputs.facts, config, inputs.pool, **inputs.kwargs())
    assert isinstance(result, InvalidAlignment)
    assert result.alignment == alignment


@given(valid_plan_inputs(), st.data())
def test_invalid_alignment_on_a_checked_plan_rejects(
    inputs: PlanInputs, data: st.DataObject
) -> None:
    plan = _plan(inputs)
    index = data.draw(st.integers(0, len(plan.edges) - 1))
    alignment = data.draw(st.integers(-8, 2**12).filter(lambda a: a <= 0 or a & (a - 1)))
    ring = attrs.evolve(plan.edges[index].ring_spec, alignment=alignment)
    result = check_plan(_with_edge(plan, index, ring_spec=ring))
    assert isinstance(result, InvalidAlignment)


@given(
    valid_plan_inputs(),
    st.sampled_from([DTypeFamily.FLOAT, DTypeFamily.BFLOAT]),
    st.integers(-1, 16),
)
def test_invalid_dtype_width_rejects_the_plan(
    inputs: PlanInputs, family: DTypeFamily, width: int
) -> None:
    valid = {DTypeFamily.FLOAT: {2, 4}, DTypeFamily.BFLOAT: {2}}[family]
    config = attrs.evolve(
        inputs.config, activation_dtype_family=family, activation_dtype_width_bytes=width
    )
    result = plan_run(inputs.facts, config, inputs.pool, **inputs.kwargs())
    if width in valid:
        assert isinstance(result, RunPlan)
    else:
        assert isinstance(result, InvalidDtypeWidth)
        assert result.dtype_width_bytes == width


@given(valid_plan_inputs(), st.data())
def test_invalid_dtype_width_on_a_checked_plan_rejects(
    inputs: PlanInputs, data: st.DataObject
) -> None:
    plan = _plan(inputs)
    index = data.draw(st.integers(0, len(plan.edges) - 1))
    spec = plan.edges[index].object_spec
    width = data.draw(st.integers(0, 16).filter(lambda w: w not in (2, 4)))
    result = check_plan(
        _with_edge(plan, index, object_spec=attrs.evolve(spec, dtype_width_bytes=width))
    )
    assert isinstance(result, InvalidDtypeWidth)


@given(valid_plan_inputs())
def test_unsupported_activation_layout_rejects_the_plan(inputs: PlanInputs) -> None:
    config = attrs.evolve(
        inputs.config, activation_dtype_family=DTypeFamily.UINT, activation_dtype_width_bytes=4
    )
    result = plan_run(inputs.facts, config, inputs.pool, **inputs.kwargs())
    assert isinstance(result, UnsupportedLayout)


@given(valid_plan_inputs(), st.data())
def test_unsupported_shape_or_layout_on_a_checked_plan_rejects(
    inputs: PlanInputs, data: st.DataObject
) -> None:
    plan = _plan(inputs)
    index = data.draw(st.integers(0, len(plan.edges) - 1))
    spec = plan.edges[index].object_spec
    # An object of the other kind, or a layout this edge kind does not carry.
    wrong = data.draw(
        st.sampled_from(
            [
                attrs.evolve(
                    spec,
                    kind=ObjectKind.TOKEN
                    if spec.kind is ObjectKind.ACTIVATION
                    else ObjectKind.ACTIVATION,
                ),
                attrs.evolve(
                    spec,
                    layout=Layout.ROW_MAJOR
                    if spec.layout is not Layout.ROW_MAJOR
                    else Layout.TOKEN_IDS,
                ),
            ]
        )
    )
    assert isinstance(check_plan(_with_edge(plan, index, object_spec=wrong)), UnsupportedLayout)
