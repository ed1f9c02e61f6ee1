"""Many seeded scenarios: random plan shapes, random faults, every run checked.

Each seed decides everything of its scenario (stage count, ring slots, prompt,
tokens, where EOS falls, the fault plan) through PRNGs derived from it, so
``explore --seeds 1 --start S`` reproduces scenario ``S`` exactly. Runs use the
synthetic worker: no weights, any plan size, milliseconds each.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from attrs import frozen

from runplan import (
    GgufSource,
    ModelFacts,
    NodePool,
    NodeSpec,
    PlanRejection,
    RunPlan,
    RuntimeConfig,
    Timeouts,
    plan_run,
)
from runtime_sim.clock import derive_rng
from runtime_sim.driver import PLAIN, SimResult, Simulation
from runtime_sim.faults import FaultPlan, random_fault_plan
from runtime_sim.invariants import (
    READY_AFTER_SETUP,
    READY_BEFORE_INJECT,
    RELEASE_AFTER_STEP,
    SAME_SEQUENCE,
    TEARDOWN_TO_ALL,
    Violation,
    check,
)
from runtime_sim.links import ORCHESTRATOR
from runtime_sim.mutants import Mutation, parts_for
from runtime_sim.synthetic import SYNTHETIC_CAPABILITIES, SyntheticWorker
from runtime_sim.timing import stored_stage_costs


@frozen
class Scenario:
    seed: int
    plan: RunPlan
    prompt: tuple[int, ...]
    eos_after: int | None
    faults: FaultPlan
    block_bytes: tuple[int, ...]


@frozen
class Outcome:
    seed: int
    outcome: str  # completed / faulted / cancelled / unfinished
    tokens: int
    violations: tuple[Violation, ...]
    faults: tuple[str, ...]
    events: int
    end_us: int


def synthetic_facts(
    num_layers: int, hidden: int, vocab: int, block_bytes: int, max_seq_len: int
) -> ModelFacts:
    """Facts of a model that exists only for the synthetic worker."""
    heads = max(1, hidden // 128)
    return ModelFacts(
        model_id=f"synthetic-{num_layers}x{hidden}",
        gguf_source=GgufSource.single(f"/synthetic/{num_layers}x{hidden}.gguf"),
        architecture="llama",
        num_layers=num_layers,
        hidden_dim=hidden,
        head_count=heads,
        head_count_kv=max(1, heads // 4) if heads % 4 == 0 else heads,
        head_dim_k=hidden // heads,
        head_dim_v=hidden // heads,
        vocab_size=vocab,
        eos_token_id=vocab - 1,
        context_length=max_seq_len,
        max_seq_len=max_seq_len,
        quant_types=("F32", "Q4_K", "Q6_K"),
        block_bytes=(block_bytes,) * num_layers,
        embedding_bytes=vocab * hidden // 2,
        output_bytes=vocab * hidden // 2,
        shared_bytes=0,
        tied_embeddings=False,
    )


def synthetic_plan(
    facts: ModelFacts,
    stages: int,
    *,
    max_tokens: int,
    run_id: str = "explore",
    slot_count: int = 2,
    timeouts: Timeouts | None = None,
) -> RunPlan:
    config = RuntimeConfig(
        run_id=run_id,
        max_tokens=max_tokens,
        activation_dtype_width_bytes=2,
        ring_slot_count=slot_count,
        worker=SYNTHETIC_CAPABILITIES,
        timeouts=timeouts or Timeouts(ready_ms=2_000, step_ms=500, edge_wait_ms=2_000, stop_ms=500),
    )
    nodes = tuple(NodeSpec(f"node-{i}", 2**50) for i in range(stages))
    result = plan_run(facts, config, NodePool(ORCHESTRATOR, nodes), stage_count=stages)
    if isinstance(result, PlanRejection):
        raise ValueError(str(result))
    return result


def scenario(seed: int) -> Scenario:
    rng = derive_rng(seed, "scenario")
    stages = rng.randint(1, 6)
    layers = rng.randint(stages, 12)
    max_tokens = rng.randint(1, 10)
    prompt = tuple(rng.randrange(1, 500) for _ in range(rng.randint(1, 8)))
    facts = synthetic_facts(layers, 64, 512, 10**6, len(prompt) + max_tokens + 4)
    plan = synthetic_plan(facts, stages, max_tokens=max_tokens, slot_count=rng.randint(1, 3))
    eos_after = rng.choice([None, None, rng.randrange(0, max_tokens)])
    faults = random_fault_plan(derive_rng(seed, "faults"), stages, max_tokens)
    return Scenario(seed, plan, prompt, eos_after, faults, facts.block_bytes)


def run_scenario(
    s: Scenario, mutation: Mutation | None = None
) -> tuple[SimResult, Simulation, list[Violation]]:
    plan = s.plan
    workers: list[Any] = [
        SyntheticWorker(plan.model.vocab_size, plan.model.eos_token_id, s.eos_after)
        for _ in plan.stages
    ]
    costs = stored_stage_costs(plan, s.block_bytes, plan.model.vocab_size * 32)
    parts = PLAIN if mutation is None else parts_for(mutation)
    sim = Simulation(plan, s.prompt, workers, costs, seed=s.seed, faults=s.faults, parts=parts)
    result = sim.run()
    return result, sim, check(sim, result)


def explore(start: int, count: int) -> list[Outcome]:
    outcomes = []
    for seed in range(start, start + count):
        s = scenario(seed)
        result, _sim, violations = run_scenario(s)
        finished = result.finished
        outcomes.append(
            Outcome(
                seed=seed,
                outcome=finished.outcome.value.lower() if finished else "unfinished",
                tokens=len(result.tokens),
                violations=tuple(violations),
                faults=tuple(f.describe() for f in s.faults.faults),
                events=result.events,
                end_us=result.end_us,
            )
        )
    return outcomes


def report(start: int, outcomes: list[Outcome]) -> dict[str, Any]:
    """The explore report: no wall-clock figures, so the same seeds give the same bytes."""
    counts = Counter(o.outcome for o in outcomes)
    return {
        "start": start,
        "seeds": len(outcomes),
        "outcomes": dict(sorted(counts.items())),
        "events": sum(o.events for o in outcomes),
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


#: The rule each built-in bug breaks; the self-test passes only if that rule fires.
MUTANT_RULES: dict[Mutation, str] = {
    Mutation.INJECT_BEFORE_READY: READY_BEFORE_INJECT,
    Mutation.SKIP_STOP_RUN: TEARDOWN_TO_ALL,
    Mutation.SEQUENCE_SHIFT: SAME_SEQUENCE,
    Mutation.EARLY_SLOT_REUSE: RELEASE_AFTER_STEP,
    Mutation.READY_BEFORE_BIND: READY_AFTER_SETUP,
}


def self_test(seeds: int = 20) -> list[MutantResult]:
    """Run every built-in mutant on fault-free scenarios until the checker reports the
    rule its bug breaks."""
    results = []
    for mutation in Mutation:
        caught: MutantResult | None = None
        for seed in range(seeds):
            s = scenario(seed)
            s = Scenario(s.seed, s.plan, s.prompt, None, FaultPlan(), s.block_bytes)
            _result, _sim, violations = run_scenario(s, mutation)
            rules = tuple(sorted({v.rule for v in violations}))
            if MUTANT_RULES[mutation] in rules:
                caught = MutantResult(mutation, True, seed, rules)
                break
        results.append(caught or MutantResult(mutation, False, None, ()))
    return results
