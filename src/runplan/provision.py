"""Projection of a plan onto its stages: one ``ProvisionStage`` per stage, derived
deterministically, carrying only that stage's own facts."""

from __future__ import annotations

from runplan.messages import (
    InboundEdgeProvision,
    OutboundEdgeProvision,
    ProvisionStage,
    StageModelFacts,
)
from runplan.plan import EdgePlan, RunPlan


def provision_stage(plan: RunPlan, stage_index: int) -> ProvisionStage:
    """The provision message of stage ``stage_index``.

    Raises ``TypeError`` if ``plan`` is not a ``RunPlan``, ``IndexError`` if the plan has
    no such stage and ``KeyError`` if the stage names an edge the plan lacks (run
    ``check_plan`` on a plan from elsewhere first).
    """
    _require_plan(plan)
    if not 0 <= stage_index < len(plan.stages):
        raise IndexError(f"stage {stage_index} not in a plan of {len(plan.stages)} stages")
    return _provision(plan, stage_index, {e.edge_id: e for e in plan.edges}, _stage_model(plan))


def provision_all(plan: RunPlan) -> tuple[ProvisionStage, ...]:
    """One provision message per stage, in stage order (``TypeError`` for a ``plan``
    that is not a ``RunPlan``)."""
    _require_plan(plan)
    edges = {e.edge_id: e for e in plan.edges}
    model = _stage_model(plan)
    return tuple(_provision(plan, i, edges, model) for i in range(len(plan.stages)))


def _require_plan(plan: object) -> None:
    if not isinstance(plan, RunPlan):
        raise TypeError(f"plan must be RunPlan, not {type(plan).__name__}")


def _stage_model(plan: RunPlan) -> StageModelFacts:
    m = plan.model
    return StageModelFacts(
        model_id=m.model_id,
        architecture=m.architecture,
        hidden_dim=m.hidden_dim,
        dtype_family=m.dtype_family,
        dtype_width_bytes=m.dtype_width_bytes,
        max_seq_len=m.max_seq_len,
        kv_dtype_width_bytes=m.kv_dtype_width_bytes,
    )


def _provision(
    plan: RunPlan, stage_index: int, edges: dict[int, EdgePlan], model: StageModelFacts
) -> ProvisionStage:
    stage = plan.stages[stage_index]
    inbound = edges[stage.inbound_edge]
    outbound = edges[stage.outbound_edge]
    last = stage_index == len(plan.stages) - 1
    return ProvisionStage(
        run_id=stage.run_id,
        stage_index=stage.stage_index,
        stage_count=stage.stage_count,
        node_id=stage.node_id,
        gguf_source=stage.gguf_source,
        layer_start=stage.layer_start,
        layer_end_exclusive=stage.layer_end_exclusive,
        inbound=InboundEdgeProvision(
            edge_id=inbound.edge_id,
            kind=inbound.kind,
            object_spec=inbound.object_spec,
            ring_spec=inbound.ring_spec,
        ),
        outbound=OutboundEdgeProvision(
            edge_id=outbound.edge_id,
            kind=outbound.kind,
            consumer_node_id=outbound.consumer.node_id,
            object_spec=outbound.object_spec,
            ring_spec=outbound.ring_spec,
        ),
        model=model,
        timeouts=plan.timeouts,
        kv_positions=plan.kv_positions,
        kv_bytes=stage.kv_bytes,
        kv_budget_bytes=stage.kv_budget_bytes,
        max_batch_rows=plan.max_batch_rows,
        sampling=plan.sampling if last else None,
        return_logits=plan.return_logits and last,
    )
