"""The kernels' bits do not depend on the calling thread's floating-point environment
(``csrc/fp_env.h``): with flush-to-zero and denormals-are-zero set (what a library built
with ``-ffast-math`` sets in the thread that loads it) or another rounding mode
(``fesetround``), each call computes the bits it computes under IEEE's defaults, on
every instruction set, and gives the caller's environment back. The environment is set
through the C library's ``fegetenv`` / ``fesetenv`` (glibc's x86-64 ``fenv_t``: MXCSR
at byte 28)."""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from runtime_core.workers.cpu import _kernels

LIBM = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")  # fegetenv, fesetenv
pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or platform.libc_ver()[0] != "glibc",
    reason="glibc's x86-64 fenv_t (MXCSR at byte 28)",
)
FTZ, DAZ = 0x8000, 0x0040
ROUNDING = {"toward zero": 0x6000, "up": 0x4000, "down": 0x2000}


def _get_env() -> ctypes.Array[ctypes.c_char]:
    env = ctypes.create_string_buffer(32)
    assert LIBM.fegetenv(env) == 0
    return env


def _mxcsr(env: ctypes.Array[ctypes.c_char]) -> int:
    return int.from_bytes(env.raw[28:32], "little")


@contextmanager
def mxcsr_set(bits: int, clear: int = 0) -> Iterator[Callable[[], int]]:
    """This thread's MXCSR with ``bits`` set (``clear`` cleared) in the block; a function
    that reads it; the caller's given back after."""
    saved = _get_env()
    env = _get_env()
    value = (_mxcsr(env) & ~clear) | bits
    ctypes.memmove(ctypes.addressof(env) + 28, value.to_bytes(4, "little"), 4)
    assert LIBM.fesetenv(env) == 0
    try:
        yield lambda: _mxcsr(_get_env())
    finally:
        assert LIBM.fesetenv(saved) == 0


ENVIRONMENTS = {
    "flush-to-zero, denormals-are-zero": (FTZ | DAZ, 0),
    **{f"round {name}": (bits, 0x6000) for name, bits in ROUNDING.items()},
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
SMALL = X[:1024] * np.float32(1e-36)  # quantized: subnormal scales and values


def _results(isa: str) -> dict[str, bytes]:
    """Each kernel's results on the inputs (computed in this thread's environment)."""
    x = X
    out: dict[str, bytes] = {}
    for name in ("exp32", "tanh32"):
        y = np.empty_like(x)
        getattr(_kernels, name)(x, y, isa=isa)
        out[name] = y.tobytes()
    act = np.empty((8, 192), np.float32)
    _kernels.swiglu(H.copy(), act, 8, 192, 2, isa=isa)  # two threads: the pool's workers too
    out["swiglu"] = act.tobytes()
    rows, n = 4, 256
    q = np.empty(rows * n, np.int8)
    d, s = np.empty(rows * n // 32, np.float32), np.empty(rows * n // 32, np.float32)
    g = np.empty(rows * n // 16, np.int32)
    _kernels.quantize("q8_0", SMALL, rows, n, q, d, s, g, isa=isa)
    out["quantize"] = q.tobytes() + d.tobytes()
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
