"""The CUDA worker's speed on a GPU: prefill and decode tokens/s, and the decode bound.

    python benchmarks/gpu_decode.py [--models smollm2,llama8b-q4_0,llama8b-q4_k]
        [--stages 1,2] [--prompt-len 128] [--decode-tokens 128] [--batch-runs 1,8,32]
        [--model-dir DIR] [--layers N] [--json OUT.json] [--write-only] [--emulated]

- Models: SmolLM2-135M-Instruct (Q4_1, the bundled file) and random-weight models with
  Llama-3-8B's shapes (32 blocks of 4096, 32 heads over 8 kv heads, feed-forward 14336,
  vocabulary 128256, untied head) in Q4_0 and in Q4_K, written once into ``--model-dir``
  by ``tests.support.random_model`` (random but valid blocks; ``--layers`` writes fewer
  blocks, for a quick look). ``--write-only`` writes the models and exits (the GPU check
  writes them in the background while the tests run).
- Each model in 1 and 2 stages on one GPU (2 stages pass f16 activations device to
  device), each with the decode step replayed as a CUDA graph and launched eagerly.
  The plan's activations are f16, as the CUDA runtime plans by default; greedy.
- Prefill: a prompt of ``--prompt-len`` random ids, timed from the call to the token on
  the host; tokens/s = prompt length / that time. Decode: ``--decode-tokens`` steps
  each feeding back its token, each timed from the call to the token on the host
  (everything a pipeline stage pays: copies, launches or the graph, synchronisation);
  tokens/s = 1 / the median step (the mean is in the JSON too). One warm-up run first
  (compilation, graph capture).
- Batched decode (CONCURRENT_RUNS.md): ``--batch-runs`` runs (1, 8 and 32; "" for none;
  ``--stages ""`` runs only these) on one chain
  of 1 stage, each with its own prompt of ``--prompt-len`` ids, prefilled in one batch,
  then ``--decode-tokens`` batched steps of one row per run, each step timed from the
  call to every run's token on the host; aggregate tokens/s = runs / the median step,
  beside the speed-up over 1 run. A run's tokens are checked equal to its tokens alone
  (batch invariance: the benchmark stops on a mismatch).
- ``--emulated``: the same code on the CUDA worker over the emulated CuPy and the SIMT
  emulator of the tests (a tiny model, a few steps): a check that the script runs on a
  host without a GPU. Its figures are the emulator's, not a GPU's, and say so.
- Bound: the bytes one decode step must read (every weight of the blocks, the output
  norm and head, one embedding row, the KV cache at the mean context) divided by the
  device-to-device copy bandwidth measured here (bytes read plus written per second,
  1 GiB buffers, the median of 20 copies timed with CUDA events). ``of bound`` is the
  measured decode tokens/s over the bound's.
- Targets (issue 7): SmolLM2 decode >= 1000 tokens/s with 1 stage; the 8B-shape Q4_0
  model >= 60 % of the bound; 2 stages within 10 % of 1 stage. Printed as measured,
  with PASS / MISS; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from runplan.gguf_header import GgufHeader
from runplan.models import resolve_model
from runtime_core.gguf_slice import EMBEDDING, OUTPUT
from runtime_core.model_config import ModelConfig
from runtime_core.workers.interface import BatchStep, TokenOutput
from runtime_cupy.cuda.worker import CUDA_CAPABILITIES, CudaWorker

# The in-process chain and the random-model writer live with the tests (tests/support).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.chain import Chain, provisions
from tests.support.cuda_device import cuda_device_problem
from tests.support.random_model import LLAMA3_8B, write_random_model

MODELS = ("smollm2", "llama8b-q4_0", "llama8b-q4_k")
DEFAULT_DIR = Path("/tmp/gguf-pipeline-models")


def model_path(name: str, folder: Path, layers: int | None, write: bool) -> Path:
    if name == "smollm2":
        return Path(resolve_model("smollm2-135m"))
    qtype = {"llama8b-q4_0": "Q4_0", "llama8b-q4_k": "Q4_K"}[name]
    spec = attrs.evolve(LLAMA3_8B, qtype=qtype, seed=8)
    if layers is not None:
        spec = attrs.evolve(spec, n_layers=layers)
    path = folder / f"random-llama3-8b-shapes-{spec.n_layers}L-{qtype}.gguf"
    if not path.exists():
        if not write:
            raise FileNotFoundError(path)
        folder.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        tmp = path.with_suffix(".partial")
        write_random_model(tmp, spec)
        tmp.rename(path)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)  # fmt: skip
    return path


def copy_bandwidth() -> float:
    """Device-to-device copy: (bytes read + bytes written) / s, median of 20."""
    import cupy

    n = 1 << 30
    src = cupy.empty(n, dtype=cupy.uint8)
    src.fill(1)
    dst = cupy.empty_like(src)
    for _ in range(3):
        cupy.copyto(dst, src)
    times = []
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(20):
        start.record()
        cupy.copyto(dst, src)
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    del src, dst
    cupy.get_default_memory_pool().free_all_blocks()
    return float(2 * n / statistics.median(times))


def bytes_per_token(path: Path, context: int) -> int:
    """What one decode step reads: every tensor but the embedding (the embedding too
    when it is the head), one embedding row, and K and V of ``context`` positions (f16)."""
    header = GgufHeader.read(path)
    tensors = header.tensors
    config = ModelConfig.from_header(header, CUDA_CAPABILITIES.architectures)
    embed = tensors[EMBEDDING]
    total = sum(t.n_bytes for name, t in tensors.items() if name != EMBEDDING)
    if OUTPUT not in tensors:  # tied head
        total += embed.n_bytes
    total += embed.n_bytes // embed.shape[1]
    kv = config.n_layers * config.n_kv_heads * (config.head_dim_k + config.head_dim_v) * 2
    return total + kv * context


def run_case(
    path: Path, stages: int, prompt: list[int], decode: int, graphs: list[bool]
) -> list[dict[str, Any]]:
    """Time a prefill and the decode steps with and without the graph (use_graph is a
    construction option: each setting binds its own workers)."""
    max_seq = len(prompt) + decode + 8
    provs = provisions(
        path,
        stages,
        dtype="f16",
        max_seq_len=max_seq,
        return_logits=False,
        worker=CUDA_CAPABILITIES,
    )
    rows = []
    for graph in graphs:
        t0 = time.perf_counter()
        chain = Chain.bind(provs, partial(CudaWorker, device_io=stages > 1, use_graph=graph))
        bind_s = time.perf_counter() - t0
        try:
            chain.generate(prompt[:16], 8)  # warm-up: compile, capture, allocate
            outs, prefill_s, steps = chain.timed_generate(prompt, decode + 1)
        finally:
            chain.release()
        rows.append(
            {
                "stages": stages,
                "graph": graph,
                "bind_s": round(bind_s, 3),
                "prompt_tokens": len(prompt),
                "prefill_s": prefill_s,
                "prefill_tok_s": len(prompt) / prefill_s,
                "decode_steps": len(steps),
                "decode_median_ms": 1e3 * statistics.median(steps),
                "decode_p90_ms": 1e3 * float(np.percentile(steps, 90)),
                "decode_tok_s": 1.0 / statistics.median(steps),
                "decode_mean_tok_s": len(steps) / sum(steps),
                "tokens": [o.token_id for o in outs[:8]],
            }
        )
    return rows


def run_batched(
    path: Path, runs: int, prompt_len: int, decode: int, make: Any, rng: np.random.Generator
) -> dict[str, Any]:
    """``runs`` runs on one 1-stage chain, prefilled in one batch, then ``decode`` batched
    decode steps of one row per run, each step timed; the tokens of each run."""
    vocab = GgufHeader.read(path).tensors[EMBEDDING].shape[1]
    prompts = {f"run-{k}": rng.integers(0, vocab, prompt_len).tolist() for k in range(runs)}
    provs = {
        r: provisions(
            path, 1, dtype="f16", max_seq_len=prompt_len + decode + 8, return_logits=False,
            worker=CUDA_CAPABILITIES, run_id=r, max_concurrent_runs=runs,
        )
        for r in prompts
    }  # fmt: skip
    chain = Chain.bind(provs["run-0"], make)
    try:
        for r in prompts:
            chain.open(provs[r])
        t0 = time.perf_counter()
        outs = chain.step_batch(
            [BatchStep(r, 0, 0, 1, np.array(p, np.uint32)) for r, p in prompts.items()]
        )
        prefill_s = time.perf_counter() - t0
        tokens = {r: [_token(outs[r])] for r in prompts}
        steps: list[float] = []
        for seq in range(1, decode + 1):
            batch = [BatchStep(r, seq, 0, 1, np.array([tokens[r][-1]], np.uint32)) for r in prompts]
            t0 = time.perf_counter()
            outs = chain.step_batch(batch)
            steps.append(time.perf_counter() - t0)
            for r in prompts:
                tokens[r].append(_token(outs[r]))
    finally:
        chain.release()
    return {
        "runs": runs,
        "prompt_tokens": prompt_len,
        "prefill_s": prefill_s,
        "decode_steps": len(steps),
        "step_median_ms": 1e3 * statistics.median(steps),
        "aggregate_tok_s": runs / statistics.median(steps),
        "tokens": tokens,
    }


def _token(out: Any) -> int:
    if not isinstance(out, TokenOutput):
        raise RuntimeError(f"a batched step failed: {out}")
    return int(out.token_id)


def batched_cases(
    path: Path, name: str, counts: list[int], prompt_len: int, decode: int, make: Any
) -> list[dict[str, Any]]:
    """Batched decode at each of ``counts`` runs; each run's tokens equal to its tokens
    alone (the same prompts: one generator seed per count)."""
    rows = []
    for runs in counts:
        row = run_batched(path, runs, prompt_len, decode, make, np.random.default_rng(runs))
        alone = run_batched(path, 1, prompt_len, decode, make, np.random.default_rng(runs))
        if row["tokens"]["run-0"] != alone["tokens"]["run-0"]:
            raise RuntimeError(f"{name}: run-0's tokens beside {runs - 1} others differ alone")
        row["model"] = name
        rows.append(row)
    base = next((r["aggregate_tok_s"] for r in rows if r["runs"] == 1), None)
    for row in rows:
        speedup = f"   x{row['aggregate_tok_s'] / base:.2f} of 1 run" if base else ""
        print(
            f"{name:14s} batched runs={row['runs']:3d} decode {row['aggregate_tok_s']:9.1f} "
            f"tok/s aggregate (step median {row['step_median_ms']:.3f} ms){speedup}",
            flush=True,
        )
        del row["tokens"]
    return rows


def main_emulated(args: argparse.Namespace) -> int:
    """The batched decode on the emulated CuPy and SIMT emulator (no GPU): a tiny model."""
    from tests.fixtures.gguf_models import ModelShape, write_model

    # imported by name: the emulated CuPy is test code, outside what mypy checks here
    worker = importlib.import_module("tests.support.emulated_cupy").EmulatedCudaWorker

    print("gpu_decode --emulated: the CUDA worker on the SIMT emulator, no GPU; these "
          "figures are the emulator's, not a GPU's")  # fmt: skip
    args.model_dir.mkdir(parents=True, exist_ok=True)
    path = write_model(args.model_dir / "emulated-tiny.gguf", ModelShape(n_layers=2))
    counts = [int(r) for r in args.batch_runs.split(",")]
    rows = batched_cases(path, "tiny (emulated)", counts, args.prompt_len, args.decode_tokens,
                         worker)  # fmt: skip
    if args.json is not None:
        doc = {"device": "emulated (no GPU)", "batched": rows}
        args.json.write_text(json.dumps(doc, indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--stages", default="1,2")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--layers", type=int, default=None, help="8B shapes with fewer blocks")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--batch-runs", default="1,8,32")
    parser.add_argument("--write-only", action="store_true")
    parser.add_argument("--emulated", action="store_true", help="no GPU: the SIMT emulator")
    args = parser.parse_args()
    if args.emulated:
        return main_emulated(args)
    names = [m for m in args.models.split(",") if m]
    for m in names:
        if m not in MODELS:
            parser.error(f"unknown model {m!r} (known: {', '.join(MODELS)})")
    if args.write_only:
        for m in names:
            print(model_path(m, args.model_dir, args.layers, write=True))
        return 0
    problem = cuda_device_problem()
    if problem is not None:
        print(f"gpu_decode: {problem}; nothing measured", file=sys.stderr)
        return 2
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    device = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    bandwidth = copy_bandwidth()
    print(f"device: {device}; copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s")
    rng = np.random.default_rng(0)
    stage_counts = [int(s) for s in args.stages.split(",") if s]  # "": batched cases only
    results: list[dict[str, Any]] = []
    for name in names:
        path = model_path(name, args.model_dir, args.layers, write=True)
        vocab = GgufHeader.read(path).tensors[EMBEDDING].shape[1]
        prompt = rng.integers(0, vocab, args.prompt_len).tolist()
        per_token = bytes_per_token(path, args.prompt_len + args.decode_tokens // 2)
        bound = bandwidth / per_token
        for stages in stage_counts:
            for row in run_case(path, stages, prompt, args.decode_tokens, [True, False]):
                row.update(model=name, bytes_per_token=per_token, bound_tok_s=bound)
                row["of_bound"] = row["decode_tok_s"] / bound
                results.append(row)
                print(
                    f"{name:14s} stages={stages} graph={'on ' if row['graph'] else 'off'} "
                    f"prefill {row['prefill_tok_s']:9.1f} tok/s   decode "
                    f"{row['decode_tok_s']:8.1f} tok/s (median {row['decode_median_ms']:.3f} "
                    f"ms, p90 {row['decode_p90_ms']:.3f})   bound {bound:8.1f} tok/s "
                    f"({per_token / 1e6:.1f} MB/token)   {100 * row['of_bound']:5.1f}% of bound",
                    flush=True,
                )
    counts = [int(r) for r in args.batch_runs.split(",") if r]
    batched: list[dict[str, Any]] = []
    for name in names:
        path = model_path(name, args.model_dir, args.layers, write=True)
        batched += batched_cases(path, name, counts, args.prompt_len, args.decode_tokens,
                                 CudaWorker)  # fmt: skip
    targets = check_targets(results)
    for line in targets:
        print(line)
    if args.json is not None:
        doc = {"device": device, "copy_bandwidth_bytes_s": bandwidth, "results": results,
               "batched": batched, "targets": targets,
               "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
        args.json.write_text(json.dumps(doc, indent=2))
    return 0


def check_targets(results: list[dict[str, Any]]) -> list[str]:
    def find(model: str, stages: int, graph: bool = True) -> dict[str, Any] | None:
        return next(
            (r for r in results if (r["model"], r["stages"], r["graph"]) == (model, stages, graph)),
            None,
        )

    lines = ["targets (issue 7), as measured:"]
    smol = find("smollm2", 1)
    if smol is not None:
        ok = smol["decode_tok_s"] >= 1000
        lines.append(f"  {'PASS' if ok else 'MISS'} SmolLM2 1-stage decode "
                     f"{smol['decode_tok_s']:.0f} tok/s (target >= 1000)")  # fmt: skip
    q40 = find("llama8b-q4_0", 1)
    if q40 is not None:
        ok = q40["of_bound"] >= 0.6
        lines.append(f"  {'PASS' if ok else 'MISS'} 8B-shape Q4_0 1-stage decode "
                     f"{100 * q40['of_bound']:.1f}% of the bound (target >= 60%)")  # fmt: skip
    for model in MODELS:
        one, two = find(model, 1), find(model, 2)
        if one is not None and two is not None:
            ratio = two["decode_tok_s"] / one["decode_tok_s"]
            ok = ratio >= 0.9
            lines.append(f"  {'PASS' if ok else 'MISS'} {model} 2 stages / 1 stage decode "
                         f"{100 * ratio:.1f}% (target >= 90%)")  # fmt: skip
    return lines


if __name__ == "__main__":
    sys.exit(main())
