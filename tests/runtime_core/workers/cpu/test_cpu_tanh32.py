"""The kernels' ``tanh32`` (``csrc/ieee32.h``) on every instruction set: the bits of
``runtime_core.ieee_math.tanh32_numpy`` (the correctly rounded float32: ``test_ieee_math.py``
checks it against ``decimal``, ``benchmarks/tanh32_scan.py`` on every float32), and the
operations that take it: the logits' soft cap, attention's soft cap and the GELU table.
They took the C library's ``tanhf``, which glibc 2.36 rounds otherwise on 2.8 % of the
float32 (45 % of those uniform on -1 .. 1; 730 thousand by two units), and another C
library otherwise again."""

from __future__ import annotations

import numpy as np
import pytest
from benchmarks import tanh32_scan

from runtime_core.ieee_math import exp32_numpy, tanh32, tanh32_numpy
from runtime_core.workers.cpu import _kernels
from tests.support.ieee32_kernels import (
    GLIBC_TANHF_MISROUNDED,
    assert_every_length_and_in_place,
    assert_kernel_is_twin,
    bits,
    values,
)

ISAS = _kernels.isas()
F32 = np.float32


@pytest.mark.parametrize("isa", ISAS)
def test_every_set_computes_ieee_maths_tanh32(isa: str) -> None:
    """Every 4099th float32, the clamp and where tanh reaches 1 with their neighbours,
    special values, glibc's misrounded inputs."""
    edges = [10.0, 9.010913, 9.011, 1e-4, 0.17328679, 3.4028235e38]
    x = values(edges, GLIBC_TANHF_MISROUNDED)
    assert_kernel_is_twin(_kernels.tanh32, tanh32_numpy, isa, x)


@pytest.mark.parametrize("isa", ISAS)
def test_every_length_and_in_place(isa: str) -> None:
    assert_every_length_and_in_place(_kernels.tanh32, tanh32_numpy, isa, -12, 12)


def test_the_special_values() -> None:
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 20.0, -9.5, 1e-45], F32)
    for isa in ISAS:
        y = np.empty_like(x)
        _kernels.tanh32(x, y, isa=isa)
        assert list(bits(y[:4])) == [0, 0x80000000, 0x3F800000, 0xBF800000], isa
        assert np.isnan(y[4]) and np.isnan(y[5]), isa
        assert y[6] == 1.0 and y[7] == -1.0 and y[8] == F32(1e-45), isa


def test_bad_arrays_are_refused() -> None:
    x = np.zeros(8, F32)
    with pytest.raises(ValueError, match="y: 4 elements, the call needs 8"):
        _kernels.tanh32(x, np.zeros(4, F32))
    with pytest.raises(TypeError, match="x: elements of format d"):
        _kernels.tanh32(np.zeros(8), x)
    with pytest.raises(TypeError, match="y: a C-contiguous writable array"):
        _kernels.tanh32(x, x[::2])
    with pytest.raises(ValueError, match="instruction set nope"):
        _kernels.tanh32(x, x.copy(), isa="nope")


def test_ieee_math_takes_the_kernel_with_numpys_shapes() -> None:
    x = np.linspace(-5, 5, 24, dtype=F32).reshape(2, 3, 4)
    for given in (x, x[:, ::2], x.astype(np.float64), F32(0.5), 2.0, [[1.0, -3.0]]):
        got, want = tanh32(given), tanh32_numpy(given)
        assert got.shape == want.shape and got.dtype == F32
        np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("isa", ISAS)
def test_the_soft_cap_is_tanh32_of_x_times_the_inverse_times_the_cap(isa: str) -> None:
    """llama.cpp's three float32 operations, tanh32 between: gemma2's cap of 30 on 262144
    logits (64 thread items of 4096; the set's vector tails at the end), and a cap of 1
    on the inputs glibc's tanhf rounds otherwise."""
    rng = np.random.default_rng(4)
    x = (30 * rng.standard_normal(262144 - 5)).astype(F32)
    x[:4] = [np.inf, -np.inf, 0.0, -0.0]
    for cap, logits in ((30.0, x), (1.0, np.array(GLIBC_TANHF_MISROUNDED * 3, F32))):
        want = tanh32_numpy(logits * (F32(1) / F32(cap))) * F32(cap)
        for threads in (1, 2):
            y = logits.copy()
            _kernels.softcap(y, cap, threads, isa=isa)
            np.testing.assert_array_equal(bits(y), bits(want))
    with pytest.raises(ValueError, match="instruction set nope"):
        _kernels.softcap(x.copy(), 30.0, 1, isa="nope")


@pytest.mark.parametrize("isa", ISAS)
def test_the_scores_cap_is_tanh32(isa: str) -> None:
    """Attention's cap (gemma2's 50) on scores whose products are exact (small integers
    times a power of two), 24 keys holding one-hot values: out[t] = p_t / sum p, p_t =
    exp32(c_t - max c), c_t = tanh32(s_t * (1 / 50)) * 50, the sum in order, all float32."""
    rng = np.random.default_rng(11)
    n_heads, n_kv, hd, n_ctx = 2, 1, 8, 24
    kc = rng.integers(-6, 7, (n_kv, n_ctx, hd)).astype(F32)
    vc = np.eye(n_ctx, dtype=F32)[None]  # position t's value: the unit vector t
    qkv = np.zeros((1, (n_heads + n_kv) * hd + n_kv * n_ctx), F32)
    qkv[0, : n_heads * hd] = rng.integers(-6, 7, n_heads * hd)
    heads = (n_heads, n_kv, hd, n_ctx, n_ctx, False)
    out = np.zeros((1, n_heads * n_ctx), F32)
    scale, cap = 2.0, 50.0
    _kernels.attention(qkv, 1, kc, vc, n_ctx - 1, heads, scale, out, 1, isa=isa, softcap=cap)
    q = qkv[0, : n_heads * hd].reshape(n_heads, hd)
    for h in range(n_heads):
        s = (kc[0] @ q[h]).astype(F32) * F32(scale)  # integers: exact in any order
        c = tanh32_numpy(s * (F32(1) / F32(cap))) * F32(cap)
        p = exp32_numpy(c - c.max())
        total = F32(0)
        for v in p:
            total = F32(total + v)
        np.testing.assert_array_equal(bits(out[0, h * n_ctx : (h + 1) * n_ctx]), bits(p / total))


def test_the_gelu_table_is_llamacpps_float32_formula_with_tanh32() -> None:
    """geglu reads a table of halves: for every half v in (-10, 10), 0.5 v (1 + tanh32(
    sqrt(2/pi) v (1 + 0.044715 v v))) in float32 (llama.cpp's order), rounded to half.
    (With glibc 2.36's tanhf the table has the same bits: its misroundings, 9856 of the
    63488 tanh inputs, vanish in the rounding to half; another C library's need not.)"""
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    v = halves[np.isfinite(halves) & (halves > -10) & (halves < 10)].astype(F32)
    n = v.size
    act = np.zeros((1, n), F32)
    _kernels.geglu(np.concatenate([v, np.ones(n, F32)])[None], act, 1, n, 2)
    with np.errstate(over="ignore"):
        inner = F32(0.7978845608028654) * v * (F32(1) + F32(0.044715) * v * v)
    g = F32(0.5) * v * (F32(1) + tanh32_numpy(inner))
    np.testing.assert_array_equal(bits(act[0]), bits(g.astype(np.float16).astype(F32)))


def test_the_scan_checks_the_input_nearest_a_midpoint(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/tanh32_scan.py (run on all 2^32 float32 by hand: minutes) on a range
    around 0x3ac37de2, whose double is 6 units of float64's last place from a float32
    rounding midpoint (the nearest of all), and on its negative: no set differs from the
    NumPy twin, and decimal finds the float32 correctly rounded."""
    assert tanh32_scan.scan(0x3AC37D00, 0x3AC37EFF, 256, 16.0) == 0
    out = capsys.readouterr().out
    assert "x=0x1.86fbc40000000p-10 (0x3ac37de2)   6.00 units: tanh32 0x1.86fbb2" in out
    assert "correctly rounded" in out and "(b) misrounded: 0" in out
    assert tanh32_scan.scan(0xBAC37D00, 0xBAC37EFF, 256, 16.0) == 0  # (a) only: negatives
