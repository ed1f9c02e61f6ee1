"""Placement input: which node hosts which stage, and (explicitly or by a rule) which
layers each stage runs. Constructors never validate; ``plan_run`` rejects."""

from __future__ import annotations

import enum
from collections.abc import Iterable

from attrs import frozen

from runplan._fields import int_field, str_field, tuple_field, typed_field


class PlacementStrategy(enum.Enum):
    EXPLICIT = "EXPLICIT"  # the assignments give nodes and layer ranges
    EVEN = "EVEN"  # stage i on nodes[i]; layers split as evenly as possible
    BY_MEMORY = "BY_MEMORY"  # stage i on nodes[i]; layers in proportion to memory


@frozen
class StageAssignment:
    """One explicit row: stage ``stage_index`` runs blocks
    ``[layer_start, layer_end_exclusive)`` on ``node_id``."""

    stage_index: int = int_field()
    node_id: str = str_field()
    layer_start: int = int_field()
    layer_end_exclusive: int = int_field()


def _node_ids(nodes: Iterable[str]) -> tuple[str, ...]:
    if isinstance(nodes, str):
        raise TypeError(f"nodes must be a sequence of node ids, not the string {nodes!r}")
    return tuple(nodes)


@frozen
class Placement:
    """``Placement(assignments=...)``, ``Placement.even(nodes)`` or
    ``Placement.by_memory(nodes)``. Each strategy reads one of ``assignments`` and
    ``nodes``; ``plan_run`` rejects the other given (``invalid_config``)."""

    assignments: tuple[StageAssignment, ...] = tuple_field(StageAssignment, default=())
    strategy: PlacementStrategy = typed_field(PlacementStrategy, default=PlacementStrategy.EXPLICIT)
    nodes: tuple[str, ...] = tuple_field(str, default=())

    @classmethod
    def even(cls, nodes: Iterable[str]) -> Placement:
        """Stage ``i`` on ``nodes[i]``; layers split as evenly as possible (the first
        ``num_layers % len(nodes)`` stages get one layer more)."""
        return cls(strategy=PlacementStrategy.EVEN, nodes=_node_ids(nodes))

    @classmethod
    def by_memory(cls, nodes: Iterable[str]) -> Placement:
        """Stage ``i`` on ``nodes[i]``; layers split so that every stage uses the same
        share of its node's memory (as near as whole layers allow; where that leaves a
        stage past its node's memory, the split whose largest share is least), counting the
        per-layer byte sizes read from the GGUF, the KV cache, and the embedding and
        output head on the first and last stage. Nodes sharing a device share its
        memory equally; where that split still leaves a device past its memory as the
        memory check counts it (its stages together), any split that fits
        (``runplan.layers.fitting_split``)."""
        return cls(strategy=PlacementStrategy.BY_MEMORY, nodes=_node_ids(nodes))
