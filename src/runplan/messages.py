"""Control messages (PIPELINE_ORCHESTRATION_MVP.md §4, §8). ``ProvisionStage`` is the
planner's projection of one stage plan; the other messages join with the protocol."""

from __future__ import annotations

from attrs import frozen

from runplan._fields import bool_field, int_field, str_field, typed_field
from runplan.config import SamplingConfig, Timeouts
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


@frozen
class ProvisionStage:
    """Everything one stage process needs for one run, and nothing of other stages:
    its own layer range, one inbound and one outbound edge, the timeouts, and (last
    stage only) the sampling settings."""

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
    sampling: SamplingConfig | None = typed_field((SamplingConfig, type(None)), default=None)
    return_logits: bool = bool_field(default=False)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.stage_count - 1
