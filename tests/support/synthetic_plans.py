"""A synthetic worker's plan in one call, for the simulator's tests and benchmarks: the
settings of ``runtime_sim.scenarios.synthetic_config`` planned on the explorer's nodes
(``synthetic_plan_of``)."""

from __future__ import annotations

from typing import Any

from runplan import ModelFacts, RunPlan
from runtime_sim.scenarios import synthetic_config, synthetic_plan_of


def synthetic_plan(facts: ModelFacts, stages: int, **settings: Any) -> RunPlan:
    """The plan of ``facts`` on ``stages`` of the explorer's nodes, with ``settings``
    (``synthetic_config``'s keywords; ``ValueError`` if the planner refuses it)."""
    return synthetic_plan_of(facts, synthetic_config(**settings), stages)
