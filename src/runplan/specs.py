"""Object and ring specs of each edge kind (EDGES_AND_WORKERS.md §1-§2), derived from
the model plan. The planner builds edges with these; ``check_plan`` compares with them."""

from __future__ import annotations

from runplan.dtypes import DTypeFamily
from runplan.plan import (
    OBJECT_HEADER_BYTES,
    EdgeKind,
    GgufModelPlan,
    Layout,
    ObjectKind,
    ObjectSpec,
    RingSpec,
)

TOKEN_ID_BYTES = 4
LOGIT_BYTES = 4

#: The object kind and the layouts each edge kind supports.
EDGE_OBJECTS: dict[EdgeKind, tuple[ObjectKind, frozenset[Layout]]] = {
    EdgeKind.TOKEN_IN: (ObjectKind.TOKEN, frozenset({Layout.TOKEN_IDS})),
    EdgeKind.ACTIVATION: (ObjectKind.ACTIVATION, frozenset({Layout.ROW_MAJOR})),
    EdgeKind.TOKEN_OUT: (
        ObjectKind.TOKEN,
        frozenset({Layout.TOKEN_IDS, Layout.TOKEN_ID_WITH_LOGITS}),
    ),
}


def activation_extent(max_seq_len: int, hidden_dim: int, width: int) -> int:
    """``max_seq_len * hidden_dim * dtype_width_bytes``."""
    return max_seq_len * hidden_dim * width


def expected_object_spec(
    kind: EdgeKind, model: GgufModelPlan, *, return_logits: bool
) -> ObjectSpec:
    """The object spec that an edge of ``kind`` has in a run of ``model``."""
    if kind is EdgeKind.TOKEN_IN:
        return ObjectSpec(
            kind=ObjectKind.TOKEN,
            layout=Layout.TOKEN_IDS,
            dtype_family=DTypeFamily.UINT,
            dtype_width_bytes=TOKEN_ID_BYTES,
            max_extent=model.max_seq_len * TOKEN_ID_BYTES,
        )
    if kind is EdgeKind.ACTIVATION:
        return ObjectSpec(
            kind=ObjectKind.ACTIVATION,
            layout=Layout.ROW_MAJOR,
            dtype_family=model.dtype_family,
            dtype_width_bytes=model.dtype_width_bytes,
            max_extent=activation_extent(
                model.max_seq_len, model.hidden_dim, model.dtype_width_bytes
            ),
        )
    if return_logits:
        return ObjectSpec(
            kind=ObjectKind.TOKEN,
            layout=Layout.TOKEN_ID_WITH_LOGITS,
            dtype_family=DTypeFamily.UINT,
            dtype_width_bytes=TOKEN_ID_BYTES,
            max_extent=TOKEN_ID_BYTES + LOGIT_BYTES * model.vocab_size,
        )
    return ObjectSpec(
        kind=ObjectKind.TOKEN,
        layout=Layout.TOKEN_IDS,
        dtype_family=DTypeFamily.UINT,
        dtype_width_bytes=TOKEN_ID_BYTES,
        max_extent=TOKEN_ID_BYTES,
    )


def slot_bytes(max_extent: int, alignment: int) -> int:
    """Header plus ``max_extent``, rounded up to ``alignment`` (a power of two)."""
    raw = OBJECT_HEADER_BYTES + max_extent
    return (raw + alignment - 1) & ~(alignment - 1)


def ring_spec(max_extent: int, slot_count: int, alignment: int) -> RingSpec:
    return RingSpec(
        slot_count=slot_count, alignment=alignment, slot_bytes=slot_bytes(max_extent, alignment)
    )


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
