"""What the suite's tests share."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from runplan.check import check_plan
from runplan.contract import PlanInputs, Planner
from runplan.plan import RunPlan
from runplan.rejections import PlanRejection
from runplan.testing.assertions import assert_rejected
from runplan.testing.plugin import suite_examples
from runplan.testing.strategies import Tampering

#: The suite's settings on top of the loaded profile: a planner may be slow on a busy
#: CI machine, which is no contract matter; ``--runplan-examples N`` sets the examples
#: of the suite's tests alone (the loaded profile stays the session's).
suite_settings = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
if (_examples := suite_examples()) is not None:
    suite_settings = settings(suite_settings, max_examples=_examples)


def planned(planner: Planner, inputs: PlanInputs) -> RunPlan:
    """The plan ``planner`` makes of inputs every planner keeping the contract plans."""
    result = inputs.plan_with(planner)
    if isinstance(result, PlanRejection):
        raise AssertionError(
            f"the planner rejected inputs that the contract lets it plan: {result}\n"
            f"inputs: {inputs}"
        )
    if not isinstance(result, RunPlan):
        raise AssertionError(f"the planner returned a {type(result).__name__}, not a RunPlan")
    return result


def whole(planner: Planner, inputs: PlanInputs) -> RunPlan:
    """The planner's plan of ``inputs``, for tests of what ``check_plan`` makes of it
    tampered with: skipped when ``check_plan`` rejects it untouched (the clause tests
    say why)."""
    plan = planned(planner, inputs)
    result = check_plan(plan)
    if result is not plan:
        pytest.skip(f"the planner's own plans break the contract: {result}")
    return plan


def check_plan_rejects(t: Tampering) -> None:
    """``check_plan`` returns the rejection the tampering calls for, quoting the clause
    it breaks otherwise."""
    if t.rejection is None:
        raise ValueError(f"tampering {t.what!r} leaves the plan itself as it was")
    assert_rejected(check_plan(t.plan), t.rejection, clause=t.breaks)
