"""Activations between stages in f32, f16 and bf16 (as uint16 bit patterns)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from runplan import DTypeFamily
from runtime_core import activations

float32_arrays = hnp.arrays(
    np.float32,
    st.integers(1, 64).map(lambda n: (n,)),
    elements=st.floats(width=32, allow_nan=True, allow_infinity=True),
)


@given(x=float32_arrays)
def test_bf16_rounds_as_ggml_does(x: np.ndarray) -> None:
    ours = activations.float32_to_bf16(x)
    # gguf's BF16 quantizer is a NumPy port of ggml's fp32 -> bf16 (nearest even).
    theirs = quants.quantize(x.reshape(1, -1), GGMLQuantizationType.BF16).view(np.uint16)[0]
    np.testing.assert_array_equal(ours, theirs)


@given(x=float32_arrays)
def test_bf16_values_round_trip_and_stay_close(x: np.ndarray) -> None:
    bits = activations.float32_to_bf16(x)
    back = activations.bf16_to_float32(bits)
    np.testing.assert_array_equal(activations.float32_to_bf16(back), bits)
    assert (np.isnan(back) == np.isnan(x)).all()
    finite = np.isfinite(x) & (np.abs(x) < 3e38)
    # half a unit in the last place: 2^-8 relative, or half bf16's smallest subnormal
    bound = np.maximum(np.abs(x[finite]) * 2.0**-8, 2.0**-134)
    assert (np.abs(back[finite] - x[finite]) <= bound).all()


def test_known_bf16_patterns() -> None:
    x = np.array([1.0, -2.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, np.inf], dtype=np.float32)
    bits = activations.float32_to_bf16(x)
    assert bits.tolist() == [0x3F80, 0xC000, 0x3F80, 0x3F82, 0x7F80]


@pytest.mark.parametrize(
    ("family", "width", "dtype"),
    [
        (DTypeFamily.FLOAT, 4, np.float32),
        (DTypeFamily.FLOAT, 2, np.float16),
        (DTypeFamily.BFLOAT, 2, np.uint16),
    ],
)
def test_edges_carry_the_plan_dtype_and_decode_to_new_float32(
    family: DTypeFamily, width: int, dtype: type[np.generic]
) -> None:
    edge = activations.edge_dtype(family, width)
    x = np.linspace(-4, 4, 3 * 8, dtype=np.float32).reshape(3, 8)
    data = activations.encode(x, edge)
    assert data.dtype == dtype and data.shape == x.shape
    assert not np.shares_memory(data, x)
    back = activations.decode(data, edge)
    assert back.dtype == np.float32 and not np.shares_memory(back, data)
    np.testing.assert_allclose(back, x, rtol=2.0**-8)
    with pytest.raises(ValueError):
        activations.decode(data.astype(np.float64), edge)


def test_u32_is_no_activation_dtype() -> None:
    with pytest.raises(ValueError):
        activations.edge_dtype(DTypeFamily.UINT, 4)


def test_an_f16_edge_refuses_finite_values_past_its_range_naming_one() -> None:
    """A float16 edge cannot carry a finite activation past 65504 (Gemma 3's hidden
    states pass it): the value would reach the next stage infinite and make its numbers
    NaN, a fault that named only the logits. It is refused, naming the value and where
    it is. A value that rounds to 65504, and values already infinite or NaN (the stage's
    own, which the next stage or the head reports), pass as before; bfloat16 and
    float32 edges carry float32's range."""
    f16 = activations.edge_dtype(DTypeFamily.FLOAT, 2)
    x = np.zeros((2, 4), np.float32)
    x[1, 2] = -70000.0
    with pytest.raises(activations.ActivationOverflow, match=r"-70000 \(row 1, element 2\)"):
        activations.encode(x, f16)
    for dtype in (np.float32, np.uint16):
        back = activations.decode(activations.encode(x, np.dtype(dtype)), np.dtype(dtype))
        assert np.isfinite(back).all() and abs(back[1, 2] + 70000.0) <= 70000.0 * 2.0**-8
    edge_values = np.array([[65504.0, 65519.0, -np.inf, np.nan]], np.float32)
    out = activations.encode(edge_values, f16)
    assert out[0, 0] == out[0, 1] == 65504 and np.isneginf(out[0, 2]) and np.isnan(out[0, 3])
