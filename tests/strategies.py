"""Hypothesis strategies shared by every test suite."""

from __future__ import annotations

import itertools
from typing import Any

import attrs
from hypothesis import strategies as st

from runplan import (
    DTypeFamily,
    GgufSource,
    ModelFacts,
    NodePool,
    NodeSpec,
    Placement,
    RunPlan,
    RuntimeConfig,
    SamplingConfig,
    StageAssignment,
    Timeouts,
    WorkerCapabilities,
    plan_run,
    provision_all,
)
from runplan.config import REFERENCE_ARCHITECTURES, REFERENCE_QUANT_TYPES
from runplan.messages import (
    FaultKind,
    FaultReason,
    ProvisionStage,
    RewireEdge,
    StageFault,
    StageReady,
    StageStopped,
    StopReason,
    StopRun,
)

ORCHESTRATOR = "orchestrator"
#: A worker that keeps weights as the file stores them (as the CUDA worker does).
STORED_WEIGHTS = WorkerCapabilities(
    name="stored-weights", weight_bytes_per_element=0, kv_bytes_per_element=0
)
PLENTY = 2**50  # bytes: more than any generated stage needs

run_ids = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=24
)
activation_dtypes = st.sampled_from(
    [(DTypeFamily.FLOAT, 4), (DTypeFamily.FLOAT, 2), (DTypeFamily.BFLOAT, 2)]
)


@st.composite
def model_facts(draw: st.DrawFn, *, max_layers: int = 48) -> ModelFacts:
    """Self-consistent facts of a model the reference worker can run."""
    num_layers = draw(st.integers(1, max_layers))
    head_count_kv = draw(st.integers(1, 8))
    head_count = head_count_kv * draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from([8, 16, 64, 128]))
    vocab = draw(st.integers(2, 200_000))
    context = draw(st.integers(1, 32_768))
    block = draw(st.integers(1, 2**30))
    elements = draw(st.booleans())  # facts read from a file know their element counts
    return ModelFacts(
        model_id=draw(st.text(min_size=1, max_size=16)),
        gguf_source=GgufSource(paths=(f"/models/{draw(st.integers(0, 99))}.gguf",)),
        architecture=draw(st.sampled_from(REFERENCE_ARCHITECTURES)),
        num_layers=num_layers,
        hidden_dim=head_count * head_dim,
        head_count=head_count,
        head_count_kv=head_count_kv,
        head_dim_k=head_dim,
        head_dim_v=head_dim,
        vocab_size=vocab,
        eos_token_id=draw(st.integers(0, vocab - 1)),
        context_length=context,
        max_seq_len=draw(st.integers(1, context)),
        quant_types=tuple(
            sorted(draw(st.sets(st.sampled_from(REFERENCE_QUANT_TYPES), min_size=1)))
        ),
        block_bytes=tuple(
            draw(st.lists(st.integers(1, 2 * block), min_size=num_layers, max_size=num_layers))
        ),
        embedding_bytes=draw(st.integers(1, 2**32)),
        output_bytes=draw(st.integers(1, 2**32)),
        shared_bytes=draw(st.integers(0, 2**20)),
        tied_embeddings=draw(st.booleans()),
        block_elements=tuple(
            draw(st.lists(st.integers(1, 2**28), min_size=num_layers, max_size=num_layers))
        )
        if elements
        else (),
        embedding_elements=draw(st.integers(1, 2**30)) if elements else 0,
        output_elements=draw(st.integers(1, 2**30)) if elements else 0,
    )


@st.composite
def runtime_configs(draw: st.DrawFn) -> RuntimeConfig:
    family, width = draw(activation_dtypes)
    return RuntimeConfig(
        run_id=draw(run_ids),
        max_tokens=draw(st.integers(1, 4096)),
        activation_dtype_family=family,
        activation_dtype_width_bytes=width,
        ring_slot_count=draw(st.integers(1, 4)),
        ring_alignment=2 ** draw(st.integers(0, 12)),
        sampling=SamplingConfig(
            temperature=draw(st.floats(0.0, 2.0)),
            top_k=draw(st.integers(0, 100)),
            top_p=draw(st.floats(0.01, 1.0)),
            seed=draw(st.integers(0, 2**64 - 1)),
        ),
        return_logits=draw(st.booleans()),
        timeouts=Timeouts(
            ready_ms=draw(st.integers(1, 10**6)),
            step_ms=draw(st.integers(1, 10**6)),
            edge_wait_ms=draw(st.integers(1, 10**6)),
            stop_ms=draw(st.integers(1, 10**6)),
        ),
    )


def node_ids(n: int) -> list[str]:
    return [f"node-{i}" for i in range(n)]


@st.composite
def cut_ranges(draw: st.DrawFn, num_layers: int, stage_count: int) -> list[tuple[int, int]]:
    """``stage_count`` contiguous non-empty ranges covering ``0..num_layers``."""
    cuts = (
        sorted(
            draw(
                st.sets(
                    st.integers(1, num_layers - 1),
                    min_size=stage_count - 1,
                    max_size=stage_count - 1,
                )
            )
        )
        if stage_count > 1
        else []
    )
    bounds = [0, *cuts, num_layers]
    return list(itertools.pairwise(bounds))


@attrs.frozen
class PlanInputs:
    facts: ModelFacts
    config: RuntimeConfig
    pool: NodePool
    stage_count: int
    placement: Placement

    def kwargs(self) -> dict[str, Any]:
        return {"stage_count": self.stage_count, "placement": self.placement}


@st.composite
def valid_plan_inputs(draw: st.DrawFn, *, max_layers: int = 48) -> PlanInputs:
    """Inputs ``plan_run`` must accept: nodes with plenty of memory, every
    placement kind, spare nodes in the pool, devices shared or not."""
    facts = draw(model_facts(max_layers=max_layers))
    config = draw(runtime_configs())
    stage_count = draw(st.integers(1, min(facts.num_layers, 16)))
    spare = draw(st.integers(0, 3))
    ids = node_ids(stage_count + spare)
    order = draw(st.permutations(ids))
    shared_device = draw(st.booleans())
    nodes = tuple(
        NodeSpec(nid, PLENTY * (1 + i % 3), "gpu-shared" if shared_device and i % 2 else None)
        for i, nid in enumerate(ids)
    )
    chosen = order[:stage_count]
    kind = draw(st.sampled_from(["even", "memory", "explicit"]))
    if kind == "even":
        placement = Placement.even(chosen)
    elif kind == "memory":
        placement = Placement.by_memory(chosen)
    else:
        ranges = draw(cut_ranges(facts.num_layers, stage_count))
        rows = [StageAssignment(i, chosen[i], a, b) for i, (a, b) in enumerate(ranges)]
        placement = Placement(assignments=tuple(draw(st.permutations(rows))))
    pool = NodePool(orchestrator_node_id=ORCHESTRATOR, nodes=nodes)
    if not facts.block_elements:  # hand-made facts: plan for a worker that keeps weights as stored
        config = attrs.evolve(config, worker=STORED_WEIGHTS)
    return PlanInputs(facts, config, pool, stage_count, placement)


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
    plan = plan_run(facts, config, pool, stage_count=stage_count)
    assert isinstance(plan, RunPlan), plan
    return plan


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
        K.OTHER_MESSAGE: received(ProvisionStage, StopRun, RewireEdge),
        K.TOKEN: st.builds(
            o.TokenConsumed, st.integers(0, 6), st.integers(0, plan.model.vocab_size)
        ),
        K.ENDPOINT_FAULT: st.builds(o.EndpointFault, st.text(max_size=5)),
        K.STAGE_DIED: st.builds(o.StageDied, st.integers(0, n), st.text(max_size=5)),
        K.READY_TIMEOUT: st.just(o.TimerFired(o.Timer.READY)),
        K.TOKEN_TIMEOUT: st.just(o.TimerFired(o.Timer.TOKEN)),
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
        K.OTHER_MESSAGE: received(StageReady, StageFault, StageStopped),
        K.SETUP_DONE: st.builds(s.SetupDone, st.sampled_from(s.SetupPart)),
        K.SETUP_FAILED: st.builds(s.SetupFailed, st.sampled_from(s.SetupPart), st.text(max_size=5)),
        K.OBJECT_LOADED: st.builds(
            s.ObjectLoaded, st.sampled_from([plan.run_id, OTHER_RUN]), edge_ids, st.integers(0, 5)
        ),
        K.STEP_COMPLETED: st.builds(s.StepCompleted, st.integers(0, 5)),
        K.STEP_FAILED: st.builds(s.StepFailed, st.integers(0, 5), st.text(max_size=5)),
        K.EDGE_FAULT: st.builds(s.EdgeFault, edge_ids, st.text(max_size=5)),
        K.SETUP_TIMEOUT: st.just(s.TimerFired(s.Timer.SETUP)),
        K.STEP_TIMEOUT: st.just(s.TimerFired(s.Timer.STEP)),
        K.RELEASED: st.just(s.Released()),
        K.ORCHESTRATOR_LOST: st.just(s.OrchestratorLost()),
    }


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
