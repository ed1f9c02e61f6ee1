"""Hypothesis strategies shared by every test suite. Those of the RunPlan contract
(model facts, configs, pools, placements, valid and contradictory planner inputs)
live in the shipped ``runplan.testing.strategies`` and are re-exported here."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from runplan import (
    GgufSource,
    ModelFacts,
    NodePool,
    NodeSpec,
    RunPlan,
    RuntimeConfig,
    SamplingConfig,
    plan_run,
    provision_all,
)
from runplan.messages import (
    FaultKind,
    FaultReason,
    JoinChain,
    ProvisionRefused,
    ProvisionStage,
    RewireEdge,
    StageFault,
    StageReady,
    StageStopped,
    StopReason,
    StopRun,
)
from runplan.testing.strategies import (
    ORCHESTRATOR,
    PLACEMENT_KINDS,
    PLENTY,
    STORED_WEIGHTS,
    PlanInputs,
    activation_dtypes,
    any_plan_inputs,
    contradictory_plan_inputs,
    cut_ranges,
    model_facts,
    node_ids,
    run_ids,
    runtime_configs,
    tamperings,
    valid_plan_inputs,
)

__all__ = [
    "ORCHESTRATOR",
    "OTHER_RUN",
    "PLACEMENT_KINDS",
    "PLENTY",
    "STORED_WEIGHTS",
    "STRANGER",
    "PlanInputs",
    "activation_dtypes",
    "any_plan_inputs",
    "contradictory_plan_inputs",
    "control_messages",
    "cut_ranges",
    "fault_reasons",
    "layer_ranges",
    "logits_vectors",
    "message_strategies",
    "model_facts",
    "node_ids",
    "orchestrator_event_strategies",
    "run_ids",
    "runtime_configs",
    "sampling_configs",
    "small_plan",
    "stage_event_strategies",
    "tamperings",
    "tokenizer_texts",
    "valid_plan_inputs",
]

# -- protocol: plans, messages and state-machine events ----------------------------


def small_plan(
    stage_count: int,
    *,
    max_tokens: int = 4,
    vocab: int = 8,
    eos: int = 0,
    return_logits: bool = False,
    run_id: str = "run-1",
    activation_width: int = 4,
) -> RunPlan:
    """A plan of a tiny model over ``stage_count`` nodes ``node-0..``; orchestrator
    ``orchestrator``."""
    facts, config, pool = small_plan_inputs(
        stage_count,
        max_tokens=max_tokens,
        vocab=vocab,
        eos=eos,
        return_logits=return_logits,
        run_id=run_id,
        activation_width=activation_width,
    )
    plan = plan_run(facts, config, pool, stage_count=stage_count)
    assert isinstance(plan, RunPlan), plan
    return plan


def small_plan_inputs(
    stage_count: int,
    *,
    max_tokens: int = 4,
    vocab: int = 8,
    eos: int = 0,
    return_logits: bool = False,
    run_id: str = "run-1",
    activation_width: int = 4,
) -> tuple[ModelFacts, RuntimeConfig, NodePool]:
    """The facts, config and pool ``small_plan`` plans."""
    facts = ModelFacts(
        model_id="tiny",
        gguf_source=GgufSource.single("/models/tiny.gguf"),
        architecture="llama",
        num_layers=max(stage_count, 4),
        hidden_dim=8,
        head_count=2,
        head_count_kv=1,
        head_dim_k=4,
        head_dim_v=4,
        vocab_size=vocab,
        eos_token_id=eos,
        context_length=64,
        max_seq_len=64,
        quant_types=("F32",),
        block_bytes=(1024,) * max(stage_count, 4),
        embedding_bytes=1024,
        output_bytes=1024,
        shared_bytes=0,
        tied_embeddings=True,
    )
    config = RuntimeConfig(
        run_id=run_id,
        max_tokens=max_tokens,
        return_logits=return_logits,
        activation_dtype_width_bytes=activation_width,
        worker=STORED_WEIGHTS,
    )
    pool = NodePool(ORCHESTRATOR, tuple(NodeSpec(n, PLENTY) for n in node_ids(stage_count)))
    return facts, config, pool


STRANGER = "stranger"
OTHER_RUN = "other-run"


def fault_reasons() -> st.SearchStrategy[FaultReason]:
    return st.builds(FaultReason, st.sampled_from(FaultKind), st.text(max_size=8))


def message_strategies(plan: RunPlan) -> dict[type, st.SearchStrategy[Any]]:
    """Per message type: messages about ``plan`` or a foreign run, with plausible or
    wrong fields."""
    n = plan.stage_count
    run_ids = st.sampled_from([plan.run_id, OTHER_RUN])
    stage_indices = st.integers(0, n)  # n is out of range
    nodes = st.sampled_from([*[s.node_id for s in plan.stages], STRANGER, ORCHESTRATOR])
    return {
        ProvisionStage: st.sampled_from(provision_all(plan)),
        StopRun: st.builds(StopRun, run_ids, st.sampled_from(StopReason)),
        StageReady: st.builds(StageReady, run_ids, stage_indices, nodes),
        StageFault: st.builds(StageFault, run_ids, stage_indices, nodes, fault_reasons()),
        StageStopped: st.builds(StageStopped, run_ids, stage_indices, nodes),
        RewireEdge: st.builds(RewireEdge, run_ids, st.integers(0, n + 2), nodes),
        JoinChain: st.builds(
            JoinChain,
            nodes,
            stage_indices,
            st.integers(1, n + 1),
            st.sampled_from(["shm", "tcp", ""]),
            st.sampled_from(["shm", "tcp", ""]),
            st.integers(0, 3),
        ),
        ProvisionRefused: st.builds(
            ProvisionRefused,
            run_ids,
            stage_indices,
            nodes,
            st.integers(0, 2**20),
            st.integers(0, 2**20),
            st.integers(0, 2**20),
        ),
    }


def control_messages(plan: RunPlan) -> st.SearchStrategy[Any]:
    """Any control message about ``plan`` or a foreign run."""
    return st.one_of(*message_strategies(plan).values())


def _messages_of(plan: RunPlan, cls: type) -> st.SearchStrategy[Any]:
    return message_strategies(plan)[cls]


def orchestrator_event_strategies(plan: RunPlan) -> dict[Any, st.SearchStrategy[Any]]:
    """One strategy per orchestrator event kind, with plausible and wrong payloads."""
    from runplan.fsm import orchestrator as o

    n = plan.stage_count
    senders = st.sampled_from([*[s.node_id for s in plan.stages], STRANGER])
    K = o.EventKind

    def received(*classes: type) -> st.SearchStrategy[Any]:
        return st.builds(o.Received, senders, st.one_of(*(_messages_of(plan, c) for c in classes)))

    return {
        K.START: st.just(o.Start()),
        K.ENDPOINTS_READY: st.just(o.EndpointsReady()),
        K.STAGE_READY: received(StageReady),
        K.STAGE_FAULT: received(StageFault),
        K.STAGE_STOPPED: received(StageStopped),
        K.PROVISION_REFUSED: received(ProvisionRefused),
        K.OTHER_MESSAGE: received(ProvisionStage, StopRun, RewireEdge, JoinChain),
        K.TOKEN: st.builds(
            o.TokenConsumed, st.integers(0, 6), st.integers(0, plan.model.vocab_size)
        ),
        K.ENDPOINT_FAULT: st.builds(o.EndpointFault, st.text(max_size=5)),
        K.STAGE_DIED: st.builds(o.StageDied, st.integers(0, n), st.text(max_size=5)),
        K.STAGE_SILENT: st.builds(o.StageSilent, st.integers(0, n), st.integers(0, 10**7)),
        K.READY_TIMEOUT: st.just(o.TimerFired(o.Timer.READY)),
        K.TOKEN_TIMEOUT: st.builds(o.TimerFired, st.just(o.Timer.TOKEN), st.integers(0, 2)),
        K.STOP_TIMEOUT: st.just(o.TimerFired(o.Timer.STOP)),
        K.CANCEL: st.builds(o.Cancel, st.text(max_size=5)),
    }


def stage_event_strategies(plan: RunPlan) -> dict[Any, st.SearchStrategy[Any]]:
    """One strategy per stage event kind, with plausible and wrong payloads."""
    from runplan.fsm import stage as s

    senders = st.sampled_from([*[p.node_id for p in plan.stages], STRANGER, ORCHESTRATOR])
    edge_ids = st.integers(0, plan.stage_count + 2)
    K = s.EventKind

    def received(*classes: type) -> st.SearchStrategy[Any]:
        return st.builds(s.Received, senders, st.one_of(*(_messages_of(plan, c) for c in classes)))

    return {
        K.PROVISION: received(ProvisionStage),
        K.STOP_RUN: received(StopRun),
        K.REWIRE: received(RewireEdge),
        K.OTHER_MESSAGE: received(StageReady, StageFault, StageStopped, JoinChain),
        K.SETUP_DONE: st.builds(s.SetupDone, st.sampled_from(s.SetupPart)),
        K.SETUP_FAILED: st.builds(s.SetupFailed, st.sampled_from(s.SetupPart), st.text(max_size=5)),
        K.OBJECT_LOADED: st.one_of(
            st.builds(
                s.ObjectLoaded,
                st.sampled_from([plan.run_id, OTHER_RUN]),
                edge_ids,
                st.integers(0, 5),
                rows=st.integers(1, plan.model.max_seq_len),
            ),
            _chunk_loads(plan.run_id, edge_ids, plan.model.max_seq_len),
        ),
        K.STEP_COMPLETED: st.builds(s.StepCompleted, st.integers(0, 5), st.integers(0, 3)),
        K.STEP_FAILED: st.builds(s.StepFailed, st.integers(0, 5), st.text(max_size=5)),
        K.EDGE_FAULT: st.builds(s.EdgeFault, edge_ids, st.text(max_size=5)),
        K.SETUP_TIMEOUT: st.just(s.TimerFired(s.Timer.SETUP)),
        K.STEP_TIMEOUT: st.just(s.TimerFired(s.Timer.STEP)),
        K.RELEASED: st.just(s.Released()),
        K.ORCHESTRATOR_LOST: st.just(s.OrchestratorLost()),
        K.CACHE_UNAVAILABLE: st.builds(
            s.CacheUnavailable,
            st.integers(0, 2**20),
            st.integers(0, 2**20),
            st.integers(0, 2**20),
        ),
        K.CHAIN_FAULT: st.builds(s.ChainFault, fault_reasons()),
    }


@st.composite
def _chunk_loads(
    draw: st.DrawFn, run_id: str, edge_ids: st.SearchStrategy[int], max_rows: int
) -> Any:
    """A record of a prefill in chunks (or a decode record that claims to be one)."""
    from runplan.fsm import stage as s

    count = draw(st.integers(1, 4))
    return s.ObjectLoaded(
        run_id,
        draw(edge_ids),
        draw(st.integers(0, 2)),
        draw(st.integers(0, count - 1)),
        count,
        rows=draw(st.integers(1, max_rows)),
    )


# -- tokenizer ----------------------------------------------------------------------
# Text a tokenizer must take: any characters, with the pieces tokenizers treat
# specially (special tokens and their fragments, whitespace runs, contractions)
# drawn often enough to meet each other.
_TOKENIZER_PIECES = st.sampled_from(
    [
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "<|im", "|>", "<s>",
        " ", "  ", "\t", "\n", "\r\n", "\u3000", "\xa0", "'s", "'LL", " 123", "4567",
        "Zürich", " naïve", "你好", "😀", "👍🏽", "\u0301", "\u200d", " Q",
    ]
)  # fmt: skip
tokenizer_texts = st.lists(st.one_of(st.text(max_size=8), _TOKENIZER_PIECES), max_size=12).map(
    "".join
)


@st.composite
def layer_ranges(draw: st.DrawFn, num_layers: int) -> tuple[int, int]:
    """A non-empty range ``[start, end)`` of ``0..num_layers``."""
    start = draw(st.integers(0, num_layers - 1))
    return start, draw(st.integers(start + 1, num_layers))


@st.composite
def logits_vectors(draw: st.DrawFn, *, max_size: int = 64) -> Any:
    """Finite float32 logits, with ties likely (values drawn from a small set)."""
    import numpy as np

    size = draw(st.integers(1, max_size))
    values = st.one_of(
        st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.0, 2.0]),
        st.floats(-30.0, 30.0, width=32),
    )
    return np.array(draw(st.lists(values, min_size=size, max_size=size)), dtype=np.float32)


sampling_configs = st.builds(
    SamplingConfig,
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 3.0)),
    top_k=st.integers(0, 80),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    seed=st.integers(0, 2**64 - 1),
)
