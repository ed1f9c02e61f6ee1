"""Re-placement after a loss: a chain lost a stage (its process, host or link) and its
runs go on over the cluster's live nodes.

``replace_lost(plan, facts, config, pool, lost_nodes=..., lost_stages=...)`` gives the
new plan, or says why there is none:

- Lost: every node in ``lost_nodes``, and every node of the plan that ``pool`` (the
  live nodes) no longer lists; a stage is lost when its node is, or when it is in
  ``lost_stages`` (its process or link died; its node may still be live). A lost node
  is never in the new plan.
- First, the lost stages' layer ranges on spare nodes: the live nodes no surviving
  stage uses (pool order), then the live nodes of the lost stages themselves (a stage
  process restarted where it was). Every other stage stays on its node with its
  range. The planner's memory check decides whether an assignment fits; the first
  that fits, in that order, is taken.
- Else the planner places the model over the remaining nodes (the live nodes with the
  most memory, layers split by memory, else evenly): the original stage count when
  there are that many nodes, else more nodes, else fewer; the first plan it accepts.
- Else ``Unplaceable``, naming the lost nodes and stages and the planner's own
  rejection (for the placement over every remaining node).

The new plan is ``plan_run``'s, for ``config`` (which names the new run id: the lost
plan's id stays stale), so ``check_plan`` and the contract kit judge it as any plan.
``Replacement.kept`` names the stages that keep their weights (same node, same layer
range, not lost), ``fresh`` those that start afresh; ``placement`` plans the chain's
other runs onto the same stages. Pure: no I/O, never mutates its inputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import permutations

from attrs import frozen

from runplan._fields import bool_field, int_tuple_field, str_field, tuple_field, typed_field
from runplan.config import RuntimeConfig
from runplan.facts import ModelFacts
from runplan.memory import block_weight_bytes, fixed_weight_bytes
from runplan.placement import Placement, StageAssignment
from runplan.plan import RunPlan, StagePlan
from runplan.planner import plan_run
from runplan.pool import NodePool
from runplan.rejections import InsufficientMemory, PlanRejection

#: Most spare assignments the planner checks before it places the model afresh (many
#: lost stages over many spares would otherwise be a factorial search).
MAX_SPARE_TRIES = 4096


@frozen
class Replacement:
    """The new plan after a loss, and what of the old chain it keeps."""

    plan: RunPlan = typed_field(RunPlan)
    # The new plan's stages as explicit assignments: plan_run with this placement puts
    # the chain's other runs (other configs) on the same stages.
    placement: Placement = typed_field(Placement)
    # New stage indices whose node and layer range are a surviving stage's (weights kept),
    # and those that start afresh (bind their slice on their node).
    kept: tuple[int, ...] = int_tuple_field()
    fresh: tuple[int, ...] = int_tuple_field()
    # True: the lost ranges went to spare nodes, every other stage unchanged; False: the
    # planner placed the model over the remaining nodes.
    on_spares: bool = bool_field()
    lost_nodes: tuple[str, ...] = tuple_field(str)
    lost_stages: tuple[int, ...] = int_tuple_field()


@frozen(str=False)
class Unplaceable:
    """No plan over the live nodes: the planner's own rejection, for the placement over
    every remaining node."""

    lost_nodes: tuple[str, ...] = tuple_field(str)
    lost_stages: tuple[int, ...] = int_tuple_field()
    rejection: PlanRejection = typed_field(PlanRejection)
    detail: str = str_field(default="")

    def __str__(self) -> str:
        return (
            f"no placement after losing stages {list(self.lost_stages)} "
            f"(nodes {list(self.lost_nodes)}): {self.rejection}"
            + (f" ({self.detail})" if self.detail else "")
        )


def replace_lost(
    plan: RunPlan,
    facts: ModelFacts,
    config: RuntimeConfig,
    pool: NodePool,
    *,
    lost_nodes: Iterable[str] = (),
    lost_stages: Iterable[int] = (),
) -> Replacement | Unplaceable:
    """The plan of ``plan``'s chain after the loss, over ``pool`` (the live nodes), for
    ``config`` (its run id a new one). ``ValueError`` for a lost stage the plan does not
    have, a config that reuses the plan's run id, or facts of another model; ``TypeError``
    for arguments of the wrong type."""
    for value, cls, name in (
        (plan, RunPlan, "plan"),
        (facts, ModelFacts, "facts"),
        (config, RuntimeConfig, "config"),
        (pool, NodePool, "pool"),
    ):
        if not isinstance(value, cls):
            raise TypeError(f"{name} must be {cls.__name__}, not {type(value).__name__}")
    lost_node_set = set(_strings(lost_nodes, "lost_nodes"))
    stage_set = set(_indices(lost_stages, plan.stage_count))
    if config.run_id == plan.run_id:
        raise ValueError(
            f"run id {config.run_id!r} is the lost plan's: a re-placed run takes a new id "
            "(the old one stays stale)"
        )
    if (facts.model_id, facts.gguf_source, facts.num_layers) != (
        plan.model.model_id,
        plan.model.gguf_source,
        plan.model.num_layers,
    ):
        raise ValueError(
            f"facts of model {facts.model_id!r} ({facts.num_layers} layers) are not the "
            f"plan's {plan.model.model_id!r} ({plan.model.num_layers} layers)"
        )

    live_ids = {n.node_id for n in pool.nodes}
    lost_node_set |= {s.node_id for s in plan.stages if s.node_id not in live_ids}
    stage_set |= {s.stage_index for s in plan.stages if s.node_id in lost_node_set}
    lost_n = tuple(sorted(lost_node_set))
    lost_s = tuple(sorted(stage_set))
    live = NodePool(
        orchestrator_node_id=pool.orchestrator_node_id,
        nodes=tuple(n for n in pool.nodes if n.node_id not in lost_node_set),
    )
    survivors = [s for s in plan.stages if s.stage_index not in stage_set]

    found = _on_spares(plan, facts, config, live, lost_s)
    if isinstance(found, RunPlan):
        return _replacement(found, survivors, True, lost_n, lost_s)
    if found is not None:  # a rejection no placement changes (the config's)
        return Unplaceable(lost_n, lost_s, found, "the new run's settings")

    placed = _placed_afresh(plan, facts, config, live, survivors)
    if isinstance(placed, RunPlan):
        return _replacement(placed, survivors, False, lost_n, lost_s)
    return Unplaceable(lost_n, lost_s, placed)


def _strings(values: Iterable[str], name: str) -> list[str]:
    if isinstance(values, str):
        raise TypeError(f"{name} must be a collection of node ids, not the string {values!r}")
    out = list(values)
    for v in out:
        if not isinstance(v, str):
            raise TypeError(f"{name}: {v!r} is not a node id (str)")
    return out


def _indices(values: Iterable[int], stage_count: int) -> list[int]:
    out = list(values)
    for v in out:
        if type(v) is not int:
            raise TypeError(f"lost_stages: {v!r} is not a stage index (int)")
        if not 0 <= v < stage_count:
            raise ValueError(f"lost stage {v} is not a stage of the plan (0..{stage_count - 1})")
    return out


def _on_spares(
    plan: RunPlan,
    facts: ModelFacts,
    config: RuntimeConfig,
    live: NodePool,
    lost: Sequence[int],
) -> RunPlan | PlanRejection | None:
    """The lost stages' ranges on spare nodes: the first assignment that fits; a
    rejection that is not the memory check's (no assignment would change it); ``None``
    when none fits."""
    live_ids = {n.node_id for n in live.nodes}
    used = {s.node_id for s in plan.stages if s.stage_index not in lost}
    own = [plan.stages[i].node_id for i in lost if plan.stages[i].node_id in live_ids]
    spares = [
        n.node_id
        for n in live.nodes
        if n.node_id not in used and n.node_id not in own and n.node_id != live.orchestrator_node_id
    ]
    candidates = [*spares, *own]
    memory = {n.node_id: n.memory_bytes for n in live.nodes}
    # A node whose memory is below a stage's weights alone never holds it (nodes that
    # share a device only have less): skipped without asking the planner.
    weights = {i: _weight_bytes(facts, config, plan, i) for i in lost}
    tries = 0
    for nodes in permutations(candidates, len(lost)):
        if any(memory[n] < weights[i] for i, n in zip(lost, nodes, strict=True)):
            continue
        tries += 1
        if tries > MAX_SPARE_TRIES:
            return None
        on = dict(zip(lost, nodes, strict=True))
        placement = Placement(
            assignments=tuple(
                StageAssignment(
                    s.stage_index,
                    on.get(s.stage_index, s.node_id),
                    s.layer_start,
                    s.layer_end_exclusive,
                )
                for s in plan.stages
            )
        )
        new = plan_run(facts, config, live, stage_count=plan.stage_count, placement=placement)
        if isinstance(new, RunPlan):
            return new
        if not isinstance(new, InsufficientMemory):
            return new
    return None


def _weight_bytes(facts: ModelFacts, config: RuntimeConfig, plan: RunPlan, index: int) -> int:
    """The weights stage ``index`` of ``plan`` holds, for the config's worker."""
    s = plan.stages[index]
    blocks = block_weight_bytes(facts, config.worker)[s.layer_start : s.layer_end_exclusive]
    fixed = fixed_weight_bytes(
        facts, config.worker, first=index == 0, last=index == plan.stage_count - 1
    )
    return sum(blocks) + fixed


def _placed_afresh(
    plan: RunPlan,
    facts: ModelFacts,
    config: RuntimeConfig,
    live: NodePool,
    survivors: Sequence[StagePlan],
) -> RunPlan | PlanRejection:
    """The planner's placement over the remaining nodes: ``count`` stages on the
    ``count`` live nodes with the most memory (a surviving stage's node first among
    equals, then pool order), layers split by memory, else evenly; for the original
    stage count, then more, then fewer; the first plan the planner accepts. The
    rejection, when none does, is the planner's over every remaining node (by memory)."""
    held = {s.node_id for s in survivors}
    order = sorted(
        (n for n in live.nodes if n.node_id != live.orchestrator_node_id),
        key=lambda n: (-n.memory_bytes, n.node_id not in held),
    )
    nodes = [n.node_id for n in order]
    most = min(len(nodes), facts.num_layers)
    first = min(plan.stage_count, most)
    counts = [*range(first, most + 1), *range(first - 1, 0, -1)] or [0]
    widest: PlanRejection | None = None
    for count in counts:
        chosen = nodes[:count]
        for placement in (Placement.by_memory(chosen), Placement.even(chosen)):
            new = plan_run(facts, config, live, stage_count=count, placement=placement)
            if isinstance(new, RunPlan):
                return new
            if count in (most, 0) and widest is None:
                widest = new
    assert widest is not None
    return widest


def _replacement(
    new: RunPlan,
    survivors: Sequence[StagePlan],
    on_spares: bool,
    lost_nodes: tuple[str, ...],
    lost_stages: tuple[int, ...],
) -> Replacement:
    before = {(s.node_id, s.layer_start, s.layer_end_exclusive) for s in survivors}
    kept = tuple(
        s.stage_index
        for s in new.stages
        if (s.node_id, s.layer_start, s.layer_end_exclusive) in before
    )
    placement = Placement(
        assignments=tuple(
            StageAssignment(s.stage_index, s.node_id, s.layer_start, s.layer_end_exclusive)
            for s in new.stages
        )
    )
    return Replacement(
        plan=new,
        placement=placement,
        kept=kept,
        fresh=tuple(s.stage_index for s in new.stages if s.stage_index not in kept),
        on_spares=on_spares,
        lost_nodes=lost_nodes,
        lost_stages=lost_stages,
    )
