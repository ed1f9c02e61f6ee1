"""``check_plan``: every guarantee of RUNPLAN_CONTRACT.md over a plan that came from
elsewhere (off the wire, built by hand). Returns the plan or the first rejection."""

from __future__ import annotations

from collections import Counter

from runplan.dtypes import DTypeFamily
from runplan.plan import (
    U64_MAX,
    EdgeEndpoint,
    EdgeKind,
    EdgePlan,
    GgufModelPlan,
    OrchestratorEndpoint,
    RunPlan,
    StageEndpoint,
)
from runplan.planner import check_ranges
from runplan.rejections import (
    DuplicateEdgeId,
    DuplicateNode,
    DuplicateStage,
    EdgeEndpointMismatch,
    InconsistentModelFacts,
    InconsistentPlan,
    InvalidConfig,
    InvalidExtent,
    InvalidStageCount,
    MissingStage,
    PlanRejection,
    UnsupportedLayout,
)
from runplan.specs import EDGE_OBJECTS, expected_object_spec, slot_bytes
from runplan.validate import (
    U32_MAX,
    check_activation_family,
    check_alignment,
    check_dtype,
    check_end_tokens,
    check_extent,
    check_id,
    check_max_tokens,
    check_model_strings,
    check_run_id,
    check_sampling,
    check_slot_count,
    check_timeouts,
)


def check_plan(plan: RunPlan) -> RunPlan | PlanRejection:
    """``plan`` itself when it keeps every contract guarantee, else a rejection.

    The node pool is not part of a plan, so node membership and memory are checked by
    ``plan_run`` only.
    """
    if not isinstance(plan, RunPlan):
        raise TypeError(f"plan must be RunPlan, not {type(plan).__name__}")
    return (
        check_run_id(plan.run_id)
        or check_id(plan.orchestrator_node_id, "orchestrator_node_id")
        or check_max_tokens(plan.max_tokens)
        or check_sampling(plan.sampling)
        or check_timeouts(plan.timeouts)
        or _check_model(plan.model)
        or _check_stages(plan)
        or _check_edges(plan)
        or _check_concurrency(plan)
        or plan
    )


def _check_concurrency(plan: RunPlan) -> PlanRejection | None:
    """The run's KV positions within ``max_seq_len``, every stage's cache within its
    budget, and a prefill chunk that fits one batch (CONCURRENT_RUNS.md §3-§5)."""
    if not 1 <= plan.kv_positions <= plan.model.max_seq_len:
        return InvalidConfig(
            "kv_positions",
            str(plan.kv_positions),
            f"must be in 1..max_seq_len ({plan.model.max_seq_len})",
        )
    if plan.max_tokens > plan.kv_positions:
        return InvalidConfig(
            "kv_positions",
            str(plan.kv_positions),
            f"a prompt of at least 1 token + max_tokens {plan.max_tokens} need "
            f"{plan.max_tokens} positions",
        )
    for i, stage in enumerate(plan.stages):
        for name in ("kv_bytes", "kv_budget_bytes"):
            value = getattr(stage, name)
            if not 0 <= value <= U64_MAX:
                return InvalidConfig(f"stages[{i}].{name}", str(value), "must be in 0..2**64-1")
        if stage.kv_bytes > stage.kv_budget_bytes:
            return InvalidConfig(
                "kv_budget_bytes",
                str(stage.kv_budget_bytes),
                f"stage {stage.stage_index}'s budget does not hold the run's "
                f"{stage.kv_bytes} bytes of KV cache",
            )
    if not 1 <= plan.max_batch_rows <= 2**32 - 1:
        return InvalidConfig("max_batch_rows", str(plan.max_batch_rows), "must be in 1..2**32-1")
    if not 1 <= plan.prefill_chunk <= plan.max_batch_rows:
        return InvalidConfig(
            "prefill_chunk",
            str(plan.prefill_chunk),
            f"must be in 1..max_batch_rows ({plan.max_batch_rows})",
        )
    return None


def _check_model(m: GgufModelPlan) -> PlanRejection | None:
    bounds = (("num_layers", U32_MAX, 32), ("hidden_dim", U64_MAX, 64), ("vocab_size", U64_MAX, 64))
    for name, most, bits in bounds:  # the layer count a u32, as plan_run holds it
        value = getattr(m, name)
        if not 1 <= value <= most:
            return InconsistentModelFacts(name, str(value), f"must be in 1..2**{bits}-1")
    rejection = check_end_tokens(m.eos_token_id, m.eog_token_ids, m.vocab_size)
    if rejection:
        return rejection
    rejection = check_model_strings(m.model_id, m.architecture, m.gguf_source.paths)
    if rejection:
        return rejection
    return (
        check_dtype(m.dtype_family, m.dtype_width_bytes, "model dtype")
        or check_activation_family(m.dtype_family, "model dtype")
        or check_dtype(DTypeFamily.FLOAT, m.kv_dtype_width_bytes, "model kv dtype")
    )


def _check_stages(plan: RunPlan) -> PlanRejection | None:
    stages = plan.stages
    n = len(stages)
    num_layers = plan.model.num_layers
    if n < 1:
        return InvalidStageCount(n, num_layers, n, "a plan needs at least one stage")
    if n > num_layers:
        return InvalidStageCount(n, num_layers, n, "more stages than layers")
    counts = Counter(s.stage_index for s in stages)
    for s in stages:
        if counts[s.stage_index] > 1:
            return DuplicateStage(s.stage_index, counts[s.stage_index])
    for i in range(n):
        if i not in counts:
            return MissingStage(i, n)
    seen_nodes: dict[str, int] = {}
    for i, s in enumerate(stages):
        rejection = check_id(s.node_id, f"stages[{i}].node_id")
        if rejection:
            return rejection
        where = f"stage {i}"
        if s.stage_index != i:
            return InconsistentPlan(where, "stage_index", str(i), str(s.stage_index))
        if s.run_id != plan.run_id:
            return InconsistentPlan(where, "run_id", repr(plan.run_id), repr(s.run_id))
        if s.stage_count != n:
            return InconsistentPlan(where, "stage_count", str(n), str(s.stage_count))
        if s.gguf_source != plan.model.gguf_source:
            return InconsistentPlan(
                where, "gguf_source", str(plan.model.gguf_source), str(s.gguf_source)
            )
        if s.node_id == plan.orchestrator_node_id:
            return DuplicateNode(s.node_id, (i,), "it is the orchestrator's node and a stage's")
        if s.node_id in seen_nodes:
            return DuplicateNode(s.node_id, (seen_nodes[s.node_id], i), "one node hosts one stage")
        seen_nodes[s.node_id] = i
    return check_ranges([(s.layer_start, s.layer_end_exclusive) for s in stages], num_layers)


def _describe(e: EdgeEndpoint | None) -> str:
    if e is None:
        return "no edge"
    if isinstance(e, OrchestratorEndpoint):
        return f"orchestrator {e.node_id!r}"
    return f"stage {e.stage_index} on {e.node_id!r}"


def _check_edges(plan: RunPlan) -> PlanRejection | None:
    for e in plan.edges:  # a u64 on the wire (wire.dumps refuses another)
        if not 0 <= e.edge_id <= U64_MAX:
            return InconsistentPlan(f"edge {e.edge_id}", "edge_id", f"0..{U64_MAX}", str(e.edge_id))
    counts = Counter(e.edge_id for e in plan.edges)
    for e in plan.edges:
        if counts[e.edge_id] > 1:
            return DuplicateEdgeId(e.edge_id, counts[e.edge_id])
    edges = {e.edge_id: e for e in plan.edges}
    stages = plan.stages
    n = len(stages)
    orch = OrchestratorEndpoint(plan.orchestrator_node_id)
    ends = [StageEndpoint(s.node_id, s.stage_index) for s in stages]

    # The contract's topology: edge feeding stage i, then the token-out edge.
    wanted: list[tuple[str, int, EdgeKind, EdgeEndpoint, EdgeEndpoint]] = []
    for i, s in enumerate(stages):
        kind = EdgeKind.TOKEN_IN if i == 0 else EdgeKind.ACTIVATION
        wanted.append(
            (
                f"stage {i} inbound_edge",
                s.inbound_edge,
                kind,
                orch if i == 0 else ends[i - 1],
                ends[i],
            )
        )
        if i < n - 1 and s.outbound_edge != stages[i + 1].inbound_edge:
            return EdgeEndpointMismatch(
                s.outbound_edge,
                EdgeKind.ACTIVATION.value,
                f"stage {i} outbound_edge",
                f"edge {stages[i + 1].inbound_edge} (stage {i + 1} inbound)",
                f"edge {s.outbound_edge}",
            )
    wanted.append(
        (
            f"stage {n - 1} outbound_edge",
            stages[-1].outbound_edge,
            EdgeKind.TOKEN_OUT,
            ends[-1],
            orch,
        )
    )

    used: set[int] = set()
    for field, edge_id, kind, producer, consumer in wanted:
        edge = edges.get(edge_id)
        if edge is None:
            return EdgeEndpointMismatch(edge_id, kind.value, field, "an edge of the plan", "none")
        used.add(edge_id)
        for name, expected, actual in (
            ("kind", kind.value, edge.kind.value),
            ("producer", _describe(producer), _describe(edge.producer)),
            ("consumer", _describe(consumer), _describe(edge.consumer)),
        ):
            if expected != actual:
                return EdgeEndpointMismatch(edge_id, kind.value, name, expected, actual)
        rejection = _check_edge_specs(plan, edge)
        if rejection:
            return rejection
    for e in plan.edges:
        if e.edge_id not in used:
            return EdgeEndpointMismatch(
                e.edge_id,
                e.kind.value,
                "endpoints",
                "an edge of the pipeline",
                f"{_describe(e.producer)} -> {_describe(e.consumer)}, used by no stage",
            )
    return None


def _check_edge_specs(plan: RunPlan, e: EdgePlan) -> PlanRejection | None:
    where = f"edge {e.edge_id}"
    if e.run_id != plan.run_id:
        return InconsistentPlan(where, "run_id", repr(plan.run_id), repr(e.run_id))
    spec = e.object_spec
    kind, layouts = EDGE_OBJECTS[e.kind]
    if spec.kind is not kind or spec.layout not in layouts:
        return UnsupportedLayout(
            f"{where} ({e.kind.value}) object_spec",
            f"{spec.kind.value}/{spec.layout.value} objects do not travel on this edge kind",
        )
    rejection = check_dtype(spec.dtype_family, spec.dtype_width_bytes, f"{where} object_spec")
    if rejection:
        return rejection
    # A plan either carries logits on its token-out edge or not; the spec must say so.
    wants_logits = plan.return_logits
    expected = expected_object_spec(e.kind, plan.model, return_logits=wants_logits)
    if spec.layout is not expected.layout:
        return UnsupportedLayout(
            f"{where} object_spec.layout",
            f"{spec.layout.value}, but return_logits is {wants_logits}",
        )
    if (spec.dtype_family, spec.dtype_width_bytes) != (
        expected.dtype_family,
        expected.dtype_width_bytes,
    ):
        return InconsistentPlan(
            where,
            "object_spec dtype",
            f"{expected.dtype_family.value}/{expected.dtype_width_bytes}",
            f"{spec.dtype_family.value}/{spec.dtype_width_bytes}",
        )
    rejection = check_extent(
        spec.max_extent, f"{where} object_spec.max_extent", expected.max_extent
    )
    if rejection:
        return rejection
    ring = e.ring_spec
    rejection = check_slot_count(ring.slot_count, f"{where} ring_spec.slot_count") or (
        check_alignment(ring.alignment, f"{where} ring_spec.alignment")
    )
    if rejection:
        return rejection
    want_slot = slot_bytes(spec.max_extent, ring.alignment)
    if ring.slot_bytes != want_slot or want_slot * ring.slot_count > U64_MAX:
        return InvalidExtent(
            f"{where} ring_spec.slot_bytes",
            ring.slot_bytes,
            want_slot,
            "a slot holds the header plus max_extent, rounded up to the alignment, "
            "and the ring fits 64 bits",
        )
    return None
