"""The CPU worker against the NumPy reference worker and llama.cpp, side by side.

    python benchmarks/cpu_decode.py [--models smollm2,8b-q4_0,8b-q4_k,8b-q6_k,8b-q8_0]
        [--layers 4] [--threads 1,2] [--prompt-len 32] [--prefill-chunk 512] [--kv f32]
        [--tokens 32] [--repeat 3]
        [--runners cpu,cpu-avx2,llama.cpp,llama.cpp-avx2]
        [--llamacpp-python /work/llamacpp-venv/bin/python]
        [--llamacpp-avx2-python /work/llamacpp-avx2-venv/bin/python]
        [--model-dir DIR] [--json OUT.json]

- Prints the processor's name, the instruction sets it reports (of those the kernels
  or llama.cpp use) and those the CPU worker's kernels run here.
- Models: SmolLM2-135M-Instruct Q4_1 (the bundled file), and a model of Llama-3-8B's
  block shape (hidden 4096, feed-forward 14336, 32 heads over 8 kv heads, rotary base
  500000; ``--layers`` blocks, a 32000-token vocabulary, untied head) written here with
  ``gguf.GGUFWriter`` in F16 with random weights and quantized by llama.cpp's own
  quantizer (``llama_model_quantize``: MOSTLY_Q4_0, MOSTLY_Q4_K_S, MOSTLY_Q6_K,
  MOSTLY_Q8_0; when named, ``8b-q5_k`` MOSTLY_Q5_K_S, ``8b-iq4_xs``, ``8b-iq4_nl``,
  ``8b-q3_k`` MOSTLY_Q3_K_S, ``8b-q2_k``, ``8b-q5_0``, ``8b-q5_1``; its
  default choices for the other tensors) into a temporary folder (``--model-dir`` keeps
  them).
- Runners, each in a fresh process, interleaved (every repetition runs each runner once,
  in a rotating order) on the same prompt (``--prompt-len`` random ids; the CPU and
  NumPy workers take a prompt longer than ``--prefill-chunk`` in chunks of that many
  rows, as the runtime feeds them at its default ``max_batch_rows`` of 512, and
  llama.cpp splits its batch into micro-batches of 512), thread count
  and model: ``cpu`` (``CpuWorker``, one stage of every block, the best instruction
  set), ``cpu-<isa>`` (the same forced onto one set: ``cpu-avx2``, ``cpu-portable``,
  ``cpu-avxvnni``, ``cpu-avx512bw``, ``cpu-avx512``, ``cpu-avx512-zen4``,
  ``cpu-avx512-intel``), ``numpy``
  (``ReferenceWorker``, its BLAS on the same threads), ``llama.cpp`` (llama-cpp-python in
  ``--llamacpp-python``'s interpreter, memory-mapped weights, the CPU worker's KV cache
  type, float32 unless ``--kv f16``, no flash attention), ``llama.cpp-avx2`` (the same in
  ``--llamacpp-avx2-python``'s interpreter: a llama-cpp-python built for AVX2 without
  AVX-512, ``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF
  -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"`` and ``pip install --no-cache-dir
  llama-cpp-python``, since pip otherwise reuses a wheel it built with other flags),
  the peer of ``cpu-avx2`` as an AVX2-only processor would run both; skipped, with the
  reason, where that interpreter is missing or its llama.cpp reports AVX-512). Each
  llama.cpp's own system information (the instruction sets it was built for) is
  printed. Greedy decoding of ``--tokens``
  tokens. ``--threads`` is a list: every count is run (``all``: the cores this process
  may use), and a last table gives each runner's decode tokens/s per count and its
  scaling over 1 thread.
- Figures (medians over the repetitions): decode tokens/s (1 / the median decode step),
  prefill tokens/s (prompt length / the prefill's time; the first prefill of the
  process, right after loading, which the targets use; "again": the same prompt
  prefilled once more after the decode steps, from position 0 on a cleared cache, as a
  process that has served before runs it: the first one also pays the first touch of its
  buffers, which on a virtual machine can cost 5 us a page), the resident memory above
  the process's own after its imports (VmRSS just after the first prefill, a stage idle
  after a long prompt; VmRSS after the decode steps, before the prompt again, a
  decoding stage's; and VmHWM, the peak, which has a long prefill's step buffers), the
  bytes a
  decode step reads (every block's and the head's weights as the file stores them, one
  embedding row, float32 copies for the reference worker; and the KV cache of the
  positions a step sees, on average over the timed steps, which a long prompt makes a
  good part of them) over the median step time, as
  GB/s and as a share of this machine's read bandwidth measured here (as many threads
  each reading its part of a 1 GiB buffer in vector loads, ``csrc/read_probe.c``
  compiled here with ``-march=native``, best of 5, measured again before each model's
  runs and before each run, the best kept; NumPy's maximum over the parts where no C
  compiler is found); beside it, for the bandwidth target, each run's rate over the
  probe measured just before that run (the median run: a shared host's bandwidth moves
  by a quarter between its phases, and the best of the whole script sets a bar that the
  phase of a given run may not offer); the process's CPU time per decode token and per
  prompt token (every thread's; at 1 thread, the ratio a busy host distorts least,
  printed beside the wall-clock ratio). Also: warm start, the seconds from launching an
  interpreter to a bound SmolLM2 CPU worker that has decoded one token (the kernels are
  compiled when the package is installed).
- Targets (issue 26), printed as measured with PASS / MISS (nothing here is asserted):
  on the 8B shape, decode at least 90 % of the measured read bandwidth for Q4_0 and
  Q4_K; every ``cpu*`` row's decode and prefill at least 1.0 x llama.cpp's at the same
  threads (and ``cpu-avx2``'s at least 1.0 x ``llama.cpp-avx2``'s); the CPU worker's
  resident memory above its baseline within 1.25 x (the slice's bytes + its KV cache),
  the larger of its readings after the prefill and after the decode steps;
  warm start < 2 s. The machine may be shared: run it
  several times, compare ratios.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import contextlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
LLAMACPP_PYTHON = "/work/llamacpp-venv/bin/python"
#: a llama-cpp-python built for AVX2 without AVX-512 (the module's docstring says how)
LLAMACPP_AVX2_PYTHON = "/work/llamacpp-avx2-venv/bin/python"
MODELS = ("smollm2", "8b-q4_0", "8b-q4_k", "8b-q6_k", "8b-q8_0")
RUNNERS = ("cpu", "cpu-avx2", "llama.cpp", "llama.cpp-avx2")
#: each llama.cpp runner: its instruction set's CPU worker runner it is the peer of
PEERS = {"llama.cpp": None, "llama.cpp-avx2": "cpu-avx2"}
FTYPES = {
    "8b-q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "8b-q4_k": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
    "8b-q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
    "8b-q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "8b-q5_k": "LLAMA_FTYPE_MOSTLY_Q5_K_S",
    "8b-iq4_xs": "LLAMA_FTYPE_MOSTLY_IQ4_XS",
    "8b-iq4_nl": "LLAMA_FTYPE_MOSTLY_IQ4_NL",
    "8b-q3_k": "LLAMA_FTYPE_MOSTLY_Q3_K_S",
    "8b-q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K",
    "8b-q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0",
    "8b-q5_1": "LLAMA_FTYPE_MOSTLY_Q5_1",
}
#: also known to --models, not run unless named (Q5_K_S, the non-linear 4-bit types, the
#: 2- and 3-bit K-quants and the 5-bit legacy types)
MORE_MODELS = ("8b-q5_k", "8b-iq4_xs", "8b-iq4_nl", "8b-q3_k", "8b-q2_k", "8b-q5_0", "8b-q5_1")
#: the 8B-shape models whose decode should reach 90 % of the read bandwidth
BANDWIDTH_TARGETS = ("8b-q4_0", "8b-q4_k")
#: processor flags (as /proc/cpuinfo names them) of the instruction sets that matter here
CPU_FLAGS = ("sse4_2", "avx", "f16c", "fma", "avx2", "avx_vnni", "avx512f", "avx512bw",
             "avx512vl", "avx512_vnni", "avx512_bf16", "amx_int8")  # fmt: skip
VOCAB = 32000

# ---- the 8B-shape model ------------------------------------------------------------------


def add_id_vocab(w: Any) -> None:
    """A ``VOCAB``-token vocabulary of ids only (nothing here tokenizes text) on the
    ``gguf.GGUFWriter`` ``w``: the benchmark models' prompts are token ids."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"<t{i}>" for i in range(VOCAB)])
    w.add_token_types([1] * VOCAB)
    w.add_token_merges(["< t", "<t 1"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(VOCAB - 1)
    w.add_add_bos_token(False)


def write_f16_model(path: Path, n_layers: int) -> None:
    """A random-weight llama of Llama-3-8B's block shape in F16, one tensor at a time."""
    from gguf import GGUFWriter

    hidden, ffn, heads, heads_kv = 4096, 14336, 32, 8
    hd = hidden // heads
    rng = np.random.default_rng(0)
    w = GGUFWriter(path, "llama")
    w.add_name("bench-8b-shape")
    w.add_block_count(n_layers)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(heads_kv)
    w.add_rope_freq_base(500000.0)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(1)  # MOSTLY_F16
    add_id_vocab(w)
    specs: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (VOCAB, hidden))]
    for i in range(n_layers):
        p = f"blk.{i}."
        specs += [
            (p + "attn_norm.weight", (hidden,)),
            (p + "attn_q.weight", (hidden, hidden)),
            (p + "attn_k.weight", (heads_kv * hd, hidden)),
            (p + "attn_v.weight", (heads_kv * hd, hidden)),
            (p + "attn_output.weight", (hidden, hidden)),
            (p + "ffn_norm.weight", (hidden,)),
            (p + "ffn_gate.weight", (ffn, hidden)),
            (p + "ffn_up.weight", (ffn, hidden)),
            (p + "ffn_down.weight", (hidden, ffn)),
        ]
    specs += [("output_norm.weight", (hidden,)), ("output.weight", (VOCAB, hidden))]
    for name, shape in specs:
        dtype = np.float32 if len(shape) == 1 else np.float16
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * dtype().itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _name, shape in specs:
        if len(shape) == 1:
            data = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            data = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[1])).astype(
                np.float16
            )
        w.write_tensor_data(data)
    w.close()


QUANTIZE = """
import ctypes, sys, llama_cpp
src, dst, ftype, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, ftype)
params.nthread = threads
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
sys.exit(rc)
"""


def model_path(name: str, folder: Path, layers: int, llamacpp: str, threads: int) -> Path:
    if name == "smollm2":
        from runplan.models import resolve_model

        return Path(resolve_model("smollm2-135m"))
    path = folder / f"{name}-{layers}l.gguf"
    f16 = folder / f"8b-f16-{layers}l.gguf"
    return quantized(
        path, f16, lambda: write_f16_model(f16, layers), FTYPES[name], llamacpp, threads
    )


def quantized(
    path: Path, f16: Path, write_f16: Any, ftype: str, llamacpp: str, threads: int
) -> Path:
    """``path``: ``f16`` (written by ``write_f16()`` when missing) quantized to ``ftype``
    by llama.cpp's own quantizer in the ``llamacpp`` interpreter, unless it is there."""
    if not path.exists():
        if not f16.exists():
            print(f"writing {f16} ...", file=sys.stderr)
            write_f16()
        print(f"quantizing {path.name} with llama.cpp ...", file=sys.stderr)
        subprocess.run(
            [llamacpp, "-c", QUANTIZE, str(f16), str(path), ftype, str(threads)],
            check=True,
            capture_output=True,
        )
    return path


# ---- the runners (each in its own process) --------------------------------------------------

STATUS = """
def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)
"""

LLAMACPP_CHILD = (
    STATUS
    + """
import ctypes, json, sys, time
import numpy as np
import llama_cpp
args = json.loads(sys.argv[1])
base = status_kib("VmRSS")
llm = llama_cpp.Llama(args["model"], n_ctx=args["max_seq"], n_batch=args["max_seq"],
                      n_threads=args["threads"], n_threads_batch=args["threads"],
                      type_k=getattr(llama_cpp, "GGML_TYPE_" + args["kv"].upper()),
                      type_v=getattr(llama_cpp, "GGML_TYPE_" + args["kv"].upper()),
                      flash_attn=False, verbose=False)
n_vocab = llm.n_vocab()
def last():
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                               shape=(n_vocab,))))
c0, t0 = time.process_time(), time.perf_counter(); llm.eval(args["prompt"])
prefill, prefill_cpu = time.perf_counter() - t0, time.process_time() - c0
prefilled = status_kib("VmRSS")  # just after the prefill
tok, steps, steps_cpu = last(), [], []
for _ in range(args["tokens"]):
    c0, t0 = time.process_time(), time.perf_counter(); llm.eval([tok])
    steps.append(time.perf_counter() - t0); steps_cpu.append(time.process_time() - c0)
    tok = last()
rss = status_kib("VmRSS")  # decoding: after the decode steps
llm.reset()  # the same prompt again from position 0 (eval drops the cache from there)
c0, t0 = time.process_time(), time.perf_counter(); llm.eval(args["prompt"])
again, again_cpu = time.perf_counter() - t0, time.process_time() - c0
print(json.dumps({"prefill_s": prefill, "steps_s": steps, "prefill_cpu_s": prefill_cpu,
                  "steps_cpu_s": steps_cpu, "prefill_again_s": again,
                  "prefill_again_cpu_s": again_cpu, "base_kib": base,
                  "prefilled_kib": prefilled, "rss_kib": rss,
                  "peak_kib": status_kib("VmHWM")}))
"""
)


def provisions(model: str | Path, max_seq: int) -> Any:
    """The provisions of one stage holding every block of ``model``."""
    from runplan import (
        NodePool,
        NodeSpec,
        Placement,
        PlanRejection,
        RuntimeConfig,
        StageAssignment,
        model_facts_from_gguf,
        plan_run,
        provision_all,
    )

    facts = model_facts_from_gguf(model, max_seq_len=max_seq)
    plan = plan_run(
        facts,
        RuntimeConfig(run_id="bench", max_tokens=max_seq),
        NodePool(orchestrator_node_id="orch", nodes=(NodeSpec("n0", 2**40),)),
        stage_count=1,
        placement=Placement(assignments=(StageAssignment(0, "n0", 0, facts.num_layers),)),
    )
    assert not isinstance(plan, PlanRejection), plan
    return provision_all(plan)


def child(runner: str, args: dict[str, Any]) -> dict[str, Any]:
    """Run in a fresh process: bind one stage of every block, prefill, decode."""
    if runner == "warm":
        return warm_child()
    from runtime_core.workers.cpu.worker import CpuWorker
    from runtime_core.workers.interface import BatchStep, StepFailure, TokenOutput
    from runtime_core.workers.reference.worker import ReferenceWorker

    status: dict[str, Any] = {}
    exec(STATUS, status)
    base = status["status_kib"]("VmRSS")
    (prov,) = provisions(args["model"], args["max_seq"])
    worker: Any
    if runner.startswith("cpu"):  # "cpu": the best instruction set; "cpu-avx2": that one
        isa = runner.partition("-")[2] or None
        worker = CpuWorker(threads=args["threads"], isa=isa, kv_dtype=args["kv"])
    else:
        worker = ReferenceWorker()
    worker.configure(prov)
    t0 = time.perf_counter()
    worker.bind(prov.gguf_source)
    bind_s = time.perf_counter() - t0
    prompt, chunk = np.array(args["prompt"], np.uint32), args["prefill_chunk"]

    def prefill_prompt() -> Any:
        """The prompt as one step, or in chunks as the runtime sends a longer one."""
        if chunk <= 0 or len(prompt) <= chunk:
            return worker.execute_step(0, prompt)
        worker.close_run(prov.run_id)
        worker.open_run(prov)
        parts = [prompt[i : i + chunk] for i in range(0, len(prompt), chunk)]
        for j, part in enumerate(parts):
            (res,) = worker.execute_batch((BatchStep(prov.run_id, 0, j, len(parts), part),))
            if isinstance(res, StepFailure):
                raise RuntimeError(res.detail)
        return res

    c0, t0 = time.process_time(), time.perf_counter()
    out = prefill_prompt()
    prefill, prefill_cpu = time.perf_counter() - t0, time.process_time() - c0
    prefilled = status["status_kib"]("VmRSS")  # just after the prefill
    steps, steps_cpu = [], []
    for k in range(1, args["tokens"] + 1):
        assert isinstance(out, TokenOutput)
        c0, t0 = time.process_time(), time.perf_counter()
        out = worker.execute_step(k, np.array([out.token_id], np.uint32))
        steps.append(time.perf_counter() - t0)
        steps_cpu.append(time.process_time() - c0)
    rss = status["status_kib"]("VmRSS")  # decoding: after the decode steps
    c0, t0 = time.process_time(), time.perf_counter()  # the same prompt again: a new run
    prefill_prompt()
    again, again_cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "prefill_s": prefill,
        "steps_s": steps,
        "prefill_cpu_s": prefill_cpu,
        "steps_cpu_s": steps_cpu,
        "prefill_again_s": again,
        "prefill_again_cpu_s": again_cpu,
        "bind_s": bind_s,
        "base_kib": base,
        "prefilled_kib": prefilled,
        "rss_kib": rss,
        "peak_kib": status["status_kib"]("VmHWM"),
    }


def run_child(runner: str, args: dict[str, Any], llamacpp: dict[str, str]) -> dict[str, Any]:
    """One runner's figures, in a fresh process (llamacpp: each llama.cpp runner's
    interpreter)."""
    env = dict(os.environ)
    env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = str(args["threads"])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    if runner in PEERS:
        cmd = [llamacpp[runner], "-c", LLAMACPP_CHILD, json.dumps(args)]
    else:
        cmd = [sys.executable, __file__, "--child", runner, json.dumps(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{runner} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# ---- what is measured ----------------------------------------------------------------------


#: the read probe (``csrc/read_probe.c``), compiled once per run of the script
READ_PROBE = ROOT / "benchmarks" / "csrc" / "read_probe.c"
_probe: dict[str, Path | str] = {}


def build_read_probe(folder: Path) -> Path | str:
    """``csrc/read_probe.c`` compiled into ``folder`` (the C compiler ``CC``, else gcc,
    for this processor), or why it could not be (a message)."""
    out = folder / "read_probe"
    cc = shlex.split(os.environ.get("CC", "gcc")) or ["gcc"]  # "ccache gcc" too
    cmd = [*cc, "-O3", "-march=native", "-pthread", str(READ_PROBE), "-o", str(out)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        return f"{cc[0]}: {exc}"
    return out if done.returncode == 0 else f"{' '.join(cmd)}: {done.stderr.strip()[-500:]}"


def read_probe() -> Path | str:
    """The probe compiled once per process (``build_read_probe``), in a folder removed at
    exit."""
    if "exe" not in _probe:
        folder = Path(tempfile.mkdtemp(prefix="gguf-pipeline-probe-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _probe["exe"] = build_read_probe(folder)
    return _probe["exe"]


def read_bandwidth(threads: int) -> float:
    """Bytes per second ``threads`` threads read from a 1 GiB buffer, a part each, best of
    5: ``csrc/read_probe.c`` (vector loads into independent running XORs, each thread's
    part on its own memory node). Where no C compiler builds it, NumPy's maximum over
    the parts (which read this host at 33-37 GB/s on one thread where the C probe read
    38-42), said on stderr."""
    probe = read_probe()
    if isinstance(probe, Path):
        done = subprocess.run(
            [str(probe), str(threads), "1024", "5"], capture_output=True, text=True, check=False
        )
        if done.returncode == 0:
            return float(done.stdout.split()[0])
        probe = f"it failed ({done.returncode}): {done.stderr.strip()[-300:]}"
    if "warned" not in _probe:
        print(f"read probe not run ({probe}); NumPy's maximum instead", file=sys.stderr)
        _probe["warned"] = "yes"
    buf = np.ones(1 << 27, np.float64)  # 1 GiB, touched
    parts = np.array_split(buf, threads)
    best = 0.0
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in range(5):
            t0 = time.perf_counter()
            list(pool.map(np.max, parts))
            best = max(best, buf.nbytes / (time.perf_counter() - t0))
    return best


def weight_bytes(path: Path) -> dict[str, int]:
    """Bytes a decode step reads: stored (quantized) and as float32 copies."""
    from runplan.gguf_header import GgufHeader

    header = GgufHeader.read(path)
    stored = f32 = 0
    for name, info in header.tensors.items():
        n = int(np.prod(info.shape))
        if name == "token_embd.weight":
            row = info.shape[0]
            stored += info.n_bytes // (n // row)
            f32 += 4 * row
        else:
            stored += info.n_bytes
            f32 += 4 * n
    if "output.weight" not in header.tensors:  # tied head: the embedding, read whole
        info = header.tensors["token_embd.weight"]
        stored += info.n_bytes
        f32 += 4 * int(np.prod(info.shape))
    return {"stored": stored, "f32": f32}


def slice_bytes(path: Path, max_seq: int, kv_width: int = 4) -> tuple[int, int]:
    """(the stage's tensors as stored, its KV cache of kv_width-byte values) for one stage
    of every block."""
    from runplan.gguf_header import GgufHeader
    from runtime_core.model_config import ModelConfig

    header = GgufHeader.read(path)
    config = ModelConfig.from_header(header, ("llama", "qwen2"))
    kv = config.n_layers * config.n_kv_heads * max_seq * (config.head_dim_k + config.head_dim_v)
    return sum(i.n_bytes for i in header.tensors.values()), kv_width * kv


def warm_child() -> dict[str, float]:
    """In a fresh interpreter: import the CPU worker, bind SmolLM2, decode one token."""
    t0 = time.perf_counter()
    from runplan.models import resolve_model
    from runtime_core.workers.cpu.worker import CpuWorker

    t1 = time.perf_counter()
    (prov,) = provisions(resolve_model("smollm2-135m"), 16)
    worker = CpuWorker()
    worker.configure(prov)
    worker.bind(prov.gguf_source)
    t2 = time.perf_counter()
    worker.execute_step(0, np.array([504, 3575], np.uint32))
    t3 = time.perf_counter()
    return {"imports_s": t1 - t0, "bind_s": t2 - t1, "first_token_s": t3 - t2}


def warm_start() -> dict[str, float]:
    """Seconds from launching an interpreter to a bound SmolLM2 CPU worker's first token,
    and their parts (the kernels were compiled when the package was installed)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), ""]))
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", "warm", "{}"],
        check=True, env=env, capture_output=True, text=True,
    )  # fmt: skip
    parts: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    parts["total_s"] = time.perf_counter() - t0
    return parts


def summarize(results: list[dict[str, Any]], prompt_len: int) -> dict[str, float]:
    step = statistics.median(statistics.median(r["steps_s"]) for r in results)
    prefill = statistics.median(r["prefill_s"] for r in results)
    step_cpu = statistics.median(statistics.median(r["steps_cpu_s"]) for r in results)
    prefill_cpu = statistics.median(r["prefill_cpu_s"] for r in results)
    return {
        "decode_tokens_per_s": 1.0 / step,
        "decode_step_s": step,
        "prefill_tokens_per_s": prompt_len / prefill,
        "prefill_again_tokens_per_s": prompt_len
        / statistics.median(r["prefill_again_s"] for r in results),
        # the process's CPU time (every thread's) per token: on one thread, the figure a
        # busy host changes least (time waiting for a core is not counted)
        "decode_cpu_ms_per_token": 1e3 * step_cpu,
        "prefill_cpu_ms_per_token": 1e3 * prefill_cpu / prompt_len,
        "prefilled_above_base_mib": statistics.median(
            r["prefilled_kib"] - r["base_kib"] for r in results
        )
        / 1024,
        "rss_above_base_mib": statistics.median(r["rss_kib"] - r["base_kib"] for r in results)
        / 1024,
        "peak_above_base_mib": statistics.median(r["peak_kib"] - r["base_kib"] for r in results)
        / 1024,
        "runs": len(results),
    }


def llamacpp_problem(python: str, option: str = "--llamacpp-python") -> str | None:
    """Why ``python`` cannot run llama-cpp-python, or None."""
    if not Path(python).exists():
        return f"{python} does not exist ({option})"
    proc = subprocess.run(
        [python, "-c", "import llama_cpp"], check=False, capture_output=True, text=True
    )
    if proc.returncode != 0:
        return f"{python} cannot import llama_cpp: {proc.stderr.strip().splitlines()[-1:]}"
    return None


def llamacpp_system_info(python: str) -> str:
    """llama.cpp's own line of the instruction sets it was built for and its features."""
    proc = subprocess.run(
        [python, "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return " ".join(proc.stdout.split())


def llamacpp_interpreters(args: argparse.Namespace, runners: list[str]) -> dict[str, str]:
    """The interpreter of each llama.cpp runner that can run here; the others are named
    on stderr with the reason (the AVX2 peer also where its build reports AVX-512)."""
    given = {"llama.cpp": (args.llamacpp_python, "--llamacpp-python"),
             "llama.cpp-avx2": (args.llamacpp_avx2_python, "--llamacpp-avx2-python")}  # fmt: skip
    found: dict[str, str] = {}
    for runner in [r for r in runners if r in PEERS]:
        python, option = given[runner]
        problem = llamacpp_problem(python, option)
        info = llamacpp_system_info(python) if problem is None else ""
        if runner == "llama.cpp-avx2" and "AVX512 = 1" in info:
            problem = f"{python}'s llama.cpp was built with AVX-512 ({info})"
        if problem is not None:
            print(f"{runner} skipped: {problem}", file=sys.stderr)
            continue
        print(f"{runner}: {info}")
        found[runner] = python
    return found


def processor() -> dict[str, Any]:
    """The processor's name, the flags of CPU_FLAGS it reports, the kernels' sets here."""
    name, flags = "unknown", set[str]()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    from runtime_core.workers.cpu.kernels import host_isas

    return {
        "name": name,
        "cores": len(os.sched_getaffinity(0)),
        "flags": [f for f in CPU_FLAGS if f in flags],
        "kernel_isas": list(host_isas()),
    }


def thread_counts(text: str) -> list[int]:
    """``--threads``: a list of counts; ``all`` is the cores this process may use."""
    cores = len(os.sched_getaffinity(0))
    counts = [cores if t.strip() == "all" else int(t) for t in text.split(",") if t.strip()]
    if not counts or min(counts) < 1:
        raise SystemExit(f"--threads {text!r}: a list of positive counts (or all)")
    return sorted(set(counts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"a list of {', '.join(MODELS + MORE_MODELS)} (default: {', '.join(MODELS)})",
    )
    parser.add_argument(
        "--runners",
        default=",".join(RUNNERS),
        help="a list of cpu, cpu-<isa> (the CPU worker on one instruction set: cpu-avx2, "
        "cpu-avx512bw, ...), numpy, llama.cpp, llama.cpp-avx2 (default: %(default)s)",
    )
    parser.add_argument(
        "--layers", type=int, default=4, help="blocks of the 8B-shape models (default: 4)"
    )
    parser.add_argument("--threads", default="1,all", help="counts, e.g. 1,2 (all: every core)")
    parser.add_argument(
        "--prompt-len", type=int, default=32, help="prompt tokens prefilled (default: 32)"
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=512,
        help="rows of each prefill step of the CPU and NumPy workers, as the runtime's "
        "max_batch_rows (0: the whole prompt in one step; default: %(default)s)",
    )
    parser.add_argument(
        "--kv",
        choices=("f32", "f16"),
        default="f32",
        help="the KV cache's type for the CPU worker and llama.cpp (the NumPy worker's is "
        "float32; default: %(default)s, the CPU runtime's)",
    )
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed (default: 32)")
    parser.add_argument(
        "--repeat", type=int, default=3, help="fresh processes per runner, interleaved (default: 3)"
    )
    parser.add_argument(
        "--llamacpp-python",
        default=LLAMACPP_PYTHON,
        help="an interpreter with llama-cpp-python, built for this processor: the llama.cpp "
        "runner, and the quantizer of the 8B-shape models (default: %(default)s)",
    )
    parser.add_argument(
        "--llamacpp-avx2-python",
        default=LLAMACPP_AVX2_PYTHON,
        help="an interpreter with llama-cpp-python built for AVX2 only (the module's "
        "docstring gives its CMAKE_ARGS): the llama.cpp-avx2 runner (default: %(default)s)",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="keep the 8B-shape models here and reuse them (default: a temporary folder)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], json.loads(args.child[1]))))
        return
    models = [m for m in args.models.split(",") if m]
    if unknown_models := [m for m in models if m not in MODELS + MORE_MODELS]:
        raise SystemExit(f"--models: unknown {unknown_models} (known: {MODELS + MORE_MODELS})")
    runners = [r for r in args.runners.split(",") if r]
    counts = thread_counts(args.threads)
    unknown = [r for r in runners if r not in PEERS and r not in ("numpy", "cpu")
               and not r.startswith("cpu-")]  # fmt: skip
    if unknown:
        known = f"cpu, cpu-<isa>, numpy, {', '.join(PEERS)}"
        raise SystemExit(f"--runners: unknown {unknown} (known: {known})")
    cpu = processor()
    print(f"processor: {cpu['name']}, {cpu['cores']} cores; flags: {' '.join(cpu['flags'])}")
    llamacpp = llamacpp_interpreters(args, runners)
    runners = [r for r in runners if r not in PEERS or r in llamacpp]
    # the quantizer of the 8B shape: the llama.cpp runner's interpreter, checked above
    problem = None if "llama.cpp" in llamacpp else llamacpp_problem(args.llamacpp_python)
    if problem is not None:
        print(f"8B-shape models skipped: no llama.cpp to quantize them: {problem}", file=sys.stderr)
        models = [m for m in models if m == "smollm2"]
    print(f"CPU worker kernels on this processor: {', '.join(cpu['kernel_isas'])} (best last)")
    for runner in runners:
        isa = runner.partition("-")[2]
        if runner.startswith("cpu-") and isa not in cpu["kernel_isas"]:
            print(f"{runner} skipped: this processor does not run {isa}", file=sys.stderr)
    runners = [
        r for r in runners if not r.startswith("cpu-") or r.partition("-")[2] in cpu["kernel_isas"]
    ]
    folder = args.model_dir or Path(tempfile.mkdtemp(prefix="gguf-pipeline-cpu-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"processor": cpu, "threads": counts, "models": {}}
    try:
        bandwidth = {t: read_bandwidth(t) for t in counts}
        report["read_bandwidth_gb_s"] = {t: b / 1e9 for t, b in bandwidth.items()}
        for t, b in bandwidth.items():
            print(f"read bandwidth, {t} threads: {b / 1e9:.1f} GB/s")
        if "cpu" in runners:
            report["warm_start"] = ws = warm_start()
            verdict = "PASS" if ws["total_s"] < 2.0 else "MISS"
            print(
                f"warm start, interpreter to a bound SmolLM2 CPU worker's first token: "
                f"{ws['total_s']:.2f} s ({verdict}, target < 2 s; imports {ws['imports_s']:.2f}, "
                f"bind {ws['bind_s']:.2f}, first token {ws['first_token_s']:.2f})"
            )
        for name in models:
            path = model_path(name, folder, args.layers, args.llamacpp_python, max(counts))
            rng = np.random.default_rng(1)
            vocab = 49152 if name == "smollm2" else VOCAB
            prompt = [int(t) for t in rng.integers(1, vocab - 1, args.prompt_len)]
            max_seq = args.prompt_len + args.tokens + 1
            per_count: dict[int, Any] = {}
            for threads in counts:
                # measured again beside each model's runs, the best so far kept: a busy
                # host's bandwidth moves, and the share is of the most it gave
                bandwidth[threads] = max(bandwidth[threads], read_bandwidth(threads))
                report["read_bandwidth_gb_s"][threads] = bandwidth[threads] / 1e9
                job = {"model": str(path), "prompt": prompt, "tokens": args.tokens,
                       "threads": threads, "max_seq": max_seq,
                       "prefill_chunk": args.prefill_chunk, "kv": args.kv}  # fmt: skip
                raw: dict[str, list[dict[str, Any]]] = {r: [] for r in runners}
                for rep in range(args.repeat):
                    for runner in runners[rep % len(runners) :] + runners[: rep % len(runners)]:
                        beside = read_bandwidth(threads)  # the host's phase for this run
                        bandwidth[threads] = max(bandwidth[threads], beside)
                        raw[runner].append(run_child(runner, job, llamacpp) | {"probe": beside})
                per_count[threads] = figures(
                    name, path, raw, args, threads, bandwidth[threads], max_seq
                )
            report["models"][name] = per_count
        scaling(report["models"], counts, runners)
    finally:
        if args.model_dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))


def figures(
    name: str,
    path: Path,
    raw: dict[str, list[dict[str, Any]]],
    args: argparse.Namespace,
    threads: int,
    bandwidth: float,
    max_seq: int,
) -> dict[str, Any]:
    wb = weight_bytes(path)
    stored, kv = slice_bytes(path, max_seq, 2 if args.kv == "f16" else 4)
    # the KV cache a decode step reads: the positions it sees, on average over the
    # timed steps (prompt + 1 .. prompt + tokens)
    kv_read = int(kv / max_seq * (args.prompt_len + (args.tokens + 1) / 2))
    out: dict[str, Any] = {"weight_bytes_per_token": wb, "slice_bytes": stored, "kv_bytes": kv,
                           "kv_bytes_read_per_token": kv_read}  # fmt: skip
    print(
        f"\n{name} ({path.name}, {stored / 2**20:.0f} MiB stored), {threads} threads, "
        f"prompt {args.prompt_len}, {args.tokens} decode steps, {args.repeat} runs each; "
        f"read bandwidth (best measured) {bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"  {'runner':14} {'decode tok/s':>12} {'prefill tok/s':>13} {'again':>6} "
        f"{'RSS+ MiB: prefilled':>19} {'decoding':>8} {'peak':>6} {'GB/tok':>7} {'GB/s':>6} "
        f"{'of bw':>6} {'CPU ms/tok: decode':>18} {'prefill':>7}"
    )
    for runner, results in raw.items():
        s = summarize(results, args.prompt_len)
        nbytes = wb["stored"] + kv_read
        if runner == "numpy":  # float32 copies of the weights, a float32 cache
            nbytes = wb["f32"] + kv_read * (2 if args.kv == "f16" else 1)
        s["read_gb_s"] = nbytes / s["decode_step_s"] / 1e9
        s["of_bandwidth"] = nbytes / s["decode_step_s"] / bandwidth
        # each run's rate over the probe measured just before it, the median
        s["of_bandwidth_beside"] = statistics.median(
            nbytes / statistics.median(r["steps_s"]) / r["probe"] for r in results
        )
        out[runner] = s
        print(
            f"  {runner:14} {s['decode_tokens_per_s']:12.1f} {s['prefill_tokens_per_s']:13.1f} "
            f"{s['prefill_again_tokens_per_s']:6.1f} "
            f"{s['prefilled_above_base_mib']:19.0f} {s['rss_above_base_mib']:8.0f} "
            f"{s['peak_above_base_mib']:6.0f} "
            f"{nbytes / 1e9:7.3f} {s['read_gb_s']:6.1f} {s['of_bandwidth']:6.0%} "
            f"{s['decode_cpu_ms_per_token']:18.2f} {s['prefill_cpu_ms_per_token']:7.2f}"
        )
    ours = [r for r in raw if r.startswith("cpu")]
    for peer, of in PEERS.items():  # llama.cpp: every cpu* row; its AVX2 build: cpu-avx2's
        if peer not in out:
            continue
        lc, key = out[peer], "llamacpp" if of is None else "llamacpp_avx2"
        for runner in [r for r in ours if of is None or r == of]:
            r = out[runner]
            dec = r["decode_tokens_per_s"] / lc["decode_tokens_per_s"]
            pre = r["prefill_tokens_per_s"] / lc["prefill_tokens_per_s"]
            again = r["prefill_again_tokens_per_s"] / lc["prefill_again_tokens_per_s"]
            r[f"decode_ratio_to_{key}"], r[f"prefill_ratio_to_{key}"] = dec, pre
            r[f"prefill_again_ratio_to_{key}"] = again
            print(
                f"  {runner} / {peer}: decode {dec:.2f} ({pass_miss(dec >= 1.0)}, "
                f"target >= 1.0), prefill {pre:.2f} ({pass_miss(pre >= 1.0)}, target >= 1.0); "
                f"prefill again {again:.2f}"
            )
            if threads == 1:  # CPU time per token, llama.cpp's over ours
                dcpu = lc["decode_cpu_ms_per_token"] / r["decode_cpu_ms_per_token"]
                pcpu = lc["prefill_cpu_ms_per_token"] / r["prefill_cpu_ms_per_token"]
                r[f"decode_cpu_ratio_to_{key}"], r[f"prefill_cpu_ratio_to_{key}"] = dcpu, pcpu
                print(
                    f"    on CPU time (1 thread, waiting for a core not counted): decode "
                    f"{dcpu:.2f}, prefill {pcpu:.2f}"
                )
    if "cpu" in out and "numpy" in out:
        print(
            "  cpu / numpy: decode "
            f"{out['cpu']['decode_tokens_per_s'] / out['numpy']['decode_tokens_per_s']:.2f}"
        )
    if name in BANDWIDTH_TARGETS:
        for runner in ours:
            share, beside = out[runner]["of_bandwidth"], out[runner]["of_bandwidth_beside"]
            print(
                f"  {runner} decode reads {share:.0%} of the measured bandwidth "
                f"({pass_miss(share >= 0.9)}, target >= 90 %); {beside:.0%} of the probe "
                "just before each run (the median run)"
            )
    if "cpu" in out and name != "smollm2":
        limit = 1.25 * (stored + kv) / 2**20
        rss = max(out["cpu"]["prefilled_above_base_mib"], out["cpu"]["rss_above_base_mib"])
        print(
            f"  cpu resident above baseline {rss:.0f} MiB (the larger of after the prefill "
            f"and while decoding), limit {limit:.0f} MiB: {pass_miss(rss <= limit)}"
        )
    return out


def pass_miss(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def scaling(models: dict[str, dict[int, Any]], counts: list[int], runners: list[str]) -> None:
    """Decode tokens/s per thread count, and the scaling over the first count."""
    if len(counts) < 2:
        return
    head = "".join(f"{f'{t} thr':>9}" for t in counts)
    print(f"\ndecode tokens/s by threads (scaling over {counts[0]} thread(s) in brackets)")
    print(f"  {'model':10} {'runner':14}{head}")
    for name, per_count in models.items():
        for runner in runners:
            rates = [per_count[t][runner]["decode_tokens_per_s"] for t in counts]
            cells = "".join(f"{r:9.1f}" for r in rates)
            ups = ", ".join(f"x{r / rates[0]:.2f}" for r in rates[1:])
            print(f"  {name:10} {runner:14}{cells}  ({ups})")


if __name__ == "__main__":
    main()
