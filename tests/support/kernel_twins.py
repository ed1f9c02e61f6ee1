"""Every kernel of ``kernels.SIGNATURES`` as a NumPy function of the same launch.

``KERNEL_TWINS[name](grid, block, args)`` does to NumPy arrays what the kernel does to
device memory: each pointer argument is an array (or ``None``) read or written in
place, flat, as the kernel indexes it; integers and floats as passed. It also checks
that the launch geometry covers the work the way the kernel expects (a launch that
would leave rows unwritten fails here).

The GPU tests run a kernel and its twin on the same random inputs, on a GPU and on the
SIMT emulator (``tests/runtime_cupy/cuda/test_simt_kernels.py``); the twin worker
(``twin_stage.py``) runs the CUDA worker's program on them, as a reference for the
device backend (``tests/runtime_cupy/cuda/test_twins_device_stage.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from runplan.quant_types import CHUNK, Q8_TYPES, QUANT_TYPES, row_bytes
from runtime_core.activations import float32_to_bf16
from tests.support import twins

KernelTwin = Callable[[tuple[int, ...], int, Sequence[Any]], None]
MV_WARPS = 4
ATT_WARPS = 8


class LaunchError(AssertionError):
    """A launch that would not do what its caller means (geometry or arguments)."""


def _flat(a: Any, dtype: Any) -> npt.NDArray[Any]:
    """The array's memory as a flat array of ``dtype`` (a view: writes go through)."""
    arr = np.asarray(a)
    if not arr.flags.c_contiguous:
        raise LaunchError("a pointer argument must be contiguous memory")
    return arr.reshape(-1).view(dtype)


def _threads(grid: tuple[int, ...], block: int) -> int:
    n = block
    for g in grid:
        n *= g
    return n


def _q8(xq: Any, xd: Any, xs: Any, n_chunks: int) -> twins.Q8Act:
    return twins.Q8Act(
        _flat(xq, np.int8)[: n_chunks * CHUNK].copy(),
        _flat(xd, np.float32)[:n_chunks].copy(),
        _flat(xs, np.float32)[:n_chunks].copy(),
    )


def _store_q8(v: npt.NDArray[np.float32], first_chunk: int, xq: Any, xd: Any, xs: Any) -> None:
    act = twins.quantize_q8(v)
    n = act.d.size
    _flat(xq, np.int8)[first_chunk * CHUNK : (first_chunk + n) * CHUNK] = act.q
    _flat(xd, np.float32)[first_chunk : first_chunk + n] = act.d
    _flat(xs, np.float32)[first_chunk : first_chunk + n] = act.s


def _epilogue(y: Any, n_rows: int, dot: npt.NDArray[np.float32], bias: Any, acc: int) -> None:
    out = _flat(y, np.float32)
    v = dot.astype(np.float32)
    if bias is not None:
        v = (v + _flat(bias, np.float32)[:n_rows]).astype(np.float32)
    out[:n_rows] = (out[:n_rows] + v) if acc else v


def _rows(w: Any, n_rows: int, row_bytes: int) -> npt.NDArray[np.uint8]:
    return _flat(w, np.uint8)[: n_rows * row_bytes].reshape(n_rows, row_bytes)


def _check_matvec(
    grid: tuple[int, ...], block: int, n_rows: int, n_chunks: int, stride: int, qtype: str
) -> None:
    if block != 32 * MV_WARPS or grid[0] * MV_WARPS < n_rows:
        raise LaunchError(f"matvec of {n_rows} rows launched as {grid} x {block}")
    expected = row_bytes(qtype, n_chunks * CHUNK)
    if stride != expected:
        raise LaunchError(f"{qtype} rows of {n_chunks} chunks are {expected} bytes, not {stride}")


def _activation_rows(grid: tuple[int, ...]) -> int:
    """A matvec's or gated kernel's activation rows: its grid's second dimension."""
    return grid[1] if len(grid) > 1 else 1


def _matvec_q8(qtype: str) -> KernelTwin:
    def run(grid: tuple[int, ...], block: int, args: Sequence[Any]) -> None:
        w, row_bytes, n_chunks, n_rows, xq, xd, xs, y, bias, acc = args
        _check_matvec(grid, block, n_rows, n_chunks, row_bytes, qtype)
        rows = _rows(w, n_rows, row_bytes)
        out = _flat(y, np.float32)
        for r in range(_activation_rows(grid)):
            act = twins.Q8Act(
                _flat(xq, np.int8)[r * n_chunks * CHUNK : (r + 1) * n_chunks * CHUNK].copy(),
                _flat(xd, np.float32)[r * n_chunks : (r + 1) * n_chunks].copy(),
                _flat(xs, np.float32)[r * n_chunks : (r + 1) * n_chunks].copy(),
            )
            dot = twins.matvec_q8(rows, qtype, act).y
            _epilogue(out[r * n_rows :], n_rows, dot, bias, acc)

    return run


def _matvec_f(qtype: str) -> KernelTwin:
    def run(grid: tuple[int, ...], block: int, args: Sequence[Any]) -> None:
        w, row_bytes, n_chunks, n_rows, x, y, bias, acc = args
        _check_matvec(grid, block, n_rows, n_chunks, row_bytes, qtype)
        rows = _rows(w, n_rows, row_bytes)
        out = _flat(y, np.float32)
        n = n_chunks * CHUNK
        for r in range(_activation_rows(grid)):
            xv = _flat(x, np.float32)[r * n : (r + 1) * n].copy()
            dot = twins.matvec_f(rows, qtype, xv).y
            _epilogue(out[r * n_rows :], n_rows, dot, bias, acc)

    return run


def _dequant_rows(qtype: str) -> KernelTwin:
    def run(grid: tuple[int, ...], block: int, args: Sequence[Any]) -> None:
        w, row_bytes, n_chunks, ids, row0, n_rows, out = args
        if _threads(grid, block) < 1:
            raise LaunchError("empty launch")
        data = _flat(w, np.uint8)
        if ids is None:
            pick = np.arange(row0, row0 + n_rows)
        else:
            pick = _flat(ids, np.int32)[:n_rows].astype(np.int64)
        if pick.size and (pick.min() < 0 or (pick.max() + 1) * row_bytes > data.size):
            raise LaunchError(f"rows {pick.tolist()} outside the matrix")
        raw = data[: data.size // row_bytes * row_bytes].reshape(-1, row_bytes)[pick]
        n = n_chunks * CHUNK
        _flat(out, np.float32)[: n_rows * n] = twins.dequantize(raw, qtype).reshape(-1)

    return run


def _rmsnorm_rows(grid: tuple[int, ...], block: int, args: Sequence[Any]) -> None:
    x, w, out, n, eps = args
    rows = grid[0]
    xs = _flat(x, np.float32)[: rows * n].reshape(rows, n)
    y, _ = twins.rmsnorm(xs, _flat(w, np.float32)[:n], eps)
    _flat(out, np.float32)[: rows * n] = y.reshape(-1)


def _rmsnorm_q8(grid: tuple[int, ...], block: int, args: Sequence[Any]) -> None:
    x, w, out, n, eps, xq, xd, xs = args
    if len(grid) != 1 or block % 32:
        raise LaunchError(f"rmsnorm_q8 is one block per row, launched as {grid} x {block}")
    rows = grid[0]
    xv = _flat(x, np.float32)[: rows * n].reshape(rows, n)
    y, _ = twins.rmsnorm(xv, _flat(w, np.float32)[:n], eps)
    _flat(out, np.float32)[: rows * n] = y.reshape(-1)
    if xq is not None:
        per_row = n // CHUNK
        for r in range(rows):
            _store_q8(y[r, : per_row * CHUNK], r * per_row, xq, xd, xs)


Gate = Callable[[npt.NDArray[np.float32], npt.NDArray[np.float32]], npt.NDArray[np.float32]]


def _gated_rows(act: Gate) -> KernelTwin:
    def run(grid: tuple[int, ...], block: int, args: Sequence[Any]) -> None:
        h, out, n_ffn, rows = args
        if _threads(grid, block) < 1:
            raise LaunchError("empty launch")
        hv = _flat(h, np.float32)[: rows * 2 * n_ffn].reshape(rows, 2 * n_ffn)
        _flat(out, np.float32)[: rows * n_ffn] = act(hv[:, :n_ffn], hv[:, n_ffn:]).reshape(-1)

    return run


def _gated_q8(act: Gate) -> KernelTwin:
    def run(grid: tuple[int, ...], block: int, args: Sequence[Any]) -> None:
        h, out, n_ffn, xq, xd, xs = args
        if grid[0] * block // 32 < n_ffn // CHUNK or block % 32:
            raise LaunchError(f"a gated q8 kernel of {n_ffn} launched as {grid} x {block}")
        n = n_ffn // CHUNK * CHUNK
        for r in range(_activation_rows(grid)):
            hv = _flat(h, np.float32)[r * 2 * n_ffn : (r + 1) * 2 * n_ffn]
            v = act(hv[:n_ffn], hv[n_ffn:])
            _flat(out, np.float32)[r * n_ffn : r * n_ffn + n] = v[:n]
            if xq is not None:
                _store_q8(v[:n], r * (n_ffn // CHUNK), xq, xd, xs)

    return run


def _rmsnorm_add_rows(grid: tuple[int, ...], block: int, args: Sequence[Any]) -> None:
    o, w, x, n, eps = args
    rows = grid[0]
    y, _ = twins.rmsnorm(
        _flat(o, np.float32)[: rows * n].reshape(rows, n), _flat(w, np.float32)[:n], eps
    )
    xv = _flat(x, np.float32)
    xv[: rows * n] = xv[: rows * n] + y.reshape(-1)


def _head_rmsnorm(grid: tuple[int, ...], block: int, args: Sequence[Any]) -> None:
    qkv, rows, bias, q_norm, k_norm, n_heads, n_kv, hd_k, hd_v, eps = args
    if tuple(grid) != (rows, n_heads + 2 * n_kv) or block != 32:
        raise LaunchError(f"head_rmsnorm of {rows} rows launched as {grid} x {block}")
    width = (n_heads + n_kv) * hd_k + n_kv * hd_v
    x = _flat(qkv, np.float32)[: rows * width].reshape(rows, width)
    b = None if bias is None else _flat(bias, np.float32)[:width]
    x[:] = twins.head_rmsnorm(
        x, b, _flat(q_norm, np.float32)[:hd_k], _flat(k_norm, np.float32)[:hd_k],
        (n_heads, n_kv, hd_k, hd_v), eps,
    )  # fmt: skip


def _quantize_q8(grid: tuple[int, ...], block: int, args: Sequence[Any]) -> None:
    x, n_chunks, xq, xd, xs = args
    if _threads(grid, block) // 32 < n_chunks or block % 32:
        raise LaunchError(f"quantize_q8 of {n_chunks} chunks launched as {grid} x {block}")
    _store_q8(_flat(x, np.float32)[: n_chunks * CHUNK].copy(), 0, xq, xd, xs)


def _add_inplace(grid: tuple[int, ...], block: int, args: Sequence[Any]) -> None:
    x, y, n = args
    xv = _flat(x, np.float32)
    xv[:n] = xv[:n] + _flat(y, np.float32)[:n]


def _scale_inplace(grid: tuple[int, ...], block: int, args: Sequence[Any]) -> None:
    x, factor, n = args
    xv = _flat(x, np.float32)
    xv[:n] = xv[:n] * np.float32(factor)


def _softcap(grid: tuple[int, ...], block: int, args: Sequence[Any]) -> None:
    x, inv_cap, cap, n = args
    xv = _flat(x, np.float32)
    xv[:n] = (np.tanh(xv[:n] * np.float32(inv_cap)) * np.float32(cap)).astype(np.float32)


def _rope_kv(kv_half: bool) -> KernelTwin:
    kv_dtype = np.float16 if kv_half else np.float32

    def run(grid: tuple[int, ...], block: int, args: Sequence[Any]) -> None:
        (qkv, rows, bias, rot, state, n_heads, n_kv, hd_k, hd_v, n_rot, neox, q_scale, kc, vc,
         cache_size, temps) = args  # fmt: skip
        if grid[0] < rows:
            raise LaunchError(f"rope_kv of {rows} rows launched as {grid}")
        if rows > cache_size:  # two rows of the launch would write one slot
            raise LaunchError(f"{rows} rows into a ring of {cache_size} slots")
        pos = int(_flat(state, np.int32)[0])
        q_dim, k_dim, v_dim = n_heads * hd_k, n_kv * hd_k, n_kv * hd_v
        width = q_dim + k_dim + v_dim
        x = _flat(qkv, np.float32)[: rows * width].reshape(rows, width)
        v = x.copy()
        if bias is not None:
            v = (v + _flat(bias, np.float32)[:width]).astype(np.float32)
        rot_c = np.ones((rows, 0), np.complex64)  # n_rot 0: nothing rotates (the table unread)
        if n_rot:
            table = _flat(rot, np.float32).reshape(-1, n_rot // 2, 2)
            if pos + rows > table.shape[0]:
                raise LaunchError(f"positions up to {pos + rows} in a table of {table.shape[0]}")
            r = table[pos : pos + rows]
            rot_c = (r[..., 0] + 1j * r[..., 1]).astype(np.complex64)
        q = twins.rotate(v[:, :q_dim].reshape(rows, n_heads, hd_k), rot_c, n_rot, bool(neox))
        k = twins.rotate(
            v[:, q_dim : q_dim + k_dim].reshape(rows, n_kv, hd_k), rot_c, n_rot, bool(neox)
        )
        q = q * np.float32(q_scale)
        if temps is not None:
            q = q * _flat(temps, np.float32)[pos : pos + rows, None, None]
        x[:, :q_dim] = q.reshape(rows, q_dim)
        cache_view = np.float16 if kv_half else np.float32
        kcache = _flat(kc, cache_view)[: n_kv * cache_size * hd_k].reshape(n_kv, cache_size, hd_k)
        vcache = _flat(vc, cache_view)[: n_kv * cache_size * hd_v].reshape(n_kv, cache_size, hd_v)
        slots = (pos + np.arange(rows)) % cache_size
        kcache[:, slots] = k.transpose(1, 0, 2).astype(kv_dtype)
        vv = v[:, q_dim + k_dim :].reshape(rows, n_kv, hd_v)
        vcache[:, slots] = vv.transpose(1, 0, 2).astype(kv_dtype)

    return run


def _attention(kv_half: bool) -> KernelTwin:
    def run(grid: tuple[int, ...], block: int, args: Sequence[Any]) -> None:
        (qkv, rows, kc, vc, state, n_heads, n_kv, hd_k, hd_v, cache_size, window, scale,
         softcap, out, oq, od, os_) = args  # fmt: skip
        if tuple(grid) != (rows, n_heads) or block != 32 * ATT_WARPS:
            raise LaunchError(f"attention of {rows} rows x {n_heads} heads launched as {grid}")
        softcap = float(np.float32(softcap))  # as the kernel takes it
        if not (0.0 <= softcap < np.inf):  # NaN too
            raise LaunchError(f"a soft cap of {softcap}: it must be finite and not negative")
        if hd_k > 256 or hd_v > 256:
            raise LaunchError("heads larger than 256")
        pos = int(_flat(state, np.int32)[0])
        end = pos + rows
        first = twins.first_seen(pos, window)  # the oldest position a row sees
        if first + cache_size < end:  # the ring no longer holds it
            raise LaunchError(
                f"rows at {pos} .. {end - 1} see position {first}, which a ring of "
                f"{cache_size} slots no longer holds"
            )
        width = n_heads * hd_k + n_kv * hd_k + n_kv * hd_v
        x = _flat(qkv, np.float32)[: rows * width].reshape(rows, width)
        q = x[:, : n_heads * hd_k].reshape(rows, n_heads, hd_k)
        view = np.float16 if kv_half else np.float32
        kring = _flat(kc, view)[: n_kv * cache_size * hd_k].reshape(n_kv, cache_size, hd_k)
        vring = _flat(vc, view)[: n_kv * cache_size * hd_v].reshape(n_kv, cache_size, hd_v)
        keys = np.zeros((n_kv, end, hd_k), np.float32)  # by position; before `first`: unread
        values = np.zeros((n_kv, end, hd_v), np.float32)
        seen = np.arange(first, end)
        keys[:, first:] = kring[:, seen % cache_size]
        values[:, first:] = vring[:, seen % cache_size]
        att = twins.attention(q, keys, values, pos, n_heads // n_kv, scale, window, softcap)
        _flat(out, np.float32)[: att.size] = att.reshape(-1)
        if oq is not None:
            if hd_v % CHUNK:
                raise LaunchError("fused quantization needs heads of a multiple of 32")
            _store_q8(att.reshape(-1), 0, oq, od, os_)

    return run


def _argmax_partial(grid: tuple[int, ...], block: int, args: Sequence[Any]) -> None:
    x, n, pmax, pidx, pbad = args
    parts = grid[0]
    v = _flat(x, np.float32)[:n]
    owner = (np.arange(n) // block) % parts
    pm, pi, pb = _flat(pmax, np.float32), _flat(pidx, np.int32), _flat(pbad, np.int32)
    for b in range(parts):
        mine = np.flatnonzero(owner == b)
        finite = mine[np.isfinite(v[mine])]
        pb[b] = mine.size - finite.size
        if finite.size:
            best = v[finite].max()
            pm[b] = best
            pi[b] = finite[v[finite] == best].min()
        else:
            pm[b] = -np.inf
            pi[b] = 0x7FFFFFFF


def _argmax_final(grid: tuple[int, ...], block: int, args: Sequence[Any]) -> None:
    pmax, pidx, pbad, n_parts, out = args
    pm = _flat(pmax, np.float32)[:n_parts]
    pi = _flat(pidx, np.int32)[:n_parts]
    best = pm.max()
    at = int(pi[pm == best].min())
    res = _flat(out, np.int32)
    res[0] = at
    res[1] = int(_flat(pbad, np.int32)[:n_parts].sum())


def _convert(src_dtype: Any, dst_dtype: Any, fn: Callable[[Any], Any]) -> KernelTwin:
    def run(grid: tuple[int, ...], block: int, args: Sequence[Any]) -> None:
        x, out, n = args
        if _threads(grid, block) < 1:
            raise LaunchError("empty launch")
        _flat(out, dst_dtype)[:n] = fn(_flat(x, src_dtype)[:n])

    return run


def _f32_to_f16(v: npt.NDArray[np.float32]) -> npt.NDArray[np.float16]:
    with np.errstate(over="ignore"):  # out of range: infinity, as the kernel rounds
        return v.astype(np.float16)


def _f32_to_f16_counted(grid: tuple[int, ...], block: int, args: Sequence[Any]) -> None:
    """``f32_to_f16``: the conversion, and the count of finite values made infinite
    added to ``overflowed[0]``."""
    x, out, n, overflowed = args
    _convert(np.float32, np.float16, _f32_to_f16)(grid, block, (x, out, n))
    v = _flat(x, np.float32)[:n]
    lost = np.isinf(_flat(out, np.float16)[:n]) & np.isfinite(v)
    _flat(overflowed, np.uint32)[0] += np.uint32(lost.sum())


def _bf16_to_f32(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    return (bits.astype(np.uint32) << 16).view(np.float32)


KERNEL_TWINS: dict[str, KernelTwin] = {
    **{f"matvec_q8_{t}": _matvec_q8(t) for t in Q8_TYPES},
    **{f"matvec_f_{t}": _matvec_f(t) for t in QUANT_TYPES},
    **{f"dequant_rows_{t}": _dequant_rows(t) for t in QUANT_TYPES},
    "rmsnorm_rows": _rmsnorm_rows,
    "rmsnorm_add_rows": _rmsnorm_add_rows,
    "rmsnorm_q8": _rmsnorm_q8,
    "head_rmsnorm": _head_rmsnorm,
    "swiglu_rows": _gated_rows(twins.silu_mul),
    "swiglu_q8": _gated_q8(twins.silu_mul),
    "geglu_rows": _gated_rows(twins.gelu_mul),
    "geglu_q8": _gated_q8(twins.gelu_mul),
    "quantize_q8": _quantize_q8,
    "add_inplace": _add_inplace,
    "scale_inplace": _scale_inplace,
    "softcap": _softcap,
    "rope_kv_f32": _rope_kv(False),
    "rope_kv_f16": _rope_kv(True),
    "attention_f32": _attention(False),
    "attention_f16": _attention(True),
    "argmax_partial": _argmax_partial,
    "argmax_final": _argmax_final,
    "f32_to_f16": _f32_to_f16_counted,
    "f16_to_f32": _convert(np.float16, np.float32, lambda v: v.astype(np.float32)),
    "f32_to_bf16": _convert(np.float32, np.uint16, float32_to_bf16),
    "bf16_to_f32": _convert(np.uint16, np.float32, _bf16_to_f32),
}
