"""A synthetic worker's plan in one call, for the simulator's tests and benchmarks: the
settings of ``runtime_sim.scenarios.synthetic_config`` planned on the explorer's nodes
(``synthetic_plan_of``)."""

from __future__ import annotations

from runplan import ModelFacts, RunPlan, Timeouts, WorkerCapabilities
from runtime_sim.scenarios import synthetic_config, synthetic_plan_of
from runtime_sim.synthetic import SYNTHETIC_CAPABILITIES


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
    """The plan of ``facts`` on ``stages`` of the explorer's nodes, with these settings
    (``ValueError`` if the planner refuses it)."""
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
