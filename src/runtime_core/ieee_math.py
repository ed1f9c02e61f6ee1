"""Functions of arrays computed from IEEE additions, multiplications, divisions,
``rint`` and ``ldexp`` alone: the same bits on every machine.

NumPy's own ``np.exp`` (float32 and float64) runs vector code of its own where the
processor has AVX2 or AVX-512 and the C library's elsewhere, and the two differ in the
last bits: a mixture's routing weights (``workers.experts``) computed with it gave
other logits on a processor without AVX2 than here (found running the CPU worker on an
emulated Sandy Bridge, ``tests/runtime_core/workers/cpu/test_cpu_other_processors.py``),
so two hosts of one chain, or a run replayed on another host, computed other bits.
Each operation here is rounded as IEEE 754 says whatever the vector width, so the
results depend on the inputs alone (with subnormal numbers kept, as they are unless a
library built with ``-ffast-math`` turns on flush-to-zero: then the subnormal results,
below 1e-38 in float32, are 0, as NumPy's own are).

``exp64``: ``x = k ln2 + r`` with ``k`` the nearest integer to ``x / ln2`` and ln2 in
two parts (Cody and Waite: the first of 32 significant bits, so that ``k`` times it is
exact for every ``k`` an exponent reaches), ``exp(r)`` (``|r| <= ln2 / 2``) by its Taylor
series to ``r^13`` in Horner's order (the first term left out is below 5e-18), scaled
by ``2^k``: within a few units of float64's last place. ``exp32`` is its float32
rounding (the correctly rounded float32 but within that distance of a tie), computed by
the CPU worker's kernels where they are built (``workers/cpu/csrc/ieee32.h``: the same
operations, the same bits on every instruction set; the SwiGLU and attention take it
there too) and by ``exp32_numpy`` elsewhere.

``tanh32``: ``tanh`` of float32 values, the correctly rounded float32 on every one of
them (the C library's ``tanhf`` is not: glibc 2.36's rounds 2.8 % of them otherwise,
some by two units, and another C library or version others), from ``tanh64``'s double:
``tanh(|x|) = m / (m + 2)`` with ``m = expm1(2 |x|)``, ``expm1`` by ``exp64``'s
reduction (``2 |x| = k ln2 + r``) and the Taylor series of ``expm1(r)`` to ``r^13``
(``r`` times a Horner polynomial: no ``exp(r) - 1`` cancellation near 0), ``m =
2^k expm1(r) + (2^k - 1)``; ``|x|`` clamped at 10 (``tanh`` rounds to 1 from 9.0109),
the sign restored (``-0`` stays ``-0``), NaN for NaN. The double is within a few units
of float64's last place (3.1 at most on 200000 random inputs); every float32 whose
double lies within 256 such units of a float32 rounding midpoint (130 of them) was
checked against ``decimal`` (``benchmarks/tanh32_scan.py`` scans all 2^32). The
kernels compute the same operations (``workers/cpu/csrc/ieee32.h``; the logits' and
attention's soft caps and the GELU table take it there).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from decimal import Decimal, localcontext
from typing import Any

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]

#: ln 2 to 60 digits.
_LN2 = "0.693147180559945309417232121458176568075500134360255254120680"


def top_bits(value: Decimal, bits: int) -> float:
    """``value`` to ``bits`` significant bits, toward zero (a float64 exactly)."""
    mantissa, exponent = math.frexp(float(value))
    kept = math.floor(mantissa * 2**bits) / 2**bits  # the float's rounding is below these bits
    return math.ldexp(kept, exponent)


def horner(coefficients: list[float], x: F64, xp: Any = np) -> F64:
    """The polynomial of ``coefficients`` (highest power first) at ``x``, in Horner's
    order, one IEEE product and one sum per coefficient (``xp``: the array module)."""
    out: F64 = xp.full_like(x, coefficients[0])
    for c in coefficients[1:]:
        out *= x
        out += c
    return out


def _ln2_parts() -> tuple[float, float, float]:
    """ln 2 in two parts (``top_bits`` 32, the rest) and 1 / ln 2, as float64s, from
    decimal (not the C library's ``log``, which another machine's could round
    otherwise)."""
    with localcontext() as ctx:
        ctx.prec = 60
        high = top_bits(Decimal(_LN2), 32)
        return high, float(Decimal(_LN2) - Decimal(high)), float(1 / Decimal(_LN2))


_LN2_HI, _LN2_LO, _INV_LN2 = _ln2_parts()
#: exp(r) = sum r^n / n!, n = 13 .. 0, highest power first
_EXP = [1.0 / math.factorial(n) for n in range(13, -1, -1)]
#: beyond these, exp is 0 or infinite in float64 (and float32)
_LOW, _HIGH = -746.0, 710.0


def exp64(x: npt.ArrayLike, xp: Any = np) -> F64:
    """``exp`` of each value, in float64: the same bits on every machine (NaN stays
    NaN, ``-inf`` gives 0, ``inf`` gives ``inf``), with array module ``xp`` (NumPy, or
    CuPy: each step one elementwise IEEE operation, so the same bits there)."""
    x = xp.asarray(x, xp.float64)
    nan = xp.isnan(x)
    clipped = xp.clip(xp.where(nan, 0.0, x), _LOW, _HIGH)
    k = xp.rint(clipped * _INV_LN2)
    r = clipped - k * _LN2_HI
    r -= k * _LN2_LO
    with np.errstate(over="ignore"):  # beyond float64: inf, as exp is
        out: F64 = xp.where(nan, xp.nan, xp.ldexp(horner(_EXP, r, xp), k.astype(xp.int32)))
    return out


def exp32_numpy(x: npt.ArrayLike) -> F32:
    """``exp`` of each float32 value, rounded to float32 from ``exp64``: the same bits
    on every machine (and those of ``exp32``)."""
    with np.errstate(over="ignore"):  # beyond float32: inf, as exp is
        return exp64(np.asarray(x, np.float32)).astype(np.float32)


#: expm1(r) = r (sum r^(n-1) / n!), n = 13 .. 1, highest power first
_EXPM1 = _EXP[:-1]
#: tanh of |x| at or above this is 1 in float32 (from 9.0109); the clamp keeps 2^k exact
_TANH_HIGH = 10.0


def tanh64(x: npt.ArrayLike) -> F64:
    """``tanh`` of each float32 value in float64 (within a few units of its last place),
    before ``tanh32``'s rounding to float32: NaN for NaN, ``-0`` for ``-0``, the same
    bits on every machine."""
    x = np.asarray(x, np.float32)
    nan = np.isnan(x)
    t = 2.0 * np.minimum(np.where(nan, np.float32(0), np.abs(x)).astype(np.float64), _TANH_HIGH)
    k = np.rint(t * _INV_LN2)
    r = t - k * _LN2_HI
    r -= k * _LN2_LO
    scale = np.ldexp(1.0, k.astype(np.int32))  # 2^k, k <= 29: scale - 1 is exact
    m = horner(_EXPM1, r)
    m *= r  # expm1(r)
    m *= scale
    m += scale - 1.0  # expm1(2 |x|)
    m /= m + 2.0
    out: F64 = np.where(nan, np.nan, np.copysign(m, x))
    return out


def tanh32_numpy(x: npt.ArrayLike) -> F32:
    """``tanh`` of each float32 value, the correctly rounded float32 (``tanh64``
    rounded once): the same bits on every machine (and those of ``tanh32``)."""
    return tanh64(x).astype(np.float32)


@functools.cache
def _compiled(name: str) -> Callable[..., None] | None:
    """The CPU worker's kernel ``name`` (``exp32``, ``tanh32``: ``csrc/ieee32.h``, the
    NumPy functions' arithmetic), or None where the kernels are not built."""
    try:
        from runtime_core.workers.cpu import _kernels
    except ImportError:
        return None
    fn: Callable[..., None] = getattr(_kernels, name)
    return fn


def _by_kernel(name: str, numpy_fn: Callable[[F32], F32], x: npt.ArrayLike) -> F32:
    values = np.asarray(x, dtype=np.float32, order="C")  # keeps a 0-d shape
    kernel = _compiled(name)
    if kernel is None:
        return numpy_fn(values)
    out = np.empty_like(values)
    kernel(values.reshape(-1), out.reshape(-1))
    return out


def exp32(x: npt.ArrayLike) -> F32:
    """``exp32_numpy(x)``, bit for bit, by the compiled kernel where it is built (a
    mixture routes with it at every block of every step: about 50 times faster than
    NumPy's 40 operations on a row of 128)."""
    return _by_kernel("exp32", exp32_numpy, x)


def tanh32(x: npt.ArrayLike) -> F32:
    """``tanh32_numpy(x)``, bit for bit, by the compiled kernel where it is built."""
    return _by_kernel("tanh32", tanh32_numpy, x)
