"""Control messages (PIPELINE_ORCHESTRATION_MVP.md §4, §8): ``ProvisionStage`` (the
planner's projection of one stage plan), ``StopRun``, ``StageReady``, ``StageFault``,
``StageStopped`` (with the stage's batch sizes since its last one), ``RewireEdge``,
``ProvisionRefused`` (CONCURRENT_RUNS.md §5: a stage that cannot reserve a run's KV
cache), and ``JoinChain`` (issue 25: a stage whose chain was re-placed around it leaves
the old chain's links and joins the new chain's, keeping its weights)."""

from __future__ import annotations

import enum

from attrs import frozen

from runplan._fields import (
    bool_field,
    int_field,
    kv_width_field,
    str_field,
    tuple_field,
    typed_field,
)
from runplan.config import SamplingConfig, Timeouts, batch_runs, shared_batch_rows, shared_batches
from runplan.dtypes import DTypeFamily
from runplan.facts import GgufSource
from runplan.plan import EdgeKind, ObjectSpec, RingSpec


@frozen
class InboundEdgeProvision:
    """The receive end of a stage: established locally, no producer address."""

    edge_id: int = int_field()
    kind: EdgeKind = typed_field(EdgeKind)
    object_spec: ObjectSpec = typed_field(ObjectSpec)
    ring_spec: RingSpec = typed_field(RingSpec)


@frozen
class OutboundEdgeProvision:
    """The send end of a stage, to ``consumer_node_id`` (a node id, not an address)."""

    edge_id: int = int_field()
    kind: EdgeKind = typed_field(EdgeKind)
    consumer_node_id: str = str_field()
    object_spec: ObjectSpec = typed_field(ObjectSpec)
    ring_spec: RingSpec = typed_field(RingSpec)


@frozen
class StageModelFacts:
    model_id: str = str_field()
    architecture: str = str_field()
    hidden_dim: int = int_field()
    dtype_family: DTypeFamily = typed_field(DTypeFamily)
    dtype_width_bytes: int = int_field()
    max_seq_len: int = int_field()
    # the KV cache's float width, as the plan counted it (``GgufModelPlan``)
    kv_dtype_width_bytes: int = kv_width_field()


@frozen
class ProvisionStage:
    """Everything one stage process needs for one run, and nothing of other stages:
    its own layer range, one inbound and one outbound edge, the timeouts, the run's KV
    cache and the stage's budget, and (last stage only) the sampling settings."""

    run_id: str = str_field()
    stage_index: int = int_field()
    stage_count: int = int_field()
    node_id: str = str_field()  # the node this stage runs on (checked by the stage)
    gguf_source: GgufSource = typed_field(GgufSource)
    layer_start: int = int_field()
    layer_end_exclusive: int = int_field()
    inbound: InboundEdgeProvision = typed_field(InboundEdgeProvision)
    outbound: OutboundEdgeProvision = typed_field(OutboundEdgeProvision)
    model: StageModelFacts = typed_field(StageModelFacts)
    timeouts: Timeouts = typed_field(Timeouts)
    # The run's KV cache on this stage: positions and bytes (what the worker's
    # ``open_run`` reserves), the stage's budget for all the chain's runs, and the rows
    # of one worker call (CONCURRENT_RUNS.md §3, §5).
    kv_positions: int = int_field()
    kv_bytes: int = int_field()
    kv_budget_bytes: int = int_field()
    max_batch_rows: int = int_field()
    sampling: SamplingConfig | None = typed_field((SamplingConfig, type(None)), default=None)
    return_logits: bool = bool_field(default=False)

    @property
    def batch_rows(self) -> int:
        """Rows this run's batches on the stage may hold in all (0: it runs alone)."""
        return shared_batch_rows(self.max_batch_rows, self.kv_bytes, self.kv_budget_bytes)

    @property
    def shared_batches(self) -> int:
        """Batches a step of this run on the stage may wait through when it shares them
        (``Timeouts``): its batches' outputs go out on the outbound ring."""
        runs = batch_runs(
            self.max_batch_rows, self.kv_bytes, self.kv_budget_bytes, self.kv_positions
        )
        return shared_batches(runs, self.outbound.ring_spec.slot_count)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.stage_count - 1


class StopReason(enum.Enum):
    """Why the orchestrator tears a run down (the run's terminal outcome)."""

    COMPLETED = "COMPLETED"  # EOS or max_tokens
    FAULTED = "FAULTED"  # any fault
    CANCELLED = "CANCELLED"  # the caller tore the run down


class FaultKind(enum.Enum):
    SETUP_FAILURE = "SETUP_FAILURE"  # worker, weights or an edge end could not be set up
    SEQUENCE_VIOLATION = "SEQUENCE_VIOLATION"  # an inbound object out of sequence
    STEP_FAILURE = "STEP_FAILURE"  # the worker failed a step
    EDGE_FAULT = "EDGE_FAULT"  # an edge closed, broke, or carried a bad record
    TIMEOUT = "TIMEOUT"  # a bounded wait ran out
    REJECTED_MESSAGE = "REJECTED_MESSAGE"  # a message the run cannot accept
    # an event the state machine has no entry for, or a record or frame the receiver
    # cannot read (another version, a garbled header)
    PROTOCOL_VIOLATION = "PROTOCOL_VIOLATION"
    PROCESS_DIED = "PROCESS_DIED"  # a stage process is gone (seen by the orchestrator)
    STAGE_SILENT = "STAGE_SILENT"  # a stage sent no heartbeat within the bound (stopped, hung)
    ORCHESTRATOR_LOST = "ORCHESTRATOR_LOST"  # the control channel to the orchestrator closed
    KV_CACHE_UNAVAILABLE = "KV_CACHE_UNAVAILABLE"  # a stage could not reserve the run's cache


@frozen
class FaultReason:
    kind: FaultKind = typed_field(FaultKind)
    detail: str = str_field(default="")

    def __str__(self) -> str:
        return f"{self.kind.value.lower()}: {self.detail}" if self.detail else self.kind.value


@frozen
class StopRun:
    """Orchestrator to stage: tear the run down. Authoritative for the active run."""

    run_id: str = str_field()
    reason: StopReason = typed_field(StopReason)


@frozen
class StageReady:
    run_id: str = str_field()
    stage_index: int = int_field()
    node_id: str = str_field()


@frozen
class StageFault:
    run_id: str = str_field()
    stage_index: int = int_field()
    node_id: str = str_field()
    reason: FaultReason = typed_field(FaultReason)


@frozen
class BatchCount:
    """``batches`` worker calls of ``rows`` rows in all (a stage's batches, counted by
    their rows)."""

    rows: int = int_field()
    batches: int = int_field()


@frozen
class StageStopped:
    """Stage to orchestrator: the run is released. ``batches``: the batches this stage
    ran since its previous ``StageStopped`` (of any run on its chain), counted by rows,
    so that each batch is reported once (CONCURRENT_RUNS.md §3; the chain's stage
    fills it in, not the run's machine; empty from a stage that reports none)."""

    run_id: str = str_field()
    stage_index: int = int_field()
    node_id: str = str_field()
    batches: tuple[BatchCount, ...] = tuple_field(BatchCount, default=())


@frozen
class ProvisionRefused:
    """Stage to orchestrator: the stage cannot reserve the run's KV cache now, so it did
    not take the provision (nothing of the run is kept; the same provision may come
    again). ``needed_bytes > budget_bytes``: the run never fits this stage."""

    run_id: str = str_field()
    stage_index: int = int_field()
    node_id: str = str_field()
    needed_bytes: int = int_field()
    free_bytes: int = int_field()
    budget_bytes: int = int_field()


@frozen
class RewireEdge:
    """A request to change an edge's peer. Only the plan wires a run, so every stage
    rejects it (EDGES_AND_WORKERS.md §5); it exists so that the rejection is tested."""

    run_id: str = str_field()
    edge_id: int = int_field()
    new_peer_node_id: str = str_field()


@frozen
class JoinChain:
    """Orchestrator to a warm stage whose chain was re-placed around it (issue 25): the
    stage keeps its process, its worker and its bound weights, stops every run it still
    holds of the old chain (their ids stay stale), leaves every link of the old chain and
    joins the new chain's links: those of stage ``stage_index`` of ``stage_count``,
    named and keyed from the new chain's secret, which its host hands it beside this
    message (never on the wire), each moving its bytes by the medium named
    (``inbound_medium``, ``outbound_medium``: the runtime's names, ``shm`` or ``tcp``).
    ``generation``: the chain's re-placements so far (for logs). Not about a run: no
    run machine takes it; a stage refuses one not from its orchestrator, for another
    node, or for another place than the layers it holds."""

    node_id: str = str_field()
    stage_index: int = int_field()
    stage_count: int = int_field()
    inbound_medium: str = str_field()
    outbound_medium: str = str_field()
    generation: int = int_field()


#: Every control message that travels between the orchestrator and stages.
ControlMessage = (
    ProvisionStage
    | StopRun
    | StageReady
    | StageFault
    | StageStopped
    | ProvisionRefused
    | RewireEdge
    | JoinChain
)
