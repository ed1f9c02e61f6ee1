"""The kernels' block decoders, run on the CPU, against their NumPy twins; and the
parts of ``kernels.py`` that need no GPU.

``kernels/quant.cuh`` and ``common.cuh`` are written so that their decoders also
compile as host C++ (``HD`` functions; inline PTX only under ``__CUDA_ARCH__``). A
small harness built here with the host compiler runs every type's ``dequant`` and
``dot_q8`` over random blocks and writes the results; they must equal the twins'
bit for bit (same integer sums, same float32 expressions, no fused multiply-add on
either side). The harness is built with ``GGUF_CHECK_ALIGN``, so every multi-byte
load of a block also checks that its address is aligned to its size, as a GPU requires,
in rows laid out as on the device. The GPU runs the very same source text, compiled
with ``--fmad=false`` (``kernels.COMPILE_OPTIONS``) so that, like this harness
(``-ffp-contract=off``), it fuses no multiply-add the source does not write:
NVRTC's default would fuse some in ``dot_q8`` (``test_kernels_compile.py`` counts
them in the PTX). What is left for the GPU tests is the device side: warps, launches,
the kernels' own loads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runplan.quant_types import CHUNK, FLOAT_TYPES, Q8_TYPES, QUANT_TYPES, block_elems
from runtime_core.activations import float32_to_bf16
from runtime_cupy.cuda.kernels import KERNEL_DIR, SIGNATURES, KernelSet, _arg
from tests.support import twins
from tests.support.random_blocks import filled_rows, random_rows

CXX = shutil.which("g++") or shutil.which("c++")
needs_cxx = pytest.mark.skipif(CXX is None, reason="no host C++ compiler (g++) on PATH")

HARNESS = r"""
#include "quant.cuh"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

// Built with GGUF_CHECK_ALIGN: each multi-byte load of quant.cuh checks its address.
void check_aligned(const void* p, unsigned n, const char* what) {
    if ((unsigned long long)p % n) {
        std::fprintf(stderr, "misaligned %u-byte load (%s) at %p\n", n, what, p);
        std::abort();
    }
}

template <class T>
static void dequant_all(const u8* raw, int rows, long long rb, int nc, float* out) {
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < nc; ++c)
            T::dequant(raw + r * rb, c, out + ((long long)r * nc + c) * 32);
}

template <class T>
static void dot_all(const u8* raw, int rows, long long rb, int nc, const i8* xq, const float* xd,
                    const float* xs, float* out) {
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < nc; ++c) {
            int x[8];
            std::memcpy(x, xq + 32 * c, 32);
            out[(long long)r * nc + c] = T::dot_q8(raw + r * rb, c, x, xd[c], xs[c]);
        }
}

template <class T>
static void run(bool q8, const std::vector<u8>& raw, int rows, long long rb, int nc,
                const std::vector<i8>& xq, const std::vector<float>& xd,
                const std::vector<float>& xs, FILE* out) {
    std::vector<float> deq((size_t)rows * nc * 32), dots((size_t)rows * nc);
    dequant_all<T>(raw.data(), rows, rb, nc, deq.data());
    std::fwrite(deq.data(), 4, deq.size(), out);
    if (q8) {
        dot_all<T>(raw.data(), rows, rb, nc, xq.data(), xd.data(), xs.data(), dots.data());
        std::fwrite(dots.data(), 4, dots.size(), out);
    }
}

template <class T>
static void run_float(const std::vector<u8>& raw, int rows, long long rb, int nc, FILE* out) {
    std::vector<float> deq((size_t)rows * nc * 32);
    dequant_all<T>(raw.data(), rows, rb, nc, deq.data());
    std::fwrite(deq.data(), 4, deq.size(), out);
}

int main(int argc, char** argv) {
    if (argc != 4) return 2;
    std::string type = argv[1];
    FILE* in = std::fopen(argv[2], "rb");
    FILE* out = std::fopen(argv[3], "wb");
    if (!in || !out) return 3;
    if (type == "half" || type == "bf16") {  // conversions
        std::vector<unsigned short> h(65536);
        for (int i = 0; i < 65536; ++i) h[i] = (unsigned short)i;
        for (int i = 0; i < 65536; ++i) {
            float f = type == "half" ? half_to_float(h[i]) : bf16_to_float(h[i]);
            std::fwrite(&f, 4, 1, out);
        }
        int n = 0;
        if (std::fread(&n, 4, 1, in) != 1) return 4;
        std::vector<float> f(n);
        if (std::fread(f.data(), 4, n, in) != (size_t)n) return 4;
        for (int i = 0; i < n; ++i) {
            unsigned short b = float_to_bf16(f[i]);
            std::fwrite(&b, 2, 1, out);
        }
        for (int i = 0; i < n; ++i) {
            unsigned short h = float_to_half(f[i]);
            std::fwrite(&h, 2, 1, out);
        }
        return 0;
    }
    int rows = 0, nc = 0;
    long long rb = 0;
    if (std::fread(&rows, 4, 1, in) != 1 || std::fread(&nc, 4, 1, in) != 1 ||
        std::fread(&rb, 8, 1, in) != 1)
        return 4;
    std::vector<u8> raw((size_t)rows * rb);
    std::vector<i8> xq((size_t)nc * 32);
    std::vector<float> xd(nc), xs(nc);
    if (std::fread(raw.data(), 1, raw.size(), in) != raw.size()) return 4;
    if (std::fread(xq.data(), 1, xq.size(), in) != xq.size()) return 4;
    if (std::fread(xd.data(), 4, nc, in) != (size_t)nc) return 4;
    if (std::fread(xs.data(), 4, nc, in) != (size_t)nc) return 4;
#define Q8(NAME) else if (type == #NAME) run<Type##NAME>(true, raw, rows, rb, nc, xq, xd, xs, out);
#define FL(NAME) else if (type == #NAME) run_float<Type##NAME>(raw, rows, rb, nc, out);
    if (false) {}
    FL(F32) FL(F16) FL(BF16)
    Q8(Q8_0) Q8(Q4_0) Q8(Q4_1) Q8(Q5_0) Q8(Q5_1) Q8(Q2_K) Q8(Q3_K) Q8(Q4_K) Q8(Q5_K) Q8(Q6_K)
    Q8(IQ4_NL) Q8(IQ4_XS)
    else return 5;
    std::fclose(out);
    return 0;
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if CXX is None:
        pytest.skip("no host C++ compiler (g++) on PATH")
    folder = tmp_path_factory.mktemp("harness")
    src = folder / "harness.cpp"
    src.write_text(HARNESS)
    exe = folder / "harness"
    proc = subprocess.run(
        [CXX, "-std=c++17", "-O2", "-Wall", "-Werror", "-ffp-contract=off", "-DGGUF_CHECK_ALIGN",
         "-I", str(KERNEL_DIR), str(src), "-o", str(exe)],
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return exe


def _payload(raw: np.ndarray, nc: int, act: twins.Q8Act) -> bytes:
    """The harness's input: rows, chunks, row stride, the rows, the activations."""
    return (
        np.array([raw.shape[0], nc], np.int32).tobytes()
        + np.array([raw.shape[1]], np.int64).tobytes()
        + raw.tobytes()
        + act.q.tobytes()
        + act.d.tobytes()
        + act.s.tobytes()
    )


def _run(exe: Path, qtype: str, payload: bytes, folder: Path) -> bytes:
    inp, out = folder / f"{qtype}.in", folder / f"{qtype}.out"
    inp.write_bytes(payload)
    proc = subprocess.run([str(exe), qtype, str(inp), str(out)], capture_output=True, check=False)
    assert proc.returncode == 0, (qtype, proc.returncode, proc.stderr)
    return out.read_bytes()


def row_shape(qtype: str) -> tuple[int, int]:
    """Odd sizes: 5 rows; 3 blocks (96) of the 32-element types, 3 super-blocks (768) of
    the 256-element ones."""
    return 5, 768 if block_elems(qtype) > CHUNK else 96


@needs_cxx
@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_device_decoders_equal_the_twins_bit_for_bit(
    harness: Path, tmp_path: Path, qtype: str
) -> None:
    rng = np.random.default_rng(QUANT_TYPES.index(qtype))
    rows, n = row_shape(qtype)
    raw = random_rows(rng, qtype, rows, n)
    nc = n // CHUNK
    act = twins.quantize_q8(rng.standard_normal(n).astype(np.float32))
    out = np.frombuffer(_run(harness, qtype, _payload(raw, nc, act), tmp_path), np.float32)
    deq = out[: rows * n].reshape(rows, n)
    np.testing.assert_array_equal(deq.view(np.uint32), twins.dequantize(raw, qtype).view(np.uint32))
    if qtype in Q8_TYPES:
        terms = out[rows * n :].reshape(rows, nc)
        expected = twins.chunk_terms_q8(raw, qtype, act)
        np.testing.assert_array_equal(terms.view(np.uint32), expected.view(np.uint32))
    else:
        assert out.size == rows * n


@needs_cxx
@pytest.mark.parametrize(("qtype", "pad"), [("Q4_1", 1), ("Q2_K", 2), ("IQ4_XS", 2), ("F16", 8)])
def test_a_misaligned_load_stops_the_harness(
    harness: Path, tmp_path: Path, qtype: str, pad: int
) -> None:
    """The harness is built with GGUF_CHECK_ALIGN: the decoders' loads check that they
    are aligned as a GPU requires (so the test above proves every type's loads are, in
    rows laid out as on the device). Rows ``pad`` bytes apart from their size are not."""
    rng = np.random.default_rng(3)
    rows, n = 3, row_shape(qtype)[1]
    raw = random_rows(rng, qtype, rows, n)
    padded = np.zeros((rows, raw.shape[1] + pad), np.uint8)
    padded[:, : raw.shape[1]] = raw
    nc = n // CHUNK
    act = twins.quantize_q8(rng.standard_normal(n).astype(np.float32))
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.write_bytes(_payload(padded, nc, act))
    proc = subprocess.run(
        [str(harness), qtype, str(inp), str(out)], capture_output=True, check=False
    )
    assert proc.returncode != 0 and b"misaligned" in proc.stderr, proc.stderr


@needs_cxx
@pytest.mark.parametrize("qtype", ["IQ4_NL", "IQ4_XS"])
def test_iq4_decoders_on_extreme_blocks_equal_the_twins(
    harness: Path, tmp_path: Path, qtype: str
) -> None:
    """IQ4_NL's and IQ4_XS's every value and scale at their extremes (rows whose every
    byte is 0x00, 0xFF, 0x87, 0x78, 0x5A), on activations of +-127 (the largest integer
    sums: 32 * 127 * 127, times IQ4_XS's scale of -32) and on random ones, bit for bit."""
    n = 512
    raw = np.concatenate([filled_rows(qtype, 1, n, fill, 0.02) for fill in (0, 255, 135, 120, 90)])
    nc = n // CHUNK
    ones = np.ones(n, np.float32)
    noise = np.random.default_rng(9).standard_normal(n).astype(np.float32)
    for x in (ones, -ones, noise):
        act = twins.quantize_q8(x)
        out = np.frombuffer(_run(harness, qtype, _payload(raw, nc, act), tmp_path), np.float32)
        deq = out[: raw.shape[0] * n].reshape(raw.shape[0], n)
        same = twins.dequantize(raw, qtype)
        np.testing.assert_array_equal(deq.view(np.uint32), same.view(np.uint32))
        terms = out[raw.shape[0] * n :].reshape(raw.shape[0], nc)
        expected = twins.chunk_terms_q8(raw, qtype, act)
        np.testing.assert_array_equal(terms.view(np.uint32), expected.view(np.uint32))


#: Half precision's edges: the largest half, values rounding to it or to infinity,
#: subnormal steps and ties, the smallest normal and the largest subnormal.
HALF_EDGES = [65504, 65519.99, 65520, -65520, 2.0**-24, 2.0**-25, 3 * 2.0**-25,
              2.0**-25 + 2.0**-40, 2.0**-14, 2.0**-14 - 2.0**-25]  # fmt: skip


@needs_cxx
def test_half_and_bfloat16_conversions_are_exact(harness: Path, tmp_path: Path) -> None:
    """Every half and bfloat16 to float, and float to bfloat16 and to half (its host path,
    which the SIMT emulator runs) on random, edge and subnormal values, bit for bit."""
    rng = np.random.default_rng(7)
    values = np.concatenate(
        [
            rng.standard_normal(4096).astype(np.float32) * np.float32(1e4),
            np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, 3.4e38, -1.5], np.float32),
            np.array(HALF_EDGES, np.float32),
            (np.float32(2.0**-14) * rng.random(4096).astype(np.float32)),
            rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32).view(np.float32),
        ]
    )
    payload = np.array([values.size], np.int32).tobytes() + values.tobytes()
    all_bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    for kind in ("half", "bf16"):
        out = _run(harness, kind, payload, tmp_path)
        floats = np.frombuffer(out[: 65536 * 4], np.float32)
        if kind == "half":
            expected = all_bits.view(np.float16).astype(np.float32)
        else:
            expected = (all_bits.astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal(floats.view(np.uint32), expected.view(np.uint32))
        bf = np.frombuffer(out[65536 * 4 : 65536 * 4 + 2 * values.size], np.uint16)
        np.testing.assert_array_equal(bf, float32_to_bf16(values))
        halves = np.frombuffer(out[65536 * 4 + 2 * values.size :], np.uint16)
        nan = np.isnan(values)
        with np.errstate(over="ignore"):
            expected_halves = values.astype(np.float16).view(np.uint16)
        np.testing.assert_array_equal(halves[~nan], expected_halves[~nan])
        assert (halves[nan] == 0x7FFF).all()  # cvt.rn.f16.f32's canonical NaN


def test_importing_the_worker_does_not_import_cupy() -> None:
    code = (
        "import sys; import runtime_cupy.cuda.worker, runtime_cupy.cuda.kernels, "
        "tests.support.twins, "
        "tests.support.twin_stage, tests.support.kernel_twins, tests.support.chain, "
        "runtime_core.workers.forward_program, runtime_core.workers.device_sampling; "
        "print('cupy' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_kernel_arguments_are_converted_to_the_parameter_types() -> None:
    assert _arg("i", 7).dtype == np.int32
    assert _arg("l", 7).dtype == np.int64
    assert _arg("f", 0.5).dtype == np.float32
    assert _arg("p", None) == 0 and _arg("p", None).dtype == np.uint64
    marker = object()
    assert _arg("p", marker) is marker
    with pytest.raises(ValueError):
        _arg("x", 1)


def test_a_launch_with_the_wrong_number_of_arguments_is_refused() -> None:
    ks = KernelSet()  # no CuPy needed: the check comes first
    with pytest.raises(TypeError, match="takes"):
        ks.launch("add_inplace", 1, 32, (None, None))
    with pytest.raises(ValueError, match="empty grid"):
        ks.launch("add_inplace", 0, 32, (None, None, 0))


def test_every_kernel_has_a_signature_and_every_type_its_kernels() -> None:
    for t in QUANT_TYPES:
        assert f"matvec_f_{t}" in SIGNATURES and f"dequant_rows_{t}" in SIGNATURES
    for t in Q8_TYPES:
        assert f"matvec_q8_{t}" in SIGNATURES
    for t in FLOAT_TYPES:
        assert f"matvec_q8_{t}" not in SIGNATURES
    with pytest.raises(ValueError, match="compiler"):
        KernelSet(compiler="clang")


def test_the_planner_counts_the_cuda_worker_s_weights_as_stored() -> None:
    """The CUDA worker keeps weights quantized and its KV cache in the activation
    dtype; the memory check must count them so, not as float32."""
    from runtime_cupy.cuda.worker import CUDA_CAPABILITIES

    assert CUDA_CAPABILITIES.weight_bytes_per_element == 0
    assert CUDA_CAPABILITIES.kv_bytes_per_element == 0
