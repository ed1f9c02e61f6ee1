"""Two or more builds of the CPU kernels in one process, in turn: whether a change to the
kernels' source makes a product faster, measured through the host's phases.

    python benchmarks/cpu_builds_ab.py BUILD[@ISA] BUILD[@ISA] ... [--types Q4_0,Q6_K]
        [--rows 1,2] [--n-out 1024] [--n-in 4096] [--isa NAME] [--rounds 15] [--json OUT]
    python benchmarks/cpu_builds_ab.py BUILD BUILD ... --model GGUF [--threads 1] [--rows 1]

Each ``BUILD`` is a source tree whose ``src/runtime_core/workers/cpu`` holds a built
``_kernels`` module (this checkout, after ``pip install -e .``), or such a module's file:
another commit's, e.g. built by ``pip wheel --no-deps -w OUT TREE`` from a ``git
worktree`` of it and unzipped from the wheel (``unzip -j OUT/*.whl
'runtime_core/workers/cpu/_kernels*.so'``); ``@ISA`` runs that build on an
instruction set of its own (default ``--isa``: the best this processor runs), so one
tree twice with two sets compares the sets. Every build gets its own copy of each random
weight matrix (``--n-out`` x ``--n-in``, a multiple of the type's block, of each type in
``--types``, repacked as the worker holds it): 1024 x 4096 is in the last-level cache,
14336 x 4096 (33 MB of Q4_0 per build) is read from memory on every call. Per type and
row count (``--rows`` rows of activations, as a decode step of that many runs, or a
prefill's tile), ``--rounds`` rounds in which every build makes its product enough times
for about 0.1 s, the builds' order rotating round by round. A shared host's phases move
a product's time by a quarter or more within minutes, more than most changes do: builds
measured minutes apart differ by the phase alone, while here each round puts them
milliseconds apart.

With ``--model GGUF`` (``--threads T``) the products are a decode step's instead: every
2-D weight of the file that a step multiplies, as ``cpu_step_products.py`` takes them
(its blocks' in order, then the head), each build's copy; a round is one pass over them
all per build (``--rows`` rows of activations, ``T`` threads), the builds in turn.

Printed: each build's median ms per call (per pass with ``--model``) and its median over
the first build's (below 1: faster), and whether every build gave the same bits (the
kernels' contract: a change that alters them is not a faster kernel). Nothing is
asserted; run it again and compare.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_step_products import activations, step_matrices  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402
from tests.support.random_blocks import random_rows  # noqa: E402

from runplan.quant_types import block_elems  # noqa: E402
from runtime_core.workers.cpu.step_buffers import q_rows  # noqa: E402


def load_build(build: Path, index: int) -> ModuleType:
    """The ``_kernels`` module ``build`` (its file, or a tree that holds it built), under a
    name of its own."""
    found = (
        [build]
        if build.is_file()
        else sorted((build / "src" / "runtime_core" / "workers" / "cpu").glob("_kernels*.so"))
    )
    if not found:
        raise SystemExit(f"no built _kernels module under {build}/src/runtime_core/workers/cpu")
    spec = importlib.util.spec_from_file_location(f"build{index}._kernels", found[0])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(builds: list[tuple[str, ModuleType, str]], qtype: str, rows: int, n_out: int,
            n_in: int, rounds: int) -> dict[str, Any]:  # fmt: skip
    rng = np.random.default_rng(0)
    raw = random_rows(rng, qtype, n_out, n_in, scale=1 / np.sqrt(n_in))
    mats = [k.Matrix([(raw, qtype, n_out, n_in, 0)], repack=True) for _, k, _ in builds]
    x = rng.standard_normal((rows, n_in)).astype(np.float32)
    q = q_rows(np.zeros, rows, n_in)
    d = np.zeros((rows, n_in // 32), np.float32)
    s = d.copy()
    g = np.zeros((rows, n_in // 16), np.int32)
    ys = [np.zeros((rows, n_out), np.float32) for _ in builds]
    calls = max(3, int(1e8 / raw.nbytes))
    times: list[list[float]] = [[] for _ in builds]
    for r in range(rounds):
        for i in [(r + o) % len(builds) for o in range(len(builds))]:
            _, kernels, isa = builds[i]
            t0 = time.perf_counter()
            for _ in range(calls):
                kernels.linear(mats[i], rows, x, q, d, s, g, True, True, ys[i], None, False, 1,
                               isa=isa)  # fmt: skip
            times[i].append((time.perf_counter() - t0) / calls * 1e3)
    first = statistics.median(times[0])
    return {
        "type": qtype, "rows": rows, "n_out": n_out, "n_in": n_in,
        "same_bits": all(np.array_equal(ys[0], y) for y in ys),
        "builds": [{"name": name, "isa": isa, "median_ms": statistics.median(t),
                    "over_first": statistics.median(t) / first, "rounds_ms": t}
                   for (name, _, isa), t in zip(builds, times, strict=True)],
    }  # fmt: skip


def measure_step(builds: list[tuple[str, ModuleType, str]], model: Path, rows: int,
                 threads: int, rounds: int) -> dict[str, Any]:  # fmt: skip
    """A decode step's products of ``model`` (``rows`` rows), each build's pass in turn."""
    passes = [
        [(k.Matrix([(raw, qtype, n_out, n_in, 0)], repack=True),
          activations(rows, n_in, n_out, seed))
         for seed, (_, qtype, n_out, n_in, raw) in enumerate(step_matrices(model))]
        for _, k, _ in builds
    ]  # fmt: skip
    times: list[list[float]] = [[] for _ in builds]
    for r in range(rounds):
        for i in [(r + o) % len(builds) for o in range(len(builds))]:
            _, kernels, isa = builds[i]
            t0 = time.perf_counter()
            for m, (x, q, d, s, g, y) in passes[i]:
                kernels.linear(m, rows, x, q, d, s, g, True, True, y, None, False, threads,
                               isa=isa)  # fmt: skip
            times[i].append((time.perf_counter() - t0) * 1e3)
    first = statistics.median(times[0])
    same = all(
        np.array_equal(a[1][5], b[1][5])
        for p in passes[1:]
        for a, b in zip(passes[0], p, strict=True)
    )
    return {
        "model": str(model), "rows": rows, "threads": threads, "same_bits": same,
        "builds": [{"name": name, "isa": isa, "median_ms": statistics.median(t),
                    "over_first": statistics.median(t) / first, "rounds_ms": t}
                   for (name, _, isa), t in zip(builds, times, strict=True)],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trees", nargs="+", help="built _kernels (a file or its tree), each BUILD[@ISA]")
    p.add_argument("--types", default="Q4_0,Q4_K,Q6_K,Q8_0", help="types (default: %(default)s)")
    p.add_argument("--rows", default="1,2", help="activation row counts (default: %(default)s)")
    p.add_argument("--n-out", type=int, default=1024, help="matrix rows (default: %(default)s)")
    p.add_argument("--n-in", type=int, default=4096,
                   help="matrix columns, a multiple of 256 (default: %(default)s)")  # fmt: skip
    p.add_argument("--isa", default=None,
                   help="the set of a tree without @ISA (default: the best here)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=15,
                   help="rounds, every build once each (default: %(default)s)")  # fmt: skip
    p.add_argument("--model", type=Path, default=None,
                   help="a GGUF file: its decode step's products, not --types'")  # fmt: skip
    p.add_argument("--threads", type=int, default=1,
                   help="threads of --model's products (default: %(default)s)")  # fmt: skip
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if args.n_in <= 0 or args.n_out <= 0 or args.rounds <= 0 or args.threads <= 0:
        p.error("--n-in, --n-out, --rounds and --threads must be positive")
    if args.model is not None and not args.model.is_file():
        p.error(f"--model {args.model}: no such file")
    for qtype in args.types.split(","):
        if qtype not in GGMLQuantizationType.__members__:
            p.error(f"--types: {qtype!r} is not a GGML type")
        if args.n_in % block_elems(qtype):
            p.error(f"--n-in {args.n_in} is not a multiple of {qtype}'s block "
                    f"({block_elems(qtype)} elements)")  # fmt: skip
    builds = []
    for i, spec in enumerate(args.trees):
        tree, _, isa = spec.partition("@")
        kernels = load_build(Path(tree), i)
        isa = isa or args.isa or kernels.isas()[-1]
        if isa not in kernels.isas():
            p.error(f"{spec}: instruction set {isa!r} is not one this processor runs there "
                    f"({', '.join(kernels.isas())})")  # fmt: skip
        builds.append((spec, kernels, isa))
    results = []
    if args.model is not None:
        for rows in (int(r) for r in args.rows.split(",")):
            res = measure_step(builds, args.model, rows, args.threads, args.rounds)
            results.append(res)
            line = "  ".join(f"{b['name']} {b['median_ms']:.2f} ms ({b['over_first']:.3f})"
                             for b in res["builds"])  # fmt: skip
            bits = "" if res["same_bits"] else "  THE BITS DIFFER"
            print(f"{args.model.name} rows={rows:<3} {args.threads} thread(s), a step's "
                  f"products: {line}{bits}", flush=True)  # fmt: skip
        report = {"rounds": args.rounds, "results": results}
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
        return report
    for qtype in args.types.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            res = measure(builds, qtype, rows, args.n_out, args.n_in, args.rounds)
            results.append(res)
            line = "  ".join(f"{b['name']} {b['median_ms']:.4f} ms ({b['over_first']:.3f})"
                             for b in res["builds"])  # fmt: skip
            print(f"{qtype:6} rows={rows:<3} {args.n_out} x {args.n_in}: {line}"
                  + ("" if res["same_bits"] else "  THE BITS DIFFER"), flush=True)  # fmt: skip
    report = {"rounds": args.rounds, "results": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
