"""Many seeded scenarios (``runtime_sim.scenarios``), each run, recovered after a loss
when it says so, and checked: every chain by ``chain_checker``, the recovery by
``recovery_checker``; the report, and the self-test of the built-in mutants."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import attrs
from attrs import frozen

from runplan import RunPlan
from runplan.replacement import Unplaceable
from runtime_core.workers.interface import Worker
from runtime_sim.chain_checker import check
from runtime_sim.chain_driver import PLAIN, ChainResult, ChainSimulation, RunSpec
from runtime_sim.chain_end_checks import Solo
from runtime_sim.chain_recovery import (
    CostsFor,
    Epoch,
    RecoveringSimulation,
    RecoveryRun,
    WorkersFor,
)
from runtime_sim.chain_ring_rules import RELEASE_AT_LOAD
from runtime_sim.chain_rules import (
    ALL_RULES,
    BATCH_INVARIANCE,
    BATCHES_REPORTED,
    ISOLATION,
    READY_AFTER_SETUP,
    READY_BEFORE_INJECT,
    SAME_SEQUENCE,
    STEP_ORDER,
    TEARDOWN_TO_ALL,
    Violation,
)
from runtime_sim.faults import FaultPlan
from runtime_sim.mutants import RECOVERY_MUTATIONS, Mutation, parts_for
from runtime_sim.recovery_checker import (
    LOST_HOST_UNUSED,
    RECOVERY_RULES,
    REPLAY_PROMPT,
    STALE_NEVER_ACCEPTED,
    STREAM_ONE_OUTCOME,
    STREAM_UNBROKEN,
    check_recovery,
)
from runtime_sim.scenarios import Scenario, loss_scenario, scenario
from runtime_sim.synthetic import SyntheticWorker
from runtime_sim.timing import StageCost, stored_stage_costs


@frozen
class Outcome:
    seed: int
    runs: tuple[str, ...]  # each run's outcome: completed / faulted / cancelled / ...
    tokens: int
    violations: tuple[Violation, ...]
    faults: tuple[str, ...]
    events: int
    end_us: int  # summed over its chains (each on its own clock)
    recovered: int = 0  # streams replayed at least once
    replacements: tuple[str, ...] = ()  # each re-placement: spare, afresh, unplaceable:CODE
    losses_during: int = 0  # re-placed chains a loss struck (a loss during a recovery)

    @property
    def outcome(self) -> str:
        """The scenario's outcome: its runs' when they agree, else ``mixed``."""
        kinds = set(self.runs)
        return kinds.pop() if len(kinds) == 1 else "mixed"


def _workers(s: Scenario) -> WorkersFor:
    """The synthetic workers of a chain of ``s`` (the first, or a re-placed one)."""

    def make(plan: RunPlan) -> list[Worker]:
        model = plan.model
        eos = model.eos_token_id
        return [SyntheticWorker(model.vocab_size, eos, s.eos_after) for _ in plan.stages]

    return make


def _costs(s: Scenario) -> CostsFor:
    def costs(plan: RunPlan) -> list[StageCost]:
        return stored_stage_costs(plan, s.block_bytes, plan.model.vocab_size * 32)

    return costs


def solo(s: Scenario) -> Solo:
    """Runs one run of ``s`` alone, on the same seed, through the same kind of worker,
    on its own plan's chain, with no fault."""

    def alone(spec: RunSpec) -> tuple[int, ...]:
        plan = spec.plan
        sim = ChainSimulation(
            [RunSpec(plan, spec.prompt, 0)], _workers(s)(plan), _costs(s)(plan), seed=s.seed
        )
        return sim.run().runs[0].tokens

    return alone


def run_recovering(
    s: Scenario, mutation: Mutation | None = None
) -> tuple[RecoveryRun, list[Violation]]:
    """Scenario ``s``, recovered after a loss when it says so: every chain it took, and
    every violation (each chain's own, ``chain N:`` for the re-placed ones, and the
    recovery's)."""
    parts = PLAIN if mutation is None else parts_for(mutation)
    run = RecoveringSimulation(
        s.runs,
        _workers(s),
        _costs(s),
        seed=s.seed,
        faults=s.faults,
        action=s.recovery,
        parts=parts,
    ).run()
    alone = solo(s)
    violations: list[Violation] = []
    for n, epoch in enumerate(run.epochs):
        found = check(epoch.sim, epoch.result, alone if len(epoch.sim.runs) > 1 else None)
        violations += [
            v if n == 0 else Violation(v.rule, v.time_us, f"chain {n}: {v.detail}") for v in found
        ]
    violations += check_recovery(run, alone)
    return run, violations


def run_scenario(
    s: Scenario, mutation: Mutation | None = None
) -> tuple[ChainResult, ChainSimulation, list[Violation]]:
    """Scenario ``s``: its first chain's result and simulation, and every violation of
    every chain it took (``run_recovering`` has the chains of its recoveries)."""
    run, violations = run_recovering(s, mutation)
    first = run.epochs[0]
    return first.result, first.sim, violations


def _replacement(epoch: Epoch) -> str | None:
    """How a chain's runs were recovered: on spares, placed afresh, or unplaceable."""
    new = epoch.replacement
    if new is None:
        return None
    if isinstance(new, Unplaceable):
        return f"unplaceable:{new.rejection.code}"
    return "spare" if new.on_spares else "afresh"


def explore(start: int, count: int, *, max_runs: int = 6) -> list[Outcome]:
    outcomes = []
    for seed in range(start, start + count):
        s = scenario(seed, max_runs=max_runs)
        run, violations = run_recovering(s)
        epochs = run.epochs
        outcomes.append(
            Outcome(
                seed=seed,
                runs=tuple(st.outcome for st in run.streams),
                tokens=sum(len(st.tokens) for st in run.streams),
                violations=tuple(violations),
                faults=tuple(f.describe() for f in s.faults.faults),
                events=sum(e.result.events for e in epochs),
                end_us=sum(e.result.end_us for e in epochs),
                recovered=sum(st.recovered > 0 for st in run.streams),
                replacements=tuple(r for e in epochs if (r := _replacement(e)) is not None),
                losses_during=sum(bool(e.sim.faults.faults) for e in epochs[1:]),
            )
        )
    return outcomes


def report(start: int, outcomes: list[Outcome]) -> dict[str, Any]:
    """The explore report: no wall-clock figures, so the same seeds give the same bytes."""
    counts = Counter(o.outcome for o in outcomes)
    runs = Counter(r for o in outcomes for r in o.runs)
    return {
        "start": start,
        "seeds": len(outcomes),
        "outcomes": dict(sorted(counts.items())),
        "runs": dict(sorted(runs.items())),
        "events": sum(o.events for o in outcomes),
        "recovered_streams": sum(o.recovered for o in outcomes),
        "replacements": dict(sorted(Counter(r for o in outcomes for r in o.replacements).items())),
        "losses_during_recovery": sum(o.losses_during for o in outcomes),
        "violations": [
            {
                "seed": o.seed,
                "rule": v.rule,
                "time_us": v.time_us,
                "detail": v.detail,
                "faults": list(o.faults),
            }
            for o in outcomes
            for v in o.violations
        ],
    }


def report_json(start: int, outcomes: list[Outcome]) -> str:
    return json.dumps(report(start, outcomes), sort_keys=True)


@frozen
class MutantResult:
    mutation: Mutation
    caught: bool  # the rule the bug breaks fired
    seed: int | None
    rules: tuple[str, ...]  # every rule that fired


#: Every rule an explored scenario is checked against: a chain's (``chain_rules``), then
#: its recovery's (``recovery_checker``); ``explore --rules`` lists them.
CHECKED_RULES: tuple[str, ...] = ALL_RULES + RECOVERY_RULES

#: The rule each built-in bug breaks; the self-test passes only if that rule fires.
MUTANT_RULES: dict[Mutation, str] = {
    Mutation.INJECT_BEFORE_READY: READY_BEFORE_INJECT,
    Mutation.SKIP_STOP_RUN: TEARDOWN_TO_ALL,
    Mutation.SEQUENCE_SHIFT: SAME_SEQUENCE,
    Mutation.LATE_RELEASE: RELEASE_AT_LOAD,
    Mutation.READY_BEFORE_BIND: READY_AFTER_SETUP,
    Mutation.CROSS_RUN_LEAK: ISOLATION,
    Mutation.REORDERED_STEPS: STEP_ORDER,
    Mutation.BATCHES_REPORTED_TWICE: BATCHES_REPORTED,
    Mutation.MIXED_ROWS: BATCH_INVARIANCE,
    Mutation.REPLAY_RESTARTS_SAMPLER: STREAM_UNBROKEN,
    Mutation.REPLAY_DROPS_DELIVERED: REPLAY_PROMPT,
    Mutation.STALE_RUN_ACCEPTED: STALE_NEVER_ACCEPTED,
    Mutation.REUSES_LOST_HOST: LOST_HOST_UNUSED,
    Mutation.FORGETS_A_RUN: STREAM_ONE_OUTCOME,
}


def self_test(seeds: int = 40) -> list[MutantResult]:
    """Run every built-in mutant until the checker reports the rule its bug breaks: on
    fault-free scenarios, the recovery mutants on scenarios with a loss
    (``loss_scenario``)."""
    results = []
    for mutation in Mutation:
        caught: MutantResult | None = None
        for seed in range(seeds):
            if mutation in RECOVERY_MUTATIONS:
                s = loss_scenario(seed)
            else:
                s = attrs.evolve(scenario(seed), eos_after=None, faults=FaultPlan(), recovery=None)
            _result, _sim, violations = run_scenario(s, mutation)
            rules = tuple(sorted({v.rule for v in violations}))
            if MUTANT_RULES[mutation] in rules:
                caught = MutantResult(mutation, True, seed, rules)
                break
        results.append(caught or MutantResult(mutation, False, None, ()))
    return results
