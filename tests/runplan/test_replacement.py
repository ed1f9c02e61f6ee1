"""Re-placement after a loss (``runplan.replacement``): the lost stages' ranges on spare
nodes when one fits, else the planner's placement over the remaining nodes, else the
planner's own rejection; the new plan is checked as any plan is."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from runplan import (
    ModelFacts,
    NodePool,
    NodeSpec,
    Placement,
    RunPlan,
    RuntimeConfig,
    check_plan,
    model_facts_from_gguf,
    plan_run,
)
from runplan.contract import check_contract
from runplan.contract.subject import PlanInputs
from runplan.memory import plan_stage_memory
from runplan.placement import StageAssignment
from runplan.planner import check_ranges
from runplan.rejections import InsufficientMemory, InvalidConfig
from runplan.replacement import Replacement, Unplaceable, replace_lost
from runplan.testing.strategies.inputs import valid_plan_inputs
from tests.fixtures.gguf_models import ModelShape, write_model

BIG = 2**40


@pytest.fixture(scope="module")
def facts(tmp_path_factory: pytest.TempPathFactory) -> ModelFacts:
    path = write_model(tmp_path_factory.mktemp("replace") / "m.gguf", ModelShape(n_layers=6))
    return model_facts_from_gguf(path, max_seq_len=64)


def config(run_id: str = "run-a") -> RuntimeConfig:
    return RuntimeConfig(run_id=run_id, max_tokens=16, max_concurrent_runs=2)


def pool(*nodes: tuple[str, int]) -> NodePool:
    return NodePool("orch", tuple(NodeSpec(nid, mem) for nid, mem in nodes))


def three_stages(facts: ModelFacts) -> tuple[RunPlan, tuple[int, ...]]:
    """A plan of 2+2+2 layers on node-0..2, and each stage's bytes."""
    placement = Placement(
        assignments=tuple(StageAssignment(i, f"node-{i}", 2 * i, 2 * i + 2) for i in range(3))
    )
    nodes = pool(*((f"node-{i}", BIG) for i in range(3)))
    plan = plan_run(facts, config(), nodes, stage_count=3, placement=placement)
    assert isinstance(plan, RunPlan), plan
    need = tuple(m.total for m in plan_stage_memory(facts, config().worker, plan))
    return plan, need


def stages_of(plan: RunPlan) -> list[tuple[str, int, int]]:
    return [(s.node_id, s.layer_start, s.layer_end_exclusive) for s in plan.stages]


def assert_checked(new: Replacement, facts: ModelFacts, live: NodePool) -> None:
    assert check_plan(new.plan) == new.plan
    inputs = PlanInputs(facts, config("run-b"), live, new.plan.stage_count, new.placement)
    report = check_contract(new.plan, inputs=inputs)
    assert report.holds, report.broken


def test_the_lost_stage_s_range_goes_to_a_spare_that_fits(facts: ModelFacts) -> None:
    plan, need = three_stages(facts)
    live = pool(("node-0", BIG), ("node-2", BIG), ("small", need[1] - 1), ("spare", need[1]))
    new = replace_lost(plan, facts, config("run-b"), live, lost_nodes=["node-1"])
    assert isinstance(new, Replacement), new
    assert new.on_spares
    # the small spare is passed over (the memory check), the one that fits takes range 1
    assert stages_of(new.plan) == [("node-0", 0, 2), ("spare", 2, 4), ("node-2", 4, 6)]
    assert (new.kept, new.fresh) == ((0, 2), (1,))
    assert (new.lost_nodes, new.lost_stages) == (("node-1",), (1,))
    assert new.plan.run_id == "run-b"
    assert_checked(new, facts, live)


def test_a_node_the_live_pool_no_longer_lists_is_lost(facts: ModelFacts) -> None:
    plan, _ = three_stages(facts)
    live = pool(("node-0", BIG), ("node-1", BIG), ("spare", BIG))
    new = replace_lost(plan, facts, config("run-b"), live)
    assert isinstance(new, Replacement), new
    assert stages_of(new.plan)[2] == ("spare", 4, 6)
    assert new.lost_nodes == ("node-2",) and new.fresh == (2,)


def test_a_lost_stage_process_restarts_on_its_live_node_when_no_spare_exists(
    facts: ModelFacts,
) -> None:
    plan, _ = three_stages(facts)
    live = pool(*((f"node-{i}", BIG) for i in range(3)))
    new = replace_lost(plan, facts, config("run-b"), live, lost_stages=[0])
    assert isinstance(new, Replacement), new
    assert stages_of(new.plan) == stages_of(plan)
    assert (new.kept, new.fresh) == ((1, 2), (0,))  # its process died: it starts afresh


def test_a_spare_is_preferred_to_the_lost_stage_s_own_node(facts: ModelFacts) -> None:
    plan, _ = three_stages(facts)
    live = pool(*((f"node-{i}", BIG) for i in range(3)), ("spare", BIG))
    new = replace_lost(plan, facts, config("run-b"), live, lost_stages=[1])
    assert isinstance(new, Replacement), new
    assert stages_of(new.plan)[1] == ("spare", 2, 4)


def test_without_a_spare_the_planner_places_the_model_over_the_remaining_nodes(
    facts: ModelFacts,
) -> None:
    plan, _ = three_stages(facts)
    live = pool(("node-0", BIG), ("node-2", BIG), ("tiny", 1))
    new = replace_lost(plan, facts, config("run-b"), live, lost_nodes=["node-1"])
    assert isinstance(new, Replacement), new
    assert not new.on_spares
    assert "node-1" not in {s.node_id for s in new.plan.stages}
    assert (
        check_ranges(
            [(s.layer_start, s.layer_end_exclusive) for s in new.plan.stages], facts.num_layers
        )
        is None
    )
    assert_checked(new, facts, live)


def test_no_room_anywhere_is_the_planner_s_rejection_named(facts: ModelFacts) -> None:
    plan, need = three_stages(facts)
    live = pool(("node-0", need[0]), ("node-2", need[2]), ("tiny", need[1] - 1))
    new = replace_lost(plan, facts, config("run-b"), live, lost_nodes=["node-1"])
    assert isinstance(new, Unplaceable), new
    assert isinstance(new.rejection, InsufficientMemory)
    assert new.lost_nodes == ("node-1",) and new.lost_stages == (1,)
    assert "insufficient_memory" in str(new) and "node-1" in str(new)


def test_no_live_node_at_all_is_a_rejection(facts: ModelFacts) -> None:
    plan, _ = three_stages(facts)
    new = replace_lost(plan, facts, config("run-b"), pool(), lost_nodes=["node-0"])
    assert isinstance(new, Unplaceable), new
    assert new.lost_stages == (0, 1, 2)


def test_a_setting_no_placement_changes_is_rejected_at_once(facts: ModelFacts) -> None:
    plan, _ = three_stages(facts)
    live = pool(("node-0", BIG), ("node-2", BIG), ("spare", BIG))
    bad = attrs.evolve(config("run-b"), max_tokens=0)
    new = replace_lost(plan, facts, bad, live, lost_nodes=["node-1"])
    assert isinstance(new, Unplaceable) and isinstance(new.rejection, InvalidConfig), new
    assert new.rejection.field == "max_tokens"


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"lost_stages": [3]}, "lost stage 3"),
        ({"lost_stages": [-1]}, "lost stage -1"),
        ({"run_id": "run-a"}, "'run-a' is the lost plan's"),
    ],
)
def test_bad_input_is_a_clear_error(
    facts: ModelFacts, kwargs: dict[str, object], words: str
) -> None:
    plan, _ = three_stages(facts)
    live = pool(*((f"node-{i}", BIG) for i in range(3)))
    run_id = str(kwargs.pop("run_id", "run-b"))
    with pytest.raises(ValueError, match=words):
        replace_lost(plan, facts, config(run_id), live, **kwargs)  # type: ignore[arg-type]


def test_arguments_of_the_wrong_type_are_type_errors(facts: ModelFacts) -> None:
    plan, _ = three_stages(facts)
    live = pool(("node-0", BIG))
    with pytest.raises(TypeError, match="string 'node-1'"):
        replace_lost(plan, facts, config("run-b"), live, lost_nodes="node-1")
    with pytest.raises(TypeError, match="pool must be NodePool"):
        replace_lost(plan, facts, config("run-b"), [])  # type: ignore[arg-type]


# -- properties ---------------------------------------------------------------------------


@st.composite
def losses(draw: st.DrawFn) -> tuple[PlanInputs, RunPlan, NodePool, list[str], list[int]]:
    """A planned chain, what it lost, and the live pool (each live node's memory as
    generated, or too little for anything)."""
    inputs = draw(valid_plan_inputs(max_layers=12))
    plan = inputs.plan_with(plan_run)
    assert isinstance(plan, RunPlan), plan
    nodes = [s.node_id for s in plan.stages]
    lost_nodes = draw(st.lists(st.sampled_from(nodes), unique=True, max_size=2))
    lost_stages = draw(st.lists(st.integers(0, plan.stage_count - 1), unique=True, max_size=2))
    if not lost_nodes and not lost_stages:
        lost_nodes = [nodes[0]]
    live = tuple(
        attrs.evolve(n, memory_bytes=draw(st.sampled_from([n.memory_bytes, 1])))
        for n in inputs.pool.nodes
        if n.node_id not in lost_nodes
    )
    return inputs, plan, attrs.evolve(inputs.pool, nodes=live), lost_nodes, lost_stages


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(losses())
def test_a_new_plan_never_uses_a_lost_node_covers_every_layer_and_passes_the_checks(
    case: tuple[PlanInputs, RunPlan, NodePool, list[str], list[int]],
) -> None:
    inputs, plan, live, lost_nodes, lost_stages = case
    new_config = attrs.evolve(inputs.config, run_id=inputs.config.run_id + "~r")
    new = replace_lost(
        plan, inputs.facts, new_config, live, lost_nodes=lost_nodes, lost_stages=lost_stages
    )
    event(
        type(new).__name__ + ("" if isinstance(new, Unplaceable) else f" on_spares={new.on_spares}")
    )
    if isinstance(new, Unplaceable):
        assert_nothing_fits(inputs, new_config, plan, live, new)
        return
    used = {s.node_id for s in new.plan.stages}
    assert not used & set(new.lost_nodes)
    assert set(lost_nodes) <= set(new.lost_nodes)
    assert set(lost_stages) <= set(new.lost_stages)
    ranges = [(s.layer_start, s.layer_end_exclusive) for s in new.plan.stages]
    assert check_ranges(ranges, inputs.facts.num_layers) is None
    assert check_plan(new.plan) == new.plan
    again = PlanInputs(inputs.facts, new_config, live, new.plan.stage_count, new.placement)
    assert again.plan_with(plan_run) == new.plan  # the placement plans the chain's other runs
    report = check_contract(new.plan, inputs=again)
    assert report.holds, report.broken
    before = {
        (s.node_id, s.layer_start, s.layer_end_exclusive)
        for s in plan.stages
        if s.stage_index not in new.lost_stages
    }
    kept = {
        s.stage_index
        for s in new.plan.stages
        if (s.node_id, s.layer_start, s.layer_end_exclusive) in before
    }
    assert set(new.kept) == kept and set(new.fresh) == set(range(new.plan.stage_count)) - kept
    if new.on_spares:  # every stage not lost is unchanged, and keeps its weights
        assert len(new.kept) == plan.stage_count - len(new.lost_stages)
        for s in plan.stages:
            if s.stage_index not in new.lost_stages:
                assert new.plan.stages[s.stage_index].node_id == s.node_id


def assert_nothing_fits(
    inputs: PlanInputs, config: RuntimeConfig, plan: RunPlan, live: NodePool, new: Unplaceable
) -> None:
    """A rejection only when no placement fits: no spare for a lost stage (the others
    where they were), and no planner's placement over every remaining node."""
    remaining = [n.node_id for n in live.nodes if n.node_id != live.orchestrator_node_id]
    used = {s.node_id for s in plan.stages if s.stage_index not in new.lost_stages}
    if len(new.lost_stages) == 1:
        (lost,) = new.lost_stages
        for node_id in remaining:
            if node_id in used:
                continue
            rows = tuple(
                StageAssignment(
                    s.stage_index,
                    node_id if s.stage_index == lost else s.node_id,
                    s.layer_start,
                    s.layer_end_exclusive,
                )
                for s in plan.stages
            )
            tried = plan_run(
                inputs.facts,
                config,
                live,
                stage_count=plan.stage_count,
                placement=Placement(assignments=rows),
            )
            assert not isinstance(tried, RunPlan), f"{node_id} fits stage {lost}"
    for count in range(1, min(len(remaining), inputs.facts.num_layers) + 1):
        for nodes in (remaining[:count], remaining[-count:]):
            for placement in (Placement.by_memory(nodes), Placement.even(nodes)):
                tried = plan_run(inputs.facts, config, live, stage_count=count, placement=placement)
                assert not isinstance(tried, RunPlan), f"{placement} fits"


def test_facts_of_another_model_are_a_clear_error(facts: ModelFacts) -> None:
    plan, _ = three_stages(facts)
    other = attrs.evolve(facts, model_id="another")
    with pytest.raises(ValueError, match="'another'"):
        replace_lost(plan, other, config("run-b"), pool(("node-0", BIG)), lost_nodes=["node-1"])
