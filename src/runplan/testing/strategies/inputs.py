"""Valid planner inputs and their pieces: model facts, runtime configs, node pools and
placements of every kind."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs
from hypothesis import strategies as st

from runplan.config import (
    REFERENCE_ARCHITECTURES,
    REFERENCE_QUANT_TYPES,
    RuntimeConfig,
    SamplingConfig,
    Timeouts,
    WorkerCapabilities,
)
from runplan.contract.subject import PlanInputs
from runplan.dtypes import DTypeFamily
from runplan.facts import GgufSource, ModelFacts
from runplan.placement import Placement, StageAssignment
from runplan.pool import NodePool, NodeSpec

ORCHESTRATOR = "orchestrator"
#: A worker that keeps weights as the file stores them (as the CUDA worker does).
STORED_WEIGHTS = WorkerCapabilities(
    name="stored-weights", weight_bytes_per_element=0, kv_bytes_per_element=0
)
PLENTY = 2**50  # bytes: more than any generated stage needs
PLACEMENT_KINDS = ("even", "memory", "explicit")

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
        eos_token_id=(eos := draw(st.integers(0, vocab - 1))),
        eog_token_ids=tuple(sorted({eos, *draw(st.lists(st.integers(0, vocab - 1), max_size=3))})),
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
    batch_rows = draw(st.integers(1, 1024))
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
            tokens_delivered=draw(st.sampled_from([0, 0, 1, 2**32 - 1])),
        ),
        return_logits=draw(st.booleans()),
        timeouts=Timeouts(
            ready_ms=draw(st.integers(1, 10**6)),
            step_ms=draw(st.integers(1, 10**6)),
            edge_wait_ms=draw(st.integers(1, 10**6)),
            stop_ms=draw(st.integers(1, 10**6)),
            step_row_ms=draw(st.integers(0, 10**4)),
            heartbeat_ms=draw(st.integers(100, 10**6)),
        ),
        max_concurrent_runs=draw(st.integers(1, 8)),
        max_batch_rows=batch_rows,
        prefill_chunk=draw(st.integers(0, batch_rows)),
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


@st.composite
def valid_plan_inputs(
    draw: st.DrawFn, *, max_layers: int = 48, placements: Sequence[str] = PLACEMENT_KINDS
) -> PlanInputs:
    """Inputs every planner that keeps the contract must plan: nodes with plenty of
    memory, placement ``even``, ``memory`` or ``explicit`` (explicit rows in any order),
    spare nodes in the pool, devices shared or not."""
    facts = draw(model_facts(max_layers=max_layers))
    config = draw(runtime_configs())
    if config.max_tokens > facts.max_seq_len:  # a 1-token prompt and max_tokens must fit
        config = attrs.evolve(config, max_tokens=draw(st.integers(1, facts.max_seq_len)))
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
    kind = draw(st.sampled_from(list(placements)))
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


@st.composite
def any_plan_inputs(draw: st.DrawFn) -> PlanInputs:
    """Valid inputs, or valid inputs with one field broken (stage count, memory,
    layers, a node gone, the dtype width)."""
    inputs = draw(valid_plan_inputs())
    breakage = draw(st.sampled_from(["none", "stages", "memory", "layers", "node", "dtype"]))
    if breakage == "stages":
        return attrs.evolve(inputs, stage_count=draw(st.integers(-2, 80)))
    if breakage == "memory":
        nodes = tuple(
            attrs.evolve(n, memory_bytes=draw(st.integers(0, 2**20))) for n in inputs.pool.nodes
        )
        return attrs.evolve(inputs, pool=attrs.evolve(inputs.pool, nodes=nodes))
    if breakage == "layers":
        facts = attrs.evolve(inputs.facts, num_layers=draw(st.integers(0, 80)))
        return attrs.evolve(inputs, facts=facts)
    if breakage == "node":
        nodes = inputs.pool.nodes[1:]
        return attrs.evolve(inputs, pool=attrs.evolve(inputs.pool, nodes=nodes))
    if breakage == "dtype":
        config = attrs.evolve(inputs.config, activation_dtype_width_bytes=draw(st.integers(0, 9)))
        return attrs.evolve(inputs, config=config)
    return inputs
