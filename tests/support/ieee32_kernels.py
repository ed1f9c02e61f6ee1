"""The checks the kernels' float32 functions share (``_kernels.exp32``, ``_kernels.tanh32``,
``csrc/ieee32.h``) against their NumPy twins in ``runtime_core.ieee_math``: the same bits
on a spread of every float32, on lengths around the vector widths, in place."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

F32 = np.float32

#: inputs glibc 2.36's tanhf rounds otherwise than the correctly rounded float32 (the
#: first two by two units), found with ctypes on libm.so.6
GLIBC_TANHF_MISROUNDED = [
    float.fromhex(h)
    for h in (
        "0x1.f72258p-7", "0x1.d8b496p-6", "0x1.f8cdb6p-1", "-0x1.9ade3ap-1",
        "0x1.4858d4p+0", "-0x1.db19cep-2", "0x1.bb845ap-3", "0x1.535c8ap-4",
        "-0x1.e9491cp-11", "0x1.066edap-9", "0x1.5f098cp-25", "0x1.2916e6p+1",
    )
]  # fmt: skip


def bits(a: Any) -> np.ndarray:
    return np.asarray(a, F32).view(np.uint32)


def values(edges: list[float], extra: list[float]) -> np.ndarray:
    """Every 4099th float32 (both signs, all exponents, NaNs among them), ``edges`` and
    their neighbours, special values, and ``extra`` with both signs."""
    spread = (np.arange(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32)).view(F32)
    e = np.array(edges, F32)
    with np.errstate(over="ignore"):  # the largest float32's neighbour: inf
        near = np.concatenate([np.nextafter(e, F32(-np.inf)), e, np.nextafter(e, F32(np.inf))])
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1.0], F32)
    more = np.array(extra, F32)
    return np.concatenate([spread, near, -near, special, more, -more])


def assert_kernel_is_twin(kernel: Callable[..., None], twin: Callable[[Any], Any], isa: str,
                          x: np.ndarray) -> None:  # fmt: skip
    y = np.empty_like(x)
    kernel(x, y, isa=isa)
    with np.errstate(invalid="ignore"):  # signalling NaNs among the values
        want = twin(x)
    np.testing.assert_array_equal(bits(y), bits(want))


def assert_every_length_and_in_place(
    kernel: Callable[..., None], twin: Callable[[Any], Any], isa: str, low: float, high: float
) -> None:
    """Lengths 0 .. 40 around the vector widths (8 and 16 values: the tails), nothing
    written past them, and y = x."""
    rng = np.random.default_rng(5)
    for n in range(0, 41):
        x = rng.uniform(low, high, n).astype(F32)
        want = bits(twin(x))
        y = np.full(n + 3, 7.0, F32)
        kernel(x, y, isa=isa)
        np.testing.assert_array_equal(bits(y[:n]), want)
        assert np.all(y[n:] == 7.0), f"wrote past {n} values"
        kernel(x, x, isa=isa)
        np.testing.assert_array_equal(bits(x), want)


def every_set_results(kernels: Any, x: np.ndarray) -> dict[str, np.ndarray]:
    """exp32, tanh32 and SwiGLU (two threads) of ``x`` on each set ``kernels`` (a build
    of ``_kernels``) runs: ``"<set> <function>"`` -> its results."""
    out: dict[str, np.ndarray] = {}
    for isa in kernels.isas():
        e, t = np.empty_like(x), np.empty_like(x)
        kernels.exp32(x, e, isa=isa)
        kernels.tanh32(x, t, isa=isa)
        act = np.empty((4, 96), F32)
        kernels.swiglu(x[: 4 * 192].reshape(4, 192).copy(), act, 4, 96, 2, isa=isa)
        out[f"{isa} exp32"], out[f"{isa} tanh32"], out[f"{isa} swiglu"] = e, t, act
    return out
