"""What a stage holds in memory: the planner's accounting for ``insufficient_memory``.

A stage holds its blocks' weights as stored in the file, the tensors every stage needs
(``shared_bytes``), the token embedding on the first stage, the output norm and head on
the last, a KV cache of ``max_seq_len`` positions for each of its blocks in the
activation dtype, and the ring of its inbound edge (the consumer end allocates it).
"""

from __future__ import annotations

from attrs import frozen

from runplan.facts import ModelFacts
from runplan.plan import RunPlan


@frozen
class StageMemory:
    weight_bytes: int
    kv_bytes: int
    ring_bytes: int

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.ring_bytes


def kv_bytes_per_layer(facts: ModelFacts, width: int) -> int:
    return facts.max_seq_len * facts.kv_bytes_per_token_per_layer(width)


def fixed_weight_bytes(facts: ModelFacts, *, first: bool, last: bool) -> int:
    """Weights a stage holds whatever its layers are."""
    return (
        facts.shared_bytes
        + (facts.embedding_bytes if first else 0)
        + (facts.output_bytes if last else 0)
    )


def stage_memory(
    facts: ModelFacts,
    *,
    layer_start: int,
    layer_end_exclusive: int,
    first: bool,
    last: bool,
    width: int,
    inbound_ring_bytes: int,
) -> StageMemory:
    blocks = sum(facts.block_bytes[layer_start:layer_end_exclusive])
    n_layers = layer_end_exclusive - layer_start
    return StageMemory(
        weight_bytes=blocks + fixed_weight_bytes(facts, first=first, last=last),
        kv_bytes=n_layers * kv_bytes_per_layer(facts, width),
        ring_bytes=inbound_ring_bytes,
    )


def plan_stage_memory(facts: ModelFacts, plan: RunPlan) -> tuple[StageMemory, ...]:
    """What each stage of ``plan`` holds, in stage order."""
    n = len(plan.stages)
    edges = {e.edge_id: e for e in plan.edges}
    out = []
    for i, stage in enumerate(plan.stages):
        ring = edges[stage.inbound_edge].ring_spec
        out.append(
            stage_memory(
                facts,
                layer_start=stage.layer_start,
                layer_end_exclusive=stage.layer_end_exclusive,
                first=i == 0,
                last=i == n - 1,
                width=plan.model.dtype_width_bytes,
                inbound_ring_bytes=ring.slot_count * ring.slot_bytes,
            )
        )
    return tuple(out)
