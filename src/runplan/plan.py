"""The run plan (PIPELINE_ORCHESTRATION_MVP.md §3): the one authority every stage takes
its layers, edges and object specs from."""

from __future__ import annotations

import enum

from attrs import frozen

from runplan._fields import (
    bool_field,
    int_field,
    int_tuple_field,
    kv_width_field,
    str_field,
    tuple_field,
    typed_field,
)
from runplan.config import SamplingConfig, Timeouts
from runplan.dtypes import DTypeFamily
from runplan.facts import GgufSource

#: Bytes of the fixed object header in front of every record on an edge
#: (EDGES_AND_WORKERS.md §1); ring slots hold header + payload.
OBJECT_HEADER_BYTES = 128
#: Longest run id, in UTF-8 bytes, that the object header holds.
MAX_RUN_ID_BYTES = 64
#: Extents and slot sizes are u64 in the header.
U64_MAX = 2**64 - 1


class EdgeKind(enum.Enum):
    TOKEN_IN = "TOKEN_IN"  # orchestrator -> stage 0
    ACTIVATION = "ACTIVATION"  # stage i -> stage i + 1
    TOKEN_OUT = "TOKEN_OUT"  # stage N-1 -> orchestrator


class ObjectKind(enum.Enum):
    TOKEN = "TOKEN"
    ACTIVATION = "ACTIVATION"


class Layout(enum.Enum):
    """How an object's payload is laid out."""

    TOKEN_IDS = "TOKEN_IDS"  # u32 ids, one per row
    TOKEN_ID_WITH_LOGITS = "TOKEN_ID_WITH_LOGITS"  # one u32 id, then n_vocab f32 raw logits
    ROW_MAJOR = "ROW_MAJOR"  # activations [rows, hidden_dim], row-major


@frozen
class OrchestratorEndpoint:
    node_id: str = str_field()


@frozen
class StageEndpoint:
    node_id: str = str_field()
    stage_index: int = int_field()


EdgeEndpoint = OrchestratorEndpoint | StageEndpoint


@frozen
class ObjectSpec:
    """What one record on an edge may hold. ``max_extent`` bounds the payload bytes."""

    kind: ObjectKind = typed_field(ObjectKind)
    layout: Layout = typed_field(Layout)
    dtype_family: DTypeFamily = typed_field(DTypeFamily)
    dtype_width_bytes: int = int_field()
    max_extent: int = int_field()


@frozen
class RingSpec:
    """A single-producer single-consumer ring of ``slot_count`` slots, each
    ``slot_bytes`` (header + max_extent, rounded up to ``alignment``)."""

    slot_count: int = int_field()
    alignment: int = int_field()
    slot_bytes: int = int_field()


@frozen
class EdgePlan:
    run_id: str = str_field()
    edge_id: int = int_field()
    kind: EdgeKind = typed_field(EdgeKind)
    producer: EdgeEndpoint = typed_field((OrchestratorEndpoint, StageEndpoint))
    consumer: EdgeEndpoint = typed_field((OrchestratorEndpoint, StageEndpoint))
    object_spec: ObjectSpec = typed_field(ObjectSpec)
    ring_spec: RingSpec = typed_field(RingSpec)


@frozen
class StagePlan:
    run_id: str = str_field()
    stage_index: int = int_field()
    stage_count: int = int_field()
    node_id: str = str_field()
    gguf_source: GgufSource = typed_field(GgufSource)
    layer_start: int = int_field()
    layer_end_exclusive: int = int_field()
    inbound_edge: int = int_field()
    outbound_edge: int = int_field()
    # This run's KV cache on this stage (``RunPlan.kv_positions`` positions of its
    # blocks), and what the stage may hold for all the chain's runs (CONCURRENT_RUNS.md §5).
    kv_bytes: int = int_field()
    kv_budget_bytes: int = int_field()


@frozen
class GgufModelPlan:
    """The spec's ``GgufModelPlan``: the model facts every stage plan agrees on. The
    dtype is the run's activation dtype (from the config), not the weights'; the KV
    cache's elements are floats of ``kv_dtype_width_bytes`` (4: float32, 2: float16),
    the width the planner counted the cache at (the worker's ``kv_bytes_per_element``,
    else the activations'), which every stage's worker holds it in."""

    model_id: str = str_field()
    gguf_source: GgufSource = typed_field(GgufSource)
    architecture: str = str_field()
    num_layers: int = int_field()
    hidden_dim: int = int_field()
    dtype_family: DTypeFamily = typed_field(DTypeFamily)
    dtype_width_bytes: int = int_field()
    max_seq_len: int = int_field()
    eos_token_id: int = int_field()
    vocab_size: int = int_field()
    kv_dtype_width_bytes: int = kv_width_field()
    #: every id that ends generation (``ModelFacts.eog_token_ids``: end of turn, ...;
    #: the spec's EOS policy read as llama.cpp reads it); empty: ``eos_token_id`` alone
    eog_token_ids: tuple[int, ...] = int_tuple_field(default=())

    @property
    def end_token_ids(self) -> frozenset[int]:
        """The ids a run ends at: ``eog_token_ids`` and ``eos_token_id``."""
        return frozenset((self.eos_token_id, *self.eog_token_ids))


@frozen
class RunPlan:
    """One immutable plan of one run: stages in order, edges in pipeline order
    (token-in, activations, token-out), and what stages need of the config."""

    run_id: str = str_field()
    model: GgufModelPlan = typed_field(GgufModelPlan)
    stages: tuple[StagePlan, ...] = tuple_field(StagePlan)
    edges: tuple[EdgePlan, ...] = tuple_field(EdgePlan)
    max_tokens: int = int_field()
    orchestrator_node_id: str = str_field()
    timeouts: Timeouts = typed_field(Timeouts)
    sampling: SamplingConfig = typed_field(SamplingConfig)
    return_logits: bool = bool_field()
    # Positions of KV cache the run reserves on every stage: its prompt plus max_tokens,
    # within max_seq_len (max_seq_len when the prompt's length is not known).
    kv_positions: int = int_field()
    # Rows of one worker call on a stage; rows of each prefill chunk (<= max_batch_rows).
    max_batch_rows: int = int_field()
    prefill_chunk: int = int_field()

    @property
    def stage_count(self) -> int:
        return len(self.stages)

    @property
    def token_in(self) -> EdgePlan:
        """The edge stage 0 consumes (found by id: edges may come in any order)."""
        return self.edge(self.stages[0].inbound_edge)

    @property
    def token_out(self) -> EdgePlan:
        """The edge the last stage produces."""
        return self.edge(self.stages[-1].outbound_edge)

    def edge(self, edge_id: int) -> EdgePlan:
        """The edge with id ``edge_id`` (``KeyError`` if the plan has none)."""
        for e in self.edges:
            if e.edge_id == edge_id:
                return e
        raise KeyError(edge_id)
