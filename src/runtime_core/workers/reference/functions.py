"""The row-wise functions of the reference model, in the style of llama2.c: RMS norms
(of rows, of each head), products, the SiLU and GELU activations, the soft cap."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]


def softcap(x: F32, cap: float) -> None:
    """``x = cap * tanh(x / cap)`` in place (llama.cpp's three operations, the first a
    product by ``1 / cap``), where ``cap`` > 0."""
    if cap > 0.0:
        x *= np.float32(1.0 / cap)
        np.tanh(x, out=x)
        x *= np.float32(cap)


def silu(x: F32) -> None:
    """``x * sigmoid(x)``, in place."""
    e = np.exp(-x)
    e += 1.0
    np.divide(x, e, out=x)


_GELU_A = np.float32(0.044715)
_SQRT_2_OVER_PI = np.float32(math.sqrt(2.0 / math.pi))


def gelu_tanh(x: F32) -> None:
    """GELU's tanh form ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, in place."""
    inner = x * x
    inner *= _GELU_A
    inner += 1.0
    inner *= x
    inner *= _SQRT_2_OVER_PI
    np.tanh(inner, out=inner)
    inner += 1.0
    inner *= 0.5
    x *= inner


def head_rms_norm(qk: F32, n_q_heads: int, q_weight: F32, k_weight: F32, eps: float) -> None:
    """RMS norm of every head of ``qk`` ``(rows, heads, head_dim)`` over its
    ``head_dim``, in place; the first ``n_q_heads`` heads times ``q_weight``, the others
    times ``k_weight``."""
    ms = np.einsum("rhd,rhd->rh", qk, qk) / np.float32(qk.shape[-1])
    qk *= (1.0 / np.sqrt(ms + np.float32(eps)))[:, :, None]
    qk[:, :n_q_heads] *= q_weight
    qk[:, n_q_heads:] *= k_weight


def linear(x: F32, w: F32, out: F32 | None = None) -> F32:
    """``x @ w`` for rows ``x`` ``(rows, n_in)`` and ``w`` ``(n_in, n_out)`` (into ``out``
    when given). One row goes to BLAS as a vector (gemv), which OpenBLAS runs faster
    than a one-row gemm."""
    if x.shape[0] == 1:
        if out is None:
            row: F32 = x[0] @ w
            return row[None, :]
        np.matmul(x[0], w, out=out[0])
        return out
    return np.matmul(x, w, out=out)


def rms_norm(x: F32, weight: F32, eps: float) -> F32:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis of ``(rows, n)``."""
    n = x.shape[1]
    if x.shape[0] == 1:  # a decode step: scalar arithmetic costs less than array calls
        out: F32 = x * np.float32(1.0 / math.sqrt(float(np.dot(x[0], x[0])) / n + eps))
    else:
        ms = np.einsum("ij,ij->i", x, x) / np.float32(n)
        out = x * (1.0 / np.sqrt(ms + np.float32(eps)))[:, None]
    out *= weight
    return out
