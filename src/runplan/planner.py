"""``plan_run``: model facts + runtime config + node pool + placement -> one ``RunPlan``
or one typed rejection. Pure: no I/O, no clocks, never mutates its inputs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from itertools import accumulate

from runplan.config import RuntimeConfig, WorkerCapabilities, run_positions
from runplan.facts import ModelFacts
from runplan.layers import Range, fitting_split, split_by_capacity, split_even
from runplan.memory import (
    StageMemory,
    block_weight_bytes,
    device_loads,
    fixed_weight_bytes,
    kv_budget_bytes,
    kv_bytes_per_layer,
    kv_width,
    plan_stage_memory,
    run_kv_bytes,
)
from runplan.placement import Placement, PlacementStrategy
from runplan.plan import (
    U64_MAX,
    EdgeEndpoint,
    EdgeKind,
    EdgePlan,
    GgufModelPlan,
    OrchestratorEndpoint,
    RingSpec,
    RunPlan,
    StageEndpoint,
    StagePlan,
)
from runplan.pool import NodePool, NodeSpec
from runplan.rejections import (
    DuplicateNode,
    DuplicateStage,
    InsufficientMemory,
    InvalidConfig,
    InvalidExtent,
    InvalidLayerRange,
    InvalidStageCount,
    MissingStage,
    PlanRejection,
    UnknownNode,
)
from runplan.specs import expected_object_spec, ring_spec
from runplan.validate import (
    check_activation_family,
    check_alignment,
    check_batching,
    check_dtype,
    check_extent,
    check_facts,
    check_max_tokens,
    check_pool,
    check_run_id,
    check_sampling,
    check_slot_count,
    check_timeouts,
    check_worker,
)

_EDGE_KINDS = (EdgeKind.TOKEN_IN, EdgeKind.ACTIVATION, EdgeKind.TOKEN_OUT)

# One placed stage: (stage_index, node_id, layer_start, layer_end_exclusive).
_Row = tuple[int, str, int, int]


def plan_run(
    facts: ModelFacts,
    config: RuntimeConfig,
    pool: NodePool,
    *,
    stage_count: int,
    placement: Placement | None = None,
) -> RunPlan | PlanRejection:
    """Plan one run, or say why not.

    ``placement`` defaults to ``Placement.even`` over the first ``stage_count`` nodes of
    the pool. Raises only ``TypeError`` for arguments of the wrong type.
    """
    _require(facts, ModelFacts, "facts")
    _require(config, RuntimeConfig, "config")
    _require(pool, NodePool, "pool")
    if not isinstance(stage_count, int) or isinstance(stage_count, bool):
        raise TypeError(f"stage_count must be an int, not {type(stage_count).__name__}")
    if placement is None:
        placement = Placement.even(n.node_id for n in pool.nodes[:stage_count])
    _require(placement, Placement, "placement")

    if stage_count < 1:
        return InvalidStageCount(stage_count, facts.num_layers, None, "must be at least 1")
    rejection = check_facts(facts)
    if rejection:
        return rejection
    if stage_count > facts.num_layers:
        return InvalidStageCount(stage_count, facts.num_layers, None, "more stages than layers")
    rejection = _check_config(config) or check_pool(pool) or _check_run_shape(facts, config)
    if rejection:
        return rejection

    model = _model_plan(facts, config)
    rings: dict[EdgeKind, RingSpec] = {}
    for kind in _EDGE_KINDS:
        spec = expected_object_spec(kind, model, return_logits=config.return_logits)
        what = f"{kind.value} object_spec.max_extent"
        rejection = check_extent(spec.max_extent, what)
        if rejection:
            return rejection
        rings[kind] = ring_spec(spec.max_extent, config.ring_slot_count, config.ring_alignment)
        if rings[kind].slot_bytes * config.ring_slot_count > U64_MAX:
            return InvalidExtent(
                f"{kind.value} ring bytes",
                rings[kind].slot_bytes * config.ring_slot_count,
                None,
                "the ring overflows 64 bits",
            )

    rejection = check_worker(facts, config.worker)
    if rejection:
        return rejection

    nodes = _pool_index(pool)
    if isinstance(nodes, PlanRejection):
        return nodes
    rows = _place(facts, config, pool, nodes, stage_count, placement, rings)
    if isinstance(rows, PlanRejection):
        return rows

    plan = _build(facts, config, pool, model, rows, rings)
    rejection = _check_budgets(config, plan) or _check_memory(facts, config, nodes, plan)
    if rejection:
        return rejection
    return plan


def _require(value: object, cls: type, name: str) -> None:
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be {cls.__name__}, not {type(value).__name__}")


def _check_config(config: RuntimeConfig) -> PlanRejection | None:
    return (
        check_run_id(config.run_id)
        or check_max_tokens(config.max_tokens)
        or check_dtype(
            config.activation_dtype_family,
            config.activation_dtype_width_bytes,
            "activation dtype",
        )
        or check_activation_family(config.activation_dtype_family, "activation dtype")
        or check_slot_count(config.ring_slot_count, "ring_slot_count")
        or check_alignment(config.ring_alignment, "ring_alignment")
        or check_sampling(config.sampling)
        or check_timeouts(config.timeouts)
        or check_batching(config)
    )


def _check_run_shape(facts: ModelFacts, config: RuntimeConfig) -> PlanRejection | None:
    """A run must fit ``max_seq_len``."""
    return run_too_long(config.prompt_tokens, config.max_tokens, facts.max_seq_len)


def run_too_long(
    prompt_tokens: int, max_tokens: int, positions: int, what: str = "max_seq_len"
) -> InvalidConfig | None:
    """The rejection of a run that does not fit ``positions`` (``run_positions``: its
    last token is not fed back; a prompt of unknown length, 0, has at least 1 token), or
    ``None``. ``what`` names the limit: ``max_seq_len``, or the model's context length
    for a runtime that sizes ``max_seq_len`` for the run."""
    n = prompt_tokens
    need = run_positions(n, max_tokens)
    if need <= positions:
        return None
    if n > 0:
        return InvalidConfig(
            "prompt_tokens",
            str(n),
            f"{n} prompt tokens + max_tokens {max_tokens} need {need} positions; "
            f"{what} is {positions}",
        )
    return InvalidConfig(
        "max_tokens",
        str(max_tokens),
        f"a prompt of at least 1 token + max_tokens {max_tokens} need {need} "
        f"positions; {what} is {positions}",
    )


def kv_positions(facts: ModelFacts, config: RuntimeConfig) -> int:
    """Positions of KV cache a run reserves on every stage: its prompt plus
    ``max_tokens`` within ``max_seq_len``, or ``max_seq_len`` when the prompt's length
    is not known."""
    if config.prompt_tokens > 0:
        return min(config.prompt_tokens + config.max_tokens, facts.max_seq_len)
    return facts.max_seq_len


def _check_budgets(config: RuntimeConfig, plan: RunPlan) -> PlanRejection | None:
    """An explicit KV budget must hold this run's cache on every stage (else the run
    could never be admitted)."""
    for stage in plan.stages:
        if stage.kv_bytes > stage.kv_budget_bytes:
            return InvalidConfig(
                "kv_budget_bytes",
                str(config.kv_budget_bytes),
                f"stage {stage.stage_index} needs {stage.kv_bytes} bytes of KV cache for "
                f"this run's {plan.kv_positions} positions",
            )
    return None


def _model_plan(facts: ModelFacts, config: RuntimeConfig) -> GgufModelPlan:
    return GgufModelPlan(
        model_id=facts.model_id,
        gguf_source=facts.gguf_source,
        architecture=facts.architecture,
        num_layers=facts.num_layers,
        hidden_dim=facts.hidden_dim,
        dtype_family=config.activation_dtype_family,
        dtype_width_bytes=config.activation_dtype_width_bytes,
        max_seq_len=facts.max_seq_len,
        eos_token_id=facts.eos_token_id,
        eog_token_ids=facts.eog_token_ids,
        vocab_size=facts.vocab_size,
        kv_dtype_width_bytes=kv_width(config.worker, config.activation_dtype_width_bytes),
    )


def _pool_index(pool: NodePool) -> dict[str, NodeSpec] | PlanRejection:
    nodes: dict[str, NodeSpec] = {}
    for node in pool.nodes:
        if node.node_id in nodes:
            return DuplicateNode(node.node_id, (), "listed twice in the node pool")
        nodes[node.node_id] = node
    return nodes


def _check_nodes(
    node_ids: Sequence[tuple[int, str]], nodes: dict[str, NodeSpec], orchestrator: str
) -> PlanRejection | None:
    """``node_ids``: (stage_index, node_id) in stage order."""
    seen: dict[str, int] = {}
    for stage_index, node_id in node_ids:
        if node_id not in nodes:
            return UnknownNode(node_id, stage_index)
        if node_id == orchestrator:
            return DuplicateNode(
                node_id, (stage_index,), "it is the orchestrator's node and a stage's"
            )
        if node_id in seen:
            return DuplicateNode(node_id, (seen[node_id], stage_index), "one node hosts one stage")
        seen[node_id] = stage_index
    return None


def _place(
    facts: ModelFacts,
    config: RuntimeConfig,
    pool: NodePool,
    nodes: dict[str, NodeSpec],
    stage_count: int,
    placement: Placement,
    rings: dict[EdgeKind, RingSpec],
) -> list[_Row] | PlanRejection:
    unread = _unread_field(placement)
    if unread:
        return unread
    if placement.strategy is PlacementStrategy.EXPLICIT:
        return _place_explicit(facts, pool, nodes, stage_count, placement)

    node_ids = placement.nodes
    if len(node_ids) != stage_count:
        return InvalidStageCount(
            stage_count, facts.num_layers, len(node_ids), "not the number of placed stages"
        )
    rejection = _check_nodes(list(enumerate(node_ids)), nodes, pool.orchestrator_node_id)
    if rejection:
        return rejection
    if placement.strategy is PlacementStrategy.EVEN:
        ranges = split_even(facts.num_layers, stage_count)
    else:
        ranges = _split_by_memory(facts, config, nodes, node_ids, rings)
    return [(i, node_ids[i], start, end) for i, (start, end) in enumerate(ranges)]


def _unread_field(placement: Placement) -> InvalidConfig | None:
    """A field the placement's strategy does not read, given anyway: an explicit
    placement's ``nodes``, or an even or by-memory placement's ``assignments`` (the
    plan would follow the strategy and silently drop what they say)."""
    strategy = placement.strategy
    if strategy is PlacementStrategy.EXPLICIT and placement.nodes:
        return InvalidConfig(
            "placement.nodes",
            repr(placement.nodes),
            "an explicit placement names its nodes in its assignments",
        )
    if strategy is not PlacementStrategy.EXPLICIT and placement.assignments:
        rows = tuple(
            (a.stage_index, a.node_id, a.layer_start, a.layer_end_exclusive)
            for a in placement.assignments
        )
        return InvalidConfig(
            "placement.assignments",
            repr(rows),
            f"a {strategy.value} placement places its nodes itself (explicit rows are "
            "the EXPLICIT strategy's)",
        )
    return None


def _split_by_memory(
    facts: ModelFacts,
    config: RuntimeConfig,
    nodes: dict[str, NodeSpec],
    node_ids: Sequence[str],
    rings: dict[EdgeKind, RingSpec],
) -> list[Range]:
    n = len(node_ids)
    worker = config.worker
    # Each block's share of a stage's KV budget: max_concurrent_runs full-length caches;
    # an explicit byte budget is the same on every stage, whatever its blocks.
    kv = kv_bytes_per_layer(facts, kv_width(worker, config.activation_dtype_width_bytes))
    runs = 0 if config.kv_budget_bytes > 0 else config.max_concurrent_runs
    sharers = Counter(nodes[nid].device_key for nid in node_ids)
    capacity = [nodes[nid].memory_bytes // sharers[nodes[nid].device_key] for nid in node_ids]
    fixed = []
    for i in range(n):
        inbound = rings[EdgeKind.TOKEN_IN if i == 0 else EdgeKind.ACTIVATION]
        fixed.append(
            fixed_weight_bytes(facts, worker, first=i == 0, last=i == n - 1)
            + inbound.slot_count * inbound.slot_bytes
            + config.kv_budget_bytes
        )
    layer_cost = [b + runs * k for b, k in zip(block_weight_bytes(facts, worker), kv, strict=True)]
    ranges = split_by_capacity(layer_cost, fixed, capacity)
    # The memory check's own accounting (``device_loads``, as ``device_memory``): each
    # device holds its stages together, within the least memory_bytes of the nodes
    # naming it.
    prefix = [0, *accumulate(layer_cost)]
    loads = [
        cost + prefix[end] - prefix[start] for (start, end), cost in zip(ranges, fixed, strict=True)
    ]
    used, held = device_loads(nodes, node_ids, loads)
    if all(used[key] <= held[key] for key in used):
        return ranges
    devices = [nodes[nid].device_key for nid in node_ids]
    return fitting_split(layer_cost, fixed, devices, held) or ranges


def _place_explicit(
    facts: ModelFacts,
    pool: NodePool,
    nodes: dict[str, NodeSpec],
    stage_count: int,
    placement: Placement,
) -> list[_Row] | PlanRejection:
    rows = placement.assignments
    counts = Counter(a.stage_index for a in rows)
    for a in rows:
        if counts[a.stage_index] > 1:
            return DuplicateStage(a.stage_index, counts[a.stage_index])
    if len(rows) != stage_count:
        return InvalidStageCount(
            stage_count, facts.num_layers, len(rows), "not the number of placed stages"
        )
    by_index = {a.stage_index: a for a in rows}
    for i in range(stage_count):
        if i not in by_index:
            return MissingStage(i, stage_count)
    ordered = [by_index[i] for i in range(stage_count)]
    rejection = _check_nodes(
        [(a.stage_index, a.node_id) for a in ordered], nodes, pool.orchestrator_node_id
    )
    if rejection:
        return rejection
    rejection = check_ranges(
        [(a.layer_start, a.layer_end_exclusive) for a in ordered], facts.num_layers
    )
    if rejection:
        return rejection
    return [(a.stage_index, a.node_id, a.layer_start, a.layer_end_exclusive) for a in ordered]


def check_ranges(ranges: Sequence[Range], num_layers: int) -> InvalidLayerRange | None:
    """Contiguous, non-overlapping, non-empty ranges that cover ``0..num_layers`` in
    stage order."""
    expected_start = 0
    for i, (start, end) in enumerate(ranges):

        def bad(reason: str, i: int = i, start: int = start, end: int = end) -> InvalidLayerRange:
            return InvalidLayerRange(i, start, end, num_layers, reason)

        if start < 0 or end > num_layers:
            return bad(f"outside the model's blocks 0..{num_layers}")
        if end <= start:
            return bad("empty range")
        if start > expected_start:
            return bad(f"gap: blocks [{expected_start}, {start}) are not assigned")
        if start < expected_start:
            return bad(f"overlaps the previous stage, which ends at {expected_start}")
        expected_start = end
    if expected_start != num_layers:
        last = len(ranges) - 1
        start, end = ranges[last]
        return InvalidLayerRange(
            last,
            start,
            end,
            num_layers,
            f"blocks [{expected_start}, {num_layers}) are not assigned",
        )
    return None


def _build(
    facts: ModelFacts,
    config: RuntimeConfig,
    pool: NodePool,
    model: GgufModelPlan,
    rows: list[_Row],
    rings: dict[EdgeKind, RingSpec],
) -> RunPlan:
    run_id = config.run_id
    n = len(rows)
    orch = OrchestratorEndpoint(pool.orchestrator_node_id)
    ends = [StageEndpoint(node_id, i) for i, node_id, _, _ in rows]
    specs = {
        kind: expected_object_spec(kind, model, return_logits=config.return_logits)
        for kind in _EDGE_KINDS
    }

    # Edge ids: assigned here, in pipeline order. Edge k feeds stage k.
    def edge(
        edge_id: int, kind: EdgeKind, producer: EdgeEndpoint, consumer: EdgeEndpoint
    ) -> EdgePlan:
        return EdgePlan(
            run_id=run_id,
            edge_id=edge_id,
            kind=kind,
            producer=producer,
            consumer=consumer,
            object_spec=specs[kind],
            ring_spec=rings[kind],
        )

    edges = [edge(1, EdgeKind.TOKEN_IN, orch, ends[0])]
    edges += [edge(i + 2, EdgeKind.ACTIVATION, ends[i], ends[i + 1]) for i in range(n - 1)]
    edges.append(edge(n + 1, EdgeKind.TOKEN_OUT, ends[n - 1], orch))

    positions = kv_positions(facts, config)
    width = config.activation_dtype_width_bytes
    stages = tuple(
        StagePlan(
            run_id=run_id,
            stage_index=i,
            stage_count=n,
            node_id=node_id,
            gguf_source=model.gguf_source,
            layer_start=start,
            layer_end_exclusive=end,
            inbound_edge=edges[i].edge_id,
            outbound_edge=edges[i + 1].edge_id,
            kv_bytes=run_kv_bytes(
                facts,
                config.worker,
                layer_start=start,
                layer_end_exclusive=end,
                activation_width=width,
                positions=positions,
            ),
            kv_budget_bytes=kv_budget_bytes(
                facts, config, layer_start=start, layer_end_exclusive=end
            ),
        )
        for i, node_id, start, end in rows
    )
    return RunPlan(
        run_id=run_id,
        model=model,
        stages=stages,
        edges=tuple(edges),
        max_tokens=config.max_tokens,
        orchestrator_node_id=pool.orchestrator_node_id,
        timeouts=config.timeouts,
        sampling=config.sampling,
        return_logits=config.return_logits,
        kv_positions=positions,
        max_batch_rows=config.max_batch_rows,
        prefill_chunk=config.prefill_chunk or config.max_batch_rows,
    )


def device_memory(
    facts: ModelFacts, worker: WorkerCapabilities, nodes: dict[str, NodeSpec], plan: RunPlan
) -> tuple[tuple[StageMemory, ...], dict[tuple[str, str], int], dict[tuple[str, str], int]]:
    """What each stage of ``plan`` holds, and per device (``NodeSpec.device_key``) what
    its stages need together and what they are held to: the smallest ``memory_bytes``
    of the run's nodes that name it."""
    memory = plan_stage_memory(facts, worker, plan)
    node_ids = [stage.node_id for stage in plan.stages]
    needed, available = device_loads(nodes, node_ids, [use.total for use in memory])
    return memory, needed, available


def _check_memory(
    facts: ModelFacts, config: RuntimeConfig, nodes: dict[str, NodeSpec], plan: RunPlan
) -> PlanRejection | None:
    """Each device's stages must fit its memory (``device_memory``)."""
    _, needed, available = device_memory(facts, config.worker, nodes, plan)
    members: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for stage in plan.stages:
        key = nodes[stage.node_id].device_key
        members.setdefault(key, []).append((stage.stage_index, stage.node_id))
    for key, need in needed.items():
        if need > available[key]:
            return InsufficientMemory(
                device=key[1],
                stage_indices=tuple(i for i, _ in members[key]),
                node_ids=tuple(nid for _, nid in members[key]),
                bytes_needed=need,
                bytes_available=available[key],
            )
    return None
