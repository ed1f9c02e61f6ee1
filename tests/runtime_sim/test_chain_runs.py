"""Several runs through one simulated chain: a run fault ends that run alone, a chain
fault ends every run naming the stage, runs wait for the KV budget, batching pays in
virtual time, and every run's tokens are its tokens alone (the checker reruns each)."""

from __future__ import annotations

from typing import Any

import numpy as np

from runplan import provision_all
from runplan.messages import FaultKind as RunFaultKind
from runtime_core.workers.interface import BatchStep
from runtime_sim.chain_checker import check
from runtime_sim.chain_driver import ChainSimulation, RunSpec
from runtime_sim.chain_rules import BATCH_INVARIANCE, KV_FREED
from runtime_sim.explore import run_scenario, solo
from runtime_sim.faults import Fault, FaultKind, FaultPlan
from runtime_sim.mutants import Mutation
from runtime_sim.scenarios import EXPLORE_CAPABILITIES, Scenario, synthetic_facts
from runtime_sim.synthetic import SyntheticWorker, carried
from runtime_sim.timing import stored_stage_costs
from tests.support.synthetic_plans import synthetic_plan


def chain(
    runs: int,
    *,
    stages: int = 3,
    max_tokens: int = 6,
    concurrent: int | None = None,
    prefill_chunk: int = 0,
    arrival_us: int = 0,
    faults: tuple[Fault, ...] = (),
) -> Scenario:
    """``runs`` runs of 5-token prompts on one chain, each with its own sampling seed."""
    facts = synthetic_facts(6, 64, 512, 10**6, 5 + max_tokens + 4)
    specs = []
    for i in range(runs):
        plan = synthetic_plan(
            facts,
            stages,
            max_tokens=max_tokens,
            run_id=f"run-{i}",
            prompt_tokens=5,
            seed=100 + i,
            max_concurrent_runs=concurrent or runs,
            prefill_chunk=prefill_chunk,
            capabilities=EXPLORE_CAPABILITIES,
        )
        specs.append(RunSpec(plan, tuple(range(10 + i, 15 + i)), i * arrival_us))
    return Scenario(7, tuple(specs), None, FaultPlan(faults), facts.block_bytes)


def test_a_run_fault_ends_that_run_alone_and_the_others_keep_their_solo_tokens() -> None:
    s = chain(
        5,
        faults=(
            Fault(FaultKind.CALLER_CANCELS, sequence=1, run=0),
            Fault(FaultKind.STEP_FAILS, stage=2, sequence=2, run=1),
            Fault(FaultKind.FORGED_WRONG_SEQUENCE, stage=1, run=2),
            Fault(FaultKind.KV_REFUSED, stage=0, run=3),
        ),
    )
    result, _sim, violations = run_scenario(s)
    assert violations == []
    outcomes = [r.outcome for r in result.runs]
    # run 3, refused its cache while the others held theirs, waits and is offered again
    # under a new id (CONCURRENT_RUNS.md §5): the stage takes it then
    assert outcomes == ["cancelled", "faulted", "faulted", "completed", "completed"]
    faults = [r.finished.fault for r in result.runs if r.finished is not None]
    assert faults[1] is not None and faults[1].kind is RunFaultKind.STEP_FAILURE
    waited = result.runs[3]
    assert waited.offered_as == ("run-0-again-1",) and waited.last_id == "run-0-again-1"
    assert waited.tokens == solo(s)(s.runs[3])
    assert {run for run, _, _ in waited.delivered} == {"run-0-again-1"}
    clean = result.runs[4]
    assert clean.tokens == solo(s)(s.runs[4]) and len(clean.tokens) == 6
    assert [(run, seq) for run, seq, _ in clean.delivered] == [("run-4", k) for k in range(6)]
    assert result.runs[0].offered_as == ()
    assert all(kv == 0 for kv in result.kv_reserved) and all(h == () for h in result.held)


def test_a_slow_step_outlasts_the_step_timer_its_stage_armed_and_ends_its_run() -> None:
    # The stage's step timer is its batch's limit (``batch_step_limit_ms``), longer than
    # one step's alone: the slow step must outlast that one, and the stage end the run.
    for runs in (1, 3):
        s = chain(runs, faults=(Fault(FaultKind.SLOW_STEP, stage=1, sequence=2, run=0),))
        result, _sim, violations = run_scenario(s)
        assert violations == []
        slow = result.runs[0]
        assert slow.outcome == "faulted" and slow.finished is not None, slow
        fault = slow.finished.fault
        assert fault is not None and fault.kind is RunFaultKind.TIMEOUT, fault
        assert slow.finished.fault_stage == 1 and fault.detail == "step 2 ran out of time"
        assert slow.tokens == solo(s)(s.runs[0])[:2]


def test_a_stage_lost_with_four_runs_in_flight_ends_all_four_naming_it() -> None:
    s = chain(4, faults=(Fault(FaultKind.KILL_MID_DECODE, stage=1, sequence=2),))
    result, _sim, violations = run_scenario(s)
    assert violations == []
    assert [r.outcome for r in result.runs] == ["faulted"] * 4
    for r in result.runs:
        assert r.finished is not None and r.finished.fault_stage == 1, r.finished
        assert r.finished.fault is not None and "node-1" in r.finished.fault.detail
    assert result.alive == (True, False, True)
    assert result.held[0] == () and result.held[2] == ()


def test_runs_beyond_the_kv_budget_wait_their_turn_and_all_complete() -> None:
    s = chain(3, concurrent=1)
    result, _sim, violations = run_scenario(s)
    assert violations == []
    assert [r.outcome for r in result.runs] == ["completed"] * 3
    ends = [r.finished_us for r in result.runs]
    readies = [r.ready_us for r in result.runs]
    assert all(e is not None for e in ends) and all(r is not None for r in readies)
    # one cache fits each stage's budget: each run starts once the one before has ended
    assert readies[1] > ends[0] and readies[2] > ends[1]  # type: ignore[operator]
    assert max(max(b, default=0) for b in result.batches) <= 5  # never two runs' rows


def test_batching_pays_in_virtual_time_and_chunks_keep_the_tokens() -> None:
    one, _, v1 = run_scenario(chain(1, max_tokens=16))
    eight, _, v8 = run_scenario(chain(8, max_tokens=16, prefill_chunk=2))
    assert v1 == [] and v8 == []
    assert all(r.outcome == "completed" for r in eight.runs)
    assert eight.runs[0].tokens == one.runs[0].tokens  # chunked, batched: the same tokens
    assert max(max(b) for b in eight.batches) > 1  # rows of several runs in one batch

    def tokens_per_s(result: object) -> float:
        runs = result.runs  # type: ignore[attr-defined]
        tokens = sum(len(r.tokens) for r in runs)
        first = min(r.ready_us for r in runs)
        last = max(r.token_times_us[-1] for r in runs)
        return float(tokens * 1e6 / (last - first))

    # Weights are read once per batch: eight runs' decode rows cost little more than one.
    assert tokens_per_s(eight) > 3 * tokens_per_s(one)


def test_a_batch_that_computes_a_run_s_step_on_another_run_s_rows_breaks_batch_invariance() -> None:
    """The synthetic worker's tokens follow the rows each step is given (every row
    carries its token through the stages): a stage whose batches hand one run's rows to
    another run's step changes their tokens, and the checker names it. Its rule once
    could not fail: a synthetic token was its seed's and position's alone."""
    s = chain(4, max_tokens=6)
    _result, _sim, clean = run_scenario(s)
    assert clean == []
    _result, _sim, violations = run_scenario(s, Mutation.MIXED_ROWS)
    assert BATCH_INVARIANCE in {v.rule for v in violations}, violations


def test_a_synthetic_stage_passes_on_the_tokens_its_rows_stand_for() -> None:
    s = chain(1, stages=3)
    provisions = provision_all(s.plan)
    model = s.plan.model
    workers = [SyntheticWorker(model.vocab_size, model.eos_token_id) for _ in provisions]
    for w, p in zip(workers, provisions, strict=True):
        w.configure(p)
        w.bind(p.gguf_source)
        w.open_run(p)
    ids = np.array(s.runs[0].prompt, dtype=np.uint32)
    first = workers[0].execute_batch([BatchStep(s.plan.run_id, 0, 0, 1, ids)])[0]
    assert isinstance(first, np.ndarray) and carried(first).tolist() == ids.tolist()
    second = workers[1].execute_batch([BatchStep(s.plan.run_id, 0, 0, 1, first)])[0]
    assert isinstance(second, np.ndarray) and np.array_equal(second, first)


class _LeakyWorker(SyntheticWorker):
    """Keeps a run's KV reservation when the run is closed (a worker bug)."""

    def close_run(self, run_id: str) -> None:
        self._runs.pop(run_id, None)


def test_the_checker_names_a_kv_reservation_a_stage_never_freed() -> None:
    s = chain(2)
    model = s.plan.model
    workers: list[Any] = [_LeakyWorker(model.vocab_size, model.eos_token_id) for _ in s.plan.stages]
    costs = stored_stage_costs(s.plan, s.block_bytes, model.vocab_size * 32)
    sim = ChainSimulation(s.runs, workers, costs, seed=s.seed)
    result = sim.run()
    assert [r.outcome for r in result.runs] == ["completed", "completed"]
    rules = {v.rule for v in check(sim, result)}
    assert rules == {KV_FREED}


def test_each_batch_takes_the_timing_model_s_time_for_its_rows() -> None:
    s = chain(6, prefill_chunk=3, arrival_us=700)
    result, sim, violations = run_scenario(s)
    assert violations == []
    spans = [e for e in result.trace.entries if e[2] == "span" and e[3].startswith("step")]
    assert any(len({r for r, _, _ in e[4][2]}) > 1 for e in spans)  # batches of several runs
    timing = sim.settings.timing
    for _time, actor, _kind, _what, (duration, rows, steps) in spans:
        stage = next(n for n in sim.stages if n.node_id == actor)
        assert rows >= len(steps)
        assert duration == int(timing.step_us(stage.cost, rows))
