"""The kernels' ``exp32`` (``csrc/ieee32.h``) on every instruction set: the bits of
``runtime_core.ieee_math.exp32_numpy`` (whose rounding ``test_ieee_math.py`` checks
against ``decimal``), and the SwiGLU computed with it. The C library's ``expf`` is not
the same function everywhere: glibc's variant for processors with FMA and its other one
differ (on 2 of the 2.24 billion float32 from -110 to 90 with glibc 2.36), and both
round 170 thousand of them otherwise than the correctly rounded float32."""

from __future__ import annotations

import numpy as np
import pytest

from runtime_core.ieee_math import exp32, exp32_numpy
from runtime_core.workers.cpu import _kernels
from tests.support.ieee32_kernels import (
    assert_every_length_and_in_place,
    assert_kernel_is_twin,
    bits,
    values,
)

ISAS = _kernels.isas()

#: gate values g whose silu g / (1 + exp(-g)) the worker computed otherwise with glibc
#: 2.36's expf (exp(-g) one unit off the correctly rounded float32), found by comparing
#: the two over glibc's misrounded inputs
GLIBC_MISROUNDED_GATES = [
    float.fromhex(h)
    for h in (
        "-0x1.57a3f4p-8", "-0x1.46e4b6p+3", "0x1.4bbceap-4", "0x1.2f1a42p-5",
        "0x1.88bd00p-2", "-0x1.b7b95cp+2", "-0x1.d012d8p-2", "-0x1.a03dccp-5",
        "-0x1.fd4532p+1", "0x1.c23b78p-7", "-0x1.279a06p+0", "0x1.964114p-2",
    )
]  # fmt: skip
#: the two inputs glibc 2.36's FMA and SSE2 expf round differently
GLIBC_VARIANTS_DIFFER = [float.fromhex("0x1.04845ep+5"), float.fromhex("-0x1.f8cbb2p+5")]


@pytest.mark.parametrize("isa", ISAS)
def test_every_set_computes_ieee_maths_exp32(isa: str) -> None:
    edges = [-104.0, 89.0, 88.72283, -103.97208, -87.33655]
    x = values(edges, GLIBC_MISROUNDED_GATES + GLIBC_VARIANTS_DIFFER)
    assert_kernel_is_twin(_kernels.exp32, exp32_numpy, isa, x)


@pytest.mark.parametrize("isa", ISAS)
def test_every_length_and_in_place(isa: str) -> None:
    assert_every_length_and_in_place(_kernels.exp32, exp32_numpy, isa, -110, 95)


def test_bad_arrays_are_refused() -> None:
    x = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="y: 4 elements, the call needs 8"):
        _kernels.exp32(x, np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="x: elements of format d"):
        _kernels.exp32(np.zeros(8), x)
    with pytest.raises(TypeError, match="y: a C-contiguous writable array"):
        _kernels.exp32(x, x[::2])
    with pytest.raises(ValueError, match="instruction set nope"):
        _kernels.exp32(x, x.copy(), isa="nope")


def test_ieee_math_takes_the_kernel_with_numpys_shapes() -> None:
    x = np.linspace(-50, 50, 24, dtype=np.float32).reshape(2, 3, 4)
    for given in (x, x[:, ::2], x.astype(np.float64), np.float32(1.5), 2.0, [[1.0, -3.0]]):
        got, want = exp32(given), exp32_numpy(given)
        assert got.shape == want.shape and got.dtype == np.float32
        np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("isa", ISAS)
def test_swiglu_is_silu_by_exp32(isa: str) -> None:
    """act = g / (1 + exp32(-g)) * u, each operation rounded in float32: rows of 5000
    (pieces of 256 crossing rows and the 4096 values of a thread's item), the gates
    glibc's expf gave other bits for among them."""
    rng = np.random.default_rng(9)
    rows, f = 3, 5000
    h = (4 * rng.standard_normal((rows, 2 * f))).astype(np.float32)
    gates = np.array(GLIBC_MISROUNDED_GATES, np.float32)
    for j in range(rows):
        h[j, 4090 - 7 * j : 4090 - 7 * j + len(gates)] = gates
    h[0, :4] = [np.inf, -np.inf, 120.0, -120.0]
    act = np.zeros((rows, f), np.float32)
    _kernels.swiglu(h, act, rows, f, 2, isa=isa)
    g, u = h[:, :f], h[:, f:]
    with np.errstate(invalid="ignore", over="ignore"):
        want = g / (np.float32(1) + exp32_numpy(-g)) * u
    np.testing.assert_array_equal(bits(act), bits(want))
