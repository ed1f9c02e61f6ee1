"""Simulator speed: simulated events per second, and seeds per second for a 4-stage,
32-token synthetic run with a random fault plan and the invariant check (a chain of one
run: ``python -m runtime_sim explore`` times chains of several).

    python benchmarks/sim_speed.py [--seeds 1000] [--json]

Targets (issue 5): >= 100,000 events/s; 1,000 seeds in under 60 s on the 2-core host.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from runtime_core.workers.interface import Worker
from runtime_sim.chain_driver import ChainSimulation, RunSpec
from runtime_sim.clock import derive_rng
from runtime_sim.explore import run_scenario
from runtime_sim.faults import random_fault_plan
from runtime_sim.scenarios import Scenario, synthetic_facts
from runtime_sim.synthetic import SyntheticWorker
from runtime_sim.timing import stored_stage_costs

# The synthetic plan of one call lives with the tests (tests/support).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.synthetic_plans import synthetic_plan


def events_per_second(tokens: int, trace: bool) -> tuple[int, float]:
    facts = synthetic_facts(32, 256, 32_000, 10**6, tokens + 16)
    plan = synthetic_plan(facts, 4, max_tokens=tokens)
    costs = stored_stage_costs(plan, facts.block_bytes, 10**6)
    workers: list[Worker] = [
        SyntheticWorker(facts.vocab_size, facts.eos_token_id) for _ in range(4)
    ]
    sim = ChainSimulation([RunSpec(plan, tuple(range(1, 9)))], workers, costs, trace=trace)
    began = time.perf_counter()
    sim.run()
    spent = time.perf_counter() - began
    return sim.clock.events_run, spent


def seeds(count: int) -> tuple[float, dict[str, int], int]:
    facts = synthetic_facts(32, 256, 32_000, 10**6, 48)
    plan = synthetic_plan(facts, 4, max_tokens=32)
    outcomes: dict[str, int] = {}
    violations = 0
    began = time.perf_counter()
    for seed in range(count):
        faults = random_fault_plan(derive_rng(seed, "faults"), 4, 32)
        s = Scenario(seed, (RunSpec(plan, tuple(range(1, 9))),), None, faults, facts.block_bytes)
        result, _sim, found = run_scenario(s)
        name = result.runs[0].outcome
        outcomes[name] = outcomes.get(name, 0) + 1
        violations += len(found)
    return time.perf_counter() - began, outcomes, violations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=1000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    ev_traced, t_traced = events_per_second(2000, trace=True)
    ev_bare, t_bare = events_per_second(2000, trace=False)
    spent, outcomes, violations = seeds(args.seeds)
    figures = {
        "events_per_s_traced": round(ev_traced / t_traced),
        "events_per_s_untraced": round(ev_bare / t_bare),
        "events_in_run": ev_traced,
        "seeds": args.seeds,
        "seeds_wall_s": round(spent, 2),
        "seeds_per_s": round(args.seeds / spent, 1),
        "outcomes": outcomes,
        "violations": violations,
    }
    if args.json:
        print(json.dumps(figures, sort_keys=True))
        return
    print(f"events/s (4 stages, 2000 tokens, traced):   {figures['events_per_s_traced']:>9,}")
    print(f"events/s (same run, trace off):             {figures['events_per_s_untraced']:>9,}")
    print(
        f"{args.seeds} seeds of a 4-stage 32-token run with faults and the checker: "
        f"{spent:.1f} s ({figures['seeds_per_s']} seeds/s), outcomes {outcomes}, "
        f"violations {violations}"
    )


if __name__ == "__main__":
    main()
