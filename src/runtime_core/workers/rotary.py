"""The rotary embedding's table, ``exp(i * theta)`` for every position and rotary pair,
the same bits on every machine.

The angles are ggml's, in float32: ``theta_0 = pos``, ``theta_{i+1} = theta_i *
freq_base ** (-2 / n)`` (that power correctly rounded: ``pow_f32``), each divided by
its frequency factor and multiplied by ``freq_scale`` (IEEE products and quotients: the
same everywhere). Their sines and
cosines are not taken from NumPy's ``np.sin`` / ``np.cos``: those differ in the last bit
between the processors NumPy runs its own vector code on (AVX2, AVX-512, each its own)
and those it does not (the C library's), for a tenth to a half of a long context's
values, so two hosts of one chain, or a stage placed again on another host, computed
other bits. Here they are computed in float64 from additions and multiplications alone
(each rounded as IEEE says, whatever the vector width) and rounded once to float32:

- the angle reduced by the nearest multiple ``k`` of pi/2, with pi/2 in three parts
  (Cody and Waite): the first two of 33 significant bits, so that ``k`` times each is
  exact while ``|k| < 2**20`` (angles up to 1.6 million, far past any context), the
  third the rest;
- the sine and cosine of the remainder (``|r| <= pi/4``) by their Taylor series to the
  15th and 16th powers (the first terms left out are below 5e-17), in Horner's order;
- put back in their quadrant (``k mod 4``).

The float64 result is within a few units of float64's last place of the true value,
so its float32 rounding is the correctly rounded one but within that distance of a
tie between two floats; whichever it is, it is the same on every machine.
"""

from __future__ import annotations

import math
from decimal import Decimal, localcontext

import numpy as np
import numpy.typing as npt

from runtime_core.f32_math import log_f32, pow_f32
from runtime_core.ieee_math import horner, top_bits
from runtime_core.model_config import ModelConfig, RopeConfig

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]

#: pi to 60 digits.
_PI = "3.14159265358979323846264338327950288419716939937510582097494"


def _half_pi_parts() -> tuple[float, float, float, float]:
    """pi/2 in three parts (``top_bits`` 33, 33, the rest) and 2/pi, as float64s."""
    with localcontext() as ctx:
        ctx.prec = 60
        half = Decimal(_PI) / 2
        p1 = top_bits(half, 33)
        p2 = top_bits(half - Decimal(p1), 33)
        p3 = float(half - Decimal(p1) - Decimal(p2))
        return p1, p2, p3, float(1 / half)


_P1, _P2, _P3, _TWO_OVER_PI = _half_pi_parts()
#: Taylor coefficients, highest power first: sin r = r + r^3 * S(r^2), cos r = 1 + r^2 *
#: C(r^2), to r^15 and r^16 (the first terms left out, at |r| = pi/4: below 5e-17).
_SIN = [(-1) ** k / math.factorial(2 * k + 1) for k in range(7, 0, -1)]
_COS = [(-1) ** k / math.factorial(2 * k) for k in range(8, 0, -1)]


#: Angles computed at once: their float64 temporaries stay in a core's cache.
_CHUNK = 16384


def sin_cos(theta: F32) -> tuple[F32, F32]:
    """The sine and cosine of each float32 angle, rounded to float32 from a float64
    computed with IEEE additions and multiplications only: the same bits on every
    machine."""
    flat = np.ascontiguousarray(theta, np.float32).reshape(-1)
    sine, cosine = np.empty_like(flat), np.empty_like(flat)
    for at in range(0, flat.size, _CHUNK):
        part = slice(at, at + _CHUNK)
        sine[part], cosine[part] = _sin_cos64(flat[part])
    return sine.reshape(np.shape(theta)), cosine.reshape(np.shape(theta))


def _sin_cos64(theta: F32) -> tuple[F64, F64]:
    x = theta.astype(np.float64)
    k = np.rint(x * _TWO_OVER_PI)
    r = x - k * _P1
    r -= k * _P2
    r -= k * _P3
    r2 = r * r
    s = horner(_SIN, r2)
    s *= r2
    s *= r
    s += r  # sin r
    c = horner(_COS, r2)
    c *= r2
    c += 1.0  # cos r
    quadrant = k.astype(np.int64) & 3  # x = k pi/2 + r
    swap = (quadrant & 1).astype(bool)
    sine, cosine = np.where(swap, c, s), np.where(swap, s, c)
    np.negative(sine, out=sine, where=(quadrant & 2).astype(bool))
    np.negative(cosine, out=cosine, where=((quadrant + 1) & 2).astype(bool))
    return sine, cosine


def yarn_corr_dims(rope: RopeConfig) -> tuple[np.float32, np.float32]:
    """ggml's ``ggml_rope_yarn_corr_dims``: the pairs where ``beta_fast`` and
    ``beta_slow`` turns fit in ``orig_context`` positions, ``floor`` of the first and
    ``ceil`` of the second, within ``[0, n_dims - 1]``."""
    n, two = np.float32(rope.n_dims), np.float32(2.0)
    log_base = log_f32(np.float32(rope.freq_base))

    def corr_dim(turns: float) -> np.float32:
        # n_dims * logf(n_ctx_orig / (n_rot * 2 * (float)M_PI)) / (2 * logf(base))
        ratio = np.float32(rope.orig_context) / (np.float32(turns) * two * np.float32(math.pi))
        return np.float32(n * log_f32(ratio) / (two * log_base))

    start = np.floor(corr_dim(rope.beta_fast))
    end = np.ceil(corr_dim(rope.beta_slow))
    return max(np.float32(0.0), start), min(n - np.float32(1.0), end)


def _yarn_ramp(rope: RopeConfig) -> npt.NDArray[np.float32]:
    """ggml's ``rope_yarn_ramp`` of each pair ``i``: ``1 - clamp((i - low) / max(0.001,
    high - low), 0, 1)``."""
    low, high = yarn_corr_dims(rope)
    pairs = np.arange(rope.n_dims // 2, dtype=np.float32)
    y = (pairs - low) / max(np.float32(0.001), np.float32(high - low))
    ramp: npt.NDArray[np.float32] = np.float32(1.0) - np.minimum(
        np.float32(1.0), np.maximum(np.float32(0.0), y)
    )
    return ramp


def rope_rotations(
    rope: RopeConfig, max_seq_len: int, freq_factors: F32 | None
) -> npt.NDArray[np.complex64]:
    """``exp(i * theta)`` for every position and rotary pair: ``(max_seq_len, n/2)``
    (times ggml's ``mscale``: ``attn_factor``, and YaRN's own)."""
    half = rope.n_dims // 2
    exponent = np.float32(-2.0) / np.float32(rope.n_dims)  # ggml's -2.0f / n_dims
    theta_scale = pow_f32(np.float32(rope.freq_base), exponent)
    theta = np.empty((max_seq_len, half), dtype=np.float32)
    t = np.arange(max_seq_len, dtype=np.float32)
    for i in range(half):
        theta[:, i] = t
        t = t * theta_scale
    if freq_factors is not None:
        theta /= freq_factors
    scale = np.float32(rope.freq_scale)
    mscale = np.float32(rope.attn_factor)
    if rope.ext_factor:  # ggml's rope_yarn, in its float32 operations
        one = np.float32(1.0)
        ramp = _yarn_ramp(rope) * np.float32(rope.ext_factor)  # (n/2,): 1 unscaled, 0 scaled
        theta = (theta * scale) * (one - ramp) + theta * ramp
        mscale = mscale * (one + np.float32(0.1) * log_f32(one / scale))
    else:
        theta *= scale
    sine, cosine = sin_cos(theta)
    if mscale != 1.0:
        sine *= mscale
        cosine *= mscale
    out = np.empty((max_seq_len, half), dtype=np.complex64)
    out.real = cosine
    out.imag = sine
    return out


def query_temperatures(config: ModelConfig, max_seq_len: int) -> F32 | None:
    """Each position's factor on the rotated queries (``(max_seq_len,)``), or None where
    the model has none: llama.cpp's ``llm_graph_input_attn_temp``, ``log(floor(pos /
    L) + 1) * scale + 1`` in double (``pos / L`` a float32 quotient, as there; the
    logarithm correctly rounded: the same bits on every machine), rounded to float32.
    1 for every position below ``L``."""
    if not config.attn_temp_scale:
        return None
    length = np.float32(config.attn_temp_length)
    steps = np.floor(np.arange(max_seq_len, dtype=np.float32) / length)
    out = np.empty(max_seq_len, np.float32)
    scale = float(np.float32(config.attn_temp_scale))
    for k in np.unique(steps):
        with localcontext() as ctx:
            ctx.prec = 40
            log = float((Decimal(float(k)) + 1).ln())
        out[steps == k] = np.float32(log * scale + 1.0)
    return out
