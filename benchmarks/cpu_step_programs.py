"""What the CPU worker's step programs save: decode steps made by a recorded program
against the same steps making every kernel call from Python, in one process, in turn.

    python benchmarks/cpu_step_programs.py [--model PATH] [--threads 1,2] [--batch 1,4]
        [--tokens 40] [--rounds 8] [--json OUT.json]

The CPU worker's backend holding every block of ``--model`` (default: the bundled
SmolLM2-135M-Instruct Q4_1; float32 KV cache), per thread count and batch size (runs
decoding side by side, one row each per step): rounds of ``--tokens`` steps with the
stage's step programs (``CpuOps.program``) and the same without them (``CpuOps.program``
giving none: every call made from Python, as steps of more than 64 rows make them), the
order alternating round by round. Printed: ms per step, best and median over rounds,
and calls / programs (above 1: the programs are faster). Both ways compute the same
bits (``tests/runtime_core/workers/cpu/test_cpu_programs.py``). Nothing is asserted;
the machine may be shared (compare the ratios, run it again).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any


def measure(model: Path, threads: int, batch: int, tokens: int, rounds: int) -> dict[str, Any]:
    import numpy as np

    from runplan import model_facts_from_gguf
    from runtime_core.gguf_slice import open_stage_slice
    from runtime_core.workers.cpu.backend import CpuBackend
    from runtime_core.workers.cpu.ops import CpuOps
    from runtime_core.workers.cpu.worker import CpuWorker
    from runtime_core.workers.stage_worker import BackendSpec, BackendStep

    max_seq = 8 + 2 * rounds * tokens + 8
    n = model_facts_from_gguf(model, max_seq_len=max_seq).num_layers
    backend = CpuBackend(BackendSpec(True, True, np.dtype(np.float32), "f32", "q8"), threads)
    with open_stage_slice(model, 0, n, is_first=True, is_last=True,
                          capabilities=CpuWorker.capabilities) as stage:  # fmt: skip
        backend.load(stage, max_seq, None)
    program = CpuOps.program
    caches = [backend.new_cache(max_seq) for _ in range(batch)]
    prompt = np.arange(1, 9, dtype=np.int32)
    for k in range(batch):
        backend.run_batch([BackendStep(caches[k], prompt + k, len(prompt), 0, True)])
    pos = len(prompt)
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for programs in (True, False) if r % 2 == 0 else (False, True):
            CpuOps.program = program if programs else (lambda *_: None)  # type: ignore[method-assign]
            t0 = time.perf_counter()
            for _ in range(tokens):
                backend.run_batch(
                    [BackendStep(caches[k], np.array([5 + k], np.int32), 1, pos, True)
                     for k in range(batch)]
                )  # fmt: skip
                for k in range(batch):
                    backend.token_of(k)
                pos += 1
            times[programs].append((time.perf_counter() - t0) * 1e3 / tokens)
    CpuOps.program = program  # type: ignore[method-assign]
    backend.release()
    out: dict[str, Any] = {"threads": threads, "batch": batch}
    for programs, name in ((True, "programs"), (False, "calls")):
        ms = times[programs]
        out[name] = {"best_ms": min(ms), "median_ms": statistics.median(ms), "rounds_ms": ms}
    out["ratio_best"] = out["calls"]["best_ms"] / out["programs"]["best_ms"]
    out["ratio_median"] = out["calls"]["median_ms"] / out["programs"]["median_ms"]
    return out


def counts(text: str, what: str, parser: argparse.ArgumentParser) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        parser.error(f"--{what} {text!r}: a comma-separated list of counts of at least 1")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="a GGUF file (default: the bundled SmolLM2 Q4_1)"
    )
    parser.add_argument("--threads", default="1,2", help="the stage's threads, each in turn")
    parser.add_argument("--batch", default="1,4", help="runs decoding side by side, each in turn")
    parser.add_argument("--tokens", type=int, default=40, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=8, help="rounds per way (alternating)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    threads, batches = counts(args.threads, "threads", parser), counts(args.batch, "batch", parser)
    if args.tokens < 1 or args.rounds < 1:
        parser.error("need --tokens and --rounds of at least 1")
    if args.model is None:
        from runplan.models import resolve_model

        args.model = Path(resolve_model("smollm2-135m"))
    if not args.model.is_file():
        parser.error(f"--model {args.model}: no such file")
    print(f"{args.model.name}: ms per decode step, {args.rounds} rounds of {args.tokens} steps "
          f"per way")  # fmt: skip
    print(f"{'threads':>7s} {'batch':>5s} {'programs best':>13s} {'median':>7s} "
          f"{'calls best':>10s} {'median':>7s} {'calls/programs':>15s}")  # fmt: skip
    report: dict[str, Any] = {"model": str(args.model), "figures": []}
    for t in threads:
        for b in batches:
            f = measure(args.model, t, b, args.tokens, args.rounds)
            report["figures"].append(f)
            p, c = f["programs"], f["calls"]
            print(f"{t:7d} {b:5d} {p['best_ms']:13.2f} {p['median_ms']:7.2f} {c['best_ms']:10.2f} "
                  f"{c['median_ms']:7.2f} {f['ratio_best']:7.2f} best, "
                  f"{f['ratio_median']:.2f} median")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
