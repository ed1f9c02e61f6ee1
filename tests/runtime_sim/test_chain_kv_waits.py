"""Runs that wait for KV memory in the simulator (CONCURRENT_RUNS.md §5), by the process
runtime's rules (``runtime_core.kv_waits``): a run a stage refused while other runs held
cache there is held and offered again under a new id once one of them ends; one that
could never fit ends faulted naming its size against the stage's whole budget; a chain
fault ends the held runs; the checker names a held run left alone and a stage whose runs
reserve beyond its budget."""

from __future__ import annotations

from typing import Any

from runplan.messages import FaultKind as RunFaultKind
from runplan.messages import ProvisionStage
from runtime_sim.chain_checker import check
from runtime_sim.chain_driver import PLAIN, ChainResult, ChainSimulation, Parts
from runtime_sim.chain_orchestrator_node import ChainOrchestratorNode, TracedChainOrchestrator
from runtime_sim.chain_rules import HARMLESS, KV_HELD_ENDS, KV_WITHIN_BUDGET
from runtime_sim.explore import solo
from runtime_sim.faults import Fault, FaultKind, FaultPlan
from runtime_sim.scenarios import Scenario
from runtime_sim.synthetic import SyntheticWorker
from runtime_sim.timing import stored_stage_costs
from tests.runtime_sim.test_chain_runs import chain


class _ShortWorker(SyntheticWorker):
    """A stage whose real KV budget is ``runs`` of the scenario's caches (``whole``
    bytes), less than the planner's figures let the orchestrator admit."""

    def __init__(self, vocab: int, eos: int | None, budget: int | None) -> None:
        super().__init__(vocab, eos)
        self.short = budget

    def configure(self, provision: ProvisionStage) -> None:
        super().configure(provision)
        if self.short is not None:
            self._budget.budget_bytes = self.short


class _GreedyWorker(SyntheticWorker):
    """Reserves every run's cache whatever its budget holds (a worker bug)."""

    def configure(self, provision: ProvisionStage) -> None:
        super().configure(provision)
        self._budget.budget_bytes = 10**15


def _simulate(
    s: Scenario,
    budgets: dict[int, int],
    *,
    worker: type[SyntheticWorker] = _ShortWorker,
    faults: FaultPlan | None = None,
    parts: Parts = PLAIN,
) -> tuple[ChainResult, ChainSimulation]:
    model = s.plan.model
    workers: list[Any] = [
        _ShortWorker(model.vocab_size, model.eos_token_id, budgets.get(i))
        if worker is _ShortWorker
        else worker(model.vocab_size, model.eos_token_id)
        for i in range(len(s.plan.stages))
    ]
    costs = stored_stage_costs(s.plan, s.block_bytes, model.vocab_size * 32)
    sim = ChainSimulation(
        s.runs, workers, costs, seed=s.seed, faults=faults or s.faults, parts=parts
    )
    return sim.run(), sim


def test_runs_a_short_stage_refuses_wait_for_memory_and_all_complete_with_their_solo_tokens() -> (
    None
):
    s = chain(3)  # the plan admits all three at once
    one = s.runs[0].plan.stages[1].kv_bytes
    result, sim = _simulate(s, {1: one})  # stage 1 holds one run's cache
    assert check(sim, result, solo(s)) == []
    assert [r.outcome for r in result.runs] == ["completed"] * 3
    assert result.runs[0].offered_as == ()
    assert len(result.runs[1].offered_as) >= 1 and len(result.runs[2].offered_as) >= 1
    again = [e for e in result.trace.entries if e[3] == "kv_again"]
    held = [e for e in result.trace.entries if e[3] == "kv_held"]
    assert len(again) == len(held) >= 2
    assert all(kv == 0 for kv in result.kv_reserved)
    again_result, _ = _simulate(s, {1: one})  # the same seed: the same trace, byte for byte
    assert again_result.trace.dumps() == result.trace.dumps()


def test_a_run_that_never_fits_a_stage_ends_naming_its_size_and_the_whole_budget() -> None:
    s = chain(2)
    need = s.runs[0].plan.stages[2].kv_bytes
    result, sim = _simulate(s, {2: need - 1})  # no run's cache fits stage 2 at all
    # the checker only knows that no fault of its plan struck them
    assert {v.rule for v in check(sim, result)} == {HARMLESS}
    assert [r.outcome for r in result.runs] == ["faulted", "faulted"]
    for r in result.runs:
        assert r.finished is not None and r.finished.fault is not None
        assert r.finished.fault.kind is RunFaultKind.KV_CACHE_UNAVAILABLE
        assert r.finished.fault.detail == (
            f"stage 2 on 'node-2': the run's KV cache needs {need} bytes, more than the "
            f"stage's whole budget of {need - 1}: it never fits"
        )
        assert r.offered_as == ()


def test_a_chain_fault_ends_the_runs_held_for_memory_faulted() -> None:
    s = chain(3)
    one = s.runs[0].plan.stages[0].kv_bytes
    kill = FaultPlan((Fault(FaultKind.KILL_MID_DECODE, stage=2, sequence=2),))
    result, sim = _simulate(s, {0: one}, faults=kill)
    assert check(sim, result) == []
    assert [r.outcome for r in result.runs] == ["faulted"] * 3
    ended = [e[4] for e in result.trace.entries if e[3] == "kv_held_ended"]
    assert ended and all(outcome == "FAULTED" for _run, outcome in ended)
    for r in result.runs:  # the held runs too: the chain's fault
        assert r.finished is not None and r.finished.fault is not None
        assert r.finished.fault.kind is RunFaultKind.PROCESS_DIED
        assert "node-2" in r.finished.fault.detail


def _with_a_cancel(
    s: Scenario, budgets: dict[int, int], run_id: str, at_us: int
) -> ChainSimulation:
    model = s.plan.model
    workers: list[Any] = [
        _ShortWorker(model.vocab_size, model.eos_token_id, budgets.get(i))
        for i in range(len(s.plan.stages))
    ]
    costs = stored_stage_costs(s.plan, s.block_bytes, model.vocab_size * 32)
    sim = ChainSimulation(s.runs, workers, costs, seed=s.seed)
    sim.clock.at(at_us, lambda: sim.orchestrator.cancel(run_id))
    return sim


def test_a_held_run_its_caller_cancels_ends_cancelled_at_once() -> None:
    s = chain(2)
    budgets = {1: s.runs[0].plan.stages[1].kv_bytes}
    first, _ = _simulate(s, budgets)
    (held_at,) = [e[0] for e in first.trace.entries if e[3] == "kv_held"]
    sim = _with_a_cancel(s, budgets, "run-1", held_at + 1)  # its caller goes, while held
    result = sim.run()
    # the checker only knows that no fault of its plan struck run-1
    assert [(v.rule, v.detail) for v in check(sim, result)] == [
        (HARMLESS, "'run-1' ended cancelled (None) with faults []")
    ]
    assert [r.outcome for r in result.runs] == ["completed", "cancelled"]
    assert result.runs[1].offered_as == () and result.runs[1].finished_us == held_at + 1
    ended = [e[4] for e in result.trace.entries if e[3] == "kv_held_ended"]
    assert ended == [("run-1", "CANCELLED")]


class _NeverAgain(ChainOrchestratorNode):
    """Holds a refused run and never offers it again (a bug)."""

    def _settle(self) -> None:
        self.waits.due = list  # type: ignore[method-assign]
        self.waits.first = list  # type: ignore[method-assign]
        super()._settle()


def test_the_checker_names_a_held_run_never_offered_again() -> None:
    s = chain(2)
    one = s.runs[0].plan.stages[1].kv_bytes
    result, sim = _simulate(
        s, {1: one}, parts=Parts(orchestrator=_NeverAgain, mutant="never again")
    )
    assert {v.rule for v in check(sim, result)} >= {KV_HELD_ENDS}
    assert [v.detail for v in check(sim, result) if v.rule == KV_HELD_ENDS] == [
        "'run-1', held for KV memory, neither offered nor ended"
    ]


class _AdmitsAll(TracedChainOrchestrator):
    """Starts every run at once, whatever the stages' budgets hold (a bug)."""

    def _fits(self, plan: Any) -> bool:
        return True


def test_the_checker_names_a_stage_whose_runs_reserve_beyond_its_budget() -> None:
    s = chain(3, concurrent=2)  # the plan's budget holds two caches
    mutant = Parts(orchestrator_controller=_AdmitsAll, mutant="admits all")
    result, sim = _simulate(s, {}, worker=_GreedyWorker, parts=mutant)
    budget = s.runs[0].plan.stages[0].kv_budget_bytes
    three = 3 * s.runs[0].plan.stages[0].kv_bytes
    over = [v for v in check(sim, result) if v.rule == KV_WITHIN_BUDGET]
    assert [v.detail for v in over][:1] == [
        f"node-0's runs reserve {three} KV bytes, its budget {budget}"
    ]
