"""The kernels' bits do not depend on the calling thread's floating-point environment
(``csrc/fp_env.h``): with flush-to-zero and denormals-are-zero set (what a library built
with ``-ffast-math`` sets in the thread that loads it) or another rounding mode
(``fesetround``), each call computes the bits it computes under IEEE's defaults, on
every instruction set, and gives the caller's environment back. The environment is set
through the C library's ``fegetenv`` / ``fesetenv`` (glibc's x86-64 ``fenv_t``: MXCSR
at byte 28)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime_core.workers.cpu import _kernels
from tests.support.kernels_tree import kernels_pythonpath
from tests.support.mxcsr import DAZ, FTZ, ROUNDING, ROUNDING_BITS, mxcsr_set

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or platform.libc_ver()[0] != "glibc",
    reason="glibc's x86-64 fenv_t (MXCSR at byte 28)",
)

ENVIRONMENTS = {
    "flush-to-zero, denormals-are-zero": (FTZ | DAZ, 0),
    **{f"round {name}": (bits, ROUNDING_BITS) for name, bits in ROUNDING.items()},
}


def _inputs() -> np.ndarray:
    rng = np.random.default_rng(11)
    x = rng.uniform(-104.0, 89.0, 2048).astype(np.float32)
    low = rng.uniform(-104.0, -87.0, 512).astype(np.float32)  # exp: subnormal results
    tiny = (rng.standard_normal(512) * 1e-39).astype(np.float32)  # subnormal inputs
    return np.concatenate([x, low, tiny])


#: made once, under IEEE's defaults (NumPy under flush-to-zero would make other inputs)
X = _inputs()
H = X[: 8 * 384].reshape(8, 384).copy()
SMALL = X[:1024] * np.float32(1e-40)  # quantized: subnormal scales and values
W = np.random.default_rng(12).standard_normal((8, 64)).astype(np.float32)
MATRIX = _kernels.Matrix([(W.view(np.uint8).ravel(), "F32", 8, 64, 0)])
Q8_W = np.random.default_rng(13).integers(0, 256, 8 * 2 * 34).astype(np.uint8)
Q8_MATRIX = _kernels.Matrix([(Q8_W, "Q8_0", 8, 64, 0)])  # scales: bytes, any half
TINY_ROWS = SMALL[: 2 * 64].reshape(2, 64).copy()  # subnormal inputs and products


def _results(isa: str) -> dict[str, bytes]:
    """Each kernel's results on the inputs (computed in this thread's environment)."""
    x = X
    out: dict[str, bytes] = {}
    for name in ("exp32", "tanh32"):
        y = np.empty_like(x)
        getattr(_kernels, name)(x, y, isa=isa)
        out[name] = y.tobytes()
    act = np.empty((8, 192), np.float32)
    _kernels.swiglu(H.copy(), act, 8, 192, 2, isa=isa)  # one item: the caller runs it
    out["swiglu"] = act.tobytes()
    rows, n = 4, 256
    q = np.empty(rows * n, np.int8)
    d, s = np.empty(rows * n // 32, np.float32), np.empty(rows * n // 32, np.float32)
    g = np.empty(rows * n // 16, np.int32)
    _kernels.quantize("q8_0", SMALL, rows, n, q, d, s, g, isa=isa)
    out["quantize"] = q.tobytes() + d.tobytes()
    # linear_spans: float activations, and activations it quantizes itself
    x = TINY_ROWS
    y = np.zeros((2, 8), np.float32)
    _kernels.linear_spans([MATRIX], [(0, 2)], x, None, None, None, None, y, 1, isa=isa)
    out["linear_spans"] = y.tobytes()
    q, d, s = np.zeros((2, 64), np.int8), np.zeros(4, np.float32), np.zeros(4, np.float32)
    g = np.zeros(8, np.int32)
    y = np.zeros((2, 8), np.float32)
    _kernels.linear_spans([Q8_MATRIX], [(0, 2)], x, q, d, s, g, y, 1, isa=isa)
    out["linear_spans q8"] = q.tobytes() + d.tobytes() + y.tobytes()
    # a float argument: rounded to float32 as IEEE's defaults round it
    y = np.ones(4, np.float32)
    _kernels.scale(y[:2], 0.1, 1)  # rounded up to nearest, down toward zero
    _kernels.scale(y[2:], 1e-39, 1)  # a subnormal float32, zero flushed
    z = np.zeros(4, np.float32)
    _kernels.add_scaled(z, np.ones(4, np.float32), 0.1, 1)
    out["float argument"] = y.tobytes() + z.tobytes()
    return out


@pytest.mark.parametrize("isa", _kernels.isas())
@pytest.mark.parametrize("environment", sorted(ENVIRONMENTS))
def test_the_callers_environment_changes_no_bit_and_is_given_back(
    isa: str, environment: str
) -> None:
    expected = _results(isa)
    bits, clear = ENVIRONMENTS[environment]
    with mxcsr_set(bits, clear) as mxcsr:
        before = mxcsr()
        assert before & (bits | clear) == bits  # the environment is in force
        got = _results(isa)
        assert mxcsr() == before  # the caller's, given back
    assert got.keys() == expected.keys()
    for name in expected:
        assert got[name] == expected[name], name


def test_the_environment_is_one_that_changes_these_results() -> None:
    """Without the kernels' own environment these inputs' results would differ: NumPy
    under flush-to-zero gives zeros where IEEE's defaults give subnormal numbers."""
    tiny = np.array([1e-39, -3e-40], np.float32)
    with mxcsr_set(FTZ | DAZ):
        flushed = tiny * np.float32(1.0)
    assert (flushed == 0).all() and (tiny * np.float32(1.0) != 0).all()


#: made in a process whose MXCSR rounds toward zero when it loads the kernels
_IMPORTED_UNDER = """
import sys
import numpy as np
from tests.support.mxcsr import ROUNDING, ROUNDING_BITS, set_mxcsr
h = np.load(sys.argv[1])
set_mxcsr(ROUNDING["toward zero"], ROUNDING_BITS)
from runtime_core.workers.cpu import _kernels
set_mxcsr(0, ROUNDING_BITS)
rows, f = h.shape[0], h.shape[1] // 2
gelu, silu = np.empty((rows, f), np.float32), np.empty((rows, f), np.float32)
_kernels.geglu(h, gelu, rows, f, 1)
_kernels.swiglu(h, silu, rows, f, 1)
np.save(sys.argv[2], np.stack([gelu, silu]))
"""


def test_the_kernels_loaded_in_another_environment_compute_the_same_bits(
    tmp_path: Path,
) -> None:
    """GELU's table of halves, made when the module loads, does not take the loading
    thread's rounding: every half under 10 goes through it."""
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    gate = halves[np.isfinite(halves) & (np.abs(halves) < 10)].astype(np.float32)
    f = gate.size // 4
    h = np.concatenate([gate[: 4 * f].reshape(4, f), np.full((4, f), 1.5, np.float32)], 1)
    np.save(tmp_path / "h.npy", h)
    subprocess.run(
        [sys.executable, "-c", _IMPORTED_UNDER, str(tmp_path / "h.npy"), str(tmp_path / "out.npy")],
        check=True, timeout=120, env={**os.environ, "PYTHONPATH": kernels_pythonpath()},
    )  # fmt: skip
    gelu, silu = np.empty((4, f), np.float32), np.empty((4, f), np.float32)
    _kernels.geglu(h, gelu, 4, f, 1)
    _kernels.swiglu(h, silu, 4, f, 1)
    got = np.load(tmp_path / "out.npy")
    assert got[0].tobytes() == gelu.tobytes(), "geglu"
    assert got[1].tobytes() == silu.tobytes(), "swiglu"
