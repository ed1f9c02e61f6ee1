"""Several runs of the synthetic worker on one simulated chain whose stages (or links)
are slow against tight timeouts: what a timer bounding one wait sees under load."""

from __future__ import annotations

from runplan import Timeouts
from runtime_sim.chain_driver import ChainResult, ChainSimulation, RunSpec, SimSettings
from runtime_sim.faults import Fault, FaultPlan
from runtime_sim.scenarios import EXPLORE_CAPABILITIES, synthetic_facts
from runtime_sim.synthetic import SyntheticWorker
from runtime_sim.timing import TimingModel, stored_stage_costs
from tests.support.synthetic_plans import synthetic_plan


def slow_chain(
    runs: int,
    *,
    timeouts: Timeouts,
    timing: TimingModel,
    stages: int = 1,
    max_batch_rows: int = 512,
    prompt_tokens: int = 1,
    prefill_chunk: int = 0,
    slot_count: int = 2,
    faults: tuple[Fault, ...] = (),
) -> tuple[ChainResult, ChainSimulation]:
    """``runs`` runs of 4 tokens each, all arriving at once, run to their ends."""
    facts = synthetic_facts(6, 64, 512, 10**6, prompt_tokens + 8)
    specs = []
    for i in range(runs):
        plan = synthetic_plan(
            facts,
            stages,
            max_tokens=4,
            run_id=f"run-{i}",
            prompt_tokens=prompt_tokens,
            seed=100 + i,
            max_concurrent_runs=runs,
            max_batch_rows=max_batch_rows,
            prefill_chunk=prefill_chunk,
            slot_count=slot_count,
            timeouts=timeouts,
            capabilities=EXPLORE_CAPABILITIES,
        )
        specs.append(RunSpec(plan, tuple(range(10 + i, 10 + i + prompt_tokens))))
    model = specs[0].plan.model
    workers = [SyntheticWorker(model.vocab_size, model.eos_token_id) for _ in range(stages)]
    costs = stored_stage_costs(specs[0].plan, facts.block_bytes, model.vocab_size * 32)
    sim = ChainSimulation(
        tuple(specs),
        workers,
        costs,
        seed=7,
        settings=SimSettings(timing=timing),
        faults=FaultPlan(faults),
    )
    return sim.run(), sim
