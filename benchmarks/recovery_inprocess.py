"""Recovery after a lost stage, in one process (issue 25's library pieces): how long
the re-plan takes, and from a stage's loss to the next token of the interrupted stream
on the in-process chain (``tests/support/recovering_chain.py``, the CPU worker,
SmolLM2-135M in 3 stages, a spare node holding the file).

    python benchmarks/recovery_inprocess.py [--repeat N] [--tokens K] [--json]

It prints:

- ``replace_lost`` on SmolLM2's facts: a spare that fits; no spare (the planner over the
  two remaining nodes); a 1,000-node pool whose first 500 spares are too small (500
  memory checks before the fit);
- ``plan_replay`` of one interrupted run;
- loss to next token: from the loss (the orchestrator told the stage died) to the
  replay's first token delivered, and in it a fresh 3-stage chain's first token for
  the same prompt (prompt + delivered: weights bound, replay prefill) measured alone.

No detection (heartbeats, process exit) and no process start are in these figures:
the process runtime's benchmark adds them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from runplan import (
    NodePool,
    NodeSpec,
    Placement,
    RunPlan,
    RuntimeConfig,
    SamplingConfig,
    model_facts_from_gguf,
    plan_run,
)
from runplan.models import resolve_model
from runplan.replacement import Replacement, replace_lost
from runtime_core.replay import Interrupted, ReplayRefused, plan_replay
from runtime_core.workers.cpu.worker import CpuWorker
from runtime_core.workers.interface import Worker

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BIG = 2**40
PROMPT = tuple(range(100, 164))  # 64 prompt tokens
SEEDED = SamplingConfig(temperature=0.8, top_k=40, seed=3)


def _median_ms(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    fn()  # warm up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def _cpu(_i: int, _node: str) -> Worker:
    return CpuWorker()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=8, help="tokens before the loss (8)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from tests.support.recovering_chain import RecoveringChain

    facts = model_facts_from_gguf(resolve_model("smollm2-135m"), max_seq_len=512)
    base = RuntimeConfig(run_id="base", max_tokens=32, max_concurrent_runs=4)
    three = ["node-0", "node-1", "node-2"]
    pool = NodePool("orch", tuple(NodeSpec(n, BIG) for n in [*three, "spare-0"]))
    plan = plan_run(facts, base, pool, stage_count=3, placement=Placement.even(three))
    assert isinstance(plan, RunPlan), plan
    new_config = RuntimeConfig(run_id="placement-1", max_tokens=32, max_concurrent_runs=4)
    results: dict[str, tuple[float, float]] = {}

    def spare() -> Replacement:
        new = replace_lost(plan, facts, new_config, pool, lost_nodes=["node-1"])
        assert isinstance(new, Replacement) and new.on_spares, new
        return new

    def no_spare() -> None:
        live = NodePool("orch", pool.nodes[:3])
        new = replace_lost(plan, facts, new_config, live, lost_nodes=["node-1"])
        assert isinstance(new, Replacement) and not new.on_spares, new

    crowd = NodePool(
        "orch",
        (
            *pool.nodes[:3],
            *(NodeSpec(f"small-{i:03d}", 2**20) for i in range(500)),
            *(NodeSpec(f"big-{i:03d}", BIG) for i in range(497)),
        ),
    )

    def search() -> None:
        new = replace_lost(plan, facts, new_config, crowd, lost_nodes=["node-1"])
        assert isinstance(new, Replacement) and new.plan.stages[1].node_id == "big-000", new

    results["replace_lost: a spare fits"] = _median_ms(spare, args.repeat)
    results["replace_lost: no spare (planner over 2 nodes)"] = _median_ms(no_spare, args.repeat)
    results["replace_lost: 500 spares too small, then a fit"] = _median_ms(
        search, max(3, args.repeat // 10)
    )
    replacement = spare()
    interrupted = Interrupted.of_plan(plan, PROMPT, tuple(range(1, args.tokens + 1)))

    def replay() -> None:
        planned = plan_replay(interrupted, "run-0~r1", facts, base, pool, replacement.placement)
        assert not isinstance(planned, ReplayRefused), planned

    results["plan_replay"] = _median_ms(replay, args.repeat)

    loss, fresh = [], []
    for _ in range(max(1, args.repeat // 10)):
        chain = RecoveringChain(facts, base, pool, Placement.even(three), _cpu)
        stream = chain.start("run-0", PROMPT, sampling=SEEDED)
        while len(stream.tokens) < args.tokens:
            chain.pump(rounds=1)
        t0 = time.perf_counter()
        chain.lose(1, "node-1: killed")
        while len(stream.tokens) <= args.tokens:
            chain.pump(rounds=1)
        loss.append((time.perf_counter() - t0) * 1e3)
        chain.pump()
        assert stream.completed, stream.ended

        cold = RecoveringChain(facts, base, pool, Placement.even(three), _cpu)
        t0 = time.perf_counter()
        first = cold.start("cold", PROMPT + tuple(stream.tokens[: args.tokens]))
        while not first.tokens:
            cold.pump(rounds=1)
        fresh.append((time.perf_counter() - t0) * 1e3)
        cold.pump()
    results[f"loss to next token ({args.tokens} delivered)"] = (
        statistics.median(loss),
        min(loss),
    )
    results["of which: a fresh chain's first token (bind + prefill)"] = (
        statistics.median(fresh),
        min(fresh),
    )

    if args.json:
        print(json.dumps({k: {"median_ms": m, "min_ms": lo} for k, (m, lo) in results.items()}))
        return
    for name, (median, lowest) in results.items():
        print(f"{name:<60} median {median:8.2f} ms   min {lowest:8.2f} ms")


if __name__ == "__main__":
    main()
