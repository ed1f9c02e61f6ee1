"""The rules of ``runtime_core.kv_waits`` without processes: when a run a stage refused for
want of KV memory never fits (its fault's words), and a plan offered again under a new
run id. The runs that wait, end to end: ``serve/test_kv_waits.py``."""

from __future__ import annotations

from runplan.messages import ProvisionRefused
from runtime_core.kv_waits import never_fits, renamed
from tests.support.strategies import small_plan


def test_a_run_that_needs_more_than_the_whole_budget_never_fits() -> None:
    why = never_fits(ProvisionRefused("r", 1, "node-1", 300, 100, 200), others_held=150)
    assert why == (
        "stage 1 on 'node-1': the run's KV cache needs 300 bytes, more than the stage's "
        "whole budget of 200: it never fits"
    )


def test_a_run_refused_when_no_other_run_holds_memory_never_fits() -> None:
    why = never_fits(ProvisionRefused("r", 0, "node-0", 50, 10, 200), others_held=0)
    assert why == (
        "stage 0 on 'node-0': the run's KV cache needs 50 bytes, 10 of the stage's whole "
        "budget of 200 free, and no other run on the chain holds any of it to free: it "
        "never fits"
    )


def test_a_run_refused_while_others_hold_memory_may_fit() -> None:
    assert never_fits(ProvisionRefused("r", 0, "node-0", 50, 10, 200), others_held=60) is None
    # Needing all of the budget fits once the others have freed theirs.
    assert never_fits(ProvisionRefused("r", 0, "node-0", 200, 0, 200), others_held=1) is None


def test_a_plan_offered_again_differs_in_its_run_id_alone() -> None:
    plan = small_plan(3, run_id="run-1")
    again = renamed(plan, "run-2")
    assert again.run_id == "run-2"
    assert {s.run_id for s in again.stages} == {"run-2"}
    assert {e.run_id for e in again.edges} == {"run-2"}
    assert renamed(again, "run-1") == plan
