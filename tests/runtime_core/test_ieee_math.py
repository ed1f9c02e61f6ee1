"""``runtime_core.ieee_math``: the exponentials against an independent reading (Python's
``decimal`` to 50 digits), their special values, and the same bits whether NumPy runs
its vector code or not, element by element or in arrays (NumPy's own ``np.exp``
differs between those)."""

from __future__ import annotations

from decimal import Decimal, localcontext
from typing import Any

import numpy as np
import pytest

from runtime_core.ieee_math import exp32, exp32_numpy, exp64
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


SCRIPT = """
import hashlib, numpy as np
from runtime_core.ieee_math import exp32, exp32_numpy, exp64
from tests.support.numpy_vectors import script_words
x = np.random.default_rng(7).uniform(-100, 80, 200_000)
x32 = x.astype(np.float32)
assert np.array_equal(exp32(x32).view(np.uint32), exp32_numpy(x32).view(np.uint32))
print(hashlib.sha256(exp64(x).tobytes() + exp32_numpy(x32).tobytes()).hexdigest(),
      hashlib.sha256(np.exp(x).tobytes() + np.exp(x32).tobytes()).hexdigest())
"""


def test_the_bits_do_not_depend_on_numpys_vector_code() -> None:
    ours, numpys = script_words(SCRIPT, baseline=False)
    ours_base, numpys_base = script_words(SCRIPT, baseline=True)
    assert ours == ours_base
    if numpys == numpys_base:
        pytest.skip("NumPy's own exp is the same with its vector code off here: no contrast")
