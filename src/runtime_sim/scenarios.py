"""Seeded scenarios of a chain: random chain shapes, concurrent runs, random faults, and
the runner's recovery after a loss.

Each seed decides everything of its scenario (stage count, ring slots, how many runs
and when each arrives, each run's prompt, tokens and sampling seed, the chain's batch
rows, prefill chunk and KV budget, where EOS falls, the fault plan, the recovery: the
cluster's spares and memory, whether a lost stage takes its host, the losses during a
recovery) through PRNGs derived from it, so ``explore --seeds 1 --start S`` reproduces
scenario ``S`` exactly. Runs use the synthetic worker: no weights, any plan size,
milliseconds each.
"""

from __future__ import annotations

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
from runtime_sim.chain_driver import RunSpec
from runtime_sim.chain_recovery import RecoveryAction
from runtime_sim.clock import derive_rng
from runtime_sim.faults import Fault, FaultKind, FaultPlan, random_fault_plan
from runtime_sim.links import ORCHESTRATOR
from runtime_sim.synthetic import SYNTHETIC_CAPABILITIES


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


def loss_scenario(seed: int) -> Scenario:
    """Scenario ``seed`` with a runner that recovers, no EOS and one loss: stage
    ``seed mod stages`` dies as it steps sequence 1 (the recovery mutants' ground)."""
    s = scenario(seed, recover=True)
    kill = Fault(FaultKind.KILL_MID_DECODE, stage=seed % s.plan.stage_count, sequence=1)
    return attrs.evolve(s, eos_after=None, faults=FaultPlan((kill,)))
