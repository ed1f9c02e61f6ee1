"""Typed rejections: ``plan_run`` and ``check_plan`` return one of these instead of a
plan. Each is a frozen value carrying the offending values, with a stable ``code``."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
from attrs import frozen

from runplan._fields import int_field, int_tuple_field, str_field, tuple_field, typed_field


@frozen
class PlanRejection:
    """Base of every rejection. ``code`` is stable; ``str()`` is for people."""

    code: ClassVar[str] = "rejected"
    _template: ClassVar[str] = "the plan was rejected"

    def values(self) -> dict[str, Any]:
        """The offending values, by field name."""
        return attrs.asdict(self, recurse=False)

    def __str__(self) -> str:
        return f"{self.code}: " + self._template.format(**self.values())


_OptInt = (int, type(None))


@frozen(str=False)
class UnknownNode(PlanRejection):
    code: ClassVar[str] = "unknown_node"
    _template: ClassVar[str] = "node {node_id!r} (stage {stage_index}) is not in the node pool"
    node_id: str = str_field()
    stage_index: int | None = typed_field(_OptInt)


@frozen(str=False)
class DuplicateNode(PlanRejection):
    code: ClassVar[str] = "duplicate_node"
    _template: ClassVar[str] = "node {node_id!r} is given twice: {detail}"
    node_id: str = str_field()
    stage_indices: tuple[int, ...] = int_tuple_field()
    detail: str = str_field()


@frozen(str=False)
class DuplicateStage(PlanRejection):
    code: ClassVar[str] = "duplicate_stage"
    _template: ClassVar[str] = "stage index {stage_index} is assigned {count} times"
    stage_index: int = int_field()
    count: int = int_field()


@frozen(str=False)
class MissingStage(PlanRejection):
    code: ClassVar[str] = "missing_stage"
    _template: ClassVar[str] = (
        "stage index {stage_index} is not assigned (stage_count {stage_count})"
    )
    stage_index: int = int_field()
    stage_count: int = int_field()


@frozen(str=False)
class InvalidStageCount(PlanRejection):
    code: ClassVar[str] = "invalid_stage_count"
    _template: ClassVar[str] = (
        "stage_count {stage_count}: {reason} (layers {num_layers}, placed stages {placed_stages})"
    )
    stage_count: int = int_field()
    num_layers: int | None = typed_field(_OptInt)
    placed_stages: int | None = typed_field(_OptInt)
    reason: str = str_field()

    def __str__(self) -> str:
        """The template's, naming only the counts that are known (it said ``placed
        stages None`` of a plan not placed yet)."""
        known = [
            f"{label} {value}"
            for label, value in (("layers", self.num_layers), ("placed stages", self.placed_stages))
            if value is not None
        ]
        counts = f" ({', '.join(known)})" if known else ""
        return f"{self.code}: stage_count {self.stage_count}: {self.reason}{counts}"


@frozen(str=False)
class InvalidLayerRange(PlanRejection):
    code: ClassVar[str] = "invalid_layer_range"
    _template: ClassVar[str] = (
        "stage {stage_index} layers [{layer_start}, {layer_end_exclusive}) of {num_layers}: "
        "{reason}"
    )
    stage_index: int = int_field()
    layer_start: int = int_field()
    layer_end_exclusive: int = int_field()
    num_layers: int = int_field()
    reason: str = str_field()


@frozen(str=False)
class EdgeEndpointMismatch(PlanRejection):
    code: ClassVar[str] = "edge_endpoint_mismatch"
    _template: ClassVar[str] = "edge {edge_id} ({kind}) {field}: expected {expected}, got {actual}"
    edge_id: int | None = typed_field(_OptInt)
    kind: str = str_field()
    field: str = str_field()
    expected: str = str_field()
    actual: str = str_field()


@frozen(str=False)
class DuplicateEdgeId(PlanRejection):
    code: ClassVar[str] = "duplicate_edge_id"
    _template: ClassVar[str] = "edge id {edge_id} is used by {count} edges"
    edge_id: int = int_field()
    count: int = int_field()


@frozen(str=False)
class InconsistentModelFacts(PlanRejection):
    code: ClassVar[str] = "inconsistent_model_facts"
    _template: ClassVar[str] = "model facts: {field} = {value}: {reason}"
    field: str = str_field()
    value: str = str_field()
    reason: str = str_field()


@frozen(str=False)
class InvalidExtent(PlanRejection):
    code: ClassVar[str] = "invalid_extent"
    _template: ClassVar[str] = "{what} = {value} (expected {expected}): {reason}"
    #: The text where the facts expect no value (``expected`` None): the bound alone is broken.
    _template_unbound: ClassVar[str] = "{what} = {value}: {reason}"
    what: str = str_field()  # e.g. "edge 2 object_spec.max_extent"
    value: int = int_field()
    expected: int | None = typed_field(_OptInt)
    reason: str = str_field()

    def __str__(self) -> str:
        template = self._template if self.expected is not None else self._template_unbound
        return f"{self.code}: " + template.format(**self.values())


@frozen(str=False)
class InvalidAlignment(PlanRejection):
    code: ClassVar[str] = "invalid_alignment"
    _template: ClassVar[str] = "{what} = {alignment} is not a power of two"
    what: str = str_field()
    alignment: int = int_field()


@frozen(str=False)
class InvalidDtypeWidth(PlanRejection):
    code: ClassVar[str] = "invalid_dtype_width"
    _template: ClassVar[str] = (
        "{what}: width {dtype_width_bytes} does not match family {dtype_family} "
        "(valid widths: {valid_widths})"
    )
    what: str = str_field()
    dtype_family: str = str_field()
    dtype_width_bytes: int = int_field()
    valid_widths: tuple[int, ...] = int_tuple_field()


@frozen(str=False)
class UnsupportedLayout(PlanRejection):
    code: ClassVar[str] = "unsupported_layout"
    _template: ClassVar[str] = "{what}: {reason}"
    what: str = str_field()
    reason: str = str_field()


@frozen(str=False)
class UnsupportedModel(PlanRejection):
    code: ClassVar[str] = "unsupported_model"
    _template: ClassVar[str] = (
        "worker {worker!r} cannot run architecture {architecture!r} "
        "with quant types {unsupported_quant_types} "
        "(it runs architectures {supported_architectures} and quant types "
        "{supported_quant_types})"
    )
    worker: str = str_field()
    architecture: str = str_field()
    unsupported_quant_types: tuple[str, ...] = tuple_field(str)
    supported_architectures: tuple[str, ...] = tuple_field(str)
    supported_quant_types: tuple[str, ...] = tuple_field(str)


@frozen(str=False)
class InsufficientMemory(PlanRejection):
    code: ClassVar[str] = "insufficient_memory"
    _template: ClassVar[str] = (
        "device {device!r} (stages {stage_indices} on nodes {node_ids}) needs "
        "{bytes_needed} bytes but has {bytes_available}"
    )
    device: str = str_field()
    stage_indices: tuple[int, ...] = int_tuple_field()
    node_ids: tuple[str, ...] = tuple_field(str)
    bytes_needed: int = int_field()
    bytes_available: int = int_field()


@frozen(str=False)
class InvalidConfig(PlanRejection):
    """A run-wide setting no run can have (run id, max tokens, ring slots, sampling,
    timeouts, worker capabilities no worker has, a placement field its strategy does
    not read)."""

    code: ClassVar[str] = "invalid_config"
    _template: ClassVar[str] = "{field} = {value}: {reason}"
    field: str = str_field()
    value: str = str_field()
    reason: str = str_field()


@frozen(str=False)
class InconsistentPlan(PlanRejection):
    """A stage or edge of a checked plan whose run-wide fields (run id, stage count,
    GGUF source, dtype) or order disagree with the rest of the plan."""

    code: ClassVar[str] = "inconsistent_plan"
    _template: ClassVar[str] = "{where} {field}: expected {expected}, got {actual}"
    where: str = str_field()  # "stage 2", "edge 3"
    field: str = str_field()
    expected: str = str_field()
    actual: str = str_field()


#: Every rejection class, by code.
REJECTIONS: dict[str, type[PlanRejection]] = {
    cls.code: cls
    for cls in (
        UnknownNode,
        DuplicateNode,
        DuplicateStage,
        MissingStage,
        InvalidStageCount,
        InvalidLayerRange,
        EdgeEndpointMismatch,
        DuplicateEdgeId,
        InconsistentModelFacts,
        InvalidExtent,
        InvalidAlignment,
        InvalidDtypeWidth,
        UnsupportedLayout,
        UnsupportedModel,
        InsufficientMemory,
        InvalidConfig,
        InconsistentPlan,
    )
}
