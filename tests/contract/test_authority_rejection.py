"""RUNPLAN_CONTRACT.md, "Authority / Rejection": the shipped clause suite against
``plan_run``, and the rejections ``plan_run`` adds for the worker and its memory."""

from __future__ import annotations

import attrs
from hypothesis import assume, given
from hypothesis import strategies as st

from runplan import (
    Placement,
    PlacementStrategy,
    RunPlan,
    StageAssignment,
    WorkerCapabilities,
    check_plan,
    plan_run,
)
from runplan.memory import kv_budget_bytes, plan_stage_memory, stage_memory
from runplan.rejections import (
    InconsistentModelFacts,
    InconsistentPlan,
    InsufficientMemory,
    InvalidConfig,
    UnsupportedModel,
)
from runplan.testing.suite.test_authority import *  # noqa: F403
from tests.support.strategies import PlanInputs, valid_plan_inputs


def _run(inputs: PlanInputs, **changes: object) -> object:
    changed = attrs.evolve(inputs, **changes)
    return plan_run(changed.facts, changed.config, changed.pool, **changed.kwargs())


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


@given(valid_plan_inputs(), st.integers(1, 256))
def test_a_mixture_of_experts_rejects_for_a_worker_that_runs_none(
    inputs: PlanInputs, experts: int
) -> None:
    facts = attrs.evolve(inputs.facts, expert_count=experts)
    none = attrs.evolve(inputs.config.worker, name="no-experts", experts=False)
    result = _run(inputs, facts=facts, config=attrs.evolve(inputs.config, worker=none))
    assert isinstance(result, UnsupportedModel)
    assert result.worker == "no-experts"
    assert "mixture of experts" in result.architecture
    # the same facts plan for the same worker running experts
    able = attrs.evolve(none, experts=True)
    assert isinstance(
        _run(inputs, facts=facts, config=attrs.evolve(inputs.config, worker=able)), RunPlan
    )


@given(valid_plan_inputs(), st.data())
def test_stages_that_do_not_fit_their_device_reject(
    inputs: PlanInputs, data: st.DataObject
) -> None:
    """The victim's node gets less than its stage needs (down to one byte less). Under
    placement ``memory`` it gets less than its stage holds with no blocks at all (the
    weights every stage at its place holds, its inbound ring, an explicit KV budget):
    that placement moves blocks off a small node, so less than the planned stage's need
    may still fit the smaller stage it plans then."""
    plan = _run(inputs)
    assert isinstance(plan, RunPlan), plan
    index = data.draw(st.integers(0, len(plan.stages) - 1))
    stage = plan.stages[index]
    use = plan_stage_memory(inputs.facts, inputs.config.worker, plan)[index]
    start = stage.layer_start
    bare = stage_memory(
        inputs.facts,
        inputs.config.worker,
        layer_start=start,
        layer_end_exclusive=start,
        first=index == 0,
        last=index == len(plan.stages) - 1,
        kv_budget_bytes=kv_budget_bytes(
            inputs.facts, inputs.config, layer_start=start, layer_end_exclusive=start
        ),
        inbound_ring_bytes=use.ring_bytes,
    )
    by_memory = inputs.placement.strategy is PlacementStrategy.BY_MEMORY
    bound = (bare if by_memory else use).total
    memory = bound - data.draw(st.integers(1, bound))  # often just short of it
    victim = stage.node_id
    nodes = tuple(
        attrs.evolve(n, memory_bytes=memory) if n.node_id == victim else n
        for n in inputs.pool.nodes
    )
    result = _run(inputs, pool=attrs.evolve(inputs.pool, nodes=nodes))
    assert isinstance(result, InsufficientMemory)
    assert result.bytes_needed > result.bytes_available
    assert victim in result.node_ids


@given(valid_plan_inputs(), st.sampled_from(["even", "memory"]), st.integers(2**64, 10**400))
def test_block_bytes_or_a_weight_width_past_what_a_host_holds_reject(
    inputs: PlanInputs, how: str, huge: int
) -> None:
    """``plan_run`` raises only for programming errors: a block of more than 2**64 - 1
    bytes, or a worker holding a weight in more than 8, once made the memory
    placement's float division raise OverflowError."""
    nodes = [s.node_id for s in inputs.pool.nodes[: inputs.stage_count]]
    assume(len(nodes) == inputs.stage_count)  # else no one-node-a-stage placement of them
    placement = (Placement.even if how == "even" else Placement.by_memory)(nodes)
    facts = attrs.evolve(inputs.facts, block_bytes=(huge,) * inputs.facts.num_layers)
    result = _run(inputs, facts=facts, placement=placement)
    assert isinstance(result, InconsistentModelFacts) and result.field == "block_bytes[0]"
    wide = attrs.evolve(inputs.config.worker, weight_bytes_per_element=huge)
    result = _run(inputs, config=attrs.evolve(inputs.config, worker=wide), placement=placement)
    assert isinstance(result, InvalidConfig), result
    assert (result.field, result.value) == ("worker.weight_bytes_per_element", str(huge))


@given(valid_plan_inputs(), st.data())
def test_a_placement_field_its_strategy_does_not_read_rejects(
    inputs: PlanInputs, data: st.DataObject
) -> None:
    """ARCHITECTURE.md: every contradiction of a placement comes back as a rejection.
    An even placement with explicit rows, an explicit one with a node list, or a
    by-memory one with rows naming a node the pool lacks once planned by the strategy,
    the other field dropped."""
    placement = inputs.placement
    if placement.strategy is PlacementStrategy.EXPLICIT:
        listed = tuple(data.draw(st.lists(st.text(min_size=1, max_size=8), min_size=1)))
        changed = attrs.evolve(placement, nodes=listed)
        field, value = "placement.nodes", repr(listed)
    else:
        plan = _run(inputs)
        assert isinstance(plan, RunPlan), plan
        rows = tuple(
            StageAssignment(s.stage_index, s.node_id, s.layer_start, s.layer_end_exclusive)
            for s in plan.stages
        )  # even the rows the strategy itself gives
        ghost = data.draw(st.booleans())
        if ghost:
            rows = (attrs.evolve(rows[0], node_id="ghost"), *rows[1:])
        changed = attrs.evolve(placement, assignments=rows)
        field, value = "placement.assignments", f"(0, {rows[0].node_id!r}, "
    result = _run(inputs, placement=changed)
    assert isinstance(result, InvalidConfig), result
    assert result.field == field and value in result.value, result


@given(valid_plan_inputs(), st.sampled_from([-1, 2**64]))
def test_check_plan_rejects_an_edge_id_the_wire_cannot_carry(inputs: PlanInputs, bad: int) -> None:
    """Edge ids are u64s on the wire: ``check_plan`` once passed -1 (set on the edge and
    every stage naming it), which ``wire.dumps`` and the contract kit refuse."""
    plan = _run(inputs)
    assert isinstance(plan, RunPlan), plan
    old = plan.edges[-1].edge_id

    def moved(edge_id: int) -> int:
        return bad if edge_id == old else edge_id

    edges = tuple(attrs.evolve(e, edge_id=moved(e.edge_id)) for e in plan.edges)
    stages = tuple(
        attrs.evolve(s, inbound_edge=moved(s.inbound_edge), outbound_edge=moved(s.outbound_edge))
        for s in plan.stages
    )
    result = check_plan(attrs.evolve(plan, edges=edges, stages=stages))
    assert isinstance(result, InconsistentPlan) and result.field == "edge_id", result
    huge = attrs.evolve(plan, model=attrs.evolve(plan.model, num_layers=2**40))
    result = check_plan(huge)
    assert isinstance(result, InconsistentModelFacts) and result.field == "num_layers", result


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


@given(
    valid_plan_inputs(),
    st.sampled_from(["row_multiple", "weight_bytes_per_element", "kv_bytes_per_element"]),
    st.data(),
)
def test_worker_capabilities_no_worker_has_are_an_invalid_config_naming_them(
    inputs: PlanInputs, field: str, data: st.DataObject
) -> None:
    """A row multiple below 1, a weight of fewer than 0 or more than 8 bytes, a KV
    element neither 0 (the activations'), 2 nor 4 bytes: a run-wide setting no run can
    have (``invalid_config``), naming ``worker.<field>`` and the value (they were
    ``inconsistent_model_facts`` naming "worker" and the worker's name)."""
    bad = {
        "row_multiple": st.integers(max_value=0),
        "weight_bytes_per_element": st.integers(max_value=-1) | st.integers(min_value=9),
        "kv_bytes_per_element": st.integers().filter(lambda n: n not in (0, 2, 4)),
    }
    value = data.draw(bad[field])
    worker = attrs.evolve(inputs.config.worker, **{field: value})
    result = _run(inputs, config=attrs.evolve(inputs.config, worker=worker))
    assert isinstance(result, InvalidConfig), result
    assert (result.field, result.value) == (f"worker.{field}", str(value))


@given(valid_plan_inputs(), st.data())
def test_a_stage_naming_no_file_is_rejected_not_an_index_error(
    inputs: PlanInputs, data: st.DataObject
) -> None:
    """A plan from elsewhere (JSON) whose stage's source lists no path: ``check_plan``
    once raised ``IndexError`` describing it; it is an inconsistent plan."""
    from runplan import GgufSource

    plan = _run(inputs)
    assert isinstance(plan, RunPlan)
    i = data.draw(st.integers(0, len(plan.stages) - 1))
    stage = attrs.evolve(plan.stages[i], gguf_source=GgufSource(paths=()))
    broken = attrs.evolve(plan, stages=(*plan.stages[:i], stage, *plan.stages[i + 1 :]))
    result = check_plan(broken)
    assert isinstance(result, InconsistentPlan)
    assert "(no file)" in str(result)


@given(
    valid_plan_inputs(),
    st.sampled_from(["temperature", "top_p"]),
    st.integers(min_value=2**1024) | st.integers(max_value=-(2**1024)),
)
def test_a_sampling_number_past_a_float_is_an_invalid_config_naming_it(
    inputs: PlanInputs, field: str, value: int
) -> None:
    """An int sampling value is a float field's type; one past a float's range once
    raised ``OverflowError`` ("int too large to convert to float", naming no field) from
    the value class. It is infinite, and rejected as any value out of range."""
    from runplan import SamplingConfig

    sampling = attrs.evolve(inputs.config.sampling, **{field: value})
    assert isinstance(sampling, SamplingConfig)
    result = _run(inputs, config=attrs.evolve(inputs.config, sampling=sampling))
    assert isinstance(result, InvalidConfig), result
    assert result.field == f"sampling.{field}"
