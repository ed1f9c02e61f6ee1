"""The service's own contract tests, written with runplan.testing."""

from __future__ import annotations

from hypothesis import given, settings
from runplan import RunPlan, provision_all
from runplan.testing import PlanInputs, assert_contract, assert_rejected
from runplan.testing.strategies import Contradiction, contradictory_plan_inputs, valid_plan_inputs
from service_plans import build_plan


# No deadline: a busy CI machine may take more than Hypothesis's 200 ms for one example
# (the shipped suite sets none either).
@settings(deadline=None)
@given(valid_plan_inputs())
def test_our_plans_and_provisions_keep_every_clause(inputs: PlanInputs) -> None:
    plan = inputs.plan_with(build_plan)
    assert isinstance(plan, RunPlan), f"valid inputs rejected: {plan}"
    assert_contract(plan, provision_all(plan), inputs=inputs)


@settings(deadline=None)
@given(contradictory_plan_inputs())
def test_contradictory_inputs_get_the_rejection_the_contract_demands(c: Contradiction) -> None:
    assert_rejected(c.inputs.plan_with(build_plan), c.rejection, clause=c.clause, values=c.values)
