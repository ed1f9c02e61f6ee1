"""Many seeded scenarios: random chain shapes, concurrent runs, random faults, every
run checked.

Each seed decides everything of its scenario (stage count, ring slots, how many runs
and when each arrives, each run's prompt, tokens and sampling seed, the chain's batch
rows, prefill chunk and KV budget, where EOS falls, the fault plan) through PRNGs
derived from it, so ``explore --seeds 1 --start S`` reproduces scenario ``S`` exactly.
Runs use the synthetic worker: no weights, any plan size, milliseconds each.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import attrs
from attrs import frozen

from runplan import (
    GgufSource,
    ModelFacts,
    NodePool,
    NodeSpec,
    PlanRejection,
    RunPlan,
    RuntimeConfig,
    SamplingConfig,
    Timeouts,
    WorkerCapabilities,
    plan_run,
)
from runtime_sim.chain_checker import (
    BATCHES_REPORTED,
    ISOLATION,
    READY_AFTER_SETUP,
    READY_BEFORE_INJECT,
    SAME_SEQUENCE,
    STEP_ORDER,
    TEARDOWN_TO_ALL,
    Solo,
    Violation,
    check,
)
from runtime_sim.chain_driver import PLAIN, ChainResult, ChainSimulation, RunSpec
from runtime_sim.chain_ring_rules import RELEASE_AT_LOAD
from runtime_sim.clock import derive_rng
from runtime_sim.faults import FaultPlan, random_fault_plan
from runtime_sim.links import ORCHESTRATOR
from runtime_sim.mutants import Mutation, parts_for
from runtime_sim.synthetic import SYNTHETIC_CAPABILITIES, SyntheticWorker
from runtime_sim.timing import StageCost, stored_stage_costs


@frozen
class Scenario:
    seed: int
    runs: tuple[RunSpec, ...]  # by arrival
    eos_after: int | None
    faults: FaultPlan
    block_bytes: tuple[int, ...]

    @property
    def plan(self) -> RunPlan:
        """The first run's plan: the chain's stages, nodes and timeouts."""
        return self.runs[0].plan


@frozen
class Outcome:
    seed: int
    runs: tuple[str, ...]  # each run's outcome: completed / faulted / cancelled / ...
    tokens: int
    violations: tuple[Violation, ...]
    faults: tuple[str, ...]
    events: int
    end_us: int

    @property
    def outcome(self) -> str:
        """The scenario's outcome: its runs' when they agree, else ``mixed``."""
        kinds = set(self.runs)
        return kinds.pop() if len(kinds) == 1 else "mixed"


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


#: The explorer's worker: the synthetic worker's rules, with a KV cache of 2 bytes per
#: element so that runs share each stage's budget (and wait for it).
EXPLORE_CAPABILITIES = attrs.evolve(SYNTHETIC_CAPABILITIES, kv_bytes_per_element=2)


def synthetic_plan(
    facts: ModelFacts,
    stages: int,
    *,
    max_tokens: int,
    run_id: str = "explore",
    slot_count: int = 2,
    timeouts: Timeouts | None = None,
    prompt_tokens: int = 0,
    seed: int = 0,
    max_concurrent_runs: int = 1,
    max_batch_rows: int = 512,
    prefill_chunk: int = 0,
    capabilities: WorkerCapabilities = SYNTHETIC_CAPABILITIES,
) -> RunPlan:
    config = RuntimeConfig(
        run_id=run_id,
        max_tokens=max_tokens,
        activation_dtype_width_bytes=2,
        ring_slot_count=slot_count,
        worker=capabilities,
        sampling=SamplingConfig(seed=seed),
        timeouts=timeouts or Timeouts(ready_ms=2_000, step_ms=500, edge_wait_ms=2_000, stop_ms=500),
        prompt_tokens=prompt_tokens,
        max_concurrent_runs=max_concurrent_runs,
        max_batch_rows=max_batch_rows,
        prefill_chunk=prefill_chunk,
    )
    nodes = tuple(NodeSpec(f"node-{i}", 2**50) for i in range(stages))
    result = plan_run(facts, config, NodePool(ORCHESTRATOR, nodes), stage_count=stages)
    if isinstance(result, PlanRejection):
        raise ValueError(str(result))
    return result


def scenario(seed: int, *, max_runs: int = 6) -> Scenario:
    """Scenario ``seed``: a chain of 1 to 6 stages and 1 to ``max_runs`` runs arriving
    staggered, each with its own prompt, tokens and sampling seed; the chain's batch
    rows, prefill chunk and KV budget (how many runs fit at once); the faults."""
    rng = derive_rng(seed, "scenario")
    stages = rng.randint(1, 6)
    layers = rng.randint(stages, 12)
    count = rng.choice([1, 1, *range(1, max_runs + 1)])
    shapes = [(rng.randint(1, 12), rng.randint(1, 8)) for _ in range(count)]  # (prompt, tokens)
    max_seq_len = max(p + t for p, t in shapes) + 4
    facts = synthetic_facts(layers, 64, 512, 10**6, max_seq_len)
    max_batch_rows = rng.choice([2, 4, 8, 512])
    prefill_chunk = min(rng.choice([0, 0, 1, 2, 3]), max_batch_rows)
    concurrent = rng.randint(1, count)
    slot_count = rng.randint(1, 3)
    runs = []
    arrival = 0
    for i, (prompt_len, max_tokens) in enumerate(shapes):
        plan = synthetic_plan(
            facts,
            stages,
            max_tokens=max_tokens,
            run_id=f"explore-{i}",
            slot_count=slot_count,
            prompt_tokens=prompt_len,
            seed=rng.randrange(2**16),
            max_concurrent_runs=concurrent,
            max_batch_rows=max_batch_rows,
            prefill_chunk=prefill_chunk,
            capabilities=EXPLORE_CAPABILITIES,
        )
        prompt = tuple(rng.randrange(1, 500) for _ in range(prompt_len))
        runs.append(RunSpec(plan, prompt, arrival))
        arrival += rng.choice([0, 0, rng.randrange(1, 20_000)])
    eos_after = rng.choice([None, None, rng.randrange(0, max(p for _, p in shapes))])
    faults = random_fault_plan(
        derive_rng(seed, "faults"), stages, max(t for _, t in shapes), runs=count
    )
    return Scenario(seed, tuple(runs), eos_after, faults, facts.block_bytes)


def _workers(s: Scenario) -> list[Any]:
    model = s.plan.model
    return [
        SyntheticWorker(model.vocab_size, model.eos_token_id, s.eos_after) for _ in s.plan.stages
    ]


def _costs(s: Scenario) -> list[StageCost]:
    return stored_stage_costs(s.plan, s.block_bytes, s.plan.model.vocab_size * 32)


def solo(s: Scenario) -> Solo:
    """Runs one run of ``s`` alone, on the same seed, through the same kind of worker."""

    def alone(spec: RunSpec) -> tuple[int, ...]:
        sim = ChainSimulation(
            [RunSpec(spec.plan, spec.prompt, 0)], _workers(s), _costs(s), seed=s.seed
        )
        return sim.run().runs[0].tokens

    return alone


def run_scenario(
    s: Scenario, mutation: Mutation | None = None
) -> tuple[ChainResult, ChainSimulation, list[Violation]]:
    parts = PLAIN if mutation is None else parts_for(mutation)
    sim = ChainSimulation(s.runs, _workers(s), _costs(s), seed=s.seed, faults=s.faults, parts=parts)
    result = sim.run()
    return result, sim, check(sim, result, solo(s) if len(s.runs) > 1 else None)


def explore(start: int, count: int, *, max_runs: int = 6) -> list[Outcome]:
    outcomes = []
    for seed in range(start, start + count):
        s = scenario(seed, max_runs=max_runs)
        result, _sim, violations = run_scenario(s)
        outcomes.append(
            Outcome(
                seed=seed,
                runs=tuple(r.outcome for r in result.runs),
                tokens=sum(len(r.tokens) for r in result.runs),
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
    runs = Counter(r for o in outcomes for r in o.runs)
    return {
        "start": start,
        "seeds": len(outcomes),
        "outcomes": dict(sorted(counts.items())),
        "runs": dict(sorted(runs.items())),
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
    Mutation.LATE_RELEASE: RELEASE_AT_LOAD,
    Mutation.READY_BEFORE_BIND: READY_AFTER_SETUP,
    Mutation.CROSS_RUN_LEAK: ISOLATION,
    Mutation.REORDERED_STEPS: STEP_ORDER,
    Mutation.BATCHES_REPORTED_TWICE: BATCHES_REPORTED,
}


def self_test(seeds: int = 40) -> list[MutantResult]:
    """Run every built-in mutant on fault-free scenarios until the checker reports the
    rule its bug breaks."""
    results = []
    for mutation in Mutation:
        caught: MutantResult | None = None
        for seed in range(seeds):
            s = attrs.evolve(scenario(seed), eos_after=None, faults=FaultPlan())
            _result, _sim, violations = run_scenario(s, mutation)
            rules = tuple(sorted({v.rule for v in violations}))
            if MUTANT_RULES[mutation] in rules:
                caught = MutantResult(mutation, True, seed, rules)
                break
        results.append(caught or MutantResult(mutation, False, None, ()))
    return results
