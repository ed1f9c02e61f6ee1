"""Rows as stored against the same rows repacked 8 at a time, side by side, per type and
instruction set.

    python benchmarks/cpu_repack.py [--types Q4_0,Q4_1,Q8_0,Q4_K,Q5_K,Q6_K,IQ4_NL,IQ4_XS]
        [--isas all] [--threads 1] [--repeat 5] [--rows 1] [--packed-q] [--json OUT.json]

One product of the CPU worker's kernels (``_kernels.linear``, 8-bit activations) on
random blocks of each type (``tests/support/random_blocks.py``), for a matrix that
stays in cache (1024 x 4096) and one that is read from memory (14336 x 4096, the 8B
shape's feed-forward), through a ``Matrix`` of the stored rows and one of
``repack=True`` (``csrc/repack.h``), on every instruction set of ``--isas`` this
processor runs (``all``: every one). Each figure is the best of ``--repeat`` timings,
the two layouts interleaved; the script also checks that both give the same bits.
``--rows`` above 1 times the prefill-shaped product (GMAC/s); its rows of 8-bit
activations are the worker's (``step_buffers.q_row_stride`` apart), or n bytes apart
with ``--packed-q`` (a hidden size of 4096 then puts them 4 KiB apart).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ((1024, 4096), (14336, 4096))
TYPES = (
    "Q4_0",
    "Q4_1",
    "Q8_0",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_NL",
    "IQ4_XS",
    "Q3_K",
    "Q5_0",
    "Q5_1",
    "Q2_K",
)
DEFAULT_TYPES = TYPES[:6]


def _types(text: str) -> tuple[str, ...]:
    """``--types``: a comma list of TYPES' names, any case."""
    names = tuple(t.strip().upper() for t in text.split(","))
    unknown = [t for t in names if t not in TYPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"not one of {','.join(TYPES)}: {','.join(unknown)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--types",
        type=_types,
        default=DEFAULT_TYPES,
        help=f"weight types, any case: {','.join(TYPES)} (default: {','.join(DEFAULT_TYPES)})",
    )
    parser.add_argument("--isas", default="all", help="instruction sets (all: every one here)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rows", type=int, default=1, help="activation rows (1: decode)")
    parser.add_argument(
        "--packed-q",
        dest="padded",
        action="store_false",
        help="rows of 8-bit activations n bytes apart (default: the worker's, padded by "
        "step_buffers.q_row_stride)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # tests.support
    from tests.support.random_blocks import random_rows

    from runtime_core.workers.cpu import _kernels
    from runtime_core.workers.cpu.step_buffers import q_rows

    host = _kernels.isas()
    isas = host if args.isas == "all" else tuple(i for i in args.isas.split(",") if i in host)
    rng = np.random.default_rng(0)
    figures = []
    for qtype in args.types:
        for n_out, n_in in SHAPES:
            raw = random_rows(rng, qtype, n_out, n_in, scale=1 / np.sqrt(n_in))
            x = rng.standard_normal((args.rows, n_in)).astype(np.float32)
            q = (  # the worker's padded rows, or rows n_in apart
                q_rows(np.zeros, args.rows, n_in)
                if args.padded
                else np.zeros((args.rows, n_in), np.int8)
            )
            d = np.zeros((args.rows, n_in // 32), np.float32)
            s, g = d.copy(), np.zeros((args.rows, n_in // 16), np.int32)
            parts = [(raw, qtype, n_out, n_in, 0)]
            layouts = {"stored": _kernels.Matrix(parts), "x8": _kernels.Matrix(parts, repack=True)}
            calls = max(3, int(2e8 / raw.nbytes / args.rows))
            for isa in isas:
                ys = {k: np.zeros((args.rows, n_out), np.float32) for k in layouts}
                best = dict.fromkeys(layouts, float("inf"))
                for _ in range(args.repeat):
                    for name, m in layouts.items():
                        t0 = time.perf_counter()
                        for _ in range(calls):
                            _kernels.linear(m, args.rows, x, q, d, s, g, True, True, ys[name],
                                            None, False, args.threads, isa=isa)  # fmt: skip
                        best[name] = min(best[name], (time.perf_counter() - t0) / calls)
                same = bool(np.array_equal(ys["stored"].view(np.uint32), ys["x8"].view(np.uint32)))
                macs = args.rows * n_out * n_in
                row = {
                    "type": qtype,
                    "shape": [n_out, n_in],
                    "isa": isa,
                    "threads": args.threads,
                    "rows": args.rows,
                    "stored_ms": best["stored"] * 1e3,
                    "x8_ms": best["x8"] * 1e3,
                    "stored_gb_s": raw.nbytes / best["stored"] / 1e9,
                    "x8_gb_s": raw.nbytes / best["x8"] / 1e9,
                    "x8_gmac_s": macs / best["x8"] / 1e9,
                    "speedup": best["stored"] / best["x8"],
                    "same_bits": same,
                }
                figures.append(row)
                print(
                    f"{n_out:5} x {n_in} {qtype} ({isa:8} {args.threads} thread(s), {args.rows} "
                    f"row(s)): stored {row['stored_ms']:7.3f} ms ({row['stored_gb_s']:5.1f} GB/s), "
                    f"x8 {row['x8_ms']:7.3f} ms ({row['x8_gb_s']:5.1f} GB/s, "
                    f"{row['x8_gmac_s']:6.1f} GMAC/s), x{row['speedup']:.2f}, same bits: {same}"
                )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
