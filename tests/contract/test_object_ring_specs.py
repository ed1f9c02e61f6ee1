"""RUNPLAN_CONTRACT.md, "Object/Ring Spec Consistency": the shipped clause suite
against ``plan_run``."""

from __future__ import annotations

from runplan.testing.suite.test_specs import *  # noqa: F403
