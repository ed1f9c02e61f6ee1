"""The rotary table's sines and cosines (``workers.rotary``): the float32 rounding of the
true values (read independently: CPython's ``math``, the C library's float64 sine and
cosine), and the same bits whatever vector code NumPy runs (it differed in the last bit
between processors with AVX2 / AVX-512 and without, for many of a context's angles)."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from typing import Any

import attrs
import numpy as np
import pytest

from runtime_core.f32_math import pow_f32
from runtime_core.model_config import RopeConfig
from runtime_core.workers.rotary import rope_rotations, sin_cos, yarn_corr_dims
from tests.support.numpy_vectors import script_words


def _angles() -> np.ndarray:
    rng = np.random.default_rng(20261203)
    spread = (rng.random(20_000) * 2e6).astype(np.float32)  # up to 2e6 radians
    near = (rng.random(20_000) * 7).astype(np.float32)  # the first turns, finely
    quarter = (np.arange(-64, 65) * (math.pi / 4)).astype(np.float32)  # the boundaries
    return np.concatenate([spread, near, -near[:1000], quarter, [0.0, 1e-30, -0.0]])


def _ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """How many float32s apart ``a`` and ``b`` are (both finite)."""

    def ordered(x: np.ndarray) -> np.ndarray:
        i = x.astype(np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)

    return np.abs(ordered(a) - ordered(b))


def test_the_sines_and_cosines_are_the_c_librarys_rounded_to_float32() -> None:
    theta = _angles()
    sine, cosine = sin_cos(theta)
    want_sin = np.array([math.sin(float(x)) for x in theta], np.float32)
    want_cos = np.array([math.cos(float(x)) for x in theta], np.float32)
    # Both are within a few float64 units of the true value: their float32 roundings
    # differ only where it lies that close to a tie between two floats (about 1 in 10^8).
    for got, want in ((sine, want_sin), (cosine, want_cos)):
        assert _ulps(got, want).max() <= 1
        assert np.count_nonzero(got != want) <= 2
    assert sine.dtype == cosine.dtype == np.float32 and sine.shape == theta.shape


def test_the_table_is_ggmls_angles_with_those_sines_and_cosines() -> None:
    rope = RopeConfig(n_dims=64, freq_base=10000.0, freq_scale=0.5, neox=False)
    factors = np.linspace(1.0, 4.0, 32).astype(np.float32)
    table = rope_rotations(rope, 300, factors)
    theta_scale = np.float32(10000.0) ** np.float32(-2.0 / 64)
    for pos in (0, 1, 17, 299):
        theta, want = np.float32(pos), []
        for i in range(32):  # ggml_rope_cache_init: theta *= theta_scale, each float32
            angle = np.float32(np.float32(theta / factors[i]) * np.float32(0.5))
            want.append(complex(math.cos(float(angle)), math.sin(float(angle))))
            theta = np.float32(theta * theta_scale)
        np.testing.assert_allclose(table[pos], np.array(want, np.complex64), rtol=0, atol=1e-7)


SCRIPT = """
import hashlib, numpy as np
from runtime_core.model_config import RopeConfig
from runtime_core.workers.rotary import rope_rotations
t = (np.arange(4096, dtype=np.float32)[:, None]
     * np.float32(10000) ** (-np.arange(32, dtype=np.float32) / 32)).astype(np.float32)
rope = RopeConfig(n_dims=64, freq_base=10000.0, freq_scale=1.0, neox=False)
table = rope_rotations(rope, 4096, None)
print(hashlib.sha256(table.tobytes()).hexdigest(), hashlib.sha256(np.cos(t).tobytes()).hexdigest())
"""


def test_the_table_does_not_depend_on_numpys_vector_code() -> None:
    table, numpy_cos = script_words(SCRIPT, baseline=False)
    table_base, numpy_cos_base = script_words(SCRIPT, baseline=True)
    if numpy_cos == numpy_cos_base:
        pytest.skip("NumPy's own cosines are the same with its vector code off here: no check")
    assert table == table_base  # np.cos's differ; the table's are the same


def _libm_powf() -> Any:
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    libm.powf.restype = ctypes.c_float
    libm.powf.argtypes = [ctypes.c_float, ctypes.c_float]
    return libm.powf


def test_the_base_power_is_correctly_rounded_where_powf_is_not() -> None:
    """``freq_base ** (-2 / n)``, read against the C library's float64 ``pow`` (within a
    unit of float64's last place of the true value): ours is the float32 nearest to it,
    and where the C library's ``powf`` gives another float32, ours is the nearer one
    (``powf`` is not correctly rounded, and its variants differ between processors)."""
    powf = _libm_powf()
    bases = [10000.0, 500000.0, 1e6, 75000.0, 8e6, *np.geomspace(100.0, 1e8, 60)]
    for base in np.float32(bases):
        for n in range(2, 260, 2):
            exponent = np.float32(-2.0) / np.float32(n)
            ours = pow_f32(base, exponent)
            assert isinstance(ours, np.float32)
            true = math.pow(float(base), float(exponent))
            ulp = float(np.spacing(ours))
            assert abs(float(ours) - true) <= ulp * (0.5 + 2**-20), (base, n)
            theirs = float(powf(float(base), float(exponent)))
            if theirs != float(ours):
                assert abs(float(ours) - true) < abs(theirs - true), (base, n)
    # llama.cpp's usual bases and head sizes are where powf is right
    for base, n in ((10000.0, 64), (10000.0, 128), (500000.0, 128), (1e6, 128)):
        exponent = np.float32(-2.0) / np.float32(n)
        assert pow_f32(np.float32(base), exponent) == np.float32(powf(base, float(exponent)))


@pytest.mark.parametrize(
    ("n_dims", "orig", "base"),
    [(64, 64, 10000.0), (128, 32768, 1e6), (128, 8192, 500000.0), (64, 128, 1e6), (96, 4096, 1e4)],
)
def test_yarn_correction_dims_are_the_formulas(n_dims: int, orig: int, base: float) -> None:
    """ggml's correction dims, read in float64 from the formula ``n * ln(orig / (beta 2
    pi)) / (2 ln base)`` (llama.cpp's defaults: 32 fast turns, 1 slow), floored and
    ceiled into ``[0, n - 1]``; the ramp is 1 up to the first, 0 from the second."""
    rope = RopeConfig(n_dims, base, 0.25, False, ext_factor=1.0, orig_context=orig)

    def corr(beta: float) -> float:
        return n_dims * math.log(orig / (beta * 2 * math.pi)) / (2 * math.log(base))

    low, high = yarn_corr_dims(rope)
    assert (float(low), float(high)) == (
        max(0.0, math.floor(corr(32.0))),
        min(n_dims - 1.0, math.ceil(corr(1.0))),
    )
    table = rope_rotations(rope, 8, None)
    plain = rope_rotations(attrs.evolve(rope, ext_factor=0.0), 8, None)
    mscale = np.float32(1.0) + np.float32(0.1) * np.float32(math.log(4.0))
    # pairs from `high` on take the scaled angle alone: the plain table times mscale
    np.testing.assert_array_equal(table[:, int(high) :], plain[:, int(high) :] * mscale)
    if low == 0:  # pair 0's angle is the unscaled one: position p's angle is p
        p = np.arange(8, dtype=np.float32)
        np.testing.assert_allclose(table[:, 0], np.exp(1j * p) * mscale, rtol=1e-6)
