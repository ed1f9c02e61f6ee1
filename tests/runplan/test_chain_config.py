"""The planner's side of several runs on one chain (CONCURRENT_RUNS.md §3-§5): each run's
KV need known at provisioning, the chain's KV budget in the memory check (the weights
counted once), and ``invalid_config`` for settings no run can have."""

from __future__ import annotations

import attrs
import pytest

from runplan import (
    GgufSource,
    ModelFacts,
    NodePool,
    NodeSpec,
    PlanRejection,
    RunPlan,
    RuntimeConfig,
    SamplingConfig,
    check_plan,
    plan_run,
    provision_all,
)
from runplan.fsm.orchestrator_machine import OrchestratorMachine, PromptError
from runplan.memory import plan_stage_memory
from runplan.rejections import InconsistentModelFacts, InsufficientMemory, InvalidConfig
from tests.support.strategies import STORED_WEIGHTS

LAYERS = 6
KV_HEADS, HEAD_DIM = 2, 4
PER_POSITION = KV_HEADS * (HEAD_DIM + HEAD_DIM) * 4  # one block, one position, float32


def facts(windows: tuple[int, ...] = ()) -> ModelFacts:
    return ModelFacts(
        model_id="tiny",
        gguf_source=GgufSource.single("/models/tiny.gguf"),
        architecture="llama",
        num_layers=LAYERS,
        hidden_dim=8,
        head_count=2,
        head_count_kv=KV_HEADS,
        head_dim_k=HEAD_DIM,
        head_dim_v=HEAD_DIM,
        vocab_size=16,
        eos_token_id=0,
        context_length=64,
        max_seq_len=64,
        quant_types=("F32",),
        block_bytes=(1000,) * LAYERS,
        embedding_bytes=1000,
        output_bytes=1000,
        shared_bytes=0,
        tied_embeddings=True,
        layer_windows=windows,
    )


def plan(memory: int = 2**40, windows: tuple[int, ...] = (), **config: int) -> RunPlan:
    result = planned(memory, windows, **config)
    assert isinstance(result, RunPlan), result
    return result


def planned(memory: int = 2**40, windows: tuple[int, ...] = (), **config: int) -> object:
    return plan_run(
        facts(windows),
        RuntimeConfig(
            run_id="r", max_tokens=config.pop("max_tokens", 8), worker=STORED_WEIGHTS, **config
        ),  # type: ignore[arg-type]
        NodePool("orch", (NodeSpec("a", memory), NodeSpec("b", memory))),
        stage_count=2,
    )


def test_by_default_a_run_reserves_max_seq_len_and_the_budget_is_one_run() -> None:
    p = plan()
    assert p.kv_positions == 64
    for stage, prov in zip(p.stages, provision_all(p), strict=True):
        full = 3 * 64 * PER_POSITION  # three blocks a stage
        assert stage.kv_bytes == stage.kv_budget_bytes == full
        assert (prov.kv_positions, prov.kv_bytes, prov.kv_budget_bytes) == (64, full, full)
        assert prov.max_batch_rows == p.max_batch_rows == 512
    assert p.prefill_chunk == 512  # 0: chunks of max_batch_rows


def test_a_known_prompt_reserves_its_positions_within_max_seq_len() -> None:
    p = plan(prompt_tokens=10, max_tokens=8)
    assert p.kv_positions == 18
    assert [s.kv_bytes for s in p.stages] == [3 * 18 * PER_POSITION] * 2
    assert plan(prompt_tokens=57, max_tokens=8).kv_positions == 64  # 57 + 8 - 1 fit 64
    # A sliding block (window 4) holds its window, whatever the run's length.
    windowed = plan(windows=(4, 0, 0, 4, 0, 0), prompt_tokens=10, max_tokens=8)
    assert windowed.stages[0].kv_bytes == (4 + 18 + 18) * PER_POSITION


def test_the_memory_check_counts_the_weights_once_and_the_kv_budget() -> None:
    one = plan_stage_memory(facts(), STORED_WEIGHTS, plan())
    four = plan_stage_memory(facts(), STORED_WEIGHTS, plan(max_concurrent_runs=4))
    explicit = plan_stage_memory(facts(), STORED_WEIGHTS, plan(kv_budget_bytes=50_000))
    for a, b, c in zip(one, four, explicit, strict=True):
        assert b.weight_bytes == a.weight_bytes == c.weight_bytes  # once, whatever the runs
        assert b.kv_bytes == 4 * a.kv_bytes
        assert c.kv_bytes == 50_000
    # Memory that holds one run's cache but not four: the budget is what is counted.
    need_one, need_four = max(m.total for m in one), max(m.total for m in four)
    rejection = planned(memory=need_four - 1, max_concurrent_runs=4)
    assert isinstance(rejection, InsufficientMemory)
    assert rejection.bytes_needed == need_four and need_one < need_four
    assert isinstance(planned(memory=need_four, max_concurrent_runs=4), RunPlan)


@pytest.mark.parametrize(
    ("config", "field", "words"),
    [
        ({"prompt_tokens": 60, "max_tokens": 8}, "prompt_tokens", "67 positions"),
        ({"prompt_tokens": -1}, "prompt_tokens", "0.."),
        ({"max_concurrent_runs": 0}, "max_concurrent_runs", "1.."),
        ({"kv_budget_bytes": -5}, "kv_budget_bytes", "0.."),
        ({"kv_budget_bytes": 100}, "kv_budget_bytes", "stage 0 needs"),
        ({"max_batch_rows": 0}, "max_batch_rows", "1.."),
        ({"prefill_chunk": 600}, "prefill_chunk", "max_batch_rows (512)"),
        ({"prefill_chunk": 9, "max_batch_rows": 8}, "prefill_chunk", "max_batch_rows (8)"),
        ({"prefill_chunk": -1}, "prefill_chunk", "0.."),
        ({"ring_slot_count": 0}, "ring_slot_count", "0: a ring needs at least one slot"),
        # a u32 on the wire: it was "needs at least one slot" too
        ({"ring_slot_count": 2**40}, "ring_slot_count", f"{2**40}: must be in 1..{2**32 - 1}"),
    ],
)
def test_a_setting_no_run_can_have_is_invalid_config(
    config: dict[str, int], field: str, words: str
) -> None:
    rejection = planned(**config)
    assert isinstance(rejection, InvalidConfig), rejection
    assert rejection.code == "invalid_config" and rejection.field == field
    assert words in str(rejection)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda p: attrs.evolve(p, kv_positions=0), "kv_positions"),
        (lambda p: attrs.evolve(p, kv_positions=65), "kv_positions"),
        (lambda p: attrs.evolve(p, prefill_chunk=0), "prefill_chunk"),
        (lambda p: attrs.evolve(p, prefill_chunk=513), "prefill_chunk"),
        (lambda p: attrs.evolve(p, max_batch_rows=0), "max_batch_rows"),
        (
            lambda p: attrs.evolve(
                p, stages=(attrs.evolve(p.stages[0], kv_budget_bytes=1), p.stages[1])
            ),
            "kv_budget_bytes",
        ),
    ],
)
def test_check_plan_refuses_a_plan_whose_chain_fields_no_run_can_have(
    change: object, field: str
) -> None:
    bad = change(plan())  # type: ignore[operator]
    rejection = check_plan(bad)
    assert isinstance(rejection, PlanRejection) and rejection.code == "invalid_config"
    assert isinstance(rejection, InvalidConfig) and rejection.field == field
    assert check_plan(plan()) == plan()


def test_a_prompt_longer_than_its_stages_reserve_is_refused_before_anything_is_sent() -> None:
    p = plan(prompt_tokens=4, max_tokens=8)  # 12 positions reserved
    OrchestratorMachine.for_plan(p, (1, 2, 3, 4, 5))  # 5 + 8 - 1 = 12 positions: fits
    with pytest.raises(PromptError, match="reserve 12"):
        OrchestratorMachine.for_plan(p, (1, 2, 3, 4, 5, 6))


@pytest.mark.parametrize("value", [-1, 2**32])
def test_a_replay_s_token_count_outside_u32_is_invalid_config(value: int) -> None:
    """``SamplingConfig.tokens_delivered`` (a replay's sampler resumes after that many
    tokens) is a u32 count, refused by plan_run and check_plan alike."""
    sampling = SamplingConfig(tokens_delivered=value)
    rejection = planned(sampling=sampling)  # type: ignore[arg-type]
    assert isinstance(rejection, InvalidConfig), rejection
    assert rejection.field == "sampling.tokens_delivered" and str(value) in str(rejection)
    checked = check_plan(attrs.evolve(plan(), sampling=sampling))
    assert isinstance(checked, InvalidConfig) and checked.field == "sampling.tokens_delivered"
    assert isinstance(planned(sampling=SamplingConfig(tokens_delivered=2**32 - 1)), RunPlan)  # type: ignore[arg-type]


def test_max_tokens_past_max_seq_len_with_a_prompt_of_unknown_length_is_invalid_config() -> None:
    """A prompt has at least 1 token: a run of max_tokens needs max_tokens positions
    (the last token is not fed back), so max_tokens == max_seq_len is the longest."""
    rejection = planned(max_tokens=65)
    assert isinstance(rejection, InvalidConfig), rejection
    assert rejection.field == "max_tokens" and "65 positions" in str(rejection)
    assert isinstance(planned(max_tokens=64), RunPlan)
    OrchestratorMachine.for_plan(plan(max_tokens=64), (1,))  # and its 1-token prompt runs


def _with_stage(p: RunPlan, **changes: int) -> RunPlan:
    return attrs.evolve(p, stages=(attrs.evolve(p.stages[0], **changes), *p.stages[1:]))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda p: attrs.evolve(p, max_tokens=p.kv_positions + 1), "kv_positions"),
        (lambda p: attrs.evolve(p, kv_positions=7), "kv_positions"),  # max_tokens 8
        (lambda p: _with_stage(p, kv_bytes=2**64, kv_budget_bytes=2**64), "stages[0].kv_bytes"),
        (lambda p: _with_stage(p, kv_budget_bytes=2**64), "stages[0].kv_budget_bytes"),
        (lambda p: attrs.evolve(p, orchestrator_node_id=""), "orchestrator_node_id"),
        (lambda p: attrs.evolve(p, orchestrator_node_id="o\x00"), "orchestrator_node_id"),
        (lambda p: attrs.evolve(p, orchestrator_node_id="o\udc80"), "orchestrator_node_id"),
    ],
)
def test_check_plan_refuses_a_run_no_prompt_fits_and_values_the_wire_cannot_carry(
    change: object, field: str
) -> None:
    rejection = check_plan(change(plan()))  # type: ignore[operator]
    assert isinstance(rejection, InvalidConfig) and rejection.field == field, rejection


@pytest.mark.parametrize(
    ("node", "reason"),
    [("", "empty"), ("a\x00", "NUL"), ("gpu\udc80", "surrogate")],
)
def test_a_node_id_the_wire_cannot_carry_is_invalid_config_naming_it(
    node: str, reason: str
) -> None:
    pool = NodePool("orch", (NodeSpec("a", 2**40), NodeSpec(node, 2**40)))
    config = RuntimeConfig(run_id="r", max_tokens=8, worker=STORED_WEIGHTS)
    rejection = plan_run(facts(), config, pool, stage_count=1)  # a spare node too
    assert isinstance(rejection, InvalidConfig), rejection
    assert rejection.field == "nodes[1].node_id" and reason in rejection.reason
    orch = NodePool(node, (NodeSpec("a", 2**40),))
    rejection = plan_run(facts(), config, orch, stage_count=1)
    assert isinstance(rejection, InvalidConfig) and rejection.field == "orchestrator_node_id"
    planned_plan = plan()
    stage = attrs.evolve(planned_plan.stages[0], node_id=node)
    checked = check_plan(attrs.evolve(planned_plan, stages=(stage, planned_plan.stages[1])))
    assert isinstance(checked, InvalidConfig) and checked.field == "stages[0].node_id"


@pytest.mark.parametrize("memory", [2**64, 2**80, -1])
def test_node_memory_outside_what_a_plan_carries_is_invalid_config(memory: int) -> None:
    rejection = planned(memory=memory)
    assert isinstance(rejection, InvalidConfig), rejection
    assert rejection.field == "nodes[0].memory_bytes" and str(memory) in str(rejection)
    assert isinstance(planned(memory=2**64 - 1), RunPlan)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"max_seq_len": 0}, "max_seq_len"),
        ({"max_seq_len": -5}, "max_seq_len"),
        ({"gguf_source": GgufSource(("/m\udc80.gguf",))}, "gguf_source.paths[0]"),
        ({"gguf_source": GgufSource(("/m\x00.gguf",))}, "gguf_source.paths[0]"),
        ({"gguf_source": GgufSource(("",))}, "gguf_source.paths[0]"),
        ({"model_id": "tiny\udc80"}, "model_id"),
        ({"block_elements": (-(10**8),) * LAYERS}, "block_elements[0]"),
        ({"block_elements": (0,) * LAYERS}, "block_elements[0]"),
        ({"block_elements": (9,) * LAYERS, "embedding_elements": -1}, "embedding_elements"),
        ({"block_elements": (9,) * LAYERS, "embedding_elements": 0}, "embedding_elements"),
        ({"block_elements": (9,) * LAYERS, "output_elements": -1}, "output_elements"),
        ({"shared_elements": -1}, "shared_elements"),
    ],
)
def test_facts_no_model_can_have_are_inconsistent_model_facts_naming_the_field(
    change: dict[str, object], field: str
) -> None:
    elements = {"embedding_elements": 9, "output_elements": 9}
    bad = attrs.evolve(facts(), **{**elements, **change})
    config = RuntimeConfig(run_id="r", max_tokens=8)  # the reference worker counts elements
    pool = NodePool("orch", (NodeSpec("a", 2**40),))
    rejection = plan_run(bad, config, pool, stage_count=1)
    assert isinstance(rejection, InconsistentModelFacts), rejection
    assert rejection.field == field
