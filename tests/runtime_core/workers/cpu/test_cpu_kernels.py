"""The CPU worker's compiled kernels (``runtime_core.workers.cpu._kernels``) against independent
readings of the same numbers.

- Embedding rows (the kernels' dequantization) equal ``gguf.quants.dequantize`` bit
  for bit, for all 15 types.
- 8-bit activations: the q8_0 form equals the gguf package's Q8_0 quantization (which
  is llama.cpp's reference) bit for bit; q8_1 adds s = d * sum(q) rounded to a half;
  q8_K is llama.cpp's per-256 form (the largest magnitude maps to -127); a block
  holding a NaN or an infinity gets d = NaN.
- Products: each of the 12 quantized types times 8-bit activations equals the exact
  (float64) value of the block formula of ``csrc/dot.h`` on the integers
  ``twins.decode`` reads from the same bytes, within float32 rounding of the sum
  (2e-6 of the terms' magnitudes); float weights, and the "f32" mode, equal the exact
  product of the gguf package's dequantization with the float32 rows.
- The same numbers on every instruction set the host runs (the portable one's bits;
  each set a parameter, skipped with the reason where the processor lacks it), for any
  thread count and whichever rows share a call (bit for bit), so a prefill computes
  what decoding the rows one at a time computes.
- The instruction set is a per-call choice (``isa=``): one this processor lacks, or
  one the kernels do not know, is a ValueError naming it.
- rmsnorm, rotary, attention (f32 and f16 caches), SwiGLU and argmax agree with the
  NumPy twins; the f16 cache rounds as NumPy's ``astype(float16)`` does.
- Every malformed call is a TypeError or ValueError naming what is wrong.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from runplan.quant_types import FLOAT_TYPES, Q8_TYPES, QUANT_TYPES, row_bytes
from runtime_core.workers.cpu import _kernels
from runtime_core.workers.cpu.ops import ACT_FORMAT
from tests.support import twins
from tests.support.cpu_isas import HOST_ISAS, isa_params
from tests.support.random_blocks import random_rows

K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # super-blocks of 256


def width(qtype: str, chunks: int = 9) -> int:
    """A row width with a tail past the last group of 8 blocks."""
    return 256 * 3 if qtype in K_TYPES else 32 * chunks


def gguf_dequantize(raw: np.ndarray, qtype: str) -> np.ndarray:
    return np.asarray(quants.dequantize(raw, GGMLQuantizationType[qtype]), np.float32)


def q8(
    fmt: str, x: np.ndarray, isa: str | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The kernels' 8-bit form of rows x: q, d, s, g (d, s, g as the format uses them)."""
    rows, n = x.shape
    q = np.zeros((rows, n), np.int8)
    d = np.zeros((rows, n // 32), np.float32)
    s = np.zeros((rows, n // 32), np.float32)
    g = np.zeros((rows, n // 16), np.int32)
    _kernels.quantize(fmt, np.ascontiguousarray(x, np.float32), rows, n, q, d, s, g, isa=isa)
    if fmt == "q8_K":
        return q, d[:, : n // 256], s, g
    return q, d, s, g[:, : n // 32]


def linear(
    raw: np.ndarray,
    qtype: str,
    x: np.ndarray,
    *,
    use_q8: bool = True,
    threads: int = 1,
    isa: str | None = None,
) -> np.ndarray:
    rows, n = x.shape
    m = _kernels.Matrix([(raw, qtype, raw.shape[0], n, 0)])
    y = np.zeros((rows, raw.shape[0]), np.float32)
    if use_q8 and qtype not in FLOAT_TYPES:
        q = np.zeros((rows, n), np.int8)
        d = np.zeros((rows, n // 32), np.float32)
        s, g = d.copy(), np.zeros((rows, n // 16), np.int32)
        _kernels.linear(m, rows, x, q, d, s, g, True, True, y, None, False, threads, isa=isa)
    else:
        _kernels.linear(
            m, rows, x, None, None, None, None, False, False, y, None, False, threads, isa=isa
        )
    return y


def activations(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x[:, :32] *= 20.0  # an outlier block, as real residual streams have
    return x


# ---- dequantization ------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_embedding_rows_are_the_gguf_packages_dequantization(qtype: str) -> None:
    rng = np.random.default_rng(QUANT_TYPES.index(qtype))
    n = width(qtype)
    raw = random_rows(rng, qtype, 11, n, scale=0.3)
    table = _kernels.Matrix([(raw, qtype, 11, n, 0)])
    ids = np.array([3, 0, 10, 3], np.int32)
    out = np.full((4, n), np.nan, np.float32)
    _kernels.embed(table, ids, out, 2)
    expected = gguf_dequantize(raw[ids], qtype)
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))


# ---- 8-bit activations --------------------------------------------------------------------


def test_q8_0_is_the_gguf_packages_q8_0_quantization() -> None:
    rng = np.random.default_rng(1)
    x = activations(rng, 3, 32 * 7)
    x[1, 32:64] = 0.0  # an all-zero block
    q, d, _, g = q8("q8_0", x)
    blocks = np.asarray(quants.quantize(x, GGMLQuantizationType.Q8_0)).reshape(3, 7, 34)
    theirs_d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    theirs_q = blocks[..., 2:].copy().view(np.int8).reshape(3, -1)
    np.testing.assert_array_equal(q, theirs_q)
    np.testing.assert_array_equal(d, theirs_d)
    np.testing.assert_array_equal(g, q.reshape(3, 7, 32).sum(axis=2, dtype=np.int32))
    assert (d[1, 1], q[1, 32:64].any()) == (0.0, False)


def test_q8_1_adds_the_block_sums_as_halves() -> None:
    rng = np.random.default_rng(2)
    x = activations(rng, 2, 32 * 5)
    q, d, s, _ = q8("q8_1", x)
    q0, d0, _, _ = q8("q8_0", x)
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(d, d0)
    amax = np.abs(x.reshape(2, 5, 32)).max(axis=2)
    exact_d = (amax / np.float32(127)).astype(np.float32)
    sums = q.reshape(2, 5, 32).sum(axis=2).astype(np.float32)
    np.testing.assert_array_equal(s, (sums * exact_d).astype(np.float16).astype(np.float32))


def q8_k_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's quantize_row_q8_K_ref, in NumPy: per 256, the first value of the
    largest magnitude m maps to -127; q = min(127, round-half-even(x * (-127 / m)))."""
    blocks = x.reshape(-1, 256)
    at = np.abs(blocks).argmax(axis=1)  # the first of the largest magnitudes
    m = blocks[np.arange(blocks.shape[0]), at]
    iscale = (np.float32(-127.0) / m).astype(np.float32)
    v = (blocks * iscale[:, None]).astype(np.float32)
    q = np.minimum(127, np.rint(v)).astype(np.int8)
    return q.reshape(x.shape), (np.float32(1.0) / iscale).astype(np.float32)


def test_q8_k_is_llamacpps_per_256_form() -> None:
    rng = np.random.default_rng(3)
    x = activations(rng, 2, 256 * 3)
    x[1, 300] = -40.0  # the largest magnitude maps to -127, whatever its sign
    q, d, _, g = q8("q8_K", x)
    ref_q, ref_d = q8_k_reference(x)
    np.testing.assert_array_equal(q, ref_q)
    np.testing.assert_array_equal(d.reshape(-1), ref_d)
    np.testing.assert_array_equal(g, q.reshape(2, -1, 16).sum(axis=2, dtype=np.int32))
    assert q[1, 300] == -127 and q.reshape(2, 3, 256)[:, :, :].min() >= -127


@pytest.mark.parametrize("fmt", ["q8_0", "q8_1", "q8_K"])
def test_a_block_with_a_non_finite_value_has_a_nan_scale(fmt: str) -> None:
    x = np.ones((1, 512), np.float32)
    x[0, 5] = np.inf
    x[0, 300] = np.nan
    q, d, _, _ = q8(fmt, x)
    assert np.isnan(d.reshape(-1)[0])
    assert not q[0, :32].any()
    if fmt != "q8_K":
        assert np.isnan(d[0, 9]) and np.isfinite(d[0, 1:9]).all()


def _rounding_cases(rng: np.random.Generator) -> np.ndarray:
    """Rows of 512 values that meet every branch of the 8-bit forms: blocks whose scale
    is 1 (their largest magnitude 127), so a value is its own product: halves, the float
    just below one half, negative halves, ties of the round-half-even q8_K; a block's
    largest magnitude reached twice with both signs (q8_K takes the first); zero,
    subnormal, huge and non-finite blocks; and the residual stream's usual values."""
    x = rng.standard_normal((10, 512)).astype(np.float32)
    halves = np.array([0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5], np.float32)
    below = np.nextafter(np.float32(0.5), np.float32(0))
    for r in range(4):
        row = rng.choice(np.concatenate([halves, [below, -below, 0.0, -0.0, 3.0]]), 512)
        row[:: 32 if r % 2 else 256] = 127.0 if r < 2 else -127.0  # scale 1, both signs
        x[r] = row.astype(np.float32)
    m0, m1 = np.abs(x[4, :256]).max() * 2, np.abs(x[4, 256:]).max() * 2
    x[4, 30], x[4, 40] = -m0, m0  # q8_K: the first of -m, m sets the sign
    x[4, 300], x[4, 310] = m1, -m1
    x[5, :32] = 0.0  # an all-zero block of every format
    x[5, 256:] = 0.0
    x[6] *= np.float32(1e-41)  # subnormal
    x[7] *= np.float32(3e37)  # huge, still finite
    x[8, 3], x[8, 290], x[8, 500] = np.nan, np.inf, -np.inf
    x[9] = np.round(x[9] * 4) / 4  # quarters: many products on a half
    return x


@pytest.mark.parametrize("fmt", ["q8_0", "q8_1", "q8_K"])
@pytest.mark.parametrize("isa", isa_params(portable=False))
def test_every_instruction_set_quantizes_to_the_portable_bits(fmt: str, isa: str) -> None:
    """The 8-bit forms are each set's own code (AVX2's vectors; the AVX-512 sets take
    AVX2's): q, d, s and g bit for bit the portable loop's, on values made to meet the
    rounding rules' ties and every special block, and on random ones at many scales."""
    rng = np.random.default_rng(7)
    cases = [_rounding_cases(rng)]
    for scale in (1e-30, 1e-3, 1.0, 1e3, 1e30):
        cases.append((rng.standard_normal((4, 512)) * scale).astype(np.float32))
    for x in cases:
        want = q8(fmt, x, "portable")
        got = q8(fmt, x, isa)
        for name, a, b in zip("qdsg", got, want, strict=True):
            if name == "s" and fmt != "q8_1":
                continue
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)


def test_the_rounding_cases_reach_the_ties() -> None:
    """The cases above do meet what they are made for (a check of the check): q8_0
    rounds 2.5 away from zero to 3, q8_K to even, 2; the first of the largest magnitudes
    sets q8_K's sign; a non-finite block's scale is a NaN."""
    x = _rounding_cases(np.random.default_rng(7))
    q, d, _, _ = q8("q8_0", x, "portable")
    at = np.flatnonzero(x[1, 32:64] == 2.5)  # row 1: 127 starts every block of 32
    assert at.size and (q[1, 32 + at] == 3).all() and d[1, 1] == 1.0
    q, _, _, _ = q8("q8_K", x, "portable")
    at = np.flatnonzero(x[0, :256] == 2.5)  # row 0: 127 starts every block of 256
    assert at.size and (q[0, at] == -2).all()
    assert (q[4, 30], q[4, 40], q[4, 300], q[4, 310]) == (-127, 127, -127, 127)
    _, d, _, _ = q8("q8_K", x, "portable")
    assert np.isnan(d[8, 0]) and np.isnan(d[8, 1])


# ---- products ----------------------------------------------------------------------------


def exact_q8_product(raw: np.ndarray, qtype: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The float64 value of dot.h's block formula on the integers twins.decode reads,
    and the sum of the terms' magnitudes: (rows of x, rows of raw) each."""
    fmt = ACT_FORMAT[qtype]
    xq, xd, xs, xg = q8(fmt, x)
    dec = twins.decode(raw, qtype)
    wq = dec.q.astype(np.float64)  # (w, chunks, 32)
    rows, n = x.shape
    chunks = n // 32
    xq64 = xq.astype(np.float64).reshape(rows, chunks, 32)
    out = np.zeros((rows, raw.shape[0]))
    scale = np.zeros_like(out)
    for j in range(rows):
        if fmt in ("q8_0", "q8_1"):
            offset = {"Q4_0": 8.0, "Q5_0": 16.0}.get(qtype, 0.0)
            sumi = np.einsum("wcl,cl->wc", wq - offset, xq64[j])
            terms = dec.d.astype(np.float64) * xd[j].astype(np.float64) * sumi
            if qtype in ("Q4_1", "Q5_1"):
                assert dec.m is not None
                terms = terms + dec.m.astype(np.float64) * xs[j].astype(np.float64)
        else:
            assert dec.sc is not None
            if qtype in ("Q4_K", "Q5_K", "IQ4_XS"):  # a scale per 32 (and a min)
                isum = (dec.sc * np.einsum("wcl,cl->wc", wq, xq64[j])).reshape(-1, chunks // 8, 8)
                bsum = xg[j].reshape(chunks, 2).sum(axis=1).astype(np.float64)
                mn = dec.mn if dec.mn is not None else np.zeros_like(dec.sc)
                imin = (mn * bsum).reshape(-1, chunks // 8, 8)
            else:
                groups = np.einsum("wcgl,cgl->wcg", wq.reshape(-1, chunks, 2, 16),
                                   xq64[j].reshape(chunks, 2, 16))  # fmt: skip
                isum = (dec.sc * groups).reshape(-1, chunks // 8, 16)
                mn = dec.mn if dec.mn is not None else np.zeros_like(dec.sc)
                imin = (mn * xg[j].reshape(chunks, 2)).reshape(-1, chunks // 8, 16)
            dw = dec.d[:, ::8].astype(np.float64)
            dmin = dec.m[:, ::8].astype(np.float64) if dec.m is not None else 0.0 * dw
            dx = xd[j].astype(np.float64)
            terms = dx * (dw * isum.sum(axis=2) - dmin * imin.sum(axis=2))
        out[j] = terms.sum(axis=1)
        scale[j] = np.abs(terms).sum(axis=1)
    return out, scale


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("qtype", Q8_TYPES)
def test_8bit_products_are_the_exact_block_formula(qtype: str, rows: int) -> None:
    rng = np.random.default_rng(10 + Q8_TYPES.index(qtype))
    n = width(qtype, chunks=19)
    raw = random_rows(rng, qtype, 37, n, scale=1 / np.sqrt(n))
    x = activations(rng, rows, n)
    exact, scale = exact_q8_product(raw, qtype, x)
    ours = linear(raw, qtype, x)
    assert np.all(np.abs(ours - exact) <= 2e-6 * scale + 1e-30)


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_float_products_are_the_exact_product_of_the_dequantized_rows(qtype: str) -> None:
    rng = np.random.default_rng(30 + QUANT_TYPES.index(qtype))
    n = width(qtype, chunks=11)
    raw = random_rows(rng, qtype, 23, n, scale=1 / np.sqrt(n))
    x = activations(rng, 3, n)
    w = gguf_dequantize(raw, qtype).astype(np.float64)
    terms = x.astype(np.float64)[:, None, :] * w[None, :, :]
    ours = linear(raw, qtype, x, use_q8=False)
    assert np.all(np.abs(ours - terms.sum(axis=2)) <= 2e-6 * np.abs(terms).sum(axis=2))


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("use_q8", [True, False], ids=["q8", "f32"])
@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_products_do_not_depend_on_the_isa_the_threads_or_the_rows_computed_together(
    qtype: str, use_q8: bool, isa: str
) -> None:
    rng = np.random.default_rng(50 + QUANT_TYPES.index(qtype))
    n = width(qtype, chunks=13)
    raw = random_rows(rng, qtype, 53, n, scale=1 / np.sqrt(n))
    x = activations(rng, 7, n)
    expected = linear(raw, qtype, x, use_q8=use_q8, isa="portable").view(np.uint32)
    for threads in (1, 2, 3, 5):
        got = linear(raw, qtype, x, use_q8=use_q8, threads=threads, isa=isa)
        np.testing.assert_array_equal(got.view(np.uint32), expected)
    # one row at a time, as decode steps multiply
    rows = [linear(raw, qtype, x[j : j + 1], use_q8=use_q8, isa=isa) for j in range(7)]
    np.testing.assert_array_equal(np.concatenate(rows).view(np.uint32), expected)


def test_a_matrix_of_parts_writes_each_parts_columns_with_bias_and_accumulation() -> None:
    rng = np.random.default_rng(7)
    n = 256
    a, b = random_rows(rng, "Q4_K", 5, n), random_rows(rng, "Q6_K", 3, n)
    m = _kernels.Matrix([(a, "Q4_K", 5, n, 0), (b, "Q6_K", 3, n, 6)])
    assert (m.n_in, m.n_out, m.act_format) == (n, 9, "q8_K")
    x = activations(rng, 2, n)
    bias = rng.standard_normal(9).astype(np.float32)
    y = np.full((2, 9), 1.5, np.float32)
    q, d = np.zeros((2, n), np.int8), np.zeros((2, n // 32), np.float32)
    s, g = d.copy(), np.zeros((2, n // 16), np.int32)
    _kernels.linear(m, 2, x, q, d, s, g, True, True, y, bias, True, 2)
    np.testing.assert_array_equal(y[:, :5], 1.5 + (linear(a, "Q4_K", x) + bias[:5]))
    np.testing.assert_array_equal(y[:, 5], [1.5, 1.5])  # column 5 is no part's
    np.testing.assert_array_equal(y[:, 6:], 1.5 + (linear(b, "Q6_K", x) + bias[6:]))


# ---- the other operations ------------------------------------------------------------------


def test_rmsnorm_is_the_twins() -> None:
    rng = np.random.default_rng(8)
    x = activations(rng, 4, 576)
    w = rng.standard_normal(576).astype(np.float32)
    out = np.zeros_like(x)
    _kernels.rmsnorm(x, w, out, 4, 576, 1e-5, 2)
    ref, scale = twins.rmsnorm(x, w, 1e-5)
    assert np.all(np.abs(out - ref) <= 1e-6 * scale + 1e-30)


def test_swiglu_is_the_twins() -> None:
    rng = np.random.default_rng(9)
    h = (4 * rng.standard_normal((3, 2 * 5000))).astype(np.float32)
    act = np.zeros((3, 5000), np.float32)
    _kernels.swiglu(h, act, 3, 5000, 2)
    ref = twins.silu_mul(h[:, :5000], h[:, 5000:])
    np.testing.assert_allclose(act, ref, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_rotary_cache_and_attention_are_the_twins(neox: bool, kv: str) -> None:
    rng = np.random.default_rng(11)
    n_heads, n_kv, hd, max_seq, n_rot = 6, 2, 64, 16, 48
    width_ = (n_heads + 2 * n_kv) * hd
    theta = rng.uniform(0, 6.3, (max_seq, n_rot // 2))
    rot = np.exp(1j * theta).astype(np.complex64)
    dtype = np.float16 if kv == "f16" else np.float32
    kc = np.zeros((n_kv, max_seq, hd), dtype)
    vc = np.zeros_like(kc)
    heads = (n_heads, n_kv, hd, hd, max_seq, kv == "f16")
    rot_f = np.ascontiguousarray(rot).view(np.float32)
    bias = rng.standard_normal(width_).astype(np.float32)
    scale = float(np.float32(1 / np.sqrt(hd)))
    history = []
    for pos, rows in ((0, 5), (5, 1), (6, 3)):
        qkv = rng.standard_normal((rows, width_)).astype(np.float32)
        history.append(qkv + bias)
        x = qkv.copy()
        _kernels.rope_kv(x, rows, bias, rot_f, pos, heads, n_rot, neox, kc, vc, 2)
        out = np.zeros((rows, n_heads * hd), np.float32)
        _kernels.attention(x, rows, kc, vc, pos, heads, scale, out, 2)
        # the twins, on everything seen so far
        allv = np.concatenate(history)
        r = rot[: pos + rows]
        q = twins.rotate(allv[:, : n_heads * hd].reshape(-1, n_heads, hd), r, n_rot, neox)
        k = twins.rotate(
            allv[:, n_heads * hd : (n_heads + n_kv) * hd].reshape(-1, n_kv, hd), r, n_rot, neox
        )
        v = allv[:, (n_heads + n_kv) * hd :].reshape(-1, n_kv, hd)
        keys = k.transpose(1, 0, 2).astype(dtype)
        values = v.transpose(1, 0, 2).astype(dtype)
        np.testing.assert_array_equal(kc[:, : pos + rows], keys)
        np.testing.assert_array_equal(vc[:, : pos + rows], values)
        np.testing.assert_array_equal(x[:, : n_heads * hd], q[pos:].reshape(rows, -1))
        ref = twins.attention(
            q[pos:], keys.astype(np.float32), values.astype(np.float32), pos, n_heads // n_kv, scale
        )
        np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_capped_attention_is_the_twins(softcap: float) -> None:
    # gemma2's cap on the scores (softcap * tanh(score / softcap)) before the softmax;
    # the scores here spread over about +-3, so a cap of 2 bites
    rng = np.random.default_rng(13)
    n_heads, n_kv, hd, pos, rows = 4, 2, 32, 9, 5
    max_seq = pos + rows
    kc = rng.standard_normal((n_kv, max_seq, hd)).astype(np.float32)
    vc = rng.standard_normal((n_kv, max_seq, hd)).astype(np.float32)
    qkv = rng.standard_normal((rows, (n_heads + 2 * n_kv) * hd)).astype(np.float32)
    heads = (n_heads, n_kv, hd, hd, max_seq, False)
    out = np.zeros((rows, n_heads * hd), np.float32)
    scale = float(np.float32(0.5))
    _kernels.attention(qkv, rows, kc, vc, pos, heads, scale, out, 2, softcap=softcap)
    q = qkv[:, : n_heads * hd].reshape(rows, n_heads, hd)
    ref = twins.attention(q, kc, vc, pos, n_heads // n_kv, scale, softcap=softcap)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)
    if softcap:  # the cap changed the answer
        plain = twins.attention(q, kc, vc, pos, n_heads // n_kv, scale)
        assert np.abs(out - plain).max() > 0.05


@pytest.mark.parametrize("softcap", [-1.0, float("nan"), float("inf")])
def test_a_soft_cap_that_is_not_a_finite_non_negative_number_is_refused(softcap: float) -> None:
    heads = (2, 1, 8, 8, 4, False)
    kc, vc = np.zeros((1, 4, 8), np.float32), np.zeros((1, 4, 8), np.float32)
    qkv, out = np.zeros((1, 32), np.float32), np.zeros((1, 16), np.float32)
    with pytest.raises(ValueError, match="soft cap"):
        _kernels.attention(qkv, 1, kc, vc, 0, heads, 1.0, out, 1, softcap=softcap)


@pytest.mark.parametrize("isa", isa_params(portable=False))
@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize(
    ("hd", "pos", "softcap"),
    # a tail past 64; whole vectors; past 1024 positions; scores capped (gemma2); a head
    # size that is not a whole number of 8-float vectors
    [(72, 7, 0.0), (64, 7, 0.0), (64, 1100, 0.0), (64, 40, 1.5), (68, 9, 0.0)],
)
@pytest.mark.parametrize(
    ("n_heads", "n_kv", "rows"),
    # query heads a KV head serves: 4 (one item's), 3, 5 and 8 (in pieces), 1; a decode row
    [(8, 2, 30), (9, 3, 1), (10, 2, 5), (16, 2, 1), (4, 4, 3)],
)
def test_attention_does_not_depend_on_the_isa_or_the_threads(
    kv: str, isa: str, hd: int, pos: int, softcap: float, n_heads: int, n_kv: int, rows: int
) -> None:
    rng = np.random.default_rng(12)
    max_seq = pos + 33  # scores of keys 8 at a time and a few more (pos + 1 .. pos + 30)
    dtype = np.float16 if kv == "f16" else np.float32
    kc = rng.standard_normal((n_kv, max_seq, hd)).astype(dtype)
    vc = rng.standard_normal((n_kv, max_seq, hd)).astype(dtype)
    qkv = rng.standard_normal((rows, (n_heads + 2 * n_kv) * hd)).astype(np.float32)
    heads = (n_heads, n_kv, hd, hd, max_seq, kv == "f16")
    outs = []
    for name in ("portable", isa):
        for threads in (1, 3):
            out = np.zeros((rows, n_heads * hd), np.float32)
            _kernels.attention(qkv, rows, kc, vc, pos, heads, 0.125, out, threads, isa=name,
                               softcap=softcap)  # fmt: skip
            outs.append(out)
    for other in outs[1:]:
        np.testing.assert_array_equal(other.view(np.uint32), outs[0].view(np.uint32))


def test_the_f16_cache_rounds_as_numpy_does() -> None:
    values = np.array(
        [0.0, -0.0, 1.0, 65504.0, 65519.0, 65520.0, -1e6, 6.1e-5, 5.96e-8, 2.9e-8, 3.0e-8,
         1e-9, 0.33333334, 2049.0, 2051.0, np.inf, -np.inf],
        np.float32,
    )  # fmt: skip
    n = values.size
    heads = (1, 1, n, n, 1, True)
    qkv = np.zeros((1, 3 * n), np.float32)
    qkv[0, 2 * n :] = values  # V is stored as given
    kc = np.zeros((1, 1, n), np.float16)
    vc = np.zeros_like(kc)
    rot = np.zeros((1, 0), np.float32)
    _kernels.rope_kv(qkv, 1, None, rot, 0, heads, 0, False, kc, vc, 1)
    with np.errstate(over="ignore"):  # out of range: infinity
        expected = values.astype(np.float16)
    np.testing.assert_array_equal(vc[0, 0].view(np.uint16), expected.view(np.uint16))


def test_argmax_takes_the_first_largest_finite_value_and_counts_the_others() -> None:
    x = np.array([1.0, np.nan, 3.0, np.inf, 3.0, -np.inf, 2.0], np.float32)
    assert _kernels.argmax(x) == (2, 3)
    assert _kernels.argmax(np.full(4, np.nan, np.float32)) == (0x7FFFFFFF, 4)


# ---- malformed calls -------------------------------------------------------------------------


def test_a_malformed_matrix_is_refused_naming_what_is_wrong() -> None:
    rows = np.zeros((4, row_bytes("Q4_0", 64)), np.uint8)
    with pytest.raises(ValueError, match="IQ2_XXS is not a type"):
        _kernels.Matrix([(rows, "IQ2_XXS", 4, 64, 0)])
    with pytest.raises(ValueError, match="bytes"):
        _kernels.Matrix([(rows, "Q4_0", 5, 64, 0)])
    with pytest.raises(ValueError, match="whole chunks of 32"):
        _kernels.Matrix([(np.zeros((4, 40), np.uint8), "Q8_0", 4, 40, 0)])
    with pytest.raises(ValueError, match="blocks of 256"):
        _kernels.Matrix([(np.zeros((4, 84), np.uint8), "Q2_K", 4, 64, 0)])
    with pytest.raises(ValueError, match="q8_K activations"):
        k = np.zeros((2, row_bytes("Q4_K", 256)), np.uint8)
        legacy = np.zeros((2, row_bytes("Q4_0", 256)), np.uint8)
        _kernels.Matrix([(legacy, "Q4_0", 2, 256, 0), (k, "Q4_K", 2, 256, 2)])
    with pytest.raises(TypeError, match="C-contiguous"):
        _kernels.Matrix([(np.zeros((4, 36), np.uint8)[:, ::2], "Q4_0", 4, 32, 0)])


def test_a_malformed_product_is_refused_naming_what_is_wrong() -> None:
    raw = np.zeros((3, row_bytes("Q8_0", 64)), np.uint8)
    m = _kernels.Matrix([(raw, "Q8_0", 3, 64, 0)])
    x = np.zeros((2, 64), np.float32)
    q, d, s, g = (
        np.zeros((2, 64), np.int8),
        *(np.zeros((2, 2), np.float32),) * 2,
        np.zeros((2, 4), np.int32),
    )
    y = np.zeros((2, 3), np.float32)
    _kernels.linear(m, 2, x, q, d, s, g, True, True, y, None, False, 1)
    with pytest.raises(ValueError, match="x: 128 elements, the call needs 192"):
        _kernels.linear(
            m, 3, x, q, d, s, g, True, True, np.zeros((3, 3), np.float32), None, False, 1
        )
    with pytest.raises(TypeError, match="x: elements of format d"):
        _kernels.linear(m, 2, x.astype(np.float64), q, d, s, g, True, True, y, None, False, 1)
    with pytest.raises(TypeError, match="y: a C-contiguous writable"):
        _kernels.linear(m, 2, x, q, d, s, g, True, True, y.T, None, False, 1)
    with pytest.raises(ValueError, match="threads 0"):
        _kernels.linear(m, 2, x, q, d, s, g, True, True, y, None, False, 0)
    with pytest.raises(ValueError, match="bias: 2 elements"):
        _kernels.linear(m, 2, x, q, d, s, g, True, True, y, np.zeros(2, np.float32), False, 1)
    with pytest.raises(ValueError, match="quantize without use_q8"):
        _kernels.linear(m, 2, x, q, d, s, g, True, False, y, None, False, 1)
    with pytest.raises(ValueError, match=r"token id 3 outside 0\.\.2"):
        _kernels.embed(m, np.array([0, 3], np.int32), np.zeros((2, 64), np.float32), 1)
    with pytest.raises(ValueError, match="instruction set avx9000 is not one the kernels know"):
        _kernels.linear(m, 2, x, q, d, s, g, True, True, y, None, False, 1, isa="avx9000")
    lacking = [name for name in _kernels.KNOWN_ISAS if name not in HOST_ISAS]
    for name in lacking:
        with pytest.raises(ValueError, match=f"instruction set {name} is not one this processor"):
            _kernels.linear(m, 2, x, q, d, s, g, True, True, y, None, False, 1, isa=name)
    with pytest.raises(ValueError, match="instruction set avx9000"):
        _kernels.attention(
            np.zeros((1, 3 * 32), np.float32), 1, np.zeros((1, 4, 32), np.float32),
            np.zeros((1, 4, 32), np.float32), 0, (1, 1, 32, 32, 4, False), 1.0,
            np.zeros((1, 32), np.float32), 1, isa="avx9000",
        )  # fmt: skip


#: the processor flags (as Linux's /proc/cpuinfo names them) each set needs
ISA_FLAGS = {
    "avx2": ("avx2", "f16c"),
    "avxvnni": ("avx2", "f16c", "avx_vnni"),
    "avx512bw": ("avx2", "f16c", "avx512f", "avx512bw", "avx512vl"),
    "avx512": ("avx2", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    "avx512-zen4": ("avx2", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    "avx512-intel": ("avx2", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
}


def test_the_sets_offered_are_those_the_processor_reports() -> None:
    """Every set whose instructions /proc/cpuinfo reports is offered (AVX-VNNI's 256-bit
    vpdpbusd between AVX2 and AVX-512, AVX-512 BW without VNNI before AVX-512 with it,
    AVX-512's Zen 4 choices last where the processor is AMD's family 19h, its own kernels
    for every product last where it is Intel's), in the kernels' order, the best last."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists() or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the flags are read from Linux's /proc/cpuinfo of an x86-64 processor")
    fields: dict[str, str] = {}
    for line in cpuinfo.read_text().splitlines():
        key, _, value = line.partition(":")
        if not key.strip():
            break  # the first processor's fields
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    if _kernels.AVXVNNI_AS_EVEX and "avx512_vnni" in flags:  # `make avxvnni-as-evex`'s build
        flags.add("avx_vnni")
    vendor = fields.get("vendor_id")
    zen4 = vendor == "AuthenticAMD" and fields.get("cpu family") == "25"
    only_on = {"avx512-zen4": zen4, "avx512-intel": vendor == "GenuineIntel"}
    runs = [
        n
        for n in _kernels.KNOWN_ISAS
        if all(f in flags for f in ISA_FLAGS.get(n, ())) and only_on.get(n, True)
    ]
    expected = tuple(runs)
    assert _kernels.isas() == expected
    known = ("portable", "avx2", "avxvnni", "avx512bw", "avx512", "avx512-zen4", "avx512-intel")
    assert known == _kernels.KNOWN_ISAS
