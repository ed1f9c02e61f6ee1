"""Functions of arrays computed from IEEE additions, multiplications, ``rint`` and
``ldexp`` alone: the same bits on every machine.

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
the CPU worker's kernels where they are built (``workers/cpu/csrc/exp32.h``: the same
operations, the same bits on every instruction set; the SwiGLU and attention take it
there too) and by ``exp32_numpy`` elsewhere.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from decimal import Decimal, localcontext

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


def horner(coefficients: list[float], x: F64) -> F64:
    """The polynomial of ``coefficients`` (highest power first) at ``x``, in Horner's
    order, one IEEE product and one sum per coefficient."""
    out = np.full_like(x, coefficients[0])
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


def exp64(x: npt.ArrayLike) -> F64:
    """``exp`` of each value, in float64: the same bits on every machine (NaN stays
    NaN, ``-inf`` gives 0, ``inf`` gives ``inf``)."""
    x = np.asarray(x, np.float64)
    nan = np.isnan(x)
    clipped = np.clip(np.where(nan, 0.0, x), _LOW, _HIGH)
    k = np.rint(clipped * _INV_LN2)
    r = clipped - k * _LN2_HI
    r -= k * _LN2_LO
    with np.errstate(over="ignore"):  # beyond float64: inf, as exp is
        out: F64 = np.where(nan, np.nan, np.ldexp(horner(_EXP, r), k.astype(np.int32)))
    return out


def exp32_numpy(x: npt.ArrayLike) -> F32:
    """``exp`` of each float32 value, rounded to float32 from ``exp64``: the same bits
    on every machine (and those of ``exp32``)."""
    with np.errstate(over="ignore"):  # beyond float32: inf, as exp is
        return exp64(np.asarray(x, np.float32)).astype(np.float32)


@functools.cache
def _compiled_exp32() -> Callable[..., None] | None:
    """The CPU worker's kernel of ``exp32_numpy``'s arithmetic (``csrc/exp32.h``), or
    None where the kernels are not built."""
    try:
        from runtime_core.workers.cpu import _kernels
    except ImportError:
        return None
    fn: Callable[..., None] = _kernels.exp32
    return fn


def exp32(x: npt.ArrayLike) -> F32:
    """``exp32_numpy(x)``, bit for bit, by the compiled kernel where it is built (a
    mixture routes with it at every block of every step: about 50 times faster than
    NumPy's 40 operations on a row of 128)."""
    values = np.asarray(x, dtype=np.float32, order="C")  # keeps a 0-d shape
    kernel = _compiled_exp32()
    if kernel is None:
        return exp32_numpy(values)
    out = np.empty_like(values)
    kernel(values.reshape(-1), out.reshape(-1))
    return out
