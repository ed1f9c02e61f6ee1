"""``runtime_core.ieee_math``: the exponentials and tanh against an independent reading
(Python's ``decimal``), their special values, and the same bits whether NumPy runs its
vector code or not, element by element or in arrays (NumPy's own ``np.exp`` differs
between those)."""

from __future__ import annotations

from decimal import Decimal, localcontext
from typing import Any

import numpy as np
import pytest

from runtime_core.ieee_math import exp32, exp32_numpy, exp64, tanh32, tanh32_numpy, tanh64
from tests.support.ieee32_kernels import GLIBC_TANHF_MISROUNDED
from tests.support.numpy_vectors import script_words

#: the kernels' exp32 (where they are built) and NumPy's arithmetic: one function
EXP32S = pytest.mark.parametrize("exp32_fn", [exp32, exp32_numpy], ids=["kernel", "numpy"])


def _values() -> np.ndarray:
    rng = np.random.default_rng(20261205)
    wide = rng.uniform(-110.0, 88.0, 3000)  # float32's whole range of exp
    small = rng.uniform(-1.0, 1.0, 1000)
    return np.concatenate([wide, small, np.arange(-100, 89) * np.log(2.0), [0.0, -0.0, 1e-20]])


def _exact(x: float) -> Decimal:
    with localcontext() as ctx:
        ctx.prec = 50
        return Decimal(x).exp()


def _nearest_f32(exact: Decimal) -> np.float32:
    near = np.float32(float(exact))
    around = (np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf)))
    return min(around, key=lambda c: abs(Decimal(float(c)) - exact))


def _exact_tanh(x: float) -> Decimal:
    """(e^2a - 1) / (e^2a + 1), a = |x|, at 50 digits more than a's leading zeros (the
    subtraction cancels them)."""
    a = abs(Decimal(x))
    if a == 0:
        return Decimal(0)
    with localcontext() as ctx:
        ctx.prec = 50 + max(0, -a.adjusted())
        e = (2 * a).exp()
        t = (e - 1) / (e + 1)
    return t if x > 0 else -t


def _tanh_values() -> np.ndarray:
    rng = np.random.default_rng(20261206)
    wide = rng.uniform(-10.0, 10.0, 2000)  # up to where tanh rounds to 1 (9.0109)
    small = np.exp(rng.uniform(-100.0, 0.0, 1000)) * rng.choice([-1.0, 1.0], 1000)
    edges = [0.0, -0.0, 1e-45, 0.17328679, 9.010913, 9.011, 12.0, -30.0]
    return np.concatenate([wide, small, edges, GLIBC_TANHF_MISROUNDED]).astype(np.float32)


def test_tanh32_is_the_correctly_rounded_float32() -> None:
    x = _tanh_values()
    got = tanh32(x)
    assert got.dtype == np.float32
    want = np.array([_nearest_f32(_exact_tanh(float(v))) if v else v for v in x], np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(tanh32_numpy(x).view(np.uint32), want.view(np.uint32))


def test_tanh64_is_within_four_units_of_the_last_place() -> None:
    """The double tanh32 rounds (3.06 units at most on 200000 random inputs, measured by
    benchmarks/tanh32_scan.py; that scan checks the rounding where it comes within 256)."""
    x = _tanh_values()
    x = x[np.abs(x) < 10]  # beyond, clamped: 1 in float32, not in float64
    for xi, di in zip(x, tanh64(x), strict=True):
        exact = _exact_tanh(float(xi))
        if exact == 0:
            assert di == 0.0 and np.signbit(di) == np.signbit(xi)
            continue
        ulp = Decimal(float(np.spacing(np.float64(abs(float(exact))))))
        assert abs(Decimal(float(di)) - exact) <= 4 * ulp, (xi, di)


def test_tanh_special_values() -> None:
    """NaN stays NaN, -0 stays -0; from 10 on (clamped) tanh64 is tanh(10), which
    rounds to 1 in float32."""
    x = np.array([np.nan, 0.0, -0.0, np.inf, -np.inf, 3e38, -3e38, 10.0], np.float32)
    for got in (tanh64(x), tanh32(x)):
        assert np.isnan(got[0]) and got[1] == 0.0 and not np.signbit(got[1])
        assert got[2] == 0.0 and np.signbit(got[2])
        assert list(got[3:]) == [got[7], -got[7], got[7], -got[7], got[7]]
    assert tanh32(x)[7] == 1.0


def test_exp64_is_within_two_units_of_the_last_place() -> None:
    x = _values()
    got = exp64(x)
    for xi, gi in zip(x, got, strict=True):
        exact = _exact(float(xi))
        ulp = Decimal(float(np.spacing(np.float64(float(exact)))))
        assert abs(Decimal(float(gi)) - exact) <= 2 * ulp, (xi, gi)


@EXP32S
def test_exp32_is_the_correctly_rounded_float32(exp32_fn: Any) -> None:
    x = _values().astype(np.float32)
    got = exp32_fn(x)
    assert got.dtype == np.float32
    want = np.array([_nearest_f32(_exact(float(v))) for v in x], np.float32)
    np.testing.assert_array_equal(got, want)


@EXP32S
def test_the_special_values(exp32_fn: Any) -> None:
    x = np.array([-np.inf, np.inf, np.nan, -1000.0, 1000.0, -745.5, 709.9, 710.0, 0.0])
    got = exp64(x)
    assert got[0] == 0.0 and got[1] == np.inf and np.isnan(got[2])
    assert got[3] == 0.0 and got[4] == np.inf and got[5] == 0.0
    assert got[6] == np.inf and got[7] == np.inf and got[8] == 1.0
    f = exp32_fn(np.array([-np.inf, np.nan, -104.0, 89.0, 88.7], np.float32))
    assert f[0] == 0.0 and np.isnan(f[1]) and f[2] == 0.0 and f[3] == np.inf
    assert np.isfinite(f[4])


def test_element_by_element_gives_the_arrays_bits() -> None:
    x = _values()
    whole = exp64(x)
    alone = np.array([exp64(np.float64(v)) for v in x])
    np.testing.assert_array_equal(whole.view(np.int64), alone.view(np.int64))
    t = _tanh_values()
    whole = tanh64(t)
    alone = np.array([tanh64(np.float32(v)) for v in t])
    np.testing.assert_array_equal(whole.view(np.int64), alone.view(np.int64))


SCRIPT = """
import hashlib, numpy as np
from runtime_core.ieee_math import exp32, exp32_numpy, exp64, tanh32, tanh32_numpy
from tests.support.numpy_vectors import script_words
x = np.random.default_rng(7).uniform(-100, 80, 200_000)
x32 = x.astype(np.float32)
t32 = (x32 / np.float32(20)).astype(np.float32)
assert np.array_equal(exp32(x32).view(np.uint32), exp32_numpy(x32).view(np.uint32))
assert np.array_equal(tanh32(t32).view(np.uint32), tanh32_numpy(t32).view(np.uint32))
print(hashlib.sha256(exp64(x).tobytes() + exp32_numpy(x32).tobytes()
                     + tanh32_numpy(t32).tobytes()).hexdigest(),
      hashlib.sha256(np.exp(x).tobytes() + np.exp(x32).tobytes()).hexdigest())
"""


def test_the_bits_do_not_depend_on_numpys_vector_code() -> None:
    ours, numpys = script_words(SCRIPT, baseline=False)
    ours_base, numpys_base = script_words(SCRIPT, baseline=True)
    assert ours == ours_base
    if numpys == numpys_base:
        pytest.skip("NumPy's own exp is the same with its vector code off here: no contrast")
