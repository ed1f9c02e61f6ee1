"""What the clause checks look at: a plan, its provisions (given, or derived with
``provision_all``) and, when known, the planner inputs the plan was made from."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import attrs
from attrs import frozen

from runplan._fields import int_field, typed_field
from runplan.config import RuntimeConfig
from runplan.facts import ModelFacts
from runplan.messages import ProvisionStage
from runplan.placement import Placement
from runplan.plan import EdgePlan, RunPlan, StagePlan
from runplan.pool import NodePool
from runplan.provision import provision_all
from runplan.rejections import PlanRejection

#: A plan-building function with ``plan_run``'s signature: called as
#: ``planner(facts, config, pool, stage_count=..., placement=...)``.
Planner: TypeAlias = Callable[..., RunPlan | PlanRejection]


@frozen
class PlanInputs:
    """The five inputs the contract's planner is given."""

    facts: ModelFacts = typed_field(ModelFacts)
    config: RuntimeConfig = typed_field(RuntimeConfig)
    pool: NodePool = typed_field(NodePool)
    stage_count: int = int_field()
    placement: Placement = typed_field(Placement)

    def kwargs(self) -> dict[str, Any]:
        return {"stage_count": self.stage_count, "placement": self.placement}

    def plan_with(self, planner: Planner) -> RunPlan | PlanRejection:
        """What ``planner`` makes of these inputs."""
        return planner(self.facts, self.config, self.pool, **self.kwargs())


class NotChecked(Exception):
    """Raised by a clause check that has nothing to look at (the reason is the text)."""


@attrs.define(frozen=True)
class Subject:
    plan: RunPlan
    inputs: PlanInputs | None
    given: tuple[ProvisionStage, ...] | None  # the provisions handed in, if any
    derived: tuple[ProvisionStage, ...] | None  # provision_all(plan), None if it failed
    derive_error: str
    stages: dict[int, StagePlan]  # first stage of each index
    edges: dict[int, EdgePlan]  # first edge of each id

    @property
    def provisions(self) -> tuple[ProvisionStage, ...]:
        """The provisions to check: those given, else the derived ones."""
        if self.given is not None:
            return self.given
        if self.derived is None:
            raise NotChecked(f"no provisions to check: {self.derive_error}")
        return self.derived

    def need_inputs(self, what: str) -> PlanInputs:
        if self.inputs is None:
            raise NotChecked(f"a plan does not carry {what}; give the planner's inputs")
        return self.inputs


def make_subject(
    plan: RunPlan,
    provisions: Sequence[ProvisionStage] | None = None,
    inputs: PlanInputs | None = None,
) -> Subject:
    if not isinstance(plan, RunPlan):
        raise TypeError(f"plan must be a RunPlan, not {type(plan).__name__}")
    given = None if provisions is None else tuple(provisions)
    for p in given or ():
        if not isinstance(p, ProvisionStage):
            raise TypeError(f"provisions must be ProvisionStage values, not {type(p).__name__}")
    if inputs is not None and not isinstance(inputs, PlanInputs):
        raise TypeError(f"inputs must be PlanInputs, not {type(inputs).__name__}")
    derived: tuple[ProvisionStage, ...] | None
    try:
        derived, error = provision_all(plan), ""
    except KeyError as exc:
        derived, error = None, f"a stage names edge {exc.args[0]}, which the plan lacks"
    stages: dict[int, StagePlan] = {}
    for s in plan.stages:
        stages.setdefault(s.stage_index, s)
    edges: dict[int, EdgePlan] = {}
    for e in plan.edges:
        edges.setdefault(e.edge_id, e)
    return Subject(plan, inputs, given, derived, error, stages, edges)
