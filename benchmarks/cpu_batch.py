"""Batched decode on one CPU stage, beside llama.cpp decoding the same model batched.

    python benchmarks/cpu_batch.py [--models smollm2,8b-q4_0] [--layers 4]
        [--threads 1,2] [--sequences 1,2,4,8] [--prompt-tokens 32] [--tokens 32]
        [--repeat 3] [--llamacpp-python /work/llamacpp-venv/bin/python]
        [--model-dir DIR] [--json OUT.json]

- Models: SmolLM2-135M-Instruct Q4_1 (the bundled file), and ``8b-q4_0``: Llama-3-8B's
  block shape (``--layers`` blocks) quantized to Q4_0 by llama.cpp's own quantizer, as
  ``benchmarks/cpu_decode.py`` builds it (``--model-dir`` keeps the files); any other of
  its models by name (``8b-q4_k``, ``8b-q6_k``, ...).
- Ours: ``CpuWorker`` holding every block in one stage (the best instruction set), ``n``
  runs open on it (``open_run``), their ``n`` prompts prefilled in one batch
  (``execute_batch``), then ``--tokens`` decode batches of one row of every run, greedy;
  each batch's wall time. The CPU worker reads each weight once per batch
  (``run_batch``), so a batch of ``n`` rows costs far less than ``n`` steps.
- llama.cpp: ``benchmarks/llamacpp_batch.py`` in ``--llamacpp-python``'s interpreter
  (one context of ``n`` sequences, a unified float32 KV cache, each decode step one
  ``llama_decode`` of ``n`` rows), with the same prompts (ids drawn from a generator
  seeded by the sequence's index) and counts.
- Interleaved: every repetition runs, per thread count, ours and llama.cpp once each
  (each a fresh process measuring every ``n``), in an order that alternates.
- Figures (medians over the repetitions): aggregate decode tokens/s (``n`` x steps /
  the steps' summed wall time) of each, their ratio (ours / llama.cpp), each one's
  speed-up over its own ``n = 1``, and each one's process CPU time per decoded token
  (every thread's; the figure a busy host distorts least) with their ratio. Nothing is
  asserted; on a shared machine the figures are "under load": compare ratios, run it
  several times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_decode import LLAMACPP_PYTHON, MORE_MODELS, llamacpp_problem, model_path, processor  # noqa: E402
from cpu_decode import MODELS as DECODE_MODELS  # noqa: E402

MODELS = ("smollm2", "8b-q4_0")  # the default
KNOWN = DECODE_MODELS + MORE_MODELS


def prompts(n: int, vocab: int, length: int) -> list[list[int]]:
    """llamacpp_batch.py's prompts: sequence ``k``'s ids from a generator seeded by k."""
    return [np.random.default_rng(k).integers(10, vocab, length).tolist() for k in range(n)]


def child(args: dict[str, Any]) -> list[dict[str, Any]]:
    """In a fresh process: one stage of every block, for each ``n`` that many runs
    prefilled in one batch, then decoded one row each per batch."""
    from tests.support.chain import provisions

    from runplan import model_facts_from_gguf
    from runtime_core.workers.cpu.worker import CpuWorker
    from runtime_core.workers.interface import BatchStep, TokenOutput

    max_seq = args["prompt_tokens"] + args["tokens"] + 1
    most = max(args["sequences"])
    provs = [
        provisions(args["model"], 1, max_seq_len=max_seq, run_id=f"run-{k}",
                   max_concurrent_runs=most, return_logits=False)[0]
        for k in range(most)
    ]  # fmt: skip
    worker = CpuWorker(threads=args["threads"])
    worker.configure(provs[0])
    worker.bind(provs[0].gguf_source)
    vocab = model_facts_from_gguf(args["model"], max_seq_len=max_seq).vocab_size
    out = []
    try:
        for n in args["sequences"]:
            runs = provs[:n]
            for p in runs:
                worker.open_run(p)
            ids = prompts(n, vocab, args["prompt_tokens"])
            t0 = time.perf_counter()
            results = worker.execute_batch(
                [BatchStep(p.run_id, 0, 0, 1, np.array(ids[k], np.uint32)) for k, p in
                 enumerate(runs)]
            )  # fmt: skip
            prefill_s = time.perf_counter() - t0
            steps_s, steps_cpu_s, first_tokens = [], [], []
            for seq in range(1, args["tokens"] + 1):
                tokens = []
                for r in results:
                    assert isinstance(r, TokenOutput), r
                    tokens.append(r.token_id)
                first_tokens.append(tokens[0])
                batch = [
                    BatchStep(p.run_id, seq, 0, 1, np.array([t], np.uint32))
                    for p, t in zip(runs, tokens, strict=True)
                ]
                c0, t0 = time.process_time(), time.perf_counter()
                results = worker.execute_batch(batch)
                steps_s.append(time.perf_counter() - t0)
                steps_cpu_s.append(time.process_time() - c0)
            for p in runs:
                worker.close_run(p.run_id)
            out.append(
                {
                    "sequences": n,
                    "threads": args["threads"],
                    "prefill_s": prefill_s,
                    "steps_s": steps_s,
                    "steps_cpu_s": steps_cpu_s,
                    "tokens_per_s": n * len(steps_s) / sum(steps_s),
                    "first_tokens": first_tokens,
                }
            )
    finally:
        worker.forget_weights()
    return out


def run_ours(args: dict[str, Any]) -> list[dict[str, Any]]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(args["threads"])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, __file__, "--child", json.dumps(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the CPU worker failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result: list[dict[str, Any]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def run_llamacpp(args: dict[str, Any], python: str) -> list[dict[str, Any]]:
    cmd = [
        python, str(ROOT / "benchmarks" / "llamacpp_batch.py"), "--model", str(args["model"]),
        "--threads", str(args["threads"]),
        "--sequences", ",".join(str(n) for n in args["sequences"]),
        "--prompt-tokens", str(args["prompt_tokens"]), "--tokens", str(args["tokens"]),
        "--kv", "f32",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def counts(text: str) -> list[int]:
    try:
        values = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise SystemExit(f"{text!r} is not a comma-separated list of counts") from None
    if not values or values[0] < 1:
        raise SystemExit(f"{text!r}: every count must be >= 1")
    return values


def cpu_ms_per_token(row: dict[str, Any]) -> float:
    """The process's CPU time (every thread's) per decoded token: the figure a busy host
    changes least (time spent waiting for a core is not counted)."""
    steps: list[float] = row["steps_cpu_s"]
    return 1e3 * sum(steps) / (int(row["sequences"]) * len(steps))


def table(name: str, figures: dict[tuple[int, int], dict[str, list[float]]]) -> None:
    print(f"\n{name}: medians (under load: the machine is shared)")
    print(f"{'threads':>7} {'n':>3} {'ours tok/s':>10} {'l.cpp tok/s':>11} {'ratio':>6} "
          f"{'ours xn=1':>9} {'l.cpp xn=1':>10} {'ours cpu ms/tok':>15} "
          f"{'l.cpp cpu ms/tok':>16} {'cpu ratio':>9}")  # fmt: skip

    def med(f: dict[str, list[float]], key: str) -> float:
        return statistics.median(f[key]) if f[key] else float("nan")

    for (threads, n), f in sorted(figures.items()):
        base = figures[(threads, min(k for t, k in figures if t == threads))]
        ours, peer = med(f, "ours"), med(f, "llama.cpp")
        ours_cpu, peer_cpu = med(f, "ours cpu"), med(f, "llama.cpp cpu")
        print(f"{threads:>7} {n:>3} {ours:>10.1f} {peer:>11.1f} {ours / peer:>6.2f} "
              f"{ours / med(base, 'ours'):>9.2f} {peer / med(base, 'llama.cpp'):>10.2f} "
              f"{ours_cpu:>15.2f} {peer_cpu:>16.2f} {peer_cpu / ours_cpu:>9.2f}")  # fmt: skip
    print(
        "ratio: ours / llama.cpp tokens/s; cpu ratio: llama.cpp / ours CPU time per token "
        "(above 1: ours spends less)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"a list of {', '.join(KNOWN)}")
    parser.add_argument("--layers", type=int, default=4, help="blocks of the 8B-shape model")
    parser.add_argument("--threads", type=counts, default=[1, 2])
    parser.add_argument("--sequences", type=counts, default=[1, 2, 4, 8])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32, help="decode batches per count")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--llamacpp-python", default=LLAMACPP_PYTHON)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    for name in args.models.split(","):
        if name not in KNOWN:
            raise SystemExit(f"--models: {name!r} is not one of {', '.join(KNOWN)}")
    problem = llamacpp_problem(args.llamacpp_python)
    print(json.dumps({"processor": processor()}))
    if problem:
        print(f"llama.cpp is left out: {problem}")
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        folder = args.model_dir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for name in args.models.split(","):
            if name != "smollm2" and problem:
                print(f"{name}: left out (llama.cpp's quantizer makes it: {problem})")
                continue
            model = model_path(name, folder, args.layers, args.llamacpp_python, 2)
            figures: dict[tuple[int, int], dict[str, list[float]]] = {
                (t, n): {"ours": [], "llama.cpp": [], "ours cpu": [], "llama.cpp cpu": []}
                for t in args.threads
                for n in args.sequences
            }
            for rep in range(args.repeat):
                for threads in args.threads:
                    job = {"model": str(model), "threads": threads,
                           "sequences": args.sequences, "prompt_tokens": args.prompt_tokens,
                           "tokens": args.tokens}  # fmt: skip
                    order = ["ours", "llama.cpp"] if rep % 2 == 0 else ["llama.cpp", "ours"]
                    for who in order:
                        if who == "llama.cpp" and problem:
                            continue
                        rows = run_ours(job) if who == "ours" else run_llamacpp(
                            job, args.llamacpp_python
                        )  # fmt: skip
                        for row in rows:
                            f = figures[(threads, row["sequences"])]
                            f[who].append(row["tokens_per_s"])
                            f[who + " cpu"].append(cpu_ms_per_token(row))
                            print(json.dumps({"model": name, "runner": who, "repeat": rep,
                                              "cpu_ms_per_token": cpu_ms_per_token(row),
                                              **{k: row[k] for k in ("threads", "sequences",
                                                 "tokens_per_s", "prefill_s")}}))  # fmt: skip
            table(name, figures)
            report[name] = {f"{t}x{n}": f for (t, n), f in figures.items()}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
