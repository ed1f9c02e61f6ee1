"""The clause suite: every clause of RUNPLAN_CONTRACT.md as Hypothesis tests, named
``test_<clause>``, run against the plan-building function the ``runplan_planner``
fixture gives (``runplan.plan_run`` unless ``--runplan-planner MODULE:NAME`` says
otherwise; see ``runplan.testing.plugin``). Our own ``tests/contract/`` runs it against
``plan_run``; a service runs it against its planner with::

    python -m pytest --runplan-planner mypkg.plans:build_plan --pyargs runplan.testing.suite

A planner is called as ``planner(facts, config, pool, stage_count=N, placement=P)``
and returns a ``RunPlan`` or a ``PlanRejection``.
"""

import importlib.util

for _needed in ("hypothesis", "pytest"):
    if importlib.util.find_spec(_needed) is None:
        raise ImportError(
            f"the clause suite needs {_needed}: pip install 'gguf-pipeline[testing]'",
            name=_needed,
        )
