"""The logits' soft cap (``_kernels.softcap``: ``tanh(x * (1 / cap)) * cap``), this
checkout against a baseline build, per instruction set.

    python benchmarks/cpu_softcap.py [--baseline CHECKOUT] [--n 262144] [--cap 30]
        [--isas all] [--threads 1] [--repeat 20] [--rounds 3]

In a fresh process per build and round, the builds in turn (this checkout's ``src``, and
``--baseline``'s where given: another checkout with its kernels built), one ``softcap``
call on ``--n`` logits (gemma2's vocabulary by default; random, 30 times a standard
normal) on every set of ``--isas`` this processor runs: a build whose ``softcap`` takes
no ``isa=`` (before ``tanh32``: the C library's ``tanhf``, the same on every set) is
timed once, as ``libm``. Also ``_kernels.tanh32`` alone where the build has it. Printed:
per build and set the nanoseconds a value, the best of ``--repeat`` calls (the calling
thread's CPU time, less that of restoring the logits before each call: at
``--threads 1`` the call runs on it), as the range over ``--rounds`` rounds. Nothing is
asserted; the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_prefill import builds_of, runs_in_turn  # noqa: E402


def _best_ns(fn: Any, n: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.thread_time_ns()
        fn()
        best = min(best, time.thread_time_ns() - t)
    return best / n


def child(args: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: ns a value of softcap (and tanh32) on each set."""
    import numpy as np

    from runtime_core.workers.cpu import _kernels

    n, cap, threads, repeat = args["n"], args["cap"], args["threads"], args["repeat"]
    logits = (30 * np.random.default_rng(1).standard_normal(n)).astype(np.float32)
    work = logits.copy()

    def softcap(**isa: str) -> None:
        work[:] = logits
        _kernels.softcap(work, cap, threads, **isa)

    host = _kernels.isas()
    isas = host if args["isas"] == "all" else [i for i in args["isas"].split(",") if i in host]
    out: dict[str, Any] = {}
    copy_ns = _best_ns(lambda: work.__setitem__(slice(None), logits), n, repeat)
    if hasattr(_kernels, "tanh32"):
        for isa in isas:
            out[f"softcap {isa}"] = _best_ns(lambda i=isa: softcap(isa=i), n, repeat) - copy_ns
            out[f"tanh32 {isa}"] = _best_ns(
                lambda i=isa: _kernels.tanh32(logits, work, isa=i), n, repeat
            )
    else:
        out["softcap libm"] = _best_ns(softcap, n, repeat) - copy_ns
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, default=None)
    parser.add_argument("--n", type=int, default=262144)
    parser.add_argument("--cap", type=float, default=30.0)
    parser.add_argument("--isas", default="all")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    a = parser.parse_args()
    builds = builds_of(parser, a.baseline)
    args = {"n": a.n, "cap": a.cap, "isas": a.isas, "threads": a.threads, "repeat": a.repeat}
    runs = runs_in_turn(builds, args, a.rounds, script=__file__)
    print(f"ns a value, best of {a.repeat} calls, range over {a.rounds} rounds "
          f"({a.n} logits, {a.threads} thread(s))")  # fmt: skip
    for build, results in runs.items():
        for key in results[0]:
            values = [r[key] for r in results]
            print(f"  {build:9s} {key:22s} {min(values):6.2f} - {max(values):6.2f}")


if __name__ == "__main__":
    main()
