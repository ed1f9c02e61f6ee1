"""The timing model against the NumPy worker: calibrate a node profile on this host
from one-stage decode steps of random-weight models of other shapes (a least-squares
fit of the fixed cost per step, per block, and the read bandwidth), predict SmolLM2's
time per output token at 1 and 3 stages, and compare with what the workers measured.

    python benchmarks/timing_model.py [--tokens 64] [--repeat 3] [--json]

Target (issue 5): predicted within 15% of measured.

With ``--concurrency``, the timing model alone (no calibration, nothing measured): a
chain of 4 hosts on 1 GbE, SmolLM2-shaped and 8B-shaped stages, and the aggregate
tokens/s the simulator's clock gives for 1 to 16 runs in flight (each run its own
prompt, the stages batching their rows), for this host's node profile and for an
assumed GPU-class one:

    python benchmarks/timing_model.py --concurrency [--tokens 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from runplan import SamplingConfig, Timeouts
from runplan.models import resolve_model
from runtime_sim.api import generate, plan_for
from runtime_sim.chain_driver import ChainSimulation, RunSpec, SimSettings
from runtime_sim.scenarios import synthetic_facts
from runtime_sim.synthetic import SyntheticWorker
from runtime_sim.timing import (
    LinkProfile,
    NodeProfile,
    TimingModel,
    f32_stage_costs,
    stored_stage_costs,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.fixtures.gguf_models import ModelShape, write_model
from tests.support.synthetic_plans import synthetic_plan


def _best(fn: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _decode_us(path: Path, repeat: int) -> float:
    """Median time per decode step of a one-stage run of ``path``."""
    runs = []
    for _ in range(repeat):
        result = generate(path, [1, 2, 3], stages=1, max_tokens=48)
        assert result.wall_decode_tokens_per_s is not None
        runs.append(1e6 / result.wall_decode_tokens_per_s)
    return statistics.median(runs)


def calibrate(repeat: int) -> tuple[NodeProfile, list[dict[str, float]]]:
    """Fit ``step = overhead + blocks * per_block + bytes / bandwidth`` to one-stage
    decode steps of random-weight models of other shapes than SmolLM2 (written by the
    test-model generator), and measure flops with a 256-row matrix product."""
    shapes = [
        ModelShape(n_layers=2, hidden=128, heads=4, heads_kv=2, ffn=256),
        ModelShape(n_layers=8, hidden=128, heads=4, heads_kv=2, ffn=256),
        ModelShape(n_layers=2, hidden=1024, heads=8, heads_kv=4, ffn=2816),
        ModelShape(n_layers=6, hidden=1024, heads=8, heads_kv=4, ffn=2816),
        ModelShape(n_layers=4, hidden=768, heads=12, heads_kv=4, ffn=2048),
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, shape in enumerate(shapes):
            path = write_model(Path(tmp) / f"m{i}.gguf", attrs.evolve(shape, context_length=512))
            plan = plan_for(
                str(path),
                stages=1,
                prompt_len=3,
                max_tokens=48,
                sampling=SamplingConfig(),
                return_logits=False,
            )
            (cost,) = f32_stage_costs(plan)
            rows.append(
                {"blocks": shape.n_layers, "bytes": cost.read_bytes, "us": _decode_us(path, repeat)}
            )
    a = np.array([[1.0, r["blocks"], r["bytes"]] for r in rows])
    y = np.array([r["us"] for r in rows])
    (overhead, per_block, us_per_byte), *_ = np.linalg.lstsq(a, y, rcond=None)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 1024), dtype=np.float32)
    w = rng.standard_normal((1024, 4096), dtype=np.float32)
    flops = 2 * 256 * 1024 * 4096 / _best(lambda: x @ w, 10)
    node = NodeProfile(
        read_bytes_per_s=1e6 / max(us_per_byte, 1e-12),
        flops_per_s=flops,
        step_overhead_us=max(overhead, 0.0),
        layer_overhead_us=max(per_block, 0.0),
    )
    return node, rows


#: 1 GbE between hosts: 125 MB/s, and an assumed 100 us per hop (switch, TCP, copies).
GBE = LinkProfile(latency_us=100.0, bytes_per_s=1.25e8)
#: An assumed GPU-class node (not measured): HBM-rate weight reads, tensor-core flops.
GPU_CLASS = NodeProfile(
    read_bytes_per_s=3e12, flops_per_s=2e14, step_overhead_us=30.0, layer_overhead_us=10.0
)
#: (name, layers, hidden, vocab, bytes per block, head bytes): SmolLM2-135M as stored
#: in Q4_1 (about 3.5 M weights a block at 5 bits), Llama-3-8B in Q4_K (about 218 M
#: weights a block at 4.5 bits, the Q6_K head).
SHAPES = (
    ("smollm2-135m", 30, 576, 49_152, 2_200_000, 17_700_000),
    ("8b", 32, 4096, 128_256, 122_600_000, 430_900_000),
)
IN_FLIGHT = (1, 2, 4, 8, 16)
PROMPT = 32


def concurrency(tokens: int) -> list[dict[str, Any]]:
    """Aggregate tokens/s (every run's tokens over the virtual time from the first run
    ready to the last token) for runs in flight, per shape and node profile."""
    rows = []
    for node_name, node in (
        ("this host (fitted)", NodeProfile()),
        ("GPU-class (assumed)", GPU_CLASS),
    ):
        settings = SimSettings(timing=TimingModel(node=node, link=GBE))
        for name, layers, hidden, vocab, block, head in SHAPES:
            facts = synthetic_facts(layers, hidden, vocab, block, PROMPT + tokens + 8)
            for runs in IN_FLIGHT:
                specs = []
                for i in range(runs):
                    plan = synthetic_plan(
                        facts,
                        4,
                        max_tokens=tokens,
                        run_id=f"run-{i}",
                        slot_count=runs + 1,
                        prompt_tokens=PROMPT,
                        seed=i,
                        max_concurrent_runs=runs,
                        timeouts=Timeouts(),
                    )
                    specs.append(RunSpec(plan, tuple(range(1, PROMPT + 1))))
                costs = stored_stage_costs(specs[0].plan, facts.block_bytes, head)
                workers: list[Any] = [SyntheticWorker(vocab) for _ in range(4)]
                sim = ChainSimulation(specs, workers, costs, settings=settings, trace=False)
                result = sim.run()
                done = [r for r in result.runs if r.outcome == "completed"]
                assert len(done) == runs, [(r.outcome, r.finished) for r in result.runs]
                first = min(r.ready_us for r in done if r.ready_us is not None)
                last = max(r.token_times_us[-1] for r in done)
                count = sum(len(r.token_times_us) for r in done)
                rows.append(
                    {
                        "node": node_name,
                        "shape": name,
                        "runs": runs,
                        "tokens_per_s": round(count * 1e6 / (last - first), 1),
                        "batch_rows_max": max(max(b) for b in result.batches),
                    }
                )
    return rows


def print_concurrency(rows: list[dict[str, Any]]) -> None:
    print("4 hosts on 1 GbE, aggregate tokens/s by runs in flight (timing model):")
    keys = sorted({(r["node"], r["shape"]) for r in rows}, key=lambda k: (k[0], k[1]))
    print(f"{'node':<22}{'shape':<14}" + "".join(f"{n:>10}" for n in IN_FLIGHT))
    for node, shape in keys:
        cells = {
            r["runs"]: r["tokens_per_s"] for r in rows if (r["node"], r["shape"]) == (node, shape)
        }
        print(f"{node:<22}{shape:<14}" + "".join(f"{cells[n]:>10}" for n in IN_FLIGHT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="runs per case (median)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--concurrency",
        action="store_true",
        help="the timing model's aggregate tokens/s for 1 to 16 runs in flight",
    )
    args = parser.parse_args()
    if args.concurrency:
        table = concurrency(args.tokens)
        if args.json:
            print(json.dumps({"concurrency": table}, sort_keys=True))
        else:
            print_concurrency(table)
        return
    node, fit = calibrate(args.repeat)
    model = TimingModel(node=node)
    path = resolve_model("smollm2-135m")
    prompt = list(range(1000, 1020))
    rows = []
    for stages in (1, 3):
        measured = []
        for _ in range(args.repeat):
            result = generate(path, prompt, stages=stages, max_tokens=args.tokens, timing=model)
            assert result.wall_decode_tokens_per_s is not None
            measured.append(1e6 / result.wall_decode_tokens_per_s)
        measured_us = statistics.median(measured)
        costs = f32_stage_costs(result.plan)
        predicted_us = sum(model.step_us(c, 1) for c in costs)  # the workers' share
        rows.append(
            {
                "stages": stages,
                "predicted_us_per_token": round(predicted_us, 1),
                "measured_us_per_token": round(measured_us, 1),
                "error_percent": round(100 * (predicted_us - measured_us) / measured_us, 1),
            }
        )
    figures: dict[str, Any] = {
        "node": {
            "read_GB_per_s": round(node.read_bytes_per_s / 1e9, 2),
            "GFLOP_per_s": round(node.flops_per_s / 1e9, 1),
            "step_overhead_us": round(node.step_overhead_us, 1),
            "layer_overhead_us": round(node.layer_overhead_us, 1),
        },
        "smollm2": rows,
        "calibration_models": fit,
    }
    if args.json:
        print(json.dumps(figures, sort_keys=True))
        return
    n = figures["node"]
    print(
        f"calibrated: {n['read_GB_per_s']} GB/s read, {n['GFLOP_per_s']} GFLOP/s, "
        f"{n['step_overhead_us']} us per step, {n['layer_overhead_us']} us per block"
    )
    for r in rows:
        print(
            f"SmolLM2 {r['stages']} stage(s): predicted {r['predicted_us_per_token']} us/token, "
            f"measured {r['measured_us_per_token']} us/token, error {r['error_percent']}%"
        )


if __name__ == "__main__":
    main()
