"""RUNPLAN_CONTRACT.md, "RunPlan Formation": the shipped clause suite
(``runplan.testing.suite``) against ``plan_run``, the ``runplan_planner`` fixture's
default."""

from __future__ import annotations

from runplan.testing.suite.test_formation import *  # noqa: F403
