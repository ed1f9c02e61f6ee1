"""Q4_0 rows as stored against the same rows repacked 8 at a time, side by side.

    python benchmarks/cpu_repack.py [--threads 1] [--repeat 5] [--rows 1] [--json OUT.json]

One product of the CPU worker's kernels (``_kernels.linear``, 8-bit activations) on
random Q4_0 blocks, for a matrix that stays in cache (1024 x 4096) and one that is read
from memory (14336 x 4096, the 8B shape's feed-forward), through a ``Matrix`` of the
stored rows and one of ``repack=True`` (``csrc/repack.h``), on the host's best
instruction set. Each figure is the best of ``--repeat`` timings, the two layouts
interleaved; the script also checks that both give the same bits.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from runtime_core.workers.cpu import _kernels

SHAPES = ((1024, 4096), (14336, 4096))


def q4_0_rows(rng: np.random.Generator, n_out: int, n_in: int) -> np.ndarray:
    """Random Q4_0 rows: per block a half factor and 16 bytes of nibbles."""
    blocks = n_out * (n_in // 32)
    d = (rng.standard_normal(blocks) * 0.002).astype(np.float16).view(np.uint8).reshape(-1, 2)
    qs = rng.integers(0, 256, (blocks, 16), dtype=np.uint8)
    return np.ascontiguousarray(np.concatenate([d, qs], axis=1).reshape(n_out, -1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rows", type=int, default=1, help="activation rows (1: decode)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    figures = []
    for n_out, n_in in SHAPES:
        raw = q4_0_rows(rng, n_out, n_in)
        x = rng.standard_normal((args.rows, n_in)).astype(np.float32)
        q = np.zeros((args.rows, n_in), np.int8)
        d = np.zeros((args.rows, n_in // 32), np.float32)
        s, g = d.copy(), np.zeros((args.rows, n_in // 16), np.int32)
        parts = [(raw, "Q4_0", n_out, n_in, 0)]
        layouts = {"stored": _kernels.Matrix(parts), "x8": _kernels.Matrix(parts, repack=True)}
        ys = {k: np.zeros((args.rows, n_out), np.float32) for k in layouts}
        calls = max(3, int(2e8 / raw.nbytes))
        best = dict.fromkeys(layouts, float("inf"))
        for _ in range(args.repeat):
            for name, m in layouts.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    _kernels.linear(m, args.rows, x, q, d, s, g, True, True, ys[name], None,
                                    False, args.threads)  # fmt: skip
                best[name] = min(best[name], (time.perf_counter() - t0) / calls)
        same = bool(np.array_equal(ys["stored"].view(np.uint32), ys["x8"].view(np.uint32)))
        row = {
            "shape": [n_out, n_in],
            "isa": _kernels.isa(),
            "threads": args.threads,
            "rows": args.rows,
            "stored_ms": best["stored"] * 1e3,
            "x8_ms": best["x8"] * 1e3,
            "stored_gb_s": raw.nbytes / best["stored"] / 1e9,
            "x8_gb_s": raw.nbytes / best["x8"] / 1e9,
            "speedup": best["stored"] / best["x8"],
            "same_bits": same,
        }
        figures.append(row)
        print(
            f"{n_out} x {n_in} Q4_0 ({_kernels.isa()}, {args.threads} thread(s), {args.rows} "
            f"row(s)): stored {row['stored_ms']:.3f} ms ({row['stored_gb_s']:.1f} GB/s), "
            f"x8 {row['x8_ms']:.3f} ms ({row['x8_gb_s']:.1f} GB/s), x{row['speedup']:.2f}, "
            f"same bits: {same}"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
