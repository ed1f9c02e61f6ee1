"""Tampered plans: each a ``Tampering``, a plan that keeps the contract (or the
provisions derived from it) with one thing broken, and the clause that must then fail."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
from attrs import frozen
from hypothesis import strategies as st

from runplan.messages import ProvisionStage
from runplan.plan import (
    EdgeKind,
    EdgePlan,
    Layout,
    ObjectKind,
    OrchestratorEndpoint,
    RunPlan,
    StageEndpoint,
)
from runplan.provision import provision_all
from runplan.rejections import (
    DuplicateEdgeId,
    DuplicateNode,
    DuplicateStage,
    EdgeEndpointMismatch,
    InconsistentPlan,
    InvalidAlignment,
    InvalidDtypeWidth,
    InvalidExtent,
    InvalidLayerRange,
    MissingStage,
    PlanRejection,
    UnsupportedLayout,
)


@frozen
class Tampering:
    """A plan (and, when ``provisions`` is not None, its provisions) with one thing
    broken: ``breaks`` names the clause that must then fail, and ``rejection`` is what
    ``check_plan`` must return (None when only the provisions are tampered with)."""

    plan: RunPlan
    provisions: tuple[ProvisionStage, ...] | None
    breaks: str
    rejection: type[PlanRejection] | None
    what: str


def _with_edge(plan: RunPlan, index: int, **changes: Any) -> RunPlan:
    edges = list(plan.edges)
    edges[index] = attrs.evolve(edges[index], **changes)
    return attrs.evolve(plan, edges=tuple(edges))


def _with_stage(plan: RunPlan, index: int, **changes: Any) -> RunPlan:
    stages = list(plan.stages)
    stages[index] = attrs.evolve(stages[index], **changes)
    return attrs.evolve(plan, stages=tuple(stages))


_SPECS = "invalid_extent_alignment_dtype_width_or_layout_rejects"
_DUPLICATE = "duplicate_stage_assignment_rejects"
_Build = Callable[[st.DrawFn, RunPlan], tuple[RunPlan, tuple[ProvisionStage, ...] | None, str]]


def _edge(draw: st.DrawFn, plan: RunPlan) -> tuple[int, EdgePlan]:
    i = draw(st.integers(0, len(plan.edges) - 1))
    return i, plan.edges[i]


def _duplicate_id(draw: st.DrawFn, plan: RunPlan) -> tuple[RunPlan, None, str]:
    i, e = _edge(draw, plan)
    j = draw(st.integers(0, len(plan.edges) - 1).filter(lambda j: j != i))
    return _with_edge(plan, j, edge_id=e.edge_id), None, f"edge {j} given edge {i}'s id"


def _endpoint(draw: st.DrawFn, plan: RunPlan) -> tuple[RunPlan, None, str]:
    i, e = _edge(draw, plan)
    stranger = StageEndpoint("elsewhere", draw(st.integers(0, 99)))
    options: dict[str, dict[str, Any]] = {
        "a stranger produces it": {"producer": stranger},
        "a stranger consumes it": {"consumer": stranger},
        "another kind": {"kind": next(k for k in EdgeKind if k is not e.kind)},
        "another orchestrator consumes it": {"consumer": OrchestratorEndpoint("someone-else")},
    }
    how = draw(st.sampled_from(sorted(options)))
    return _with_edge(plan, i, **options[how]), None, f"edge {e.edge_id}: {how}"


def _swap(draw: st.DrawFn, plan: RunPlan) -> tuple[RunPlan, None, str]:
    i, e = _edge(draw, plan)
    swapped = _with_edge(plan, i, producer=e.consumer, consumer=e.producer)
    return swapped, None, f"edge {e.edge_id}'s endpoints swapped"


def _extent(draw: st.DrawFn, plan: RunPlan) -> tuple[RunPlan, None, str]:
    i, e = _edge(draw, plan)
    delta = draw(st.sampled_from([-1, 1]))
    spec = attrs.evolve(e.object_spec, max_extent=e.object_spec.max_extent + delta)
    return _with_edge(plan, i, object_spec=spec), None, f"edge {e.edge_id}'s extent {delta:+}"


def _alignment(draw: st.DrawFn, plan: RunPlan) -> tuple[RunPlan, None, str]:
    i, e = _edge(draw, plan)
    a = draw(st.integers(-8, 2**12).filter(lambda a: a <= 0 or a & (a - 1)))
    ring = attrs.evolve(e.ring_spec, alignment=a)
    return _with_edge(plan, i, ring_spec=ring), None, f"edge {e.edge_id}'s alignment {a}"


def _width(draw: st.DrawFn, plan: RunPlan) -> tuple[RunPlan, None, str]:
    i, e = _edge(draw, plan)
    w = draw(st.integers(0, 16).filter(lambda w: w not in (2, 4)))
    spec = attrs.evolve(e.object_spec, dtype_width_bytes=w)
    return _with_edge(plan, i, object_spec=spec), None, f"edge {e.edge_id}'s dtype width {w}"


def _layout(draw: st.DrawFn, plan: RunPlan) -> tuple[RunPlan, None, str]:
    i, e = _edge(draw, plan)
    spec = e.object_spec
    other_kind = ObjectKind.TOKEN if spec.kind is ObjectKind.ACTIVATION else ObjectKind.ACTIVATION
    other_layout = Layout.ROW_MAJOR if spec.layout is not Layout.ROW_MAJOR else Layout.TOKEN_IDS
    bad = draw(
        st.sampled_from(
            [attrs.evolve(spec, kind=other_kind), attrs.evolve(spec, layout=other_layout)]
        )
    )
    what = f"edge {e.edge_id} carries {bad.kind.value}/{bad.layout.value}"
    return _with_edge(plan, i, object_spec=bad), None, what


def _stage(draw: st.DrawFn, plan: RunPlan, *, other: bool = False) -> tuple[int, int]:
    """A stage index, and (``other``) a second one."""
    n = len(plan.stages)
    i = draw(st.integers(0, n - 1))
    return i, draw(st.integers(0, n - 1).filter(lambda j: j != i)) if other else i


def _gap(draw: st.DrawFn, plan: RunPlan) -> tuple[RunPlan, None, str]:
    i, _ = _stage(draw, plan)
    late = plan.stages[i].layer_start + 1
    return _with_stage(plan, i, layer_start=late), None, f"stage {i} starts a layer late"


def _missing(draw: st.DrawFn, plan: RunPlan) -> tuple[RunPlan, None, str]:
    i, _ = _stage(draw, plan)
    index = len(plan.stages) + draw(st.integers(0, 5))
    return _with_stage(plan, i, stage_index=index), None, f"stage {i} renumbered {index}"


def _stage_count(draw: st.DrawFn, plan: RunPlan) -> tuple[RunPlan, None, str]:
    i, _ = _stage(draw, plan)
    count = len(plan.stages) + draw(st.integers(1, 3))
    return _with_stage(plan, i, stage_count=count), None, f"stage {i} told of {count} stages"


def _duplicate_index(draw: st.DrawFn, plan: RunPlan) -> tuple[RunPlan, None, str]:
    i, j = _stage(draw, plan, other=True)
    index = plan.stages[i].stage_index
    return _with_stage(plan, j, stage_index=index), None, f"stage {j} given stage {i}'s index"


def _shared_node(draw: st.DrawFn, plan: RunPlan) -> tuple[RunPlan, None, str]:
    i, j = _stage(draw, plan, other=True)
    node = plan.stages[i].node_id
    return _with_stage(plan, j, node_id=node), None, f"stage {j} moved onto stage {i}'s node"


def _orchestrator_node(draw: st.DrawFn, plan: RunPlan) -> tuple[RunPlan, None, str]:
    i, _ = _stage(draw, plan)
    node = plan.orchestrator_node_id
    return _with_stage(plan, i, node_id=node), None, f"stage {i} moved onto the orchestrator"


def _provision(
    draw: st.DrawFn, plan: RunPlan, change: Callable[[ProvisionStage, ProvisionStage], Any]
) -> tuple[RunPlan, tuple[ProvisionStage, ...], str]:
    """Stage ``i``'s provision changed by ``change(its provision, another stage's)``
    (its own again when the plan has one stage)."""
    msgs = list(provision_all(plan))
    i, j = _stage(draw, plan, other=len(msgs) > 1)
    msgs[i], what = change(msgs[i], msgs[j])
    return plan, tuple(msgs), f"the provision of stage {i}: {what}"


def _foreign_range(draw: st.DrawFn, plan: RunPlan) -> tuple[RunPlan, tuple[Any, ...], str]:
    def change(q: ProvisionStage, other: ProvisionStage) -> tuple[ProvisionStage, str]:
        a, b = other.layer_start, other.layer_end_exclusive
        if other is q:
            a, b = a + 1, b + 1
        return attrs.evolve(q, layer_start=a, layer_end_exclusive=b), f"layers [{a}, {b})"

    return _provision(draw, plan, change)


def _address(draw: st.DrawFn, plan: RunPlan) -> tuple[RunPlan, tuple[Any, ...], str]:
    address = f"10.0.0.{draw(st.integers(1, 254))}:{draw(st.integers(1024, 65535))}"

    def change(q: ProvisionStage, _: ProvisionStage) -> tuple[ProvisionStage, str]:
        out = attrs.evolve(q.outbound, consumer_node_id=address)
        return attrs.evolve(q, outbound=out), f"consumer {address}"

    return _provision(draw, plan, change)


def _ring(draw: st.DrawFn, plan: RunPlan) -> tuple[RunPlan, tuple[Any, ...], str]:
    def change(q: ProvisionStage, _: ProvisionStage) -> tuple[ProvisionStage, str]:
        ring = attrs.evolve(q.inbound.ring_spec, slot_count=q.inbound.ring_spec.slot_count + 1)
        return attrs.evolve(q, inbound=attrs.evolve(q.inbound, ring_spec=ring)), "a slot more"

    return _provision(draw, plan, change)


def _foreign_edge(draw: st.DrawFn, plan: RunPlan) -> tuple[RunPlan, tuple[Any, ...], str]:
    def change(q: ProvisionStage, other: ProvisionStage) -> tuple[ProvisionStage, str]:
        if other is q:  # one stage: its outbound edge as inbound too
            inbound = attrs.evolve(q.inbound, edge_id=q.outbound.edge_id)
            return attrs.evolve(q, inbound=inbound), "its outbound edge as inbound"
        return attrs.evolve(q, inbound=other.inbound), "another stage's inbound edge"

    return _provision(draw, plan, change)


def _foreign_node(draw: st.DrawFn, plan: RunPlan) -> tuple[RunPlan, tuple[Any, ...], str]:
    def change(q: ProvisionStage, other: ProvisionStage) -> tuple[ProvisionStage, str]:
        node = "elsewhere" if other is q else other.node_id
        return attrs.evolve(q, node_id=node), f"addressed to {node!r}"

    return _provision(draw, plan, change)


#: Each kind of tampering: how it is made, the clause it breaks, and what
#: ``check_plan`` returns for it (None: the plan itself is untouched).
TAMPERINGS: dict[str, tuple[_Build, str, type[PlanRejection] | None]] = {
    "duplicate edge id": (_duplicate_id, "every_edge_id_is_unique_within_the_run", DuplicateEdgeId),
    "wrong endpoint": (_endpoint, "edge_endpoint_mismatch_rejects", EdgeEndpointMismatch),
    "swapped endpoints": (_swap, "edge_endpoint_mismatch_rejects", EdgeEndpointMismatch),
    "extent off by one": (_extent, _SPECS, InvalidExtent),
    "alignment": (_alignment, _SPECS, InvalidAlignment),
    "dtype width": (_width, _SPECS, InvalidDtypeWidth),
    "layout": (_layout, _SPECS, UnsupportedLayout),
    "range gap": (_gap, "union_covers_the_intended_gguf_block_range", InvalidLayerRange),
    "missing stage": (_missing, "missing_stage_rejects", MissingStage),
    "stage count": (_stage_count, "invalid_stage_count_rejects", InconsistentPlan),
    "duplicate stage index": (_duplicate_index, _DUPLICATE, DuplicateStage),
    "shared node": (_shared_node, _DUPLICATE, DuplicateNode),
    "stage on the orchestrator": (_orchestrator_node, _DUPLICATE, DuplicateNode),
    "foreign layer range": (_foreign_range, "a_stage_receives_only_its_own_layer_range", None),
    "address for a node id": (_address, "outbound_provision_contains_the_consumer_node_id", None),
    "ring spec not copied": (_ring, "specs_are_copied_consistently_into_stage_provisions", None),
    "foreign edge": (
        _foreign_edge,
        "a_stage_receives_one_inbound_and_one_outbound_edge_provision",
        None,
    ),
    "foreign node": (_foreign_node, "no_provision_contains_remote_actor_addresses", None),
}
_NEEDS_TWO_STAGES = frozenset({"duplicate stage index", "shared node"})


@st.composite
def tamperings(
    draw: st.DrawFn,
    plan: RunPlan,
    *,
    breaking: str | None = None,
    kinds: Sequence[str] | None = None,
) -> Tampering:
    """One thing broken in ``plan`` (a plan that keeps the contract) or in the
    provisions derived from it: any kind of ``TAMPERINGS``, or only those that break
    the clause named ``breaking``, or only those of ``kinds``."""
    unknown = set(kinds or ()) - set(TAMPERINGS)
    if unknown:
        raise ValueError(f"no tampering kinds {sorted(unknown)}; known: {sorted(TAMPERINGS)}")
    chosen = [
        k
        for k, (_, clause, _) in TAMPERINGS.items()
        if (breaking is None or clause == breaking)
        and (kinds is None or k in kinds)
        and (len(plan.stages) > 1 or k not in _NEEDS_TWO_STAGES)
    ]
    if not chosen:
        raise ValueError(f"no tampering of a {len(plan.stages)}-stage plan breaks {breaking!r}")
    kind = draw(st.sampled_from(chosen))
    build, clause, rejection = TAMPERINGS[kind]
    tampered, provisions, what = build(draw, plan)
    return Tampering(tampered, provisions, clause, rejection, f"{kind}: {what}")
