"""The RunPlan contract as something other services run in their CI.

- ``runplan.testing`` (this module) and ``runplan.testing.assertions``: one assertion
  per clause of RUNPLAN_CONTRACT.md, ``assert_<clause>(plan, provisions=None, *,
  inputs=None)``, plus ``assert_contract`` (every clause) and ``assert_rejected``.
  They need nothing beyond ``runplan``.
- ``runplan.testing.strategies``: the Hypothesis strategies our own contract tests
  draw from: model facts, runtime configs, node pools and placements, valid planner
  inputs, contradictory inputs with the rejection each must get, and tampered plans.
- ``runplan.testing.suite``: the clause suite, every clause exercised over generated
  inputs against a plan-building function (the ``runplan_planner`` fixture).
- ``runplan.testing.plugin``: the pytest plugin (an entry point, loaded by pytest)
  that gives the suite its planner: ``--runplan-planner MODULE:NAME``.

The last three need Hypothesis and pytest: ``pip install 'gguf-pipeline[testing]'``.
"""

from runplan.contract import CLAUSES, Clause, PlanInputs, Planner
from runplan.testing.assertions import *  # noqa: F403
from runplan.testing.assertions import __all__ as _assertions

__all__ = ["CLAUSES", "Clause", "PlanInputs", "Planner", *_assertions]  # noqa: PLE0604
