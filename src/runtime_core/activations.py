"""Activations on an edge: float32 inside a stage, the plan's dtype between stages.

On an edge an activation is ``(rows, hidden_dim)`` row-major in the plan's dtype:
``float32`` (FLOAT, 4), ``float16`` (FLOAT, 2), or bfloat16 (BFLOAT, 2). NumPy has no
bfloat16, so bf16 activations are ``uint16`` arrays holding the bf16 bit patterns
(the upper 16 bits of the float32, rounded to nearest even; a NaN stays a quiet NaN,
as ggml converts). These are
the bytes the object record carries.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from runplan import DTypeFamily

_BF16_QUIET_BIT = np.uint16(0x0040)
_F32 = np.dtype(np.float32)
_FLOAT = DTypeFamily.FLOAT  # bound once: Enum.MEMBER is slow on Python 3.11
_BFLOAT = DTypeFamily.BFLOAT
_F16 = np.dtype(np.float16)
_U16 = np.dtype(np.uint16)


def edge_dtype(family: DTypeFamily, width_bytes: int) -> np.dtype[np.generic]:
    """The NumPy dtype of activations of ``(family, width_bytes)`` on an edge."""
    if family is _FLOAT and width_bytes == 4:
        return _F32
    if family is _FLOAT and width_bytes == 2:
        return _F16
    if family is _BFLOAT and width_bytes == 2:
        return _U16
    raise ValueError(f"no activation dtype is ({family.name}, {width_bytes} bytes)")


def float32_to_bf16(x: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """bf16 bit patterns of ``x``, rounded to nearest even (as ggml rounds)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = (bits[nan] >> 16).astype(np.uint16) | _BF16_QUIET_BIT
    return out


def bf16_to_float32(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    """float32 values of bf16 bit patterns (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


class ActivationOverflow(ValueError):
    """Activations past the largest finite value of the edge's dtype (float16's 65504):
    on the edge they would be infinite, and the next stages' numbers NaN."""


def encode(x: npt.NDArray[np.float32], dtype: np.dtype[np.generic]) -> npt.NDArray[np.generic]:
    """A new array of float32 activations ``x`` in the edge dtype ``dtype``. Finite
    values past float16's range are refused (``ActivationOverflow``), not made
    infinite (bfloat16 and float32 hold float32's range)."""
    if dtype == np.uint16:
        return float32_to_bf16(x)
    with np.errstate(over="ignore"):  # an overflow is found below, and named
        out = np.array(x, dtype=dtype, copy=True)
    if dtype == _F16 and not np.isfinite(out).all():
        lost = np.isinf(out) & np.isfinite(x)
        if lost.any():
            at = np.argwhere(lost)[0]
            row, col = int(at[0]), int(at[-1])
            raise ActivationOverflow(
                f"activation {float(x[row, col]):.6g} (row {row}, element {col}) is past "
                f"float16's largest value, {float(np.finfo(np.float16).max):g}: this "
                "edge's float16 activations cannot carry it (float32 or bfloat16 edges "
                "can)"
            )
    return out


def decode(data: npt.NDArray[np.generic], dtype: np.dtype[np.generic]) -> npt.NDArray[np.float32]:
    """A new float32 array of the activations ``data`` of edge dtype ``dtype``."""
    if data.dtype != dtype:
        raise ValueError(f"activations of dtype {data.dtype}, the edge carries {dtype}")
    if dtype == np.uint16:
        return bf16_to_float32(data.view(np.uint16))
    return np.array(data, dtype=np.float32, copy=True)
