"""The CPU worker on a mixture of experts, beside llama.cpp: a random-weight model of
Qwen3-30B-A3B's block shape, decode and prefill tokens/s.

    python benchmarks/cpu_moe.py [--types q4_k,q8_0] [--layers 2] [--threads 1,2]
        [--prompt-len 32] [--tokens 32] [--repeat 3] [--model-dir DIR]
        [--llamacpp-python /work/llamacpp-venv/bin/python] [--json OUT.json]

- The model: ``qwen3moe`` with Qwen3-30B-A3B's block (hidden 2048, 32 query heads of 128
  over 4 key/value heads, per-head Q/K norms, 128 experts of 768, 8 used per token),
  ``--layers`` blocks, a 32000-token vocabulary and an untied head, written here in F16
  with random weights (``gguf.GGUFWriter``) and quantized by llama.cpp's own quantizer
  (``Q4_K_S``, ``Q8_0``; the router stays float32, as llama.cpp keeps it).
- Runners, each in a fresh process, interleaved, same prompt and threads (the children
  of ``benchmarks/cpu_decode.py``): ``cpu`` (the CPU worker, best instruction set) and
  ``llama.cpp`` (llama-cpp-python in ``--llamacpp-python``: float32 KV cache, no flash
  attention).
- Printed, medians over the repetitions: decode tokens/s, prefill tokens/s (the first
  prefill after loading, and the same prompt again after the decode steps), the ratios
  to llama.cpp (target: at least 1.0, as issue 26 sets for every row), and the bytes a
  decode token reads when its 8 experts are distinct per block (attention, router, 8 of
  128 experts, head) against the measured read bandwidth (a ceiling: a token's rows
  choose 8 experts per block, and the probe reads in one stream).
Nothing is asserted: the machine may be shared (compare the ratios, run it again).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_decode import (  # noqa: E402
    LLAMACPP_PYTHON,
    VOCAB,
    add_id_vocab,
    llamacpp_problem,
    processor,
    quantized,
    read_bandwidth,
    run_child,
    thread_counts,
)

HIDDEN, HEADS, HEADS_KV, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, USED, EXPERT_FFN = 128, 8, 768
FTYPES = {"q4_k": "LLAMA_FTYPE_MOSTLY_Q4_K_S", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}


def write_f16_model(path: Path, n_layers: int) -> None:
    """A random-weight qwen3moe of Qwen3-30B-A3B's block shape in F16."""
    from gguf import GGUFWriter

    rng = np.random.default_rng(0)
    w = GGUFWriter(path, "qwen3moe")
    w.add_name("bench-qwen3moe-shape")
    w.add_block_count(n_layers)
    w.add_context_length(4096)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(6144)
    w.add_expert_feed_forward_length(EXPERT_FFN)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(USED)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(1e6)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(1)  # MOSTLY_F16
    add_id_vocab(w)
    q, kv = HEADS * HEAD_DIM, HEADS_KV * HEAD_DIM
    specs: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (VOCAB, HIDDEN))]
    for i in range(n_layers):
        p = f"blk.{i}."
        specs += [
            (p + "attn_norm.weight", (HIDDEN,)),
            (p + "attn_q.weight", (q, HIDDEN)),
            (p + "attn_k.weight", (kv, HIDDEN)),
            (p + "attn_v.weight", (kv, HIDDEN)),
            (p + "attn_q_norm.weight", (HEAD_DIM,)),
            (p + "attn_k_norm.weight", (HEAD_DIM,)),
            (p + "attn_output.weight", (HIDDEN, q)),
            (p + "ffn_norm.weight", (HIDDEN,)),
            (p + "ffn_gate_inp.weight", (EXPERTS, HIDDEN)),
            (p + "ffn_gate_exps.weight", (EXPERTS, EXPERT_FFN, HIDDEN)),
            (p + "ffn_up_exps.weight", (EXPERTS, EXPERT_FFN, HIDDEN)),
            (p + "ffn_down_exps.weight", (EXPERTS, HIDDEN, EXPERT_FFN)),
        ]
    specs += [("output_norm.weight", (HIDDEN,)), ("output.weight", (VOCAB, HIDDEN))]

    def f32(name: str, shape: tuple[int, ...]) -> bool:  # norms and the router
        return len(shape) == 1 or name.endswith("ffn_gate_inp.weight")

    for name, shape in specs:
        dtype = np.float32 if f32(name, shape) else np.float16
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * dtype().itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape in specs:
        if len(shape) == 1:
            w.write_tensor_data((1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        data = rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])
        w.write_tensor_data(data.astype(np.float32 if f32(name, shape) else np.float16))
    w.close()


def model_path(kind: str, folder: Path, layers: int, llamacpp: str, threads: int) -> Path:
    path = folder / f"qwen3moe-{kind}-{layers}l.gguf"
    f16 = folder / f"qwen3moe-f16-{layers}l.gguf"
    return quantized(
        path, f16, lambda: write_f16_model(f16, layers), FTYPES[kind], llamacpp, threads
    )


def active_bytes(path: Path) -> int:
    """Bytes a decode token reads whose rows choose 8 distinct experts per block: every
    tensor but the experts' (the embedding: one row), and 8 / 128 of theirs."""
    from runplan.gguf_header import GgufHeader

    total = 0
    for name, info in GgufHeader.read(path).tensors.items():
        if name == "token_embd.weight":
            total += info.n_bytes // info.shape[1]
        elif "_exps." in name:
            total += info.n_bytes * USED // EXPERTS
        else:
            total += info.n_bytes
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default="q4_k,q8_0", help="of q4_k, q8_0 (default: both)")
    parser.add_argument("--layers", type=int, default=2, help="blocks (default: 2)")
    parser.add_argument("--threads", default="1,all", help="counts, e.g. 1,2 (all: every core)")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default: 32)")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed (default: 32)")
    parser.add_argument("--repeat", type=int, default=3, help="processes per runner (default: 3)")
    parser.add_argument("--llamacpp-python", default=LLAMACPP_PYTHON)
    parser.add_argument("--model-dir", type=Path, default=None, help="keep the models here")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    kinds = [k for k in args.types.split(",") if k]
    if unknown := [k for k in kinds if k not in FTYPES]:
        raise SystemExit(f"--types: unknown {unknown} (known: {', '.join(FTYPES)})")
    if (problem := llamacpp_problem(args.llamacpp_python)) is not None:
        raise SystemExit(f"llama.cpp is needed to quantize the model and to compare: {problem}")
    counts = thread_counts(args.threads)
    cpu = processor()
    print(f"processor: {cpu['name']}, {cpu['cores']} cores; CPU worker kernels: "
          f"{', '.join(cpu['kernel_isas'])} (best last)")  # fmt: skip
    folder = args.model_dir or Path(tempfile.mkdtemp(prefix="gguf-pipeline-moe-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    llamacpp = {"llama.cpp": args.llamacpp_python}
    runners = ["cpu", "llama.cpp"]
    report: dict[str, Any] = {"processor": cpu, "models": {}}
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(1, VOCAB - 1, args.prompt_len)]
    max_seq = args.prompt_len + args.tokens + 1
    print("| type | threads | runner | decode tok/s | prefill tok/s (first / again) | "
          "decode x llama.cpp | prefill x llama.cpp (first / again) | decode GB/s (share of "
          "probe) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    try:
        for kind in kinds:
            path = model_path(kind, folder, args.layers, args.llamacpp_python, max(counts))
            read = active_bytes(path)
            print(f"({kind}: a decode token reads {read / 1e6:.0f} MB of weights at most)")
            for threads in counts:
                probe = read_bandwidth(threads)
                job = {"model": str(path), "prompt": prompt, "tokens": args.tokens,
                       "threads": threads, "max_seq": max_seq}  # fmt: skip
                raw: dict[str, list[dict[str, Any]]] = {r: [] for r in runners}
                for rep in range(args.repeat):
                    for runner in runners[rep % 2 :] + runners[: rep % 2]:
                        raw[runner].append(run_child(runner, job, llamacpp))
                fig = {
                    r: {
                        "decode": 1 / statistics.median(s for x in raw[r] for s in x["steps_s"]),
                        "prefill": args.prompt_len
                        / statistics.median(x["prefill_s"] for x in raw[r]),
                        "prefill_again": args.prompt_len
                        / statistics.median(x["prefill_again_s"] for x in raw[r]),
                    }
                    for r in runners
                }
                report["models"].setdefault(kind, {})[threads] = fig
                for r in runners:
                    d, p, a = (fig[r][k] for k in ("decode", "prefill", "prefill_again"))
                    peer = fig["llama.cpp"]
                    ratios = d / peer["decode"], p / peer["prefill"], a / peer["prefill_again"]
                    gbs = d * read / 1e9
                    print(
                        f"| {kind} | {threads} | {r} | {d:.1f} | {p:.1f} / {a:.1f} | "
                        f"{ratios[0]:.2f} | {ratios[1]:.2f} / {ratios[2]:.2f} | {gbs:.1f} "
                        f"({100 * gbs / (probe / 1e9):.0f} %) |"
                    )
    finally:
        if args.model_dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
