"""Every CUDA kernel against its NumPy twin (``kernel_twins``), on random inputs of the
shapes real models have (SmolLM2's 576 and 1536, Llama-3-8B's 4096 and 14336) and odd
ones (a chunk count not a multiple of the warp, a row count not a multiple of a
block's rows, one row), for every weight type.

Needs a CUDA device; skipped, saying why, where there is none. Each kernel runs
through ``KernelSet.launch`` on copies of the inputs; its twin runs on the host
arrays; outputs start poisoned (NaN, or 0x5A bytes) in both, so an unwritten element
shows. Exact where the twin reproduces the arithmetic (decoding, conversions,
quantizing a given row, rotary, argmax), except that a NaN matches any NaN (a GPU's
NaNs carry no payload); within a few float32 roundings of the sum of the terms'
magnitudes where the kernel sums in its own order (products, norms, attention).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from runplan.quant_types import (
    CHUNK,
    FLOAT_TYPES,
    Q8_TYPES,
    QUANT_TYPES,
    block_elems,
    row_bytes,
)
from runtime_cupy.cuda.kernels import KernelSet
from tests.support import twins
from tests.support.cuda_device import cuda_device_problem
from tests.support.kernel_twins import KERNEL_TWINS
from tests.support.random_blocks import random_rows

PROBLEM = cuda_device_problem()
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")

MV_WARPS, ATT_THREADS = 4, 256
#: (rows, n_in) per kind of type: one row, odd rows and chunks, real widths, long rows.
SHAPES_32 = [(1, 32), (7, 96), (577, 576), (1031, 4192), (64, 14336), (4099, 1536)]
SHAPES_K = [(1, 256), (5, 768), (1027, 4352), (64, 14336), (4099, 4096)]


def shapes_for(qtype: str) -> list[tuple[int, int]]:
    return SHAPES_K if block_elems(qtype) > CHUNK else SHAPES_32


@pytest.fixture(scope="module")
def ks() -> KernelSet:
    k = KernelSet()
    k.compile_all()
    return k


#: The NaNs float outputs start as: a payload that neither NumPy nor a GPU computes, so
#: that the emulation of the kernels (test_twins_gpu_dryrun.py) can tell a NaN written
#: over one from the one left there.
POISON_NAN: dict[np.dtype[Any], tuple[Any, int]] = {
    np.dtype(np.float32): (np.uint32, 0x7FD5A5A5),
    np.dtype(np.float16): (np.uint16, 0x7E5A),
}


def poison(shape: Any, dtype: Any) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt in POISON_NAN:
        bits_type, bits = POISON_NAN[dt]
        return np.full(shape, bits, bits_type).view(dt)
    if np.issubdtype(dt, np.floating):
        return np.full(shape, np.nan, dt)
    return np.full(shape, 0x5A, dt)


def launch_both(
    ks: KernelSet, name: str, grid: int | tuple[int, ...], block: int, args: Sequence[Any]
) -> tuple[list[Any], list[Any]]:
    """Run kernel ``name`` on device copies of ``args`` and its twin on host copies;
    return (device results, twin results), each argument as a host array (or as given)."""
    import cupy

    dev = [cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    host = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    ks.launch(name, grid, block, dev)
    cupy.cuda.runtime.deviceSynchronize()
    grid3 = (grid,) if isinstance(grid, int) else tuple(grid)
    KERNEL_TWINS[name](grid3, block, host)
    return [cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else a for a in dev], host


def within(got: np.ndarray, want: np.ndarray, scale: np.ndarray, rel: float = 1e-5) -> None:
    """``got`` within ``rel * scale`` of ``want``, elementwise. Every comparison is
    written so that a NaN fails it: a NaN scale (say one made from a poisoned output)
    would otherwise make every bound false, and so every check pass."""
    scale = np.asarray(scale, dtype=np.float64)
    assert np.isfinite(scale).all() and (scale >= 0).all(), "the tolerance's scale is not finite"
    assert np.isfinite(want).all(), "the twin's result is not finite"
    assert not np.isnan(got).any(), "unwritten or NaN output"
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    ok = err <= rel * scale + 1e-30
    assert ok.all(), (int((~ok).sum()), float((err / np.maximum(scale, 1e-30)).max()))


def same_bits(got: np.ndarray, want: np.ndarray) -> None:
    """Bit for bit, except that a NaN equals any NaN: a GPU writes its own canonical
    NaN (0x7fffffff, or 0x7fff in half precision) where NumPy keeps an operand's
    payload, so NaN bits are not the kernels' to match."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if np.issubdtype(got.dtype, np.floating):
        nan = np.isnan(got)
        np.testing.assert_array_equal(nan, np.isnan(want), "NaN in different places")
        got, want = got[~nan], want[~nan]
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


# ---- products -----------------------------------------------------------------------------


@pytest.mark.parametrize("accumulate", [0, 1], ids=["store", "accumulate"])
@pytest.mark.parametrize("qtype", Q8_TYPES)
def test_matvec_q8(ks: KernelSet, qtype: str, accumulate: int) -> None:
    rng = np.random.default_rng(Q8_TYPES.index(qtype) + 100 * accumulate)
    for n_out, n_in in shapes_for(qtype):
        raw = random_rows(rng, qtype, n_out, n_in)
        act = twins.quantize_q8(rng.standard_normal(n_in).astype(np.float32))
        y = (
            rng.standard_normal(n_out + 3).astype(np.float32)
            if accumulate
            else poison(n_out + 3, np.float32)
        )
        bias = rng.standard_normal(n_out).astype(np.float32) if n_out % 2 else None
        args = [raw, row_bytes(qtype, n_in), n_in // CHUNK, n_out, act.q, act.d, act.s, y, bias,
                accumulate]  # fmt: skip
        dev, twin = launch_both(
            ks, f"matvec_q8_{qtype}", -(-n_out // MV_WARPS), 32 * MV_WARPS, args
        )
        scale = twins.matvec_q8(raw, qtype, act).scale
        if accumulate:  # y holds the NaN poison when storing: no part of the scale
            scale = scale + np.abs(y[:n_out])
        within(dev[7][:n_out], twin[7][:n_out], scale + (np.abs(bias) if bias is not None else 0))
        same_bits(dev[7][n_out:], y[n_out:])  # rows past the matrix untouched


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_matvec_f(ks: KernelSet, qtype: str) -> None:
    rng = np.random.default_rng(QUANT_TYPES.index(qtype) + 50)
    for n_out, n_in in shapes_for(qtype):
        raw = random_rows(rng, qtype, n_out, n_in)
        x = rng.standard_normal(n_in).astype(np.float32)
        y = poison(n_out, np.float32)
        args = [raw, row_bytes(qtype, n_in), n_in // CHUNK, n_out, x, y, None, 0]
        dev, twin = launch_both(ks, f"matvec_f_{qtype}", -(-n_out // MV_WARPS), 32 * MV_WARPS, args)
        within(dev[5], twin[5], twins.matvec_f(raw, qtype, x).scale)


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_dequant_rows_by_id_and_by_range(ks: KernelSet, qtype: str) -> None:
    rng = np.random.default_rng(QUANT_TYPES.index(qtype) + 7)
    n = 768 if block_elems(qtype) > CHUNK else 576
    raw = random_rows(rng, qtype, 50, n)
    ids = rng.integers(0, 50, 9).astype(np.int32)
    for pick, row0 in ((ids, 0), (None, 13)):
        out = poison((9, n), np.float32)
        args = [raw, row_bytes(qtype, n), n // CHUNK, pick, row0, 9, out]
        dev, twin = launch_both(ks, f"dequant_rows_{qtype}", 4, 128, args)
        same_bits(dev[6], twin[6])


def test_float_types_have_no_8bit_product() -> None:
    assert not {f"matvec_q8_{t}" for t in FLOAT_TYPES} & set(KERNEL_TWINS)


# ---- several rows in one launch (a batch's rows) ------------------------------------------
#
# The matvec kernels, rmsnorm_q8 and the gated q8 kernels take a batch's rows in one launch
# (a grid dimension of rows): each row's results must be, bit for bit, those of that row
# launched alone (CONCURRENT_RUNS.md's batch invariance rests on it), and the twin's.

#: A launch's rows.
BATCH_ROWS = 3
#: One type of each decoder family (the row offsets are the same code for every type).
ROW_TYPES = ["Q4_0", "Q8_0", "Q4_K", "Q6_K"]


@pytest.mark.parametrize("mode", ["q8", "f"])
@pytest.mark.parametrize("qtype", ROW_TYPES)
def test_matvec_rows_are_each_row_launched_alone(ks: KernelSet, qtype: str, mode: str) -> None:
    rng = np.random.default_rng(ROW_TYPES.index(qtype) + 300)
    n_out, n_in = shapes_for(qtype)[1]
    raw = random_rows(rng, qtype, n_out, n_in)
    x = rng.standard_normal((BATCH_ROWS, n_in)).astype(np.float32)
    acts = [twins.quantize_q8(row) for row in x]
    bias = rng.standard_normal(n_out).astype(np.float32)
    head = [raw, row_bytes(qtype, n_in), n_in // CHUNK, n_out]
    blocks = -(-n_out // MV_WARPS)

    def args(rows: list[int]) -> list[Any]:
        y = poison(len(rows) * n_out, np.float32)
        if mode == "f":
            return [*head, np.ascontiguousarray(x[rows]), y, bias, 0]
        q = np.concatenate([acts[r].q for r in rows])
        d = np.concatenate([acts[r].d for r in rows])
        sums = np.concatenate([acts[r].s for r in rows])
        return [*head, q, d, sums, y, bias, 0]

    out = 5 if mode == "f" else 7
    name = f"matvec_{mode}_{qtype}"
    dev, twin = launch_both(ks, name, (blocks, BATCH_ROWS), 32 * MV_WARPS, args([0, 1, 2]))
    together = dev[out].reshape(BATCH_ROWS, n_out)
    for r in range(BATCH_ROWS):
        alone, _ = launch_both(ks, name, blocks, 32 * MV_WARPS, args([r]))
        same_bits(together[r], alone[out])
        dot = twins.matvec_q8(raw, qtype, acts[r]) if mode == "q8" else None
        scale = dot.scale if dot is not None else twins.matvec_f(raw, qtype, x[r]).scale
        within(together[r], twin[out].reshape(BATCH_ROWS, n_out)[r], scale + np.abs(bias))


def test_rmsnorm_q8_rows_are_each_row_launched_alone(ks: KernelSet) -> None:
    rng = np.random.default_rng(301)
    n = 576
    x = (rng.standard_normal((BATCH_ROWS, n)) * 3).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def args(rows: int, xs: np.ndarray) -> list[Any]:
        q8 = (poison(rows * n, np.int8), *(poison(rows * n // 32, np.float32) for _ in "ds"))
        return [xs, w, poison(rows * n, np.float32), n, 1e-5, *q8]

    dev, twin = launch_both(ks, "rmsnorm_q8", BATCH_ROWS, 1024, args(BATCH_ROWS, x))
    within(dev[2], twin[2], np.abs(twin[2]), rel=2e-6)
    for r in range(BATCH_ROWS):
        alone, _ = launch_both(ks, "rmsnorm_q8", 1, 1024, args(1, x[r].copy()))
        for i, per_row in ((2, n), (5, n), (6, n // 32), (7, n // 32)):
            same_bits(dev[i][r * per_row : (r + 1) * per_row], alone[i])


@pytest.mark.parametrize("act", ["swiglu", "geglu"])
def test_gated_q8_rows_are_each_row_launched_alone(ks: KernelSet, act: str) -> None:
    rng = np.random.default_rng(302 + len(act))
    f = 1536
    h = (rng.standard_normal((BATCH_ROWS, 2 * f)) * 4).astype(np.float32)

    def args(rows: int, hs: np.ndarray) -> list[Any]:
        q8 = (poison(rows * f, np.int8), *(poison(rows * f // 32, np.float32) for _ in "ds"))
        return [hs, poison(rows * f, np.float32), f, *q8]

    blocks = -(-f // 256)
    dev, twin = launch_both(ks, f"{act}_q8", (blocks, BATCH_ROWS), 256, args(BATCH_ROWS, h))
    size = np.abs(twin[1]) + (np.abs(h[:, :f] * h[:, f:]).reshape(-1) if act == "geglu" else 0)
    within(dev[1], twin[1], size, rel=4e-7 * 8)
    for r in range(BATCH_ROWS):
        alone, _ = launch_both(ks, f"{act}_q8", blocks, 256, args(1, h[r].copy()))
        for i, per_row in ((1, f), (3, f), (4, f // 32), (5, f // 32)):
            same_bits(dev[i][r * per_row : (r + 1) * per_row], alone[i])


# ---- norms, SwiGLU, quantizing --------------------------------------------------------------


@pytest.mark.parametrize("n", [64, 576, 4096, 8192])
def test_rmsnorm_q8(ks: KernelSet, n: int) -> None:
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    out = poison(n, np.float32)
    q, d, s = poison(n, np.int8), poison(n // 32, np.float32), poison(n // 32, np.float32)
    dev, twin = launch_both(ks, "rmsnorm_q8", 1, 1024, [x, w, out, n, 1e-5, q, d, s])
    within(dev[2], twin[2], np.abs(twin[2]), rel=2e-6)
    act = twins.quantize_q8(dev[2])  # the 8-bit row of the kernel's own output: exact
    same_bits(dev[5], act.q)
    same_bits(dev[6], act.d)
    same_bits(dev[7], act.s)


@pytest.mark.parametrize("rows", [2, 37])
def test_rmsnorm_rows(ks: KernelSet, rows: int) -> None:
    rng = np.random.default_rng(rows)
    n = 576
    x = rng.standard_normal((rows, n)).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    dev, twin = launch_both(
        ks, "rmsnorm_rows", rows, 256, [x, w, poison((rows, n), np.float32), n, 1e-6]
    )
    within(dev[2], twin[2], np.abs(twin[2]), rel=2e-6)


@pytest.mark.parametrize("act", ["swiglu", "geglu"])
@pytest.mark.parametrize("n_ffn", [1536, 14336])
def test_gated_q8_and_rows(ks: KernelSet, n_ffn: int, act: str) -> None:
    """SiLU's rounding is the twin's but for ``expf`` (a few ulp on a GPU, as NumPy's
    ``exp``): within ``4e-7 * 8`` of the result. GELU's tanh is as close to 1 in
    absolute terms (``tanhf``'s ulp is that of 1), and ``tanh + 1`` cancels where the
    gate is negative: within ``4e-7 * 8`` of ``|gate * up|`` (the product's size
    before the activation) as well."""
    rng = np.random.default_rng(n_ffn + len(act))
    h = (rng.standard_normal(2 * n_ffn) * 4).astype(np.float32)
    out = poison(n_ffn, np.float32)
    q, d, s = (
        poison(n_ffn, np.int8),
        poison(n_ffn // 32, np.float32),
        poison(n_ffn // 32, np.float32),
    )
    dev, twin = launch_both(ks, f"{act}_q8", -(-n_ffn // 256), 256, [h, out, n_ffn, q, d, s])
    size = np.abs(twin[1]) + (np.abs(h[:n_ffn] * h[n_ffn:]) if act == "geglu" else 0)
    within(dev[1], twin[1], size, rel=4e-7 * 8)
    act8 = twins.quantize_q8(dev[1])
    same_bits(dev[3], act8.q)
    same_bits(dev[4], act8.d)
    rows = 5
    hr = rng.standard_normal((rows, 2 * n_ffn)).astype(np.float32)
    dev, twin = launch_both(
        ks, f"{act}_rows", 64, 256, [hr, poison((rows, n_ffn), np.float32), n_ffn, rows]
    )
    size = np.abs(twin[1]) + (np.abs(hr[:, :n_ffn] * hr[:, n_ffn:]) if act == "geglu" else 0)
    within(dev[1], twin[1], size, rel=4e-7 * 8)


@pytest.mark.parametrize("n_chunks", [1, 18, 129])
def test_quantize_q8_is_exact(ks: KernelSet, n_chunks: int) -> None:
    rng = np.random.default_rng(n_chunks)
    x = (rng.standard_normal(32 * n_chunks) * rng.uniform(0.01, 50)).astype(np.float32)
    x[:32] = 0.0
    if n_chunks > 2:
        x[40] = np.nan
        x[70] = np.inf
    q, d, s = poison(x.size, np.int8), poison(n_chunks, np.float32), poison(n_chunks, np.float32)
    dev, twin = launch_both(ks, "quantize_q8", -(-n_chunks // 8), 256, [x, n_chunks, q, d, s])
    for i in (2, 3, 4):
        same_bits(dev[i], twin[i])


@pytest.mark.parametrize("rows", [1, 7])
def test_rmsnorm_add_rows(ks: KernelSet, rows: int) -> None:
    rng = np.random.default_rng(rows + 3)
    n = 640
    o = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    x = rng.standard_normal((rows, n)).astype(np.float32)
    dev, twin = launch_both(ks, "rmsnorm_add_rows", rows, 256, [o, w, x, n, 1e-6])
    _, size = twins.rmsnorm(o, w, 1e-6)
    within(dev[2], twin[2], size + np.abs(x) + np.abs(twin[2]), rel=2e-6)


#: (n_heads, n_kv, hd_k, hd_v): qwen3-like, gemma3's head size, a small one.
QK_HEADS = [(16, 8, 128, 128), (8, 4, 256, 256), (4, 1, 32, 32)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("heads", QK_HEADS, ids=[str(h) for h in QK_HEADS])
def test_head_rmsnorm(
    ks: KernelSet, heads: tuple[int, int, int, int], rows: int, bias: bool
) -> None:
    """Q and K heads as ``test_rmsnorm_rows`` checks a row; V gets its bias only (exact)."""
    n_heads, n_kv, hd_k, hd_v = heads
    rng = np.random.default_rng(rows * 10 + hd_k + bias)
    width = (n_heads + n_kv) * hd_k + n_kv * hd_v
    qkv = (rng.standard_normal((rows, width)) * 2).astype(np.float32)
    b = rng.standard_normal(width).astype(np.float32) if bias else None
    qn = rng.standard_normal(hd_k).astype(np.float32)
    kn = rng.standard_normal(hd_k).astype(np.float32)
    grid = (rows, n_heads + 2 * n_kv)
    args = [qkv, rows, b, qn, kn, n_heads, n_kv, hd_k, hd_v, 1e-6]
    dev, twin = launch_both(ks, "head_rmsnorm", grid, 32, args)
    qk = (n_heads + n_kv) * hd_k
    within(dev[0][:, :qk], twin[0][:, :qk], np.abs(twin[0][:, :qk]), rel=2e-6)
    same_bits(dev[0][:, qk:], twin[0][:, qk:])


def test_scale_inplace_is_exact_and_softcap_close(ks: KernelSet) -> None:
    """A product is exact; the soft cap is ``tanhf`` (a few ulp of values below 1) times
    the cap: within ``4e-7 * 4`` of the cap."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(10001) * 40).astype(np.float32)
    dev, twin = launch_both(ks, "scale_inplace", 8, 256, [x, 16.0, 10001])
    same_bits(dev[0], twin[0])
    cap = 30.0
    dev, twin = launch_both(ks, "softcap", 8, 256, [x, float(np.float32(1 / cap)), cap, 10001])
    within(dev[0], twin[0], np.full(10001, cap), rel=4e-7 * 4)


def test_add_inplace(ks: KernelSet) -> None:
    rng = np.random.default_rng(0)
    x, y = (
        rng.standard_normal(10001).astype(np.float32),
        rng.standard_normal(10001).astype(np.float32),
    )
    dev, twin = launch_both(ks, "add_inplace", 8, 256, [x, y, 10001])
    same_bits(dev[0], twin[0])


# ---- rotary and attention -------------------------------------------------------------------

#: (n_heads, n_kv, head_dim, rope dims, neox): SmolLM2, Llama-3-8B, qwen2-like, partial
#: rotary, the tiny fixtures' heads.
HEADS = [(9, 3, 64, 64, 0), (32, 8, 128, 128, 0), (14, 2, 64, 64, 1), (4, 4, 80, 64, 1),
         (4, 2, 16, 16, 0)]  # fmt: skip


def _rot_table(max_seq: int, n_rot: int, rng: np.random.Generator) -> np.ndarray:
    angles = rng.uniform(-np.pi, np.pi, (max_seq, n_rot // 2))
    table = np.empty((max_seq, n_rot // 2, 2), np.float32)
    table[..., 0], table[..., 1] = np.cos(angles), np.sin(angles)
    return table


@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize("heads", HEADS, ids=[str(h) for h in HEADS])
@pytest.mark.parametrize(("rows", "pos", "cache"), [(1, 0, 96), (1, 77, 96), (13, 5, 96),
                                                    (1, 77, 20), (13, 15, 20)])  # fmt: skip
def test_rope_kv_is_exact(
    ks: KernelSet, heads: tuple[int, ...], rows: int, pos: int, cache: int, kv: str
) -> None:
    """Exact, Q scaled (by 1 for llama and qwen2, by the query scale where llama.cpp
    scales the rotated queries) and, for the normal pairs, by each position's
    temperature (mistral3's); K and V in slot ``position % cache`` of a ring of ``cache``
    slots (96: every position; 20: a sliding block's, wrapping)."""
    n_heads, n_kv, hd, n_rot, neox = heads
    rng = np.random.default_rng(rows * 1000 + pos + hd + cache)
    max_seq = 96
    width = (n_heads + 2 * n_kv) * hd
    qkv = rng.standard_normal((rows, width)).astype(np.float32)
    bias = rng.standard_normal(width).astype(np.float32) if neox else None
    rot = _rot_table(max_seq, n_rot, rng)
    state = np.array([pos, 0], np.int32)
    kvt = np.uint16 if kv == "f16" else np.float32
    kc, vc = poison((n_kv, cache, hd), kvt), poison((n_kv, cache, hd), kvt)
    q_scale = 1.0 if neox else float(np.float32(1 / np.sqrt(hd)))
    temps = None if neox else (1 + rng.random(max_seq)).astype(np.float32)
    args = [qkv, rows, bias, rot, state, n_heads, n_kv, hd, hd, n_rot, neox, q_scale, kc, vc,
            cache, temps]  # fmt: skip
    dev, twin = launch_both(ks, f"rope_kv_{kv}", rows, 256, args)
    same_bits(dev[0][:, : n_heads * hd], twin[0][:, : n_heads * hd])
    same_bits(dev[12], twin[12])  # every slot: written, or still poison in both
    same_bits(dev[13], twin[13])


@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize("heads", HEADS, ids=[str(h) for h in HEADS])
@pytest.mark.parametrize(("rows", "pos", "window", "softcap"), [
    (1, 0, 0, 0.0), (1, 300, 0, 0.0), (37, 0, 0, 0.0), (1, 300, 24, 0.0), (37, 10, 24, 0.0),
    (1, 300, 0, 1.5), (37, 10, 24, 1.5),
])  # fmt: skip
def test_attention(
    ks: KernelSet, heads: tuple[int, ...], rows: int, pos: int, window: int, softcap: float,
    kv: str,
) -> None:  # fmt: skip
    """Global blocks (window 0, a cache of every position) and sliding ones (window 24:
    a decode step over a ring of 24 slots, a prefill over a cache of every position);
    scores uncapped (0) or capped (gemma2: ``softcap * tanh(score / softcap)`` before the
    softmax). The scores here spread over about +-3 (unit queries and keys, scaled by
    ``1 / sqrt(hd)``), so a cap of 1.5 bites: the check fails without it."""
    n_heads, n_kv, hd, _, _ = heads
    rng = np.random.default_rng(rows * 7 + pos + hd + window)
    max_seq = 400
    cache = window if window and rows == 1 else max_seq
    width = (n_heads + 2 * n_kv) * hd
    qkv = rng.standard_normal((rows, width)).astype(np.float32)
    kv_values = rng.standard_normal((2, n_kv, cache, hd)).astype(np.float32)
    if kv == "f16":
        kc, vc = (c.astype(np.float16).view(np.uint16) for c in kv_values)
    else:
        kc, vc = kv_values[0].copy(), kv_values[1].copy()
    state = np.array([pos, 0], np.int32)
    out = poison((rows, n_heads * hd), np.float32)
    fused = rows == 1 and hd % 32 == 0
    nq = n_heads * hd
    q8 = [poison(nq, np.int8), poison(nq // 32, np.float32), poison(nq // 32, np.float32)]
    scale = float(np.float32(1 / np.sqrt(hd)))
    args = [qkv, rows, kc, vc, state, n_heads, n_kv, hd, hd, cache, window, scale, softcap,
            out, *(q8 if fused else [None, None, None])]  # fmt: skip
    dev, twin = launch_both(ks, f"attention_{kv}", (rows, n_heads), ATT_THREADS, args)
    # an output is a weighted mean of values of magnitude ~1: float32 online softmax
    within(dev[13], twin[13], np.ones_like(twin[13]), rel=2e-5)
    if softcap:  # the cap changes the answer by far more than the check's bound
        plain = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
        plain[12] = 0.0
        KERNEL_TWINS[f"attention_{kv}"]((rows, n_heads), ATT_THREADS, plain)
        assert np.abs(twin[13] - plain[13]).max() > 1e-2
    if fused:
        act = twins.quantize_q8(dev[13].reshape(-1))
        same_bits(dev[14], act.q)
        same_bits(dev[15], act.d)


# ---- argmax and conversions ----------------------------------------------------------------


@pytest.mark.parametrize("n", [323, 49152, 128256])
def test_argmax(ks: KernelSet, n: int) -> None:
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    x[n // 3] = x[n // 2] = x.max() + 1  # a tie: the first wins
    for poisoned in (False, True):
        if poisoned:
            x[5], x[n - 1] = np.nan, -np.inf
        parts = 128
        pm, pi, pb = poison(parts, np.float32), poison(parts, np.int32), poison(parts, np.int32)
        dev, twin = launch_both(ks, "argmax_partial", parts, 256, [x, n, pm, pi, pb])
        out = poison(2, np.int32)
        dev2, _ = launch_both(ks, "argmax_final", 1, 256, [dev[2], dev[3], dev[4], parts, out])
        assert dev2[4].tolist() == [n // 3, 2 if poisoned else 0]
        assert dev2[4].tolist() == list(twins.argmax(x))
        same_bits(dev[3], twin[3])


@pytest.mark.parametrize(("name", "src", "dst"), [
    ("f32_to_f16", np.float32, np.float16), ("f16_to_f32", np.float16, np.float32),
    ("f32_to_bf16", np.float32, np.uint16), ("bf16_to_f32", np.uint16, np.float32),
])  # fmt: skip
def test_conversions_are_exact(ks: KernelSet, name: str, src: Any, dst: Any) -> None:
    rng = np.random.default_rng(1)
    values = (rng.standard_normal(4099) * 1e3).astype(np.float32)
    values[:8] = [0.0, -0.0, np.inf, 1e6, np.nan, 6e-8, 65519.0, -65520.0]
    with np.errstate(over="ignore"):
        x = values.astype(src) if src != np.uint16 else twins_bf16(values)
    # f32_to_f16 adds to its counter the finite values it made infinite (1e6, -65520)
    counted = [np.array([5], np.uint32)] if name == "f32_to_f16" else []
    dev, twin = launch_both(ks, name, 8, 256, [x, poison(4099, dst), 4099, *counted])
    same_bits(dev[1], twin[1])
    if counted:
        assert int(dev[3][0]) == int(twin[3][0]) == 5 + 2


def twins_bf16(values: np.ndarray) -> np.ndarray:
    from runtime_core.activations import float32_to_bf16

    return float32_to_bf16(values)
