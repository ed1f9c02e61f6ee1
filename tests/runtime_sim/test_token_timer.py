"""A run's token timer under load (CONCURRENT_RUNS.md §3, §6): a run whose record waits
behind other runs' records (their prefill chunks, or more decoding runs than a batch
holds) through more batches than its bound counts is not faulted while the chain
delivers tokens to any run; a chain that delivers none still faults every run, within
its bound of its timer's last start (two bounds of the chain's last token at most); a
run whose record is lost while other runs go on faults within its restarts' bounds, as
many as the runs in flight, whatever the runs' caches."""

from __future__ import annotations

import pytest

from runplan import RunPlan, Timeouts
from runplan.fsm import orchestrator as ofsm
from runplan.fsm.orchestrator import InjectTokens
from runplan.messages import FaultKind as RunFaultKind
from runtime_core.chain_orchestrator import RunHandle
from runtime_core.token_links import TokenLinks
from runtime_sim.chain_checker import check
from runtime_sim.chain_driver import ChainResult, ChainSimulation, RunSpec, SimSettings
from runtime_sim.faults import Fault, FaultKind
from runtime_sim.scenarios import EXPLORE_CAPABILITIES, synthetic_facts
from runtime_sim.synthetic import SyntheticWorker
from runtime_sim.timing import NodeProfile, TimingModel, stored_stage_costs
from tests.support.slow_chain import slow_chain
from tests.support.synthetic_plans import synthetic_plan

#: Tight bounds: a step of one row may take 110 ms.
TIMEOUTS = Timeouts(ready_ms=2_000, step_ms=100, step_row_ms=10, edge_wait_ms=2_000, stop_ms=500)
#: Slow stages: every batch takes a little over 100 ms, within the step limit of each
#: batch (110 ms for a row), so that a record waiting through a few more batches than
#: the bound counts outlasts it.
SLOW = TimingModel(node=NodeProfile(step_overhead_us=100_000))


def busy_chain(
    runs: int, *, faults: tuple[Fault, ...] = (), **chain: int
) -> tuple[ChainResult, ChainSimulation]:
    """``runs`` runs of 4 tokens each on slow stages (``slow_chain``'s keywords)."""
    return slow_chain(runs, timeouts=TIMEOUTS, timing=SLOW, faults=faults, **chain)


def bound_us(plan: RunPlan, prompt: tuple[int, ...], sequence: int) -> int:
    """The bound the run's machine arms its token timer with for ``sequence``."""
    return ofsm.OrchestratorMachine.for_plan(plan, prompt)._token_ms(sequence) * 1000


def longest_wait_over_bound(result: ChainResult, sim: ChainSimulation) -> int:
    """How far the longest wait for a token (from the previous token, or from the
    readiness barrier for token 0) outlasted that token's bound, in microseconds."""
    over = []
    for spec, run in zip(sim.runs, result.runs, strict=True):
        assert run.ready_us is not None
        starts = (run.ready_us, *run.token_times_us[:-1])
        for k, (start, end) in enumerate(zip(starts, run.token_times_us, strict=True)):
            over.append(end - start - bound_us(spec.plan, spec.prompt, k))
    return max(over)


def test_decodes_among_more_runs_than_a_batch_holds_outlast_the_bound_and_complete() -> None:
    # One row a batch, six runs: each run's record waits through the other runs' batches.
    result, sim = busy_chain(6, max_batch_rows=1, prompt_tokens=1)
    assert [r.outcome for r in result.runs] == ["completed"] * 6
    assert all(len(r.tokens) == 4 for r in result.runs)
    assert longest_wait_over_bound(result, sim) > 0  # a token waited past its bound
    assert check(sim, result) == []


def test_a_prompt_behind_other_runs_prefill_chunks_outlasts_the_bound_and_completes() -> None:
    for stages in (1, 2):
        result, sim = busy_chain(
            4, stages=stages, max_batch_rows=2, prompt_tokens=8, prefill_chunk=2
        )
        assert [r.outcome for r in result.runs] == ["completed"] * 4
        assert longest_wait_over_bound(result, sim) > 0
        assert check(sim, result) == []


def test_a_chain_that_delivers_no_token_still_faults_every_run_within_its_bound() -> None:
    # Hop 0's record of sequence 2 stalls far past every timeout, for each run: once
    # the runs reach it, the chain delivers no token to anyone.
    stall = (Fault(FaultKind.EDGE_STALL, stage=0, sequence=2),)
    for runs in (1, 3):
        result, sim = busy_chain(runs, max_batch_rows=1, prompt_tokens=1, faults=stall)
        last_token = max(t for r in result.runs for t in r.token_times_us)
        stop_us = TIMEOUTS.stop_limit_ms(1, 1) * 1000
        for spec, run in zip(sim.runs, result.runs, strict=True):
            assert run.finished is not None and run.finished_us is not None, run
            fault = run.finished.fault
            assert fault is not None and fault.kind is RunFaultKind.TIMEOUT, fault
            assert fault.detail == "token 2 not produced in time"
            assert len(run.token_times_us) == 2
            bound = bound_us(spec.plan, spec.prompt, 2)
            # a timer started before the chain's last token runs out once more, at
            # most, after it: the fault comes within its bound of that start
            allowed = bound if runs == 1 else 2 * bound
            assert run.finished_us - last_token <= allowed + stop_us, (run, bound)


def lose_run_0_token_2(
    monkeypatch: pytest.MonkeyPatch, runs: tuple[tuple[int, int, int], ...]
) -> tuple[ChainResult, tuple[RunSpec, ...]]:
    """Runs of ``(max_tokens, prompt_tokens, arrival_us)`` on one slow stage whose KV
    budget holds 2 full-length caches, run to their ends, run-0's record of token 2
    never going onto token-in."""
    facts = synthetic_facts(6, 64, 512, 10**6, 1 + 400)
    specs = []
    for i, (max_tokens, prompt_tokens, arrival_us) in enumerate(runs):
        plan = synthetic_plan(
            facts,
            1,
            max_tokens=max_tokens,
            run_id=f"run-{i}",
            prompt_tokens=prompt_tokens,
            seed=100 + i,
            max_concurrent_runs=2,
            max_batch_rows=2,
            timeouts=TIMEOUTS,
            capabilities=EXPLORE_CAPABILITIES,
        )
        specs.append(RunSpec(plan, (10 + i,), arrival_us))
    queue = TokenLinks._queue

    def lose(self: TokenLinks, handle: RunHandle, action: InjectTokens) -> None:
        if not (handle.run_id == "run-0" and action.sequence == 2):
            queue(self, handle, action)

    monkeypatch.setattr(TokenLinks, "_queue", lose)
    model = specs[0].plan.model
    costs = stored_stage_costs(specs[0].plan, facts.block_bytes, model.vocab_size * 32)
    timing = TimingModel(node=NodeProfile(step_overhead_us=50_000))
    sim = ChainSimulation(
        tuple(specs),
        [SyntheticWorker(model.vocab_size, model.eos_token_id)],
        costs,
        seed=7,
        settings=SimSettings(timing=timing),
    )
    return sim.run(), tuple(specs)


def check_lost(result: ChainResult, specs: tuple[RunSpec, ...], runs_seen: int) -> None:
    """run-0 faulted ``TIMEOUT`` alone, its timer having started again ``runs_seen``
    times (the runs in flight while token 2 waited), within that many bounds and one of
    token 2's injection; every other run completed, going on long after."""
    lost, *busy = result.runs
    assert lost.finished is not None and lost.finished_us is not None
    for spec, run in zip(specs[1:], busy, strict=True):
        assert run.outcome == "completed" and len(run.tokens) == spec.plan.max_tokens
    # token 2 was injected when token 1 came: the first bound and the limit's restarts
    bound = bound_us(specs[0].plan, specs[0].prompt, 2)
    waited = lost.finished_us - lost.token_times_us[-1]
    stop_us = TIMEOUTS.stop_limit_ms(1, 2) * 1000
    assert waited <= (runs_seen + 1) * bound + stop_us, (waited, bound)
    last = max(r.token_times_us[-1] for r in busy)
    assert last > lost.finished_us + 10 * bound  # they went on long after
    fault = lost.finished.fault
    assert fault is not None and fault.kind is RunFaultKind.TIMEOUT, fault
    assert fault.detail == (
        f"token 2 not produced in time (its timer started again {runs_seen} times while "
        f"other runs got tokens, {runs_seen} runs in flight at most)"
    )


def test_a_lost_record_faults_its_run_within_its_restarts_while_another_run_delivers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # run-0's record of token 2 never goes onto token-in; run-1 keeps getting tokens
    # for far longer than run-0's bound. run-0's timer starts again while it does, as
    # many times as runs were in flight (2), then run-0 faults alone: not once run-1
    # ends.
    result, specs = lose_run_0_token_2(monkeypatch, ((4, 0, 0), (300, 1, 0)))
    check_lost(result, specs, 2)


def test_a_lost_record_among_short_runs_faults_within_the_runs_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Three runs of short caches (a stage's budget holds 2 x 401 positions: 160 caches
    # of run-0's 5), run-2 arriving after run-0's token 2 was injected: run-0's timer
    # starts again 3 times, the most runs in flight while token 2 waited, not as many
    # times as the budget holds runs of its cache (it then waited until the others
    # ended, 28 bounds).
    result, specs = lose_run_0_token_2(monkeypatch, ((4, 1, 0), (150, 1, 0), (150, 1, 600_000)))
    assert result.runs[2].arrival_us > result.runs[0].token_times_us[-1]
    check_lost(result, specs, 3)


def test_a_long_run_among_more_short_runs_than_its_budget_counts_completes() -> None:
    # run-0 reserves the whole context (a stage's budget holds 2 such caches) and shares
    # one-row batches with 10 runs of one-position prompts, which fill the rest of the
    # budget: its token waits through more than 3 bounds (2 restarts) behind theirs.
    # Its timer starts again as many times as runs are in flight, not as many as the
    # budget holds runs of its size (it was faulted TIMEOUT with no fault at all).
    facts = synthetic_facts(6, 64, 512, 10**6, 64)
    specs = []
    for i in range(11):
        plan = synthetic_plan(
            facts,
            1,
            max_tokens=4,
            run_id=f"run-{i}",
            prompt_tokens=0 if i == 0 else 1,
            seed=100 + i,
            max_concurrent_runs=2,
            max_batch_rows=1,
            timeouts=TIMEOUTS,
            capabilities=EXPLORE_CAPABILITIES,
        )
        specs.append(RunSpec(plan, (10 + i,)))
    stage = specs[0].plan.stages[0]
    assert stage.kv_budget_bytes // stage.kv_bytes == 2
    model = specs[0].plan.model
    costs = stored_stage_costs(specs[0].plan, facts.block_bytes, model.vocab_size * 32)
    sim = ChainSimulation(
        tuple(specs),
        [SyntheticWorker(model.vocab_size, model.eos_token_id)],
        costs,
        seed=7,
        settings=SimSettings(timing=SLOW),
    )
    result = sim.run()
    assert [r.outcome for r in result.runs] == ["completed"] * 11
    long = result.runs[0]
    assert long.ready_us is not None
    starts = (long.ready_us, *long.token_times_us[:-1])
    waits = [
        (end - start) / bound_us(specs[0].plan, specs[0].prompt, k)
        for k, (start, end) in enumerate(zip(starts, long.token_times_us, strict=True))
    ]
    assert max(waits) > 3, waits  # past the bound and 2 restarts
    assert check(sim, result) == []
