"""What a CPU stage's steps pay for their buffers: page faults and time, this checkout
against a baseline build.

    python benchmarks/cpu_step_buffers.py [--model PATH] [--baseline SRC] [--threads 1]
        [--prompt-len 32] [--repeat 4] [--json OUT.json]

The CPU worker's backend holding every block of ``--model`` (default: the bundled
SmolLM2-135M-Instruct Q4_1; float16 KV cache), in a fresh process per build and round,
the builds in turn (this checkout's ``src``, and ``--baseline``'s ``src`` when given:
another checkout with its kernels built):

- bind: the backend's ``load`` (seconds);
- the first prefill after bind, and the same prompt again (a new run each): wall time
  and the process's minor page faults during it;
- decode batches whose row count changes every step (6 runs, batches of 1, 3, 5, 2, 6
  and 4 of them, 8 times over, after one batch of each size): milliseconds and minor
  page faults per batch.

A run's KV cache is new memory, so each prefill and decode row takes the faults of the
cache positions it writes. Printed: per build the medians over rounds, and the ratios.
Nothing is asserted; the machine may be shared (compare ratios, run it again).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_prefill import builds_of, runs_in_turn  # noqa: E402

SIZES = (1, 3, 5, 2, 6, 4)
FIGURES = ("bind_s", "first_ms", "first_faults", "again_ms", "again_faults",
           "batch_ms", "batch_faults")  # fmt: skip


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def child(args: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: bind, two prefills, decode batches of changing sizes."""
    import numpy as np

    from runplan import model_facts_from_gguf
    from runtime_core.gguf_slice import open_stage_slice
    from runtime_core.workers.cpu.backend import CpuBackend
    from runtime_core.workers.cpu.worker import CpuWorker
    from runtime_core.workers.stage_worker import BackendSpec, BackendStep

    max_seq = args["prompt_len"] + 64
    n = model_facts_from_gguf(args["model"], max_seq_len=max_seq).num_layers
    t0 = time.perf_counter()
    backend = CpuBackend(BackendSpec(True, True, np.dtype(np.float16), "f16", "q8"),
                         args["threads"])  # fmt: skip
    with open_stage_slice(args["model"], 0, n, is_first=True, is_last=True,
                          capabilities=CpuWorker.capabilities) as stage:  # fmt: skip
        backend.load(stage, max_seq, None)
    out: dict[str, Any] = {"bind_s": time.perf_counter() - t0}
    prompt = np.random.default_rng(0).integers(0, 32000, args["prompt_len"]).astype(np.int32)
    for name in ("first", "again"):
        f0, t0 = faults(), time.perf_counter()
        step = BackendStep(backend.new_cache(max_seq), prompt, len(prompt), 0, True, True)
        backend.run_batch([step])
        backend.token_of(0)
        out[f"{name}_ms"] = (time.perf_counter() - t0) * 1e3
        out[f"{name}_faults"] = faults() - f0
    caches = [backend.new_cache(max_seq) for _ in range(max(SIZES))]
    pos = [0] * len(caches)

    def batch(n: int) -> None:
        backend.run_batch(
            [BackendStep(caches[i], np.array([5 + i], np.int32), 1, pos[i], True)
             for i in range(n)]
        )  # fmt: skip
        for i in range(n):
            backend.token_of(i)
            pos[i] += 1

    for n in SIZES:
        batch(n)
    sizes = SIZES * 8
    f0, t0 = faults(), time.perf_counter()
    for n in sizes:
        batch(n)
    out["batch_ms"] = (time.perf_counter() - t0) * 1e3 / len(sizes)
    out["batch_faults"] = (faults() - f0) / len(sizes)
    backend.release()
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file (default SmolLM2)")
    parser.add_argument(
        "--baseline", type=Path, default=None, help="a checkout whose built src is the baseline"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.threads < 1 or args.prompt_len < 1 or args.repeat < 1:
        parser.error("need --threads, --prompt-len and --repeat of at least 1")
    if args.model is None:
        from runplan.models import resolve_model

        args.model = Path(resolve_model("smollm2-135m"))
    if not args.model.is_file():
        parser.error(f"--model {args.model}: no such file")
    builds = builds_of(parser, args.baseline)
    cargs = {"model": str(args.model), "threads": args.threads, "prompt_len": args.prompt_len}
    runs = runs_in_turn(builds, cargs, args.repeat, __file__)
    report: dict[str, Any] = {"args": cargs, "builds": {}}
    print(f"{args.model.name}, {args.threads} thread(s), a {args.prompt_len}-token prompt; "
          f"medians of {args.repeat} processes per build")  # fmt: skip
    print(f"{'build':9s} {'bind s':>7s} {'1st prefill ms':>15s} {'faults':>7s} "
          f"{'again ms':>9s} {'faults':>7s} {'batch ms':>9s} {'faults':>7s}")  # fmt: skip
    for name, rs in runs.items():
        med = {k: statistics.median(x[k] for x in rs) for k in FIGURES}
        report["builds"][name] = {"src": str(builds[name]), "median": med, "runs": rs}
        print(f"{name:9s} {med['bind_s']:7.2f} {med['first_ms']:15.1f} {med['first_faults']:7.0f} "
              f"{med['again_ms']:9.1f} {med['again_faults']:7.0f} {med['batch_ms']:9.2f} "
              f"{med['batch_faults']:7.0f}")  # fmt: skip
    if "baseline" in runs:
        b, t = report["builds"]["baseline"]["median"], report["builds"]["this"]["median"]
        report["ratios"] = {k: t[k] / b[k] for k in ("first_ms", "again_ms", "batch_ms") if b[k]}
        print("this / baseline: " + ", ".join(f"{k} x{v:.3f}" for k, v in report["ratios"].items()))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
