"""RUNPLAN_CONTRACT.md, "Edge Assignment": the shipped clause suite against
``plan_run``."""

from __future__ import annotations

from runplan.testing.suite.test_edges import *  # noqa: F403
