"""Hypothesis strategies for the RunPlan contract: what our own contract tests and the
clause suite draw from.

- ``model_facts()``, ``runtime_configs()``, ``cut_ranges()``: the pieces.
- ``valid_plan_inputs()``: ``PlanInputs`` every planner that keeps the contract must
  plan (nodes with plenty of memory, every placement kind, spare nodes, shared
  devices). ``any_plan_inputs()``: those, or with one field broken.
- ``contradictory_plan_inputs()`` (and one strategy per kind): a ``Contradiction``,
  inputs with one contradiction and the rejection the contract demands for it.
- ``tamperings(plan)``: a ``Tampering``, the plan (or its provisions) with one thing
  broken and the clause that must then fail.

Needs Hypothesis (``pip install 'gguf-pipeline[testing]'``).
"""

from runplan.contract.subject import PlanInputs
from runplan.testing import _needs_hypothesis  # noqa: F401 (first: a clear error without it)
from runplan.testing.strategies.contradictions import (
    Contradiction,
    contradictory_plan_inputs,
    duplicate_node_inputs,
    duplicate_stage_inputs,
    inconsistent_facts_inputs,
    invalid_layer_range_inputs,
    invalid_spec_inputs,
    invalid_stage_count_inputs,
    missing_stage_inputs,
    unknown_node_inputs,
)
from runplan.testing.strategies.inputs import (
    ORCHESTRATOR,
    PLACEMENT_KINDS,
    PLENTY,
    STORED_WEIGHTS,
    activation_dtypes,
    any_plan_inputs,
    cut_ranges,
    model_facts,
    node_ids,
    run_ids,
    runtime_configs,
    valid_plan_inputs,
)
from runplan.testing.strategies.tampering import TAMPERINGS, Tampering, tamperings

__all__ = [
    "ORCHESTRATOR",
    "PLACEMENT_KINDS",
    "PLENTY",
    "STORED_WEIGHTS",
    "TAMPERINGS",
    "Contradiction",
    "PlanInputs",
    "Tampering",
    "activation_dtypes",
    "any_plan_inputs",
    "contradictory_plan_inputs",
    "cut_ranges",
    "duplicate_node_inputs",
    "duplicate_stage_inputs",
    "inconsistent_facts_inputs",
    "invalid_layer_range_inputs",
    "invalid_spec_inputs",
    "invalid_stage_count_inputs",
    "missing_stage_inputs",
    "model_facts",
    "node_ids",
    "run_ids",
    "runtime_configs",
    "tamperings",
    "unknown_node_inputs",
    "valid_plan_inputs",
]
