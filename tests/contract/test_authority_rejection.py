"""RUNPLAN_CONTRACT.md, "Authority / Rejection": contradictory inputs reject, and no
plan is emitted."""

from __future__ import annotations

import attrs
from hypothesis import assume, given
from hypothesis import strategies as st

from runplan import (
    EdgeKind,
    NodeSpec,
    OrchestratorEndpoint,
    Placement,
    PlanRejection,
    RunPlan,
    StageAssignment,
    StageEndpoint,
    WorkerCapabilities,
    check_plan,
    plan_run,
    provision_all,
)
from runplan.rejections import (
    DuplicateEdgeId,
    DuplicateNode,
    DuplicateStage,
    EdgeEndpointMismatch,
    InconsistentModelFacts,
    InsufficientMemory,
    InvalidLayerRange,
    InvalidStageCount,
    MissingStage,
    UnknownNode,
    UnsupportedModel,
)
from runplan.wire import dumps, loads
from tests.strategies import PlanInputs, valid_plan_inputs


def _plan(inputs: PlanInputs) -> RunPlan:
    plan = plan_run(inputs.facts, inputs.config, inputs.pool, **inputs.kwargs())
    assert isinstance(plan, RunPlan), plan
    return plan


def _run(inputs: PlanInputs, **changes: object) -> RunPlan | PlanRejection:
    changed = attrs.evolve(inputs, **changes)
    return plan_run(changed.facts, changed.config, changed.pool, **changed.kwargs())


def _rows(inputs: PlanInputs) -> list[StageAssignment]:
    """The inputs' placement as explicit rows, in stage order."""
    plan = _plan(inputs)
    return [
        StageAssignment(s.stage_index, s.node_id, s.layer_start, s.layer_end_exclusive)
        for s in plan.stages
    ]


@given(valid_plan_inputs(), st.text(min_size=1, max_size=8))
def test_unknown_node_id_rejects(inputs: PlanInputs, stranger: str) -> None:
    assume(stranger not in {n.node_id for n in inputs.pool.nodes})
    rows = _rows(inputs)
    i = len(rows) // 2
    rows[i] = attrs.evolve(rows[i], node_id=stranger)
    result = _run(inputs, placement=Placement(assignments=tuple(rows)))
    assert isinstance(result, UnknownNode)
    assert (result.node_id, result.stage_index) == (stranger, i)


@given(valid_plan_inputs(), st.data())
def test_duplicate_stage_assignment_rejects(inputs: PlanInputs, data: st.DataObject) -> None:
    rows = _rows(inputs)
    extra = data.draw(st.sampled_from(rows))
    # The stage count may or may not count the extra row; either way it is a duplicate.
    stage_count = min(len(rows) + data.draw(st.integers(0, 1)), inputs.facts.num_layers)
    result = _run(inputs, placement=Placement(assignments=(*rows, extra)), stage_count=stage_count)
    assert isinstance(result, DuplicateStage)
    assert result.stage_index == extra.stage_index and result.count == 2


@given(valid_plan_inputs(), st.data())
def test_one_node_given_two_stages_rejects(inputs: PlanInputs, data: st.DataObject) -> None:
    assume(inputs.stage_count >= 2)
    rows = _rows(inputs)
    a, b = sorted(data.draw(st.sets(st.integers(0, len(rows) - 1), min_size=2, max_size=2)))
    rows[b] = attrs.evolve(rows[b], node_id=rows[a].node_id)
    result = _run(inputs, placement=Placement(assignments=tuple(rows)))
    assert isinstance(result, DuplicateNode)
    assert result.node_id == rows[a].node_id and result.stage_indices == (a, b)


@given(valid_plan_inputs())
def test_a_stage_on_the_orchestrator_node_rejects(inputs: PlanInputs) -> None:
    rows = _rows(inputs)
    orch = inputs.pool.orchestrator_node_id
    pool = attrs.evolve(inputs.pool, nodes=(*inputs.pool.nodes, NodeSpec(orch, 2**60)))
    rows[0] = attrs.evolve(rows[0], node_id=orch)
    result = _run(inputs, pool=pool, placement=Placement(assignments=tuple(rows)))
    assert isinstance(result, DuplicateNode)


@given(valid_plan_inputs(), st.data())
def test_missing_stage_rejects(inputs: PlanInputs, data: st.DataObject) -> None:
    rows = _rows(inputs)
    gone = data.draw(st.integers(0, len(rows) - 1))
    # Re-number the missing stage out of range, keeping the row count.
    rows[gone] = attrs.evolve(rows[gone], stage_index=len(rows) + data.draw(st.integers(0, 5)))
    result = _run(inputs, placement=Placement(assignments=tuple(rows)))
    assert isinstance(result, MissingStage)
    assert result.stage_index == gone


@given(valid_plan_inputs(), st.data())
def test_invalid_stage_count_rejects(inputs: PlanInputs, data: st.DataObject) -> None:
    n_layers = inputs.facts.num_layers
    bad = data.draw(
        st.integers(-5, 0)  # fewer than one stage
        | st.integers(n_layers + 1, n_layers + 40)  # more stages than layers
        | st.integers(1, n_layers).filter(lambda n: n != inputs.stage_count)  # not placed
    )
    result = _run(inputs, stage_count=bad)
    assert isinstance(result, InvalidStageCount)
    assert result.stage_count == bad


@given(valid_plan_inputs(), st.data())
def test_layer_ranges_with_a_gap_overlap_or_outside_the_model_reject(
    inputs: PlanInputs, data: st.DataObject
) -> None:
    rows = _rows(inputs)
    i = data.draw(st.integers(0, len(rows) - 1))
    n_layers = inputs.facts.num_layers
    row = rows[i]
    bad = data.draw(
        st.sampled_from(
            [
                attrs.evolve(row, layer_end_exclusive=row.layer_start),  # empty
                attrs.evolve(row, layer_start=row.layer_start - 1),  # overlap (or below 0)
                attrs.evolve(row, layer_start=row.layer_start + 1),  # gap (or empty)
                attrs.evolve(row, layer_end_exclusive=n_layers + 1),  # outside / overlap
            ]
        )
    )
    rows[i] = bad
    result = _run(inputs, placement=Placement(assignments=tuple(rows)))
    assert isinstance(result, InvalidLayerRange)


@given(valid_plan_inputs(), st.data())
def test_edge_endpoint_mismatch_rejects(inputs: PlanInputs, data: st.DataObject) -> None:
    plan = _plan(inputs)
    i = data.draw(st.integers(0, len(plan.edges) - 1))
    e = plan.edges[i]
    stranger = StageEndpoint("elsewhere", data.draw(st.integers(0, 99)))
    wrong = data.draw(
        st.sampled_from(
            [
                attrs.evolve(e, producer=stranger),
                attrs.evolve(e, consumer=stranger),
                attrs.evolve(e, producer=e.consumer, consumer=e.producer),
                attrs.evolve(e, kind=next(k for k in EdgeKind if k is not e.kind)),
                attrs.evolve(e, consumer=OrchestratorEndpoint("someone-else")),
            ]
        )
    )
    assume(wrong != e)
    edges = list(plan.edges)
    edges[i] = wrong
    result = check_plan(attrs.evolve(plan, edges=tuple(edges)))
    assert isinstance(result, EdgeEndpointMismatch)


@given(valid_plan_inputs(), st.data())
def test_two_edges_with_one_id_reject(inputs: PlanInputs, data: st.DataObject) -> None:
    plan = _plan(inputs)
    a, b = sorted(data.draw(st.sets(st.integers(0, len(plan.edges) - 1), min_size=2, max_size=2)))
    edges = list(plan.edges)
    edges[b] = attrs.evolve(edges[b], edge_id=edges[a].edge_id)
    result = check_plan(attrs.evolve(plan, edges=tuple(edges)))
    assert isinstance(result, DuplicateEdgeId)
    assert result.edge_id == edges[a].edge_id


@given(valid_plan_inputs(), st.data())
def test_model_facts_inconsistent_with_the_stage_layout_reject(
    inputs: PlanInputs, data: st.DataObject
) -> None:
    f = inputs.facts
    broken = data.draw(
        st.sampled_from(
            [
                attrs.evolve(f, num_layers=0),
                attrs.evolve(f, hidden_dim=0),
                attrs.evolve(f, head_count_kv=f.head_count + 1),
                attrs.evolve(f, block_bytes=f.block_bytes[:-1]),
                attrs.evolve(f, block_bytes=(0, *f.block_bytes[1:])),
                attrs.evolve(f, eos_token_id=f.vocab_size),
                attrs.evolve(f, vocab_size=0),
            ]
        )
    )
    result = _run(inputs, facts=broken)
    assert isinstance(result, InconsistentModelFacts)


@given(valid_plan_inputs(), st.data())
def test_a_model_the_worker_cannot_run_rejects(inputs: PlanInputs, data: st.DataObject) -> None:
    worker = data.draw(
        st.sampled_from(
            [
                WorkerCapabilities(name="no-arch", architectures=()),
                WorkerCapabilities(name="no-quants", quant_types=()),
            ]
        )
    )
    result = _run(inputs, config=attrs.evolve(inputs.config, worker=worker))
    assert isinstance(result, UnsupportedModel)
    assert result.worker == worker.name
    assert result.architecture == inputs.facts.architecture


@given(valid_plan_inputs(), st.data())
def test_stages_that_do_not_fit_their_device_reject(
    inputs: PlanInputs, data: st.DataObject
) -> None:
    plan = _plan(inputs)
    victim = data.draw(st.sampled_from(plan.stages)).node_id
    nodes = tuple(
        attrs.evolve(n, memory_bytes=data.draw(st.integers(0, 1024))) if n.node_id == victim else n
        for n in inputs.pool.nodes
    )
    result = _run(inputs, pool=attrs.evolve(inputs.pool, nodes=nodes))
    assert isinstance(result, InsufficientMemory)
    assert result.bytes_needed > result.bytes_available
    assert victim in result.node_ids


@given(valid_plan_inputs())
def test_the_planner_is_the_only_source_of_stage_layer_edge_and_object_spec_assignment(
    inputs: PlanInputs,
) -> None:
    plan = _plan(inputs)
    # Stages are provisioned from the plan alone: the plan as it travels (the wire)
    # yields the very same provisions, and they agree with the plan.
    travelled = loads(dumps(plan))
    assert travelled == plan
    assert provision_all(travelled) == provision_all(plan)
    for stage, msg in zip(plan.stages, provision_all(plan), strict=True):
        assert msg.inbound.object_spec == plan.edge(stage.inbound_edge).object_spec
        assert msg.outbound.object_spec == plan.edge(stage.outbound_edge).object_spec


@given(valid_plan_inputs())
def test_facts_without_element_counts_reject_for_a_worker_that_dequantizes(
    inputs: PlanInputs,
) -> None:
    facts = attrs.evolve(inputs.facts, block_elements=(), embedding_elements=0, output_elements=0)
    result = _run(
        inputs, facts=facts, config=attrs.evolve(inputs.config, worker=WorkerCapabilities())
    )
    assert isinstance(result, InconsistentModelFacts)
    assert result.field == "block_elements"
