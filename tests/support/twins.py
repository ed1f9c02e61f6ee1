"""NumPy twins of the CUDA kernels (``kernels/*.cu``): each function computes what its
kernel computes, with the same block decoding, the same 8-bit activation quantization
and the same float32 expressions, so that a kernel is checked against its twin alone
and the twin is checked on any CPU against the gguf package and the reference worker.

Where a kernel sums many terms in an order NumPy cannot follow (a warp's butterfly, a
block's tree), the twin sums in float64 and also returns the sum of the terms'
magnitudes, the scale of the rounding a float32 sum may add; a kernel's result is
within a few units of ``1e-7 * scale`` of the twin's.

Block layouts: ``kernels/quant.cuh`` (the comment at its top) and ``runplan/quant_types.py``.
Every matrix is a ``(rows, row_bytes)`` uint8 array of GGUF blocks; a row is read in
chunks of 32 elements.
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt

from runplan.quant_types import CHUNK, block_bytes

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I32 = npt.NDArray[np.int32]
U8 = npt.NDArray[np.uint8]


# ---- block decoding ----------------------------------------------------------------------


def _f16(raw: U8) -> F32:
    """Little-endian f16 from the last axis (2 bytes) as float32 (exact)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _u32(raw: U8) -> npt.NDArray[np.uint32]:
    return np.ascontiguousarray(raw).view("<u4")[..., 0].astype(np.uint32)


def _blocks(raw: U8, qtype: str) -> U8:
    """``raw`` (rows, row_bytes) as (rows, blocks, block_bytes)."""
    size = block_bytes(qtype)
    rows, row_bytes = raw.shape
    if row_bytes % size:
        raise ValueError(f"{qtype}: rows of {row_bytes} bytes are not whole blocks of {size}")
    return raw.reshape(rows, row_bytes // size, size)


def _nibbles(qs: U8) -> npt.NDArray[np.int32]:
    """16 bytes -> 32 values: the low nibbles, then the high nibbles."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int32)


def _bit(qh: npt.NDArray[np.uint32], n: int) -> npt.NDArray[np.int32]:
    """Bits 0..n-1 of qh as (..., n) ints."""
    return ((qh[..., None] >> np.arange(n, dtype=np.uint32)) & 1).astype(np.int32)


@attrs.frozen
class Decoded:
    """A quantized matrix decoded to integers and scales, chunk by chunk.

    ``q``: (rows, chunks, 32) the integer of every element (for Q4_0 / Q5_0 before the
    offset of 8 / 16 is taken off; for Q3_K and Q6_K signed; for IQ4_NL and IQ4_XS the
    signed value its nibble indexes). ``d``, ``m``: (rows, chunks)
    float32 factors (the block's d and m, or a K-quant's d and dmin). ``sc``, ``mn``: the
    K-quants' integer scales and mins, (rows, chunks) for 32-element sub-blocks (and
    IQ4_XS's scales, less their offset of 32), or (rows, chunks, 2) for 16-element groups.
    """

    qtype: str
    q: npt.NDArray[np.int32]
    d: F32
    m: F32 | None = None
    sc: npt.NDArray[np.int32] | None = None
    mn: npt.NDArray[np.int32] | None = None


def _per_chunk(x: F32, chunks_per_block: int) -> F32:
    return np.repeat(x, chunks_per_block, axis=1)


def k4_scale_min(scales: U8) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """The 8 6-bit scales and mins of Q4_K / Q5_K super-blocks: ``scales`` (..., 12)."""
    s = scales.astype(np.int32)
    sc = np.empty((*s.shape[:-1], 8), np.int32)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def pack_k4_scale_min(sc: npt.NDArray[np.integer], mn: npt.NDArray[np.integer]) -> U8:
    """The inverse of ``k4_scale_min``: 8 scales and 8 mins (each 0..63) -> 12 bytes."""
    sc = np.asarray(sc, np.int32)
    mn = np.asarray(mn, np.int32)
    if sc.min() < 0 or sc.max() > 63 or mn.min() < 0 or mn.max() > 63:
        raise ValueError("Q4_K / Q5_K scales and mins are 6-bit")
    out = np.empty((*sc.shape[:-1], 12), np.int32)
    out[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return out.astype(np.uint8)


def k3_scales(scales: U8) -> npt.NDArray[np.int32]:
    """The 16 signed 6-bit scales of Q3_K super-blocks: ``scales`` (..., 12)."""
    s = scales.astype(np.int32)
    j = np.arange(16)
    low = (s[..., j & 7] >> (4 * (j >> 3))) & 15
    high = (s[..., 8 + (j & 3)] >> (2 * (j >> 2))) & 3
    return (low | (high << 4)) - 32


def decode(raw: U8, qtype: str) -> Decoded:
    """Decode the blocks of a quantized matrix ``raw`` (rows, row_bytes)."""
    b = _blocks(raw, qtype)
    rows, nb = b.shape[:2]
    if qtype == "Q8_0":
        q = b[..., 2:].view(np.int8).astype(np.int32)
        return Decoded(qtype, q, _f16(b[..., 0:2]))
    if qtype in ("Q4_0", "Q4_1"):
        at = 2 if qtype == "Q4_0" else 4
        m = _f16(b[..., 2:4]) if qtype == "Q4_1" else None
        return Decoded(qtype, _nibbles(b[..., at : at + 16]), _f16(b[..., 0:2]), m)
    if qtype in ("Q5_0", "Q5_1"):
        at = 2 if qtype == "Q5_0" else 4
        qh = _u32(b[..., at : at + 4])
        q = _nibbles(b[..., at + 4 : at + 20]) | (_bit(qh, 32) << 4)
        m = _f16(b[..., 2:4]) if qtype == "Q5_1" else None
        return Decoded(qtype, q, _f16(b[..., 0:2]), m)
    # K-quants: 8 chunks per super-block; chunk s = 4h + t (h: 128-element half).
    chunks = nb * 8
    if qtype == "Q2_K":
        qs = b[..., 16:80].reshape(rows, nb, 2, 1, 32)
        shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1)
        q = ((qs >> shifts) & 3).reshape(rows, chunks, 32).astype(np.int32)
        sc = b[..., 0:16].reshape(rows, chunks, 2).astype(np.int32)
        return Decoded(
            qtype,
            q,
            _per_chunk(_f16(b[..., 80:82]), 8),
            _per_chunk(_f16(b[..., 82:84]), 8),
            sc & 15,
            sc >> 4,
        )
    if qtype == "Q3_K":
        qs = b[..., 32:96].reshape(rows, nb, 2, 1, 32)
        shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1)
        low = ((qs >> shifts) & 3).reshape(rows, chunks, 32).astype(np.int32)
        hmask = b[..., 0:32].reshape(rows, nb, 1, 32)
        bits = np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        high = ((hmask >> bits) & 1).reshape(rows, chunks, 32).astype(np.int32)
        q = low - 4 * (1 - high)
        sc = k3_scales(b[..., 96:108]).reshape(rows, chunks, 2)
        return Decoded(qtype, q, _per_chunk(_f16(b[..., 108:110]), 8), sc=sc)
    if qtype in ("Q4_K", "Q5_K"):
        at = 16 if qtype == "Q4_K" else 48
        qs = b[..., at : at + 128].reshape(rows, nb, 4, 1, 32)
        nib = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        q = ((qs >> nib) & 15).reshape(rows, chunks, 32).astype(np.int32)
        if qtype == "Q5_K":
            high_bits = b[..., 16:48].reshape(rows, nb, 1, 32)
            bits = np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
            q |= (((high_bits >> bits) & 1).reshape(rows, chunks, 32).astype(np.int32)) << 4
        sc, mn = k4_scale_min(b[..., 4:16])
        return Decoded(
            qtype,
            q,
            _per_chunk(_f16(b[..., 0:2]), 8),
            _per_chunk(_f16(b[..., 2:4]), 8),
            sc.reshape(rows, chunks),
            mn.reshape(rows, chunks),
        )
    if qtype == "Q6_K":
        ql = b[..., 0:128].reshape(rows, nb, 2, 1, 64)
        nib = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        low = ((ql >> nib) & 15).reshape(rows, chunks, 32).astype(np.int32)
        q_high = b[..., 128:192].reshape(rows, nb, 2, 1, 32)
        shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1)
        high = ((q_high >> shifts) & 3).reshape(rows, chunks, 32).astype(np.int32)
        sc = b[..., 192:208].view(np.int8).astype(np.int32).reshape(rows, chunks, 2)
        return Decoded(qtype, (low | (high << 4)) - 32, _per_chunk(_f16(b[..., 208:210]), 8), sc=sc)
    if qtype == "IQ4_NL":
        return Decoded(qtype, IQ4_VALUES[_nibbles(b[..., 2:18])], _f16(b[..., 0:2]))
    if qtype == "IQ4_XS":
        q = IQ4_VALUES[_nibbles(b[..., 8:136].reshape(rows, nb, 8, 16))].reshape(rows, chunks, 32)
        return Decoded(qtype, q, _per_chunk(_f16(b[..., 0:2]), 8), sc=iq4xs_scales(b))
    raise ValueError(f"no block decoder for {qtype}")


#: IQ4_NL's and IQ4_XS's 16 values (llama.cpp's ``kvalues_iq4nl``): a nibble indexes it.
IQ4_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int32
)


def iq4xs_scales(b: U8) -> npt.NDArray[np.int32]:
    """The 8 signed 6-bit scales of IQ4_XS super-blocks ``b`` (rows, blocks, 136), one
    per 32-element sub-block, as (rows, chunks): the low 4 bits in ``scales_l`` (bytes
    4-7, two per byte, low nibble first), the high 2 in ``scales_h`` (bytes 2-3), less 32."""
    rows, nb = b.shape[:2]
    low = _nibbles(b[..., 4:8]).reshape(rows, nb, 2, 4).transpose(0, 1, 3, 2).reshape(rows, nb, 8)
    high = (b[..., 2].astype(np.int32) | (b[..., 3].astype(np.int32) << 8))[..., None]
    high = (high >> (2 * np.arange(8))) & 3
    return ((low | (high << 4)) - 32).reshape(rows, nb * 8)


def dequantize(raw: U8, qtype: str) -> F32:
    """Rows of GGUF blocks to float32 ``(rows, n)``, rounded as the gguf package rounds
    (each product and sum in float32, in its order); ``dequant_rows_<T>``'s twin."""
    rows = raw.shape[0]
    if qtype == "F32":
        return np.ascontiguousarray(raw).view(np.float32).copy()
    if qtype == "F16":
        return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)
    if qtype == "BF16":
        bits = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)
    dec = decode(raw, qtype)
    q = dec.q.astype(np.float32)
    d = dec.d[..., None]
    if qtype == "Q8_0":
        out = q * d
    elif qtype == "Q4_0":
        out = d * (q - np.float32(8))
    elif qtype == "Q5_0":
        out = d * (q - np.float32(16))
    elif qtype in ("Q4_1", "Q5_1"):
        assert dec.m is not None
        out = d * q + dec.m[..., None]
    elif qtype == "Q2_K":
        assert dec.m is not None and dec.sc is not None and dec.mn is not None
        dl = np.repeat(d * dec.sc.astype(np.float32), 16, axis=-1)
        ml = np.repeat(dec.m[..., None] * dec.mn.astype(np.float32), 16, axis=-1)
        out = dl * q - ml
    elif qtype in ("Q3_K", "Q6_K"):
        assert dec.sc is not None
        out = np.repeat(d * dec.sc.astype(np.float32), 16, axis=-1) * q
    elif qtype in ("Q4_K", "Q5_K"):
        assert dec.m is not None and dec.sc is not None and dec.mn is not None
        dl = d * dec.sc[..., None].astype(np.float32)
        ml = dec.m[..., None] * dec.mn[..., None].astype(np.float32)
        out = dl * q - ml
    elif qtype == "IQ4_NL":
        out = d * q
    elif qtype == "IQ4_XS":
        assert dec.sc is not None
        out = (d * dec.sc[..., None].astype(np.float32)) * q
    else:  # pragma: no cover - decode() refused it
        raise ValueError(qtype)
    return np.ascontiguousarray(out, dtype=np.float32).reshape(rows, -1)


# ---- 8-bit activations -------------------------------------------------------------------


@attrs.frozen
class Q8Act:
    """An activation row quantized in chunks of 32: value ``d[c] * q[32 c + i]``;
    ``s[c] = d[c] * sum(q of chunk c)`` (float32)."""

    q: npt.NDArray[np.int8]  # (n,)
    d: F32  # (n / 32,)
    s: F32  # (n / 32,)

    def values(self) -> F64:
        """What the quantized row stands for, in float64."""
        q = self.q.astype(np.float64).reshape(-1, CHUNK)
        return (q * self.d.astype(np.float64)[:, None]).ravel()


def roundf(x: F32) -> F32:
    """C's roundf: to the nearest integer, halves away from zero (exact in float32)."""
    t = np.trunc(x)
    frac = np.abs(x - t)  # exact
    return np.where(frac >= np.float32(0.5), t + np.sign(x), t).astype(np.float32)


def quantize_q8(x: F32) -> Q8Act:
    """``quantize_q8`` / ``warp_quantize_chunk``: per chunk of 32, d = max|x| / 127,
    q = roundf(x / d) (0 where d is 0), s = d * sum(q); a chunk holding a NaN or an
    infinity gets d = NaN and q = 0."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 1 or x.size % CHUNK:
        raise ValueError(f"a row of a multiple of {CHUNK} values, got shape {x.shape}")
    blocks = x.reshape(-1, CHUNK)
    bad = ~np.isfinite(blocks).all(axis=1)  # such a chunk: d = NaN, q = 0
    amax = np.where(
        bad, np.float32(0), np.abs(np.where(np.isfinite(blocks), blocks, 0)).max(axis=1)
    )
    d = np.where(bad, np.float32(np.nan), amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where((amax == 0)[:, None], np.float32(0), roundf(blocks / d[:, None]))
    qi = q.astype(np.int32)
    s = (d * qi.sum(axis=1).astype(np.float32)).astype(np.float32)
    return Q8Act(qi.astype(np.int8).ravel(), d, s)


# ---- matrix-vector products --------------------------------------------------------------


def _sums(q: npt.NDArray[np.int32], x: npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
    """sum_l q[r, c, l] * x[c, l] -> (rows, chunks), exact."""
    out: npt.NDArray[np.int32] = np.einsum("rcl,cl->rc", q, x, dtype=np.int32)
    return out


def chunk_terms_q8(raw: U8 | Decoded, qtype: str, act: Q8Act) -> F32:
    """The float32 term of every chunk of every row in ``matvec_q8_<T>``: (rows, chunks).
    Each is the expression of the type's ``dot_q8`` in quant.cuh, evaluated in the same
    order with the same float32 roundings. ``raw`` may be already ``decode``d."""
    dec = raw if isinstance(raw, Decoded) else decode(raw, qtype)
    n_chunks = dec.q.shape[1]
    if act.q.size != n_chunks * CHUNK:
        raise ValueError(f"activations of {act.q.size} values for rows of {n_chunks * CHUNK}")
    x = act.q.astype(np.int32).reshape(n_chunks, CHUNK)
    xd, xs = act.d[None, :], act.s[None, :]
    f = np.float32
    if qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL"):
        sumi = _sums(dec.q, x).astype(f)
        d = dec.d
        if qtype in ("Q8_0", "IQ4_NL"):  # IQ4_NL: q already the signed value its nibble indexes
            out = d * (xd * sumi)
        elif qtype == "Q4_0":
            out = d * (xd * sumi - f(8) * xs)
        elif qtype == "Q5_0":
            out = d * (xd * sumi - f(16) * xs)
        else:
            assert dec.m is not None
            out = d * (xd * sumi) + dec.m * xs
        return np.asarray(out, dtype=np.float32)
    if qtype in ("Q4_K", "Q5_K"):
        assert dec.m is not None and dec.sc is not None and dec.mn is not None
        scaled = (dec.sc * _sums(dec.q, x)).astype(f)
        out = dec.d * (xd * scaled) - dec.m * (dec.mn.astype(f) * xs)
        return np.asarray(out, dtype=np.float32)
    if qtype == "IQ4_XS":  # one signed scale per chunk, no min
        assert dec.sc is not None
        scaled = (dec.sc * _sums(dec.q, x)).astype(f)
        return np.asarray(dec.d * (xd * scaled), dtype=np.float32)
    # 16-element groups
    qg = dec.q.reshape(*dec.q.shape[:2], 2, 16)
    xg = x.reshape(n_chunks, 2, 16)
    sumi_g = np.einsum("rcgl,cgl->rcg", qg, xg, dtype=np.int32)
    sumx_g = xg.sum(axis=-1, dtype=np.int32)[None]  # (1, chunks, 2)
    assert dec.sc is not None
    if qtype == "Q2_K":
        assert dec.m is not None and dec.mn is not None
        isum = (dec.sc * sumi_g).sum(axis=-1, dtype=np.int32).astype(f)
        imin = (dec.mn * sumx_g).sum(axis=-1, dtype=np.int32).astype(f)
        out = xd * (dec.d * isum - dec.m * imin)
    elif qtype in ("Q3_K", "Q6_K"):
        # Q6_K: q already has the offset of 32 taken off (sumi - 32 * sumx in the kernel)
        isum = (dec.sc * sumi_g).sum(axis=-1, dtype=np.int32).astype(f)
        out = xd * (dec.d * isum)
    else:
        raise ValueError(f"no 8-bit product for {qtype}")
    return np.asarray(out, dtype=np.float32)


@attrs.frozen
class RowSums:
    """Row sums of terms (float64 sums, rounded to float32) and the sums of the terms'
    magnitudes, the scale a float32 summation error is measured against."""

    y: F32
    scale: F64


def matvec_q8(raw: U8 | Decoded, qtype: str, act: Q8Act) -> RowSums:
    """``matvec_q8_<T>``: one output per row, the chunk terms added up."""
    terms = chunk_terms_q8(raw, qtype, act).astype(np.float64)
    return RowSums(terms.sum(axis=1).astype(np.float32), np.abs(terms).sum(axis=1))


def matvec_f(raw: U8, qtype: str, x: F32, dense: F32 | None = None) -> RowSums:
    """``matvec_f_<T>``: the dequantized rows (``dense``, when given) times a float32 row."""
    w = (dequantize(raw, qtype) if dense is None else dense).astype(np.float64)
    terms = w * np.asarray(x, np.float64)[None, :]
    return RowSums(terms.sum(axis=1).astype(np.float32), np.abs(terms).sum(axis=1))


# ---- norm, rotary, attention, feed-forward, sampling -----------------------------------------


def rms_scale(ss: np.float32, n: int, eps: float) -> np.float32:
    """``rms_scale`` in norm.cu: double-precision 1 / sqrt(ss / n + eps), rounded."""
    return np.float32(1.0 / np.sqrt(float(ss) / n + eps))


def rmsnorm(x: F32, w: F32, eps: float) -> tuple[F32, F64]:
    """``rmsnorm_rows`` / ``rmsnorm_q8``: (x * s) * w per row of (rows, n); also the
    magnitude scale (|x| * |w| * s) for the tolerance of the kernel's float32 sum."""
    x = np.asarray(x, np.float32)
    ss = np.einsum("ij,ij->i", x.astype(np.float64), x.astype(np.float64)).astype(np.float32)
    s = np.array([rms_scale(v, x.shape[1], eps) for v in ss], dtype=np.float32)
    out = (x * s[:, None]) * w[None, :]
    return out.astype(np.float32), np.abs(out).astype(np.float64)


def rotate(x: F32, rot: npt.NDArray[np.complex64], n_rot: int, neox: bool) -> F32:
    """Rotary embedding of heads ``x`` (rows, heads, head_dim) by ``rot`` (rows, n_rot/2):
    pairs (2j, 2j + 1) or, neox, (j, j + n_rot / 2); as ``rope_kv``. ``n_rot`` 0: none
    (a block without rotary embedding)."""
    out = x.copy()
    half = n_rot // 2
    j = np.arange(half)
    a, b = (j, j + half) if neox else (2 * j, 2 * j + 1)
    c = rot.real.astype(np.float32)[:, None, :half]
    s = rot.imag.astype(np.float32)[:, None, :half]
    va, vb = x[..., a], x[..., b]
    out[..., a] = va * c - vb * s
    out[..., b] = va * s + vb * c
    return out


def head_rmsnorm(
    qkv: F32,
    bias: F32 | None,
    q_norm: F32,
    k_norm: F32,
    heads: tuple[int, int, int, int],
    eps: float,
) -> F32:
    """``head_rmsnorm``: rows of Q|K|V ``(rows, width)`` plus ``bias``, then every Q and K
    head normed as ``rmsnorm`` norms a row, times ``q_norm`` or ``k_norm``; ``heads`` =
    (n_heads, n_kv, hd_k, hd_v)."""
    n_heads, n_kv, hd_k, _ = heads
    x = np.asarray(qkv, np.float32)
    if bias is not None:
        x = (x + bias).astype(np.float32)
    out = x.copy()
    rows = x.shape[0]
    for h in range(n_heads + n_kv):
        cols = slice(h * hd_k, (h + 1) * hd_k)
        out[:, cols], _ = rmsnorm(
            x[:, cols].reshape(rows, hd_k), q_norm if h < n_heads else k_norm, eps
        )
    return out


def silu_mul(gate: F32, up: F32) -> F32:
    """``swiglu_*`` in norm.cu: gate / (1 + exp(-gate)) * up, in float32."""
    g = np.asarray(gate, np.float32)
    return (g / (np.float32(1) + np.exp(-g)) * up).astype(np.float32)


_GELU_A = np.float32(0.044715)
_SQRT_2_OVER_PI = np.float32(0.7978845608028654)


def gelu_mul(gate: F32, up: F32) -> F32:
    """``geglu_*`` in norm.cu: GELU's tanh form of gate, times up, each step rounded in
    float32 in the reference worker's order (``reference.functions.gelu_tanh``)."""
    g = np.asarray(gate, np.float32)
    inner = ((g * g) * _GELU_A + np.float32(1)) * g * _SQRT_2_OVER_PI
    return (g * ((np.tanh(inner) + np.float32(1)) * np.float32(0.5)) * up).astype(np.float32)


def softcap(x: F32, cap: float) -> F32:
    """``softcap`` as the CUDA worker launches it: tanh(x * float32(1 / cap)) * cap."""
    inv = np.float32(1.0 / cap)
    return (np.tanh(np.asarray(x, np.float32) * inv) * np.float32(cap)).astype(np.float32)


def first_seen(pos: int, window: int) -> int:
    """The first position a query at ``pos`` attends to (``window`` 0: every one)."""
    return pos - window + 1 if window and pos >= window else 0


def attention(
    q: F32,
    keys: F32,
    values: F32,
    pos0: int,
    group: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> F32:
    """``attention_<KV>``: query rows ``q`` (rows, n_heads, hd_k) at positions pos0 ..,
    over ``keys`` (n_kv, n_ctx, hd_k) and ``values`` (n_kv, n_ctx, hd_v) of positions
    0 .. n_ctx - 1; causal, and within ``window`` positions when it is not 0; query head h
    reads kv head h // group; scores capped at ``softcap`` (``c * tanh(s / c)``) when it
    is not 0. Exact softmax in float64; (rows, n_heads * hd_v)."""
    rows, n_heads, _ = q.shape
    hd_v = values.shape[2]
    out = np.empty((rows, n_heads, hd_v), np.float64)
    for h in range(n_heads):
        k = keys[h // group].astype(np.float64)
        v = values[h // group].astype(np.float64)
        for r in range(rows):
            seen = slice(first_seen(pos0 + r, window), pos0 + r + 1)
            scores = (k[seen] @ q[r, h].astype(np.float64)) * np.float32(scale)
            if softcap:
                scores = softcap * np.tanh(scores / softcap)
            p = np.exp(scores - scores.max())
            out[r, h] = (p / p.sum()) @ v[seen]
    return out.reshape(rows, n_heads * hd_v).astype(np.float32)


def argmax(logits: F32) -> tuple[int, int]:
    """``argmax_partial`` + ``argmax_final``: (first index of the largest finite entry,
    number of non-finite entries)."""
    finite = np.isfinite(logits)
    bad = int((~finite).sum())
    if not finite.any():
        return 0x7FFFFFFF, bad
    masked = np.where(finite, logits, -np.inf)
    return int(np.argmax(masked)), bad
