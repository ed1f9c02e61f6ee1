"""Planner speed: ``plan_run`` + ``provision_all`` for 128 layers / 128 stages drawn from
a 10,000-node pool, and ``model_facts_from_gguf`` on SmolLM2-135M.

    python benchmarks/plan_speed.py [--repeat N] [--json]

Targets (issue 2): under 10 ms and under 50 ms on the 2-core CI-class machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from runplan import (
    GgufSource,
    ModelFacts,
    NodePool,
    NodeSpec,
    Placement,
    RunPlan,
    RuntimeConfig,
    model_facts_from_gguf,
    plan_run,
    provision_all,
)
from runplan.models import resolve_model


def _median_ms(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    fn()  # warm up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def _facts_128() -> ModelFacts:
    """A 128-block model with Llama-3-70B-like byte sizes."""
    return ModelFacts(
        model_id="synthetic-128",
        gguf_source=GgufSource.single("/models/synthetic-128.gguf"),
        architecture="llama",
        num_layers=128,
        hidden_dim=8192,
        head_count=64,
        head_count_kv=8,
        head_dim_k=128,
        head_dim_v=128,
        vocab_size=128_256,
        eos_token_id=128_009,
        context_length=8192,
        max_seq_len=4096,
        quant_types=("F32", "Q4_K", "Q6_K"),
        block_bytes=(490_000_000,) * 128,
        embedding_bytes=1_050_000_000,
        output_bytes=1_100_000_000,
        shared_bytes=0,
        tied_embeddings=False,
        block_elements=(870_000_000,) * 128,
        embedding_elements=128_256 * 8192,
        output_elements=128_256 * 8192 + 8192,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    facts = _facts_128()
    pool = NodePool(
        orchestrator_node_id="orch",
        nodes=tuple(
            NodeSpec(f"node-{i:05d}", (80 if i % 3 else 24) * 2**30, f"gpu-{i // 2}")
            for i in range(10_000)
        ),
    )
    # 128 stages on nodes spread over the pool, one per device.
    chosen = [f"node-{i:05d}" for i in range(0, 10_000, 78)][:128]
    config = RuntimeConfig(run_id="bench", max_tokens=64, activation_dtype_width_bytes=2)
    results = {}
    for name, placement in (
        ("even", Placement.even(chosen)),
        ("by_memory", Placement.by_memory(chosen)),
    ):

        def plan_and_provision(placement: Placement = placement) -> None:
            plan = plan_run(facts, config, pool, stage_count=128, placement=placement)
            assert isinstance(plan, RunPlan), plan
            provision_all(plan)

        results[f"plan_run+provision_all ({name}, 128 stages, 10k pool)"] = _median_ms(
            plan_and_provision, args.repeat
        )

    path = resolve_model("smollm2-135m")
    results["model_facts_from_gguf (SmolLM2-135M)"] = _median_ms(
        lambda: model_facts_from_gguf(path), max(10, args.repeat // 4)
    )

    if args.json:
        print(json.dumps({k: {"median_ms": m, "min_ms": lo} for k, (m, lo) in results.items()}))
        return
    for name, (median, lowest) in results.items():
        print(f"{name:<60} median {median:7.2f} ms   min {lowest:7.2f} ms")


if __name__ == "__main__":
    main()
