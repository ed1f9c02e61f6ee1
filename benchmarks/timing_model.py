"""The timing model against the NumPy worker: calibrate a node profile on this host
from one-stage decode steps of random-weight models of other shapes (a least-squares
fit of the fixed cost per step, per block, and the read bandwidth), predict SmolLM2's
time per output token at 1 and 3 stages, and compare with what the workers measured.

    python benchmarks/timing_model.py [--tokens 64] [--repeat 3] [--json]

Target (issue 5): predicted within 15% of measured.
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

from runplan import SamplingConfig
from runplan.models import resolve_model
from runtime_sim.api import generate, plan_for
from runtime_sim.timing import NodeProfile, TimingModel, f32_stage_costs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.fixtures.gguf_models import ModelShape, write_model


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="runs per case (median)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
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
