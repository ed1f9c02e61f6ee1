"""Decode steps of the CPU worker on several instruction sets in one process, in turn:
which set's kernels a processor should take, measured through the host's phases.

    python benchmarks/cpu_isa_steps.py MODEL [--isas avx512,avx512-zen4] [--threads 1]
        [--batch 1,2] [--tokens 10] [--rounds 12] [--json OUT.json]

One backend per set in ``--isas`` (default: the two best sets this processor runs), each
holding every block of the GGUF file ``MODEL`` and its own KV caches; per thread count
and batch size (runs decoding side by side, one row each per step), ``--rounds`` rounds
in which every set decodes ``--tokens`` steps, the sets' order rotating round by round.
A shared host's read bandwidth moves between phases by a quarter or more within
minutes, more than a kernel choice changes: sets measured in separate processes minutes
apart (``cpu_decode.py``'s runners) can differ by the phase alone, while here each round
puts the sets seconds apart. Printed: ms per step per set, the median and best round,
and each set's median over the rounds of its time over the first set's in the same round
(below 1: faster than the first); and whether every set gave the same greedy token at
every step (the sets compute the same bits: a comparison of kernels doing the same
work). Nothing is asserted; run it again and compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from runtime_core.workers.cpu import _kernels  # noqa: E402


def measure(model: Path, isas: list[str], threads: int, batch: int, tokens: int,
            rounds: int) -> dict[str, Any]:  # fmt: skip
    from runplan import model_facts_from_gguf
    from runtime_core.gguf_slice import open_stage_slice
    from runtime_core.workers.cpu.backend import CpuBackend
    from runtime_core.workers.cpu.worker import CpuWorker
    from runtime_core.workers.stage_worker import BackendSpec, BackendStep

    max_seq = 8 + rounds * tokens + 8
    n = model_facts_from_gguf(model, max_seq_len=max_seq).num_layers
    spec = BackendSpec(True, True, np.dtype(np.float32), "f32", "q8")
    backends = [CpuBackend(spec, threads, isa) for isa in isas]
    with open_stage_slice(model, 0, n, is_first=True, is_last=True,
                          capabilities=CpuWorker.capabilities) as stage:  # fmt: skip
        for backend in backends:
            backend.load(stage, max_seq, None)
    caches = [[backend.new_cache(max_seq) for _ in range(batch)] for backend in backends]
    prompt = np.arange(1, 9, dtype=np.int32)
    for backend, cs in zip(backends, caches, strict=True):
        for k in range(batch):
            backend.run_batch([BackendStep(cs[k], prompt + k, len(prompt), 0, True)])
    ms: list[list[float]] = [[] for _ in isas]
    tokens_of: list[list[Any]] = [[] for _ in isas]
    for r in range(rounds):
        pos = len(prompt) + r * tokens
        for i in [(r + s) % len(isas) for s in range(len(isas))]:
            backend, cs = backends[i], caches[i]
            t0 = time.perf_counter()
            for t in range(tokens):
                backend.run_batch(
                    [BackendStep(cs[k], np.array([5 + k], np.int32), 1, pos + t, True)
                     for k in range(batch)]
                )  # fmt: skip
                tokens_of[i].extend(backend.token_of(k) for k in range(batch))
            ms[i].append((time.perf_counter() - t0) * 1e3 / tokens)
    for backend in backends:
        backend.release()
    same = all(t == tokens_of[0] for t in tokens_of)
    out: dict[str, Any] = {"threads": threads, "batch": batch, "same_tokens": same, "sets": {}}
    for i, isa in enumerate(isas):
        ratios = [a / b for a, b in zip(ms[i], ms[0], strict=True)]
        out["sets"][isa] = {
            "median_ms": statistics.median(ms[i]),
            "best_ms": min(ms[i]),
            "over_first": statistics.median(ratios),
            "rounds_ms": ms[i],
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", type=Path, help="a GGUF file")
    host = _kernels.isas()
    parser.add_argument(
        "--isas", default=",".join(host[-2:]),
        help=f"sets, the first the reference (default: %(default)s; this processor runs "
        f"{', '.join(host)})",
    )  # fmt: skip
    parser.add_argument("--threads", default="1", help="the stage's threads, each in turn")
    parser.add_argument("--batch", default="1,2", help="runs decoding side by side, each in turn")
    parser.add_argument("--tokens", type=int, default=10, help="decode steps per set per round")
    parser.add_argument("--rounds", type=int, default=12, help="rounds")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    isas = args.isas.split(",")
    for isa in isas:
        if isa not in host:
            parser.error(f"--isas: {isa!r} is not a set this processor runs ({', '.join(host)})")
    try:
        threads = [int(v) for v in args.threads.split(",")]
        batches = [int(v) for v in args.batch.split(",")]
    except ValueError:
        parser.error("--threads and --batch: comma-separated counts")
    if min(threads + batches) < 1 or args.tokens < 1 or args.rounds < 1:
        parser.error("need counts, --tokens and --rounds of at least 1")
    if not args.model.is_file():
        parser.error(f"{args.model}: no such file")
    print(f"{args.model.name}: ms per decode step, {args.rounds} rounds of {args.tokens} steps "
          f"per set, the sets in turn")  # fmt: skip
    print(f"{'threads':>7s} {'batch':>5s} {'set':>12s} {'median':>7s} {'best':>7s} "
          f"{'over ' + isas[0]:>18s}")  # fmt: skip
    results: list[dict[str, Any]] = []
    for t in threads:
        for b in batches:
            res = measure(args.model, isas, t, b, args.tokens, args.rounds)
            results.append(res)
            for isa, fig in res["sets"].items():
                print(f"{t:7d} {b:5d} {isa:>12s} {fig['median_ms']:7.2f} {fig['best_ms']:7.2f} "
                      f"{fig['over_first']:18.3f}", flush=True)  # fmt: skip
            if not res["same_tokens"]:
                print(f"  the sets' greedy tokens differ at {t} threads, batch {b}", flush=True)
    report = {"model": str(args.model), "isas": isas, "results": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
