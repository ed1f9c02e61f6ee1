"""What a stage holds in memory: the planner's accounting for ``insufficient_memory``.

A stage holds its blocks' weights, the tensors every stage needs, the token embedding
on the first stage, the output norm and head on the last, its KV budget, and the ring
of its inbound edge (the consumer end allocates it). Weights count once, whatever the
number of runs on the chain. The KV budget is what the stage may hold for all the
chain's runs (CONCURRENT_RUNS.md §5): ``RuntimeConfig.kv_budget_bytes``, or
``max_concurrent_runs`` caches of a full-length run (each block ``max_seq_len``
positions, or a sliding-window block's window when that is shorter:
``ModelFacts.layer_kv_positions``). One run's cache is the same count for the run's own
``kv_positions``. Weights count as stored in the file, or as
``weight_bytes_per_element`` per element for a worker that dequantizes them (the NumPy
reference worker holds float32); the KV cache in the activation dtype, or
``kv_bytes_per_element`` when the worker says so. A device holds the stages of the
nodes that name it together, within the least memory those nodes state
(``device_loads``): the split of ``Placement.by_memory`` and the plan's memory check
count it alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from attrs import frozen

from runplan.config import RuntimeConfig, WorkerCapabilities
from runplan.facts import ModelFacts
from runplan.plan import RunPlan
from runplan.pool import NodeSpec

#: what memory is accounted under (``NodeSpec.device_key``)
DeviceKey = tuple[str, str]


@frozen
class StageMemory:
    weight_bytes: int
    kv_bytes: int  # the stage's KV budget (every run's cache together)
    ring_bytes: int

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.ring_bytes


def kv_width(worker: WorkerCapabilities, activation_width: int) -> int:
    return worker.kv_bytes_per_element or activation_width


def kv_bytes_per_layer(
    facts: ModelFacts, width: int, positions: int | None = None
) -> tuple[int, ...]:
    """What each block's KV cache takes at ``width`` bytes per element, for a run of
    ``positions`` positions (default ``max_seq_len``)."""
    return facts.layer_kv_bytes(width, positions)


def run_kv_bytes(
    facts: ModelFacts,
    worker: WorkerCapabilities,
    *,
    layer_start: int,
    layer_end_exclusive: int,
    activation_width: int,
    positions: int | None = None,
) -> int:
    """One run's KV cache on the stage of blocks ``layer_start..layer_end_exclusive``."""
    kv = kv_bytes_per_layer(facts, kv_width(worker, activation_width), positions)
    return sum(kv[layer_start:layer_end_exclusive])


def kv_budget_bytes(
    facts: ModelFacts, config: RuntimeConfig, *, layer_start: int, layer_end_exclusive: int
) -> int:
    """A stage's KV budget: ``config.kv_budget_bytes``, or ``max_concurrent_runs``
    caches of a full-length run."""
    if config.kv_budget_bytes > 0:
        return config.kv_budget_bytes
    full = run_kv_bytes(
        facts,
        config.worker,
        layer_start=layer_start,
        layer_end_exclusive=layer_end_exclusive,
        activation_width=config.activation_dtype_width_bytes,
    )
    return config.max_concurrent_runs * full


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
    kv_budget_bytes: int,
    inbound_ring_bytes: int,
) -> StageMemory:
    blocks = sum(block_weight_bytes(facts, worker)[layer_start:layer_end_exclusive])
    fixed = fixed_weight_bytes(facts, worker, first=first, last=last)
    return StageMemory(
        weight_bytes=blocks + fixed, kv_bytes=kv_budget_bytes, ring_bytes=inbound_ring_bytes
    )


def plan_stage_memory(
    facts: ModelFacts, worker: WorkerCapabilities, plan: RunPlan
) -> tuple[StageMemory, ...]:
    """What each stage of ``plan`` holds, in stage order, for ``worker`` (the KV budget
    as the plan gives it)."""
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
                kv_budget_bytes=stage.kv_budget_bytes,
                inbound_ring_bytes=ring.slot_count * ring.slot_bytes,
            )
        )
    return tuple(out)


def device_loads(
    nodes: Mapping[str, NodeSpec], node_ids: Sequence[str], loads: Sequence[int]
) -> tuple[dict[DeviceKey, int], dict[DeviceKey, int]]:
    """Per device (``NodeSpec.device_key``), stage ``i`` on ``node_ids[i]`` holding
    ``loads[i]`` bytes: what its stages need together, and what they are held to, the
    smallest ``memory_bytes`` of the nodes naming it. The one accounting of the
    planner's split (``Placement.by_memory``) and of its memory check."""
    needed: dict[DeviceKey, int] = {}
    available: dict[DeviceKey, int] = {}
    for node_id, load in zip(node_ids, loads, strict=True):
        node = nodes[node_id]
        key = node.device_key
        needed[key] = needed.get(key, 0) + load
        available[key] = min(available.get(key, node.memory_bytes), node.memory_bytes)
    return needed, available
