"""What a stage holds in memory: the planner's accounting for ``insufficient_memory``.

A stage holds its blocks' weights, the tensors every stage needs, the token embedding
on the first stage, the output norm and head on the last, a KV cache for each of its
blocks (``max_seq_len`` positions, or a sliding-window block's window when that is
shorter: ``ModelFacts.layer_kv_positions``), and the ring of its inbound edge (the
consumer end allocates it). Weights count as stored in the file, or as
``weight_bytes_per_element`` per element for a worker that dequantizes them (the NumPy
reference worker holds float32); the KV cache in the activation dtype, or
``kv_bytes_per_element`` when the worker says so.
"""

from __future__ import annotations

from attrs import frozen

from runplan.config import WorkerCapabilities
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


def kv_width(worker: WorkerCapabilities, activation_width: int) -> int:
    return worker.kv_bytes_per_element or activation_width


def kv_bytes_per_layer(facts: ModelFacts, width: int) -> tuple[int, ...]:
    """What each block's KV cache takes at ``width`` bytes per element."""
    return facts.layer_kv_bytes(width)


def _dequantized(worker: WorkerCapabilities, facts: ModelFacts) -> bool:
    return worker.weight_bytes_per_element > 0 and len(facts.block_elements) == facts.num_layers


def block_weight_bytes(facts: ModelFacts, worker: WorkerCapabilities) -> tuple[int, ...]:
    """What each block's weights take in the worker's memory."""
    if _dequantized(worker, facts):
        w = worker.weight_bytes_per_element
        return tuple(n * w for n in facts.block_elements)
    return facts.block_bytes


def fixed_weight_bytes(
    facts: ModelFacts, worker: WorkerCapabilities, *, first: bool, last: bool
) -> int:
    """Weights a stage holds whatever its layers are."""
    if _dequantized(worker, facts):
        w = worker.weight_bytes_per_element
        return w * (
            facts.shared_elements
            + (facts.embedding_elements if first else 0)
            + (facts.output_elements if last else 0)
        )
    return (
        facts.shared_bytes
        + (facts.embedding_bytes if first else 0)
        + (facts.output_bytes if last else 0)
    )


def stage_memory(
    facts: ModelFacts,
    worker: WorkerCapabilities,
    *,
    layer_start: int,
    layer_end_exclusive: int,
    first: bool,
    last: bool,
    activation_width: int,
    inbound_ring_bytes: int,
) -> StageMemory:
    blocks = sum(block_weight_bytes(facts, worker)[layer_start:layer_end_exclusive])
    kv = kv_bytes_per_layer(facts, kv_width(worker, activation_width))
    fixed = fixed_weight_bytes(facts, worker, first=first, last=last)
    return StageMemory(
        weight_bytes=blocks + fixed,
        kv_bytes=sum(kv[layer_start:layer_end_exclusive]),
        ring_bytes=inbound_ring_bytes,
    )


def plan_stage_memory(
    facts: ModelFacts, worker: WorkerCapabilities, plan: RunPlan
) -> tuple[StageMemory, ...]:
    """What each stage of ``plan`` holds, in stage order, for ``worker``."""
    n = len(plan.stages)
    edges = {e.edge_id: e for e in plan.edges}
    out = []
    for i, stage in enumerate(plan.stages):
        ring = edges[stage.inbound_edge].ring_spec
        out.append(
            stage_memory(
                facts,
                worker,
                layer_start=stage.layer_start,
                layer_end_exclusive=stage.layer_end_exclusive,
                first=i == 0,
                last=i == n - 1,
                activation_width=plan.model.dtype_width_bytes,
                inbound_ring_bytes=ring.slot_count * ring.slot_bytes,
            )
        )
    return tuple(out)
