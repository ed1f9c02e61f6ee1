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
from runplan.memory import plan_stage_memory
from runplan.replacement import Unplaceable
from runtime_core.workers.interface import Worker
from runtime_sim.chain_checker import (
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
from runtime_sim.chain_recovery import (
    CostsFor,
    Epoch,
    RecoveringSimulation,
    RecoveryAction,
    RecoveryRun,
    WorkersFor,
)
from runtime_sim.chain_ring_rules import RELEASE_AT_LOAD
from runtime_sim.clock import derive_rng
from runtime_sim.faults import Fault, FaultKind, FaultPlan, random_fault_plan
from runtime_sim.links import ORCHESTRATOR
from runtime_sim.mutants import RECOVERY_MUTATIONS, Mutation, parts_for
from runtime_sim.recovery_checker import (
    LOST_HOST_UNUSED,
    STALE_NEVER_ACCEPTED,
    STREAM_ONE_OUTCOME,
    STREAM_UNBROKEN,
    check_recovery,
)
from runtime_sim.synthetic import SYNTHETIC_CAPABILITIES, SyntheticWorker
from runtime_sim.timing import StageCost, stored_stage_costs


@frozen
class Scenario:
    seed: int
    runs: tuple[RunSpec, ...]  # by arrival
    eos_after: int | None
    faults: FaultPlan
    block_bytes: tuple[int, ...]
    # The runner's recovery after a loss (issue 25); None: a loss ends the runs.
    recovery: RecoveryAction | None = None

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
    end_us: int  # summed over its chains (each on its own clock)
    recovered: int = 0  # streams replayed at least once
    replacements: tuple[str, ...] = ()  # each re-placement: spare, afresh, unplaceable:CODE
    losses_during: int = 0  # re-placed chains a loss struck (a loss during a recovery)

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


def synthetic_config(
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
) -> RuntimeConfig:
    """The settings of a run for the synthetic worker (a replay's base)."""
    return RuntimeConfig(
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


def synthetic_pool(stages: int, spares: int = 0) -> NodePool:
    """The explorer's cluster: a node per stage (``node-i``), then ``spares`` spare
    nodes (``spare-j``), each with memory to spare."""
    nodes = [NodeSpec(f"node-{i}", 2**50) for i in range(stages)]
    nodes += [NodeSpec(f"spare-{j}", 2**50) for j in range(spares)]
    return NodePool(ORCHESTRATOR, tuple(nodes))


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
    config = synthetic_config(
        max_tokens=max_tokens,
        run_id=run_id,
        slot_count=slot_count,
        timeouts=timeouts,
        prompt_tokens=prompt_tokens,
        seed=seed,
        max_concurrent_runs=max_concurrent_runs,
        max_batch_rows=max_batch_rows,
        prefill_chunk=prefill_chunk,
        capabilities=capabilities,
    )
    return synthetic_plan_of(facts, config, stages)


def synthetic_plan_of(facts: ModelFacts, config: RuntimeConfig, stages: int) -> RunPlan:
    """The plan of ``config`` on the explorer's first ``stages`` nodes."""
    result = plan_run(facts, config, synthetic_pool(stages), stage_count=stages)
    if isinstance(result, PlanRejection):
        raise ValueError(str(result))
    return result


def scenario(seed: int, *, max_runs: int = 6, recover: bool = False) -> Scenario:
    """Scenario ``seed``: a chain of 1 to 6 stages and 1 to ``max_runs`` runs arriving
    staggered, each with its own prompt, tokens and sampling seed; the chain's batch
    rows, prefill chunk and KV budget (how many runs fit at once); the faults; whether
    and how the runner recovers after a loss (``recover``: always)."""
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
    configs = []
    arrival = 0
    for i, (prompt_len, max_tokens) in enumerate(shapes):
        config = synthetic_config(
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
        configs.append(config)
        plan = synthetic_plan_of(facts, config, stages)
        prompt = tuple(rng.randrange(1, 500) for _ in range(prompt_len))
        runs.append(RunSpec(plan, prompt, arrival))
        arrival += rng.choice([0, 0, rng.randrange(1, 20_000)])
    eos_after = rng.choice([None, None, rng.randrange(0, max(p for _, p in shapes))])
    faults = random_fault_plan(
        derive_rng(seed, "faults"), stages, max(t for _, t in shapes), runs=count
    )
    recovery = recovery_action(seed, facts, tuple(configs), runs[0].plan, always=recover)
    return Scenario(seed, tuple(runs), eos_after, faults, facts.block_bytes, recovery)


#: Of the explorer's scenarios, the share whose runner recovers after a loss.
RECOVERING_SHARE = 0.5
#: Of the recovering scenarios, the share whose nodes hold no more than the largest stage.
TIGHT_SHARE = 0.3
#: Faults that lose a stage's process (and, with ``host_lost``, its host): the losses
#: the explorer strikes a re-placed chain with.
LOSSES = (FaultKind.KILL_BEFORE_READY, FaultKind.KILL_MID_PREFILL, FaultKind.KILL_MID_DECODE)


def recovery_action(
    seed: int,
    facts: ModelFacts,
    configs: tuple[RuntimeConfig, ...],
    plan: RunPlan,
    *,
    always: bool = False,
) -> RecoveryAction | None:
    """Scenario ``seed``'s recovery of the chain ``plan`` (from its own PRNG, so the
    rest of the scenario is drawn as without one): about half the scenarios
    (``always``: every one) recover after a loss, on a cluster of the chain's nodes and
    0 to 2 spares, each node with memory to spare or, in about a third, only what the
    chain's largest stage needs (so the remaining nodes cannot take a lost stage's
    layers: the planner's rejection ends the runs); a lost stage takes its host with it
    or not; 0 to 2 losses strike the chains of the recoveries (a loss during a
    recovery)."""
    rng = derive_rng(seed, "recovery")
    if not always and rng.random() >= RECOVERING_SHARE:
        return None
    spares = rng.choice([0, 0, 1, 2])
    host_lost = rng.random() < 0.5
    most = max(c.max_tokens for c in configs)
    losses = tuple(
        Fault(
            rng.choice(LOSSES),
            stage=rng.randrange(6),
            sequence=rng.randrange(1, max(2, most)),
            fraction=rng.random(),
        )
        for _ in range(rng.choice([0, 0, 1, 2]))
    )
    pool = synthetic_pool(plan.stage_count, spares)
    if rng.random() < TIGHT_SHARE:
        largest = max(m.total for m in plan_stage_memory(facts, configs[0].worker, plan))
        pool = attrs.evolve(
            pool, nodes=tuple(attrs.evolve(n, memory_bytes=largest) for n in pool.nodes)
        )
    return RecoveryAction(pool, facts, configs, host_lost, losses)


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


#: The rule each built-in bug breaks; the self-test passes only if that rule fires.
MUTANT_RULES: dict[Mutation, str] = {
    Mutation.INJECT_BEFORE_READY: READY_BEFORE_INJECT,
    Mutation.SKIP_STOP_RUN: TEARDOWN_TO_ALL,
    Mutation.SEQUENCE_SHIFT: SAME_SEQUENCE,
    Mutation.LATE_RELEASE: RELEASE_AT_LOAD,
    Mutation.READY_BEFORE_BIND: READY_AFTER_SETUP,
    Mutation.CROSS_RUN_LEAK: ISOLATION,
    Mutation.REORDERED_STEPS: STEP_ORDER,
    Mutation.REPLAY_RESTARTS_SAMPLER: STREAM_UNBROKEN,
    Mutation.STALE_RUN_ACCEPTED: STALE_NEVER_ACCEPTED,
    Mutation.REUSES_LOST_HOST: LOST_HOST_UNUSED,
    Mutation.FORGETS_A_RUN: STREAM_ONE_OUTCOME,
}


def loss_scenario(seed: int) -> Scenario:
    """Scenario ``seed`` with a runner that recovers, no EOS and one loss: stage
    ``seed mod stages`` dies as it steps sequence 1 (the recovery mutants' ground)."""
    s = scenario(seed, recover=True)
    kill = Fault(FaultKind.KILL_MID_DECODE, stage=seed % s.plan.stage_count, sequence=1)
    return attrs.evolve(s, eos_after=None, faults=FaultPlan((kill,)))


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
