"""Float32 results of the C library's ``powf`` and ``logf``, correctly rounded: the same
bits on every machine.

ggml computes its rotary tables' terms with ``powf`` and ``logf``, which are not
correctly rounded: on a grid of rotary bases and head sizes, 0.08 % of ``powf``'s
results on this project's machines were one float32 unit off, and the C library picks
its variant by processor (with fused multiply-adds or without), so two hosts computed
other bits. Here each value is computed in decimal to 60 digits and rounded once: the
nearest float32 to the true value (a tie between two float32s would need the true
value to be one, which these never are).
"""

from __future__ import annotations

from decimal import Decimal, localcontext

import numpy as np

_DIGITS = 60


def _nearest(exact: Decimal) -> np.float32:
    near = np.float32(float(exact))
    candidates = (
        np.nextafter(near, np.float32(-np.inf)),
        near,
        np.nextafter(near, np.float32(np.inf)),
    )
    return min(candidates, key=lambda c: abs(Decimal(float(c)) - exact))


def pow_f32(base: np.float32, exponent: np.float32) -> np.float32:
    """``base ** exponent`` (``base`` > 0), correctly rounded to float32."""
    with localcontext() as ctx:
        ctx.prec = _DIGITS
        return _nearest((Decimal(float(exponent)) * Decimal(float(base)).ln()).exp())


def log_f32(x: np.float32) -> np.float32:
    """``ln(x)`` (``x`` > 0), correctly rounded to float32."""
    with localcontext() as ctx:
        ctx.prec = _DIGITS
        return _nearest(Decimal(float(x)).ln())
