"""A SmolLM2 stage's prefill in the CPU worker, per kernel, against a baseline build.

    python benchmarks/cpu_prefill.py [--baseline SRC] [--stages 3] [--stage 1]
        [--prompt-len 41] [--threads 1] [--repeat 5] [--tokens 16] [--json OUT.json]

SmolLM2-135M-Instruct Q4_1 (the bundled file) cut into ``--stages`` even stages (3: 10
blocks each). Each build (this checkout's ``src``, and ``--baseline``'s ``src`` when
given: another checkout with its kernels built, e.g. a ``git worktree`` of the commit
before) runs in a fresh process, the builds interleaved over ``--repeat`` rounds:

- prefill: stage ``--stage`` bound in-process, fed the activations stage 0 computes for
  a ``--prompt-len`` random prompt; the best of 5 prefills per round, then one more with
  every ``_kernels`` call the backend makes timed (a wrapper around the module; the
  linear products named by their activation format and output columns);
- tokens: ``--tokens`` greedy tokens of the whole chain of stages (in one process), so
  the two builds' tokens (and the last logits' bits) can be compared; decode tokens/s
  is 1 / the median step after the prefill (every stage in turn, no hops).

Printed: per build the median prefill (ms per stage), the kernel breakdown of the
median round, decode tokens/s, the ratios, and whether tokens and logits are identical.
Nothing is asserted; the machine may be shared (compare ratios, run it again).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def child(args: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: the prefill of one stage, per kernel, and the chain's tokens."""
    import numpy as np
    from tests.support.chain import Chain, provisions

    from runplan.models import resolve_model
    from runtime_core.workers.cpu import _kernels, backend
    from runtime_core.workers.cpu.worker import CpuWorker
    from runtime_core.workers.interface import TokenOutput

    provs = provisions(resolve_model("smollm2-135m"), args["stages"], max_seq_len=256)
    rng = np.random.default_rng(args["seed"])
    prompt = rng.integers(0, 49152, args["prompt_len"]).astype(np.uint32)
    chain = Chain.bind(provs, lambda: CpuWorker(threads=args["threads"]))
    try:
        outs = [chain.step(0, prompt)]
        steps = []
        for k in range(1, args["tokens"]):
            t0 = time.perf_counter()
            outs.append(chain.step(k, np.array([outs[-1].token_id], np.uint32)))
            steps.append(time.perf_counter() - t0)
        tokens = [o.token_id for o in outs]
        last = outs[-1].logits
        logits = None if last is None else np.asarray(last, np.float32).view(np.uint32).tolist()
        data: Any = np.array(prompt)
        for w in chain.workers[: args["stage"]]:
            data = w.execute_step(0, data)
        assert not isinstance(data, TokenOutput)
        worker = chain.workers[args["stage"]]
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            worker.execute_step(0, data)
            times.append(time.perf_counter() - t0)
        spent: collections.defaultdict[str, float] = collections.defaultdict(float)

        class Timed:
            def __getattr__(self, name: str) -> Any:
                f = getattr(_kernels, name)
                if not callable(f) or isinstance(f, type):
                    return f

                def timed(*a: Any, **kw: Any) -> Any:
                    t0 = time.perf_counter()
                    r = f(*a, **kw)
                    key = f"linear {a[0].act_format} x {a[0].n_out}" if name == "linear" else name
                    spent[key] += time.perf_counter() - t0
                    return r

                return timed

        setattr(backend, "_kernels", Timed())  # noqa: B010 (the backend's calls, timed)
        t0 = time.perf_counter()
        worker.execute_step(0, data)
        timed_s = time.perf_counter() - t0
        setattr(backend, "_kernels", _kernels)  # noqa: B010
    finally:
        chain.release()
    return {
        "prefill_s": min(times),
        "timed_s": timed_s,
        "kernels_s": dict(spent),
        "tokens": tokens,
        "decode_s": statistics.median(steps) if steps else None,
        "logits_bits": logits,
        "isa": getattr(chain.workers[0], "isa", None) or _kernels.isas()[-1],
    }


def run_child(src: Path, args: dict[str, Any], script: str = __file__) -> dict[str, Any]:
    """``script --child ARGS`` in a fresh process importing ``src`` first: its last line
    of output, read as JSON."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src), str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, script, "--child", json.dumps(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{src} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def builds_of(parser: argparse.ArgumentParser, baseline: Path | None) -> dict[str, Path]:
    """The ``src`` of each build: this checkout's, and ``--baseline``'s where given."""
    builds = {"this": ROOT / "src"}
    if baseline is not None:
        if not (baseline / "src" / "runtime_core" / "workers" / "cpu").is_dir():
            parser.error(f"--baseline {baseline}: no src/runtime_core/workers/cpu there")
        builds["baseline"] = baseline / "src"
    return builds


def runs_in_turn(
    builds: dict[str, Path],
    args: dict[str, Any],
    repeat: int,
    script: str = __file__,
    each: Callable[[int, str, dict[str, Any]], None] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Each build's ``repeat`` fresh processes (``run_child``), the builds in turn, the
    first one of each round moving on by one; ``each(round, build, result)`` after
    every process."""
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in builds}
    for r in range(repeat):
        order = list(builds)[r % len(builds) :] + list(builds)[: r % len(builds)]
        for name in order:
            runs[name].append(run_child(builds[name], args, script))
            if each is not None:
                each(r, name, runs[name][-1])
    return runs


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--baseline", type=Path, default=None, help="a checkout whose built src is the baseline"
    )
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--stage", type=int, default=1, help="the stage timed (0-based)")
    parser.add_argument("--prompt-len", type=int, default=41)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    if not 0 <= args.stage < args.stages or args.prompt_len < 1 or args.threads < 1:
        parser.error("need 0 <= --stage < --stages, --prompt-len >= 1, --threads >= 1")
    builds = builds_of(parser, args.baseline)
    cargs = {
        k: getattr(args, k) for k in ("stages", "stage", "prompt_len", "threads", "tokens", "seed")
    }

    def each(r: int, name: str, result: dict[str, Any]) -> None:
        print(f"round {r + 1} {name}: {result['prefill_s'] * 1e3:.1f} ms", file=sys.stderr)

    runs = runs_in_turn(builds, cargs, args.repeat, each=each)
    report: dict[str, Any] = {"args": cargs, "builds": {}}
    for name, rs in runs.items():
        med = statistics.median(x["prefill_s"] for x in rs)
        mid = min(rs, key=lambda x: abs(x["prefill_s"] - med))
        report["builds"][name] = {
            "src": str(builds[name]),
            "isa": rs[0]["isa"],
            "prefill_ms": med * 1e3,
            "prefill_ms_all": [x["prefill_s"] * 1e3 for x in rs],
            "kernels_ms": {
                k: v * 1e3 for k, v in sorted(mid["kernels_s"].items(), key=lambda kv: -kv[1])
            },
            "tokens": rs[0]["tokens"],
            "decode_tok_s": 1 / statistics.median(x["decode_s"] for x in rs)
            if args.tokens > 1
            else None,
        }
        print(f"{name} ({builds[name]}, {rs[0]['isa']}, {args.threads} thread(s)): stage "
              f"{args.stage} of {args.stages}, {args.prompt_len}-token prefill "
              f"{med * 1e3:.1f} ms (median of {len(rs)})")  # fmt: skip
        if args.tokens > 1:
            tok_s = report["builds"][name]["decode_tok_s"]
            print(f"    decode through every stage: {tok_s:.1f} tokens/s")
        for k, v in report["builds"][name]["kernels_ms"].items():
            print(f"    {k:24s} {v:8.2f} ms")
    if "baseline" in runs:
        b, t = report["builds"]["baseline"], report["builds"]["this"]
        same_tokens = all(
            x["tokens"] == runs["this"][0]["tokens"] for rs in runs.values() for x in rs
        )
        same_logits = all(
            x["logits_bits"] == runs["this"][0]["logits_bits"] for rs in runs.values() for x in rs
        )
        report["speedup"] = b["prefill_ms"] / t["prefill_ms"]
        if args.tokens > 1:
            report["decode_ratio"] = t["decode_tok_s"] / b["decode_tok_s"]
            print(f"decode this / baseline: x{report['decode_ratio']:.2f}")
        report["same_tokens"], report["same_logits"] = same_tokens, same_logits
        print(f"baseline / this: x{report['speedup']:.2f}; {args.tokens} greedy tokens identical: "
              f"{same_tokens}; last logits' bits identical: {same_logits}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
