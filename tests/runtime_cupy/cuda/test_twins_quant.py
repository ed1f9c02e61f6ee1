"""The kernels' NumPy twins against the gguf package and exact arithmetic.

- ``twins.dequantize`` equals ``gguf.quants.dequantize`` bit for bit, for every type,
  on random valid blocks of odd sizes, on blocks the gguf package quantized, and on
  every tensor of llama.cpp's quantized fixture models.
- ``twins.quantize_q8`` (the kernels' 8-bit activations): |x - d q| <= d / 2, q within
  [-127, 127], the largest element exact, halves rounded away from zero,
  s = d * sum(q), all-zero chunks stay zero.
- ``twins.matvec_q8``, the integer-dot-product form of each type, equals the exact
  product of the dequantized rows with the dequantized activations within float32
  rounding (1e-6 of the sum of the terms' magnitudes); ``matvec_f`` the same for
  float32 activations.
- The Q4_K / Q5_K scale packing used to write random models round-trips.
- ``device_sampling.sample`` picks what the reference sampler picks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from runplan import SamplingConfig
from runplan.gguf_header import GgufHeader
from runplan.gguf_tensors import TensorInfo
from runplan.quant_types import (
    CHUNK,
    Q8_TYPES,
    QUANT_TYPES,
    block_bytes,
    block_elems,
    row_bytes,
)
from runtime_core.workers import device_sampling
from runtime_core.workers.sampling import Sampler
from tests.fixtures.llamacpp_fixtures import MODELS_DIR
from tests.support import twins
from tests.support.random_blocks import filled_rows, random_rows

GGUF_QUANTIZES = ("BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def gguf_dequantize(raw: np.ndarray, qtype: str) -> np.ndarray:
    return np.asarray(quants.dequantize(raw, GGMLQuantizationType[qtype]), np.float32)


def same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype == np.float32
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize("rows", [1, 7])
def test_dequantize_equals_the_gguf_package_on_random_blocks(qtype: str, rows: int) -> None:
    rng = np.random.default_rng(rows * 100 + QUANT_TYPES.index(qtype))
    n = 256 * 3 if block_elems(qtype) > CHUNK else 32 * 5
    raw = random_rows(rng, qtype, rows, n, scale=0.3)
    assert raw.shape == (rows, row_bytes(qtype, n))
    same_bits(twins.dequantize(raw, qtype), gguf_dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", GGUF_QUANTIZES)
def test_dequantize_equals_the_gguf_package_on_its_own_blocks(qtype: str) -> None:
    rng = np.random.default_rng(3)
    values = rng.standard_normal((9, 32 * 7)).astype(np.float32)
    values[0] = 0.0  # all-zero blocks
    raw = np.ascontiguousarray(quants.quantize(values, GGMLQuantizationType[qtype]))
    same_bits(twins.dequantize(raw, qtype), gguf_dequantize(raw, qtype))


@pytest.mark.parametrize("path", sorted(MODELS_DIR.glob("*.gguf")), ids=lambda p: p.stem)
def test_dequantize_equals_the_gguf_package_on_llamacpp_files(path: Path) -> None:
    header = GgufHeader.read(path)
    types = set()
    for name, info in header.tensors.items():
        raw = np.ascontiguousarray(header.tensor_bytes(name)).reshape(-1, _row(info))
        same_bits(twins.dequantize(raw, info.ggml_type), gguf_dequantize(raw, info.ggml_type))
        types.add(info.ggml_type)
    assert types & set(Q8_TYPES)


def _row(info: TensorInfo) -> int:
    return row_bytes(info.ggml_type, info.shape[0])


def test_decode_refuses_rows_that_are_not_whole_blocks() -> None:
    with pytest.raises(ValueError, match="whole blocks"):
        twins.dequantize(np.zeros((2, block_bytes("Q4_0") + 1), np.uint8), "Q4_0")


def test_q8_activations_round_to_nearest_within_half_a_step() -> None:
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(32 * 40) * rng.uniform(0.01, 100, 32 * 40)).astype(np.float32)
    x[:32] = 0.0  # a zero chunk
    x[32:64] = np.linspace(-1, 1, 32, dtype=np.float32)
    act = twins.quantize_q8(x)
    q = act.q.astype(np.int32).reshape(-1, CHUNK)
    d = act.d.astype(np.float64)[:, None]
    blocks = x.reshape(-1, CHUNK).astype(np.float64)
    assert np.abs(q).max() <= 127
    assert np.all(np.abs(blocks - d * q) <= d / 2 * (1 + 1e-6) + 1e-30)
    assert np.all(np.abs(q).max(axis=1)[1:] == 127)  # the largest element maps to +-127
    assert np.all(q[0] == 0) and act.d[0] == 0.0 and act.s[0] == 0.0
    np.testing.assert_array_equal(act.s, act.d * q.sum(axis=1).astype(np.float32))


def test_q8_rounds_halves_away_from_zero() -> None:
    np.testing.assert_array_equal(
        twins.roundf(np.array([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, -1.4], np.float32)),
        np.array([1, 2, 3, -1, -3, 0, -1], np.float32),
    )


def test_q8_refuses_a_row_that_is_not_whole_chunks() -> None:
    with pytest.raises(ValueError, match="multiple"):
        twins.quantize_q8(np.zeros(33, np.float32))


@pytest.mark.parametrize("qtype", Q8_TYPES)
def test_integer_products_equal_the_exact_product(qtype: str) -> None:
    rng = np.random.default_rng(11 + Q8_TYPES.index(qtype))
    n = 256 * 3 if block_elems(qtype) > CHUNK else 32 * 9
    raw = random_rows(rng, qtype, 13, n)
    act = twins.quantize_q8(rng.standard_normal(n).astype(np.float32) * np.float32(3))
    got = twins.matvec_q8(raw, qtype, act)
    exact = gguf_dequantize(raw, qtype).astype(np.float64) @ act.values()
    assert np.all(np.abs(got.y - exact) <= 1e-6 * got.scale + 1e-30), qtype


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_float_products_equal_the_exact_product(qtype: str) -> None:
    rng = np.random.default_rng(17)
    n = 256 if block_elems(qtype) > CHUNK else 64
    raw = random_rows(rng, qtype, 6, n)
    x = rng.standard_normal(n).astype(np.float32)
    got = twins.matvec_f(raw, qtype, x)
    exact = gguf_dequantize(raw, qtype).astype(np.float64) @ x.astype(np.float64)
    assert np.all(np.abs(got.y - exact) <= 1e-6 * got.scale)


def test_q8_products_stay_close_to_float_products() -> None:
    """8-bit activations cost well under a percent on a real-sized row."""
    rng = np.random.default_rng(2)
    raw = random_rows(rng, "Q4_K", 64, 4096)
    x = rng.standard_normal(4096).astype(np.float32)
    exact = twins.matvec_f(raw, "Q4_K", x).y.astype(np.float64)
    q8 = twins.matvec_q8(raw, "Q4_K", twins.quantize_q8(x)).y
    assert np.linalg.norm(q8 - exact) / np.linalg.norm(exact) < 0.01


def test_k_scale_packing_round_trips_and_matches_gguf() -> None:
    rng = np.random.default_rng(4)
    sc = rng.integers(0, 64, (50, 8))
    mn = rng.integers(0, 64, (50, 8))
    packed = twins.pack_k4_scale_min(sc, mn)
    got_sc, got_mn = twins.k4_scale_min(packed)
    np.testing.assert_array_equal(got_sc, sc)
    np.testing.assert_array_equal(got_mn, mn)
    # a Q4_K block built with these scales dequantizes, by the gguf package, as written
    block = random_rows(rng, "Q4_K", 50, 256)
    block[:, 4:16] = packed
    dec = twins.decode(block, "Q4_K")
    np.testing.assert_array_equal(dec.sc, sc)
    same_bits(twins.dequantize(block, "Q4_K"), gguf_dequantize(block, "Q4_K"))
    with pytest.raises(ValueError, match="6-bit"):
        twins.pack_k4_scale_min(sc + 64, mn)


# ---- IQ4_NL and IQ4_XS: a nibble indexes 16 signed values ----------------------------------

IQ4_TYPES = ("IQ4_NL", "IQ4_XS")
#: Every byte one value: 0x00 and 0xFF give the extreme values (-127, 113) and IQ4_XS's
#: extreme scales (-32, 31); 0x87 and 0x78 the two values nearest zero.
IQ4_FILLS = (0x00, 0xFF, 0x87, 0x78)


def iq4_rows(qtype: str, rows: int, n: int) -> np.ndarray:
    """Random rows, then one row filled with each of ``IQ4_FILLS``."""
    rng = np.random.default_rng(IQ4_TYPES.index(qtype) + 40)
    filled = [filled_rows(qtype, 1, n, fill, 0.01) for fill in IQ4_FILLS]
    return np.concatenate([random_rows(rng, qtype, rows, n), *filled])


@pytest.mark.parametrize("qtype", IQ4_TYPES)
def test_iq4_extreme_blocks_decode_as_the_gguf_package(qtype: str) -> None:
    raw = iq4_rows(qtype, 3, 512)
    same_bits(twins.dequantize(raw, qtype), gguf_dequantize(raw, qtype))
    dec = twins.decode(raw, qtype)
    assert set(np.unique(dec.q)) <= set(twins.IQ4_VALUES.tolist())
    low, high = dec.q[3], dec.q[4]  # the rows of 0x00 and 0xFF bytes
    assert (low == -127).all() and (high == 113).all()
    if qtype == "IQ4_XS":
        assert dec.sc is not None
        assert (dec.sc[3] == -32).all() and (dec.sc[4] == 31).all()
        assert dec.sc.min() >= -32 and dec.sc.max() <= 31


@pytest.mark.parametrize("qtype", IQ4_TYPES)
def test_iq4_chunk_terms_are_the_exact_product_rounded_twice(qtype: str) -> None:
    """Each chunk's term (``dot_q8``: an exact integer sum, then two float32 products)
    is the float64 product of the decoded integers, scales and factors within two
    roundings; on random activations and on chunks of +-127 (the largest sums)."""
    n = 512
    raw = iq4_rows(qtype, 5, n)
    dec = twins.decode(raw, qtype)
    rng = np.random.default_rng(8)
    ones = np.ones(n, np.float32)
    for x in (rng.standard_normal(n).astype(np.float32), ones, -ones):
        act = twins.quantize_q8(x)
        got = twins.chunk_terms_q8(raw, qtype, act).astype(np.float64)
        xq = act.q.astype(np.int64).reshape(-1, CHUNK)
        sums = np.einsum("rcl,cl->rc", dec.q.astype(np.int64), xq)
        scale = dec.sc.astype(np.float64) if dec.sc is not None else 1.0
        exact = dec.d.astype(np.float64) * scale * act.d.astype(np.float64)[None, :] * sums
        assert np.all(np.abs(got - exact) <= 2.0**-23 * np.abs(exact)), qtype


def test_argmax_twin_takes_the_first_largest_finite_and_counts_the_rest() -> None:
    x = np.array([1.0, 5.0, np.nan, 5.0, -np.inf, 2.0], np.float32)
    assert twins.argmax(x) == (1, 2)
    assert twins.argmax(np.array([np.nan], np.float32))[1] == 1


def test_device_sampling_picks_what_the_reference_sampler_picks() -> None:
    rng = np.random.default_rng(1)
    for trial in range(60):
        n = int(rng.integers(2, 2000))
        logits = (rng.standard_normal(n) * rng.uniform(0.1, 5)).astype(np.float32)
        if trial % 3 == 0:
            logits = np.round(logits, 1).astype(np.float32)  # many ties
        config = SamplingConfig(
            temperature=float(rng.uniform(0.1, 2.0)),
            top_k=int(rng.choice([0, 1, 5, 40, n, n + 3])),
            top_p=float(rng.choice([1.0, 0.9, 0.5, 0.01])),
            seed=trial,
        )
        reference = Sampler(config)
        draws = np.random.Generator(np.random.PCG64(config.seed))
        for _ in range(4):
            ours = device_sampling.sample(np, logits, config, float(draws.random()))
            assert ours == reference.sample(logits), (trial, config)


def test_device_sampling_orders_by_logit_then_id() -> None:
    logits = np.array([0.5, 2.0, -0.0, 2.0, 0.0, -3.0], np.float32)
    np.testing.assert_array_equal(device_sampling.descending_order(np, logits), [1, 3, 0, 2, 4, 5])
    with pytest.raises(ValueError, match="greedy"):
        device_sampling.sample(np, logits, SamplingConfig(), 0.5)


def test_a_chunk_holding_nan_or_infinity_poisons_its_products() -> None:
    x = np.ones(96, np.float32)
    x[3] = np.nan
    x[70] = -np.inf
    act = twins.quantize_q8(x)
    assert np.isnan(act.d[0]) and np.isnan(act.d[2]) and act.d[1] == np.float32(1 / 127)
    assert not act.q[:32].any() and not act.q[64:].any()
    assert np.all(act.q[32:64] == 127)
    raw = random_rows(np.random.default_rng(0), "Q4_0", 2, 96)
    assert np.isnan(twins.matvec_q8(raw, "Q4_0", act).y).all()
