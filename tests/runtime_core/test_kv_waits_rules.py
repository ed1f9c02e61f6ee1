"""The rules of ``runtime_core.kv_waits`` without processes: when a run a stage refused for
want of KV memory never fits (its fault's words), and a plan offered again under a new
run id. The runs that wait, end to end: ``serve/test_kv_waits.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from runplan.messages import FaultKind, FaultReason, ProvisionRefused, StopReason
from runtime_core.kv_waits import KvWaits, never_fits, renamed
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


class _Run:
    """A run whose machine ended faulted for want of KV memory, as the runner sees it
    (``ChainRun``'s fields that ``KvWaits`` reads and writes)."""

    def __init__(self, run_id: str) -> None:
        self.plan = small_plan(2, run_id=run_id)
        self.former_ids: tuple[str, ...] = ()
        self.handle: Any = None
        self.refused()

    @property
    def run_id(self) -> str:
        return self.plan.run_id

    def refused(self) -> None:
        fault = FaultReason(FaultKind.KV_CACHE_UNAVAILABLE, "full")
        self.handle = SimpleNamespace(
            finished=SimpleNamespace(outcome=StopReason.FAULTED, fault=fault)
        )


def test_a_held_run_that_is_due_does_not_wait_behind_one_that_is_not() -> None:
    """B refused before a run ended, C after: B is due, C not, whatever order their
    machines ended in (C's first here)."""
    ids = iter(["new-1", "new-2"])
    waits = KvWaits(lambda: next(ids))
    b, c = _Run("B"), _Run("C")
    held_elsewhere = {0: 10**6, 1: 10**6}
    waits.heard(ProvisionRefused("B", 1, "n1", 10, 0, 1000), b, held_elsewhere)
    waits.ended()
    waits.heard(ProvisionRefused("C", 1, "n1", 10, 0, 1000), c, held_elsewhere)
    assert waits.holds(c) and waits.holds(b)
    assert [r.former_ids for r in waits.due()] == [("B",)]
    assert len(waits) == 1 and waits.due() == []
    waits.ended()
    assert [r.former_ids for r in waits.due()] == [("C",)]


def test_the_first_held_run_is_offered_alone_when_asked() -> None:
    ids = iter(["new-1", "new-2"])
    waits = KvWaits(lambda: next(ids))
    b, c = _Run("B"), _Run("C")
    for run in (b, c):
        waits.heard(ProvisionRefused(run.run_id, 1, "n1", 10, 0, 1000), run, {1: 10**6})
        assert waits.holds(run)
    (first,) = waits.first()
    assert first is b and b.run_id == "new-1" and b.former_ids == ("B",)
    assert len(waits) == 1


def test_a_held_run_is_taken_by_an_id_it_had_before() -> None:
    ids = iter(["new-1", "new-2"])
    waits = KvWaits(lambda: next(ids))
    b = _Run("B")
    waits.heard(ProvisionRefused("B", 1, "n1", 10, 0, 1000), b, {1: 10**6})
    assert waits.holds(b)
    (again,) = waits.first()
    again.refused()
    waits.heard(ProvisionRefused(again.run_id, 1, "n1", 10, 0, 1000), again, {1: 10**6})
    assert waits.holds(again)  # refused a second time, held under its new id
    assert waits.take("B") is b and len(waits) == 0
