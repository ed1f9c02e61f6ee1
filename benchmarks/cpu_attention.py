"""The CPU worker's attention kernel at a position, per instruction set.

    python benchmarks/cpu_attention.py [--positions 64,512,2048] [--rows 64]
        [--heads 9,3,64] [--kv f32] [--isas all] [--threads 1] [--repeat 5] [--from-memory]

One ``_kernels.attention`` call of ``--rows`` query rows (a prefill chunk; 1: a decode
step) at each position of ``--positions`` over a KV cache of random values
(``--heads`` query heads, KV heads, head size: SmolLM2's 9, 3, 64 by default), on every
instruction set of ``--isas`` this processor runs. Prints, per position and set, the
best of ``--repeat`` timings in ms (wall clock, and the calling thread's CPU time, which
a busy host distorts less: at ``--threads 1`` the call runs on that thread) and the
multiply-adds per CPU second of the scores and the mix (2 x rows x heads x positions
seen x head size), the KV cache's bytes read over the wall time (GB/s), and checks that
every set gives the portable set's bits. ``--from-memory``: 256 MiB read before every
call, so that the cache comes from memory as a decode step's does (the weights' stream
has passed since the layer's last step); without it the cache stays wherever the last
call left it (the last-level cache, when it fits).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--positions", default="64,512,2048")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head size")
    parser.add_argument("--kv", choices=("f32", "f16"), default="f32")
    parser.add_argument("--isas", default="all", help="instruction sets (all: every one here)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--from-memory", action="store_true", help="evict the cache first")
    args = parser.parse_args()
    flush = np.ones(64 << 20, np.float32) if args.from_memory else None

    from runtime_core.workers.cpu import _kernels

    host = _kernels.isas()
    isas = host if args.isas == "all" else tuple(i for i in args.isas.split(",") if i in host)
    n_heads, n_kv, hd = (int(v) for v in args.heads.split(","))
    dtype = np.float16 if args.kv == "f16" else np.float32
    rng = np.random.default_rng(0)
    print(f"rows {args.rows}, heads {n_heads}/{n_kv} x {hd}, kv {args.kv}, threads {args.threads}")
    print(
        "position | isa | wall ms | CPU ms | GMAC/s (CPU) | KV GB/s (wall) | same bits as portable"
    )
    for pos in (int(p) for p in args.positions.split(",")):
        max_seq = pos + args.rows
        kc = rng.standard_normal((n_kv, max_seq, hd)).astype(dtype)
        vc = rng.standard_normal((n_kv, max_seq, hd)).astype(dtype)
        qkv = rng.standard_normal((args.rows, (n_heads + 2 * n_kv) * hd)).astype(np.float32)
        heads = (n_heads, n_kv, hd, hd, max_seq, args.kv == "f16")
        macs = 2 * n_heads * hd * sum(pos + r + 1 for r in range(args.rows))
        kv_bytes = kc.nbytes * (pos + args.rows) // max_seq * 2  # the positions seen
        outs: dict[str, np.ndarray] = {}
        best = {isa: float("inf") for isa in isas}
        cpu = {isa: float("inf") for isa in isas}
        for _ in range(args.repeat):
            for isa in isas:  # interleaved
                out = np.zeros((args.rows, n_heads * hd), np.float32)
                if flush is not None:
                    flush += 1.0
                t0, c0 = time.perf_counter(), time.thread_time()
                _kernels.attention(qkv, args.rows, kc, vc, pos, heads, 0.125, out, args.threads,
                                   isa=isa)  # fmt: skip
                cpu[isa] = min(cpu[isa], time.thread_time() - c0)
                best[isa] = min(best[isa], time.perf_counter() - t0)
                outs[isa] = out
        ref = outs.get("portable")
        for isa in isas:
            same = "-" if ref is None else str(np.array_equal(outs[isa].view(np.uint32),
                                                              ref.view(np.uint32)))  # fmt: skip
            print(
                f"{pos} | {isa} | {best[isa] * 1e3:.3f} | {cpu[isa] * 1e3:.3f} | "
                f"{macs / cpu[isa] / 1e9:.2f} | {kv_bytes / best[isa] / 1e9:.1f} | {same}"
            )


if __name__ == "__main__":
    main()
