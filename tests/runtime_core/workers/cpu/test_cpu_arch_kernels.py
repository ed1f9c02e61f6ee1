"""The kernels of the architectures' optional steps (``runtime_core.architectures``) and
of sliding-window caches, against independent readings of the same numbers.

- Per-head Q/K norm: the bias added, then every Q and K head RMS-normed times its
  weight (float64 within float32 rounding); V gets the bias only.
- Post-norms: ``rmsnorm(..., accumulate=True)`` adds exactly what the plain norm writes.
- GELU gating: every half in (-10, 10) maps to the exact GELU rounded to a half (llama.cpp's
  table; up to float32's error where it computes the table), the input rounded to a
  half first, times the up value; 0 at or below -10, the input itself at or above 10.
- Soft cap: ``cap * tanh(x / cap)`` within float32 rounding.
- Rotary with a query scale: the rotated queries times the scale, bit for bit; keys and
  values unchanged by it.
- A ring of ``window`` slots: steps of every size (decode rows, prefills that wrap the
  ring, given the step's own buffers) attend to exactly the window's positions (a
  float64 attention over the whole history with the window's mask), and leave the
  ring holding the last ``window`` positions; the same bits on every instruction set
  and thread count, and for a prefill and the same rows decoded one at a time.
- A call that would read positions the ring no longer holds is refused, naming them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from runtime_core.workers.cpu import _kernels
from tests.support.cpu_isas import isa_params

F32 = np.float32


def rms64(x: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)


# ---- per-head norms, post-norms --------------------------------------------------------------


def test_qk_norm_adds_the_bias_then_norms_every_query_and_key_head() -> None:
    rng = np.random.default_rng(1)
    n_heads, n_kv, hd, rows = 4, 2, 128, 3
    heads = (n_heads, n_kv, hd, hd, 16, False)
    width = (n_heads + 2 * n_kv) * hd
    qkv = (3 * rng.standard_normal((rows, width))).astype(F32)
    bias = rng.standard_normal(width).astype(F32)
    qw, kw = rng.standard_normal(hd).astype(F32), rng.standard_normal(hd).astype(F32)
    x = qkv.copy()
    _kernels.qk_norm(x, rows, bias, qw, kw, heads, 1e-6, 2)
    biased = qkv + bias
    qk = biased[:, : (n_heads + n_kv) * hd].reshape(rows, n_heads + n_kv, hd)
    want = rms64(qk, 1e-6) * np.concatenate([[qw]] * n_heads + [[kw]] * n_kv)[None]
    got = x[:, : (n_heads + n_kv) * hd].reshape(rows, n_heads + n_kv, hd)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    np.testing.assert_array_equal(x[:, (n_heads + n_kv) * hd :], biased[:, (n_heads + n_kv) * hd :])


def test_a_post_norm_adds_what_the_norm_writes() -> None:
    rng = np.random.default_rng(2)
    o = rng.standard_normal((3, 256)).astype(F32)
    w = rng.standard_normal(256).astype(F32)
    x = rng.standard_normal((3, 256)).astype(F32)
    plain = np.zeros_like(x)
    _kernels.rmsnorm(o, w, plain, 3, 256, 1e-6, 2)
    acc = x.copy()
    _kernels.rmsnorm(o, w, acc, 3, 256, 1e-6, 2, True)
    np.testing.assert_array_equal(acc, x + plain)


# ---- GELU gating, soft cap -------------------------------------------------------------------


def gelu64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def test_geglu_reads_the_exact_gelu_rounded_to_a_half_at_the_input_rounded_to_a_half() -> None:
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    gates = halves[np.isfinite(halves) & (halves > -10) & (halves < 10)].astype(F32)
    n = gates.size
    h = np.concatenate([gates, np.ones(n, F32)])[None]
    act = np.zeros((1, n), F32)
    _kernels.geglu(h, act, 1, n, 2)
    got = act[0]
    assert np.array_equal(got.astype(np.float16).astype(F32), got)  # halves
    exact = gelu64(gates)
    # the nearest half to the exact value, up to float32's error in 0.5 x (1 + tanh(..))
    # (a few units of 2^-24 in 1 + tanh, times x: the table is computed in float32, as
    # llama.cpp's is; below -3, where 1 + tanh is small, that is most of a half's unit)
    ulp = np.spacing(np.abs(got).astype(np.float16)).astype(np.float64)
    assert np.all(np.abs(got - exact) <= 0.5 * ulp + np.abs(gates) * 2.0**-22)
    assert np.mean(got == exact.astype(np.float16).astype(F32)) > 0.99
    # between halves: the input rounded to a half first; times the up value, in float32
    rng = np.random.default_rng(3)
    g = rng.uniform(-12, 12, 4096).astype(F32)
    u = rng.standard_normal(4096).astype(F32)
    g[:4] = [-10.0, 10.0, -10.5, 11.0]
    out = np.zeros((1, 4096), F32)
    _kernels.geglu(np.concatenate([g, u])[None], out, 1, 4096, 3)
    table = np.zeros((1, 4096), F32)
    rounded = g.astype(np.float16).astype(F32)
    _kernels.geglu(np.concatenate([rounded, np.ones(4096, F32)])[None], table, 1, 4096, 1)
    inside = (g > -10) & (g < 10)
    np.testing.assert_array_equal(out[0][inside], (table[0] * u)[inside])
    np.testing.assert_array_equal(out[0][g <= -10], 0.0)
    np.testing.assert_array_equal(out[0][g >= 10], (g * u)[g >= 10])


def test_the_soft_cap_is_cap_tanh_x_over_cap() -> None:
    rng = np.random.default_rng(4)
    x = (30 * rng.standard_normal(10000)).astype(F32)
    outs = []
    for threads in (1, 3):
        y = x.copy()
        _kernels.softcap(y, 30.0, threads)
        outs.append(y)
    np.testing.assert_array_equal(outs[0], outs[1])
    want = 30.0 * np.tanh(x.astype(np.float64) / 30.0)
    np.testing.assert_allclose(outs[0], want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="soft cap"):
        _kernels.softcap(x, 0.0, 1)


def test_a_query_scale_multiplies_the_rotated_queries_only() -> None:
    rng = np.random.default_rng(5)
    n_heads, n_kv, hd, rows = 4, 2, 64, 3
    heads = (n_heads, n_kv, hd, hd, 8, False)
    width = (n_heads + 2 * n_kv) * hd
    rot = np.exp(1j * rng.uniform(0, 6.3, (8, 24))).astype(np.complex64).view(F32)
    qkv = rng.standard_normal((rows, width)).astype(F32)
    caches = []
    results = []
    for q_scale in (1.0, 0.125):
        x = qkv.copy()
        kc, vc = np.zeros((n_kv, 8, hd), F32), np.zeros((n_kv, 8, hd), F32)
        _kernels.rope_kv(x, rows, None, rot, 2, heads, 48, True, kc, vc, 2, q_scale)
        results.append(x)
        caches.append((kc, vc))
    q = n_heads * hd
    np.testing.assert_array_equal(results[1][:, :q], results[0][:, :q] * F32(0.125))
    np.testing.assert_array_equal(results[1][:, q:], results[0][:, q:])
    np.testing.assert_array_equal(caches[1][0], caches[0][0])
    np.testing.assert_array_equal(caches[1][1], caches[0][1])


def test_temperatures_multiply_each_rows_rotated_queries_by_its_positions() -> None:
    """mistral3's query temperature: row r (position pos + r) times ``temps[pos + r]``,
    after the query scale, each element rounded once; keys and values untouched; a
    table shorter than the rows' positions refused, naming it."""
    rng = np.random.default_rng(6)
    n_heads, n_kv, hd, rows, pos = 4, 2, 64, 3, 2
    heads = (n_heads, n_kv, hd, hd, 8, False)
    width = (n_heads + 2 * n_kv) * hd
    rot = np.exp(1j * rng.uniform(0, 6.3, (8, 24))).astype(np.complex64).view(F32)
    qkv = rng.standard_normal((rows, width)).astype(F32)
    temps = (1 + rng.random(8)).astype(F32)
    out = []
    for t in (None, temps):
        x = qkv.copy()
        kc, vc = np.zeros((n_kv, 8, hd), F32), np.zeros((n_kv, 8, hd), F32)
        _kernels.rope_kv(x, rows, None, rot, pos, heads, 48, True, kc, vc, 2, 0.5, None, None, t)
        out.append((x, kc, vc))
    q = n_heads * hd
    want = out[0][0][:, :q] * temps[pos : pos + rows, None]
    np.testing.assert_array_equal(out[1][0][:, :q], want)
    np.testing.assert_array_equal(out[1][0][:, q:], out[0][0][:, q:])
    for a, b in zip(out[0][1:], out[1][1:], strict=True):
        np.testing.assert_array_equal(a, b)
    kc, vc = np.zeros((n_kv, 8, hd), F32), np.zeros((n_kv, 8, hd), F32)
    with pytest.raises(ValueError, match="temps: 4 elements, the call needs 5"):
        _kernels.rope_kv(qkv.copy(), rows, None, rot, pos, heads, 48, True, kc, vc, 2, 1.0,
                         None, None, temps[:4])  # fmt: skip


@pytest.mark.parametrize("threads", [1, 2])
def test_add_scaled_rounds_the_product_before_the_sum(threads: int) -> None:
    """granite's residual scale, as ggml's scale then add: ``x + fl(y * f)``, not a
    fused multiply-add (which differs on some of these values); a short ``y`` refused."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal(5000).astype(F32)
    y = rng.standard_normal(5000).astype(F32)
    factor = F32(0.22)
    want = x + (y * factor)
    fused = (x.astype(np.float64) + y.astype(np.float64) * np.float64(factor)).astype(F32)
    assert np.count_nonzero(fused != want) > 0  # the test tells the two apart
    got = x.copy()
    _kernels.add_scaled(got, y, float(factor), threads)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="y: 10 elements, the call needs 5000"):
        _kernels.add_scaled(got, y[:10], 1.0, threads)


# ---- a sliding window's ring -----------------------------------------------------------------

N_HEADS, N_KV, HD = 4, 2, 32
HEAD_WIDTH = (N_HEADS + 2 * N_KV) * HD


class Ring:
    """One sliding block's cache driven as the CPU worker drives it: a step that would
    wrap the ring keeps its own keys and values beside it (``k_step``, ``v_step``)."""

    def __init__(self, window: int, kv: str, threads: int = 2, isa: str | None = None) -> None:
        self.window, self.threads, self.isa = window, threads, isa
        self.dtype = np.float16 if kv == "f16" else F32
        self.k = np.zeros((N_KV, window, HD), self.dtype)
        self.v = np.zeros_like(self.k)
        self.heads = (N_HEADS, N_KV, HD, HD, window, kv == "f16")

    def step(self, qkv: np.ndarray, pos: int, rot: np.ndarray) -> np.ndarray:
        rows = qkv.shape[0]
        x = qkv.copy()
        step: tuple[Any, Any] = (None, None)
        if rows > 1 and pos + rows > self.window:
            step = (np.empty((N_KV, rows, HD), self.dtype), np.empty((N_KV, rows, HD), self.dtype))
        _kernels.rope_kv(x, rows, None, rot, pos, self.heads, 0, False, self.k, self.v,
                         self.threads, 1.0, *step)  # fmt: skip
        out = np.zeros((rows, N_HEADS * HD), F32)
        _kernels.attention(x, rows, self.k, self.v, pos, self.heads, 0.125, out, self.threads,
                           self.window, *step, isa=self.isa)  # fmt: skip
        return out


def windowed64(history: np.ndarray, pos: int, rows: int, window: int, dtype: Any) -> np.ndarray:
    """Float64 attention of the rows at ``pos ..`` over every position before them and
    their own, masked to the window (keys and values rounded as the cache holds them)."""
    q = history[:, : N_HEADS * HD].reshape(-1, N_HEADS, HD).astype(np.float64)
    kv_at = N_HEADS * HD
    k = history[:, kv_at : kv_at + N_KV * HD].reshape(-1, N_KV, HD).astype(dtype)
    v = history[:, kv_at + N_KV * HD :].reshape(-1, N_KV, HD).astype(dtype)
    out = np.zeros((rows, N_HEADS, HD))
    for r in range(rows):
        p = pos + r
        lo = max(0, p - window + 1)
        for h in range(N_HEADS):
            kv = h // (N_HEADS // N_KV)
            s = (k[lo : p + 1, kv].astype(np.float64) @ q[p, h]) * 0.125
            e = np.exp(s - s.max())
            out[r, h] = (e / e.sum()) @ v[lo : p + 1, kv].astype(np.float64)
    return out.reshape(rows, -1)


STEPS = ((0, 5), (5, 1), (6, 1), (7, 9), (16, 1), (17, 20), (37, 1), (38, 2))


@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_a_ring_of_the_window_attends_to_exactly_the_window(kv: str) -> None:
    rng = np.random.default_rng(6)
    window, total = 8, 40
    rot = np.zeros((total, 0), F32)  # no rotation: the history is what the cache holds
    ring = Ring(window, kv)
    history = rng.standard_normal((total, HEAD_WIDTH)).astype(F32)
    for pos, rows in STEPS:
        out = ring.step(history[pos : pos + rows], pos, rot)
        want = windowed64(history, pos, rows, window, ring.dtype)
        np.testing.assert_allclose(out, want, rtol=0, atol=3e-6)
        end = pos + rows  # the ring holds the last ``window`` positions, slot p % window
        for p in range(max(0, end - window), end):
            k = history[p, N_HEADS * HD : (N_HEADS + N_KV) * HD].reshape(N_KV, HD)
            np.testing.assert_array_equal(ring.k[:, p % window], k.astype(ring.dtype))


@pytest.mark.parametrize("isa", isa_params(portable=False))
def test_a_ring_gives_the_same_bits_on_every_isa_thread_count_and_step_size(isa: str) -> None:
    rng = np.random.default_rng(7)
    window, total = 8, 40
    rot = np.exp(1j * rng.uniform(0, 6.3, (total, HD // 2))).astype(np.complex64).view(F32)
    history = rng.standard_normal((total, HEAD_WIDTH)).astype(F32)
    runs = []
    for name in ("portable", isa):
        for threads in (1, 3):
            ring = Ring(window, "f16", threads, name)
            runs.append(np.concatenate([ring.step(history[p : p + r], p, rot) for p, r in STEPS]))
    rows = Ring(window, "f16", isa=isa)  # every position a decode step of its own
    runs.append(np.concatenate([rows.step(history[p : p + 1], p, rot) for p in range(total)]))
    for other in runs[1:]:
        np.testing.assert_array_equal(other.view(np.uint32), runs[0].view(np.uint32))


def test_positions_the_ring_no_longer_holds_are_refused() -> None:
    ring = Ring(8, "f32")
    rot = np.zeros((40, 0), F32)
    qkv = np.zeros((4, HEAD_WIDTH), F32)
    out = np.zeros((4, N_HEADS * HD), F32)
    with pytest.raises(ValueError, match="give the step's buffers"):
        _kernels.rope_kv(np.zeros((9, HEAD_WIDTH), F32), 9, None, rot, 0, ring.heads, 0, False,
                         ring.k, ring.v, 1)  # fmt: skip
    # 4 rows at 6 wrap a ring of 8 while the first row still sees position 0
    with pytest.raises(ValueError, match="see positions from 0"):
        _kernels.attention(qkv, 4, ring.k, ring.v, 6, ring.heads, 0.125, out, 1, 8)
    # a global block (no window) whose ring is shorter than the positions
    with pytest.raises(ValueError, match="holds them from 2 only"):
        _kernels.attention(qkv, 4, ring.k, ring.v, 6, ring.heads, 0.125, out, 1, 0)
    with pytest.raises(ValueError, match="both arrays, or both None"):
        _kernels.attention(qkv, 4, ring.k, ring.v, 6, ring.heads, 0.125, out, 1, 8, ring.k)
