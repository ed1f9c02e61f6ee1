"""The CUDA worker's operations: ``program.Ops`` as kernel launches (``kernels.KernelSet``)
on the stage's stream (``DeviceOps``; a mixture's experts: ``expert_ops.py``), the
stage's buffers and its runs' KV caches on one GPU. Imports CuPy: only ``backend.py``
imports this module.

A run's KV cache (``DeviceCache``) is one ring per block (``rope.cu``): the run's
positions, or a sliding block's window when that is shorter (what the planner counts,
``ModelFacts.layer_kv_positions``), position ``p`` in slot ``p % size``. A prefill whose
positions would wrap a sliding block's ring writes its keys and values to a cache of
every position of the step instead (the ring's positions the step sees copied in
first), attends there, and leaves its last ``size`` positions in the ring.

The architectures' optional steps (``forward_program.py``) are kernels too: per-head Q/K norms
(``head_rmsnorm``), post-norms (``rmsnorm_add_rows``), GELU gating (``geglu_*``), the
embedding scale, the query scale where llama.cpp applies it (the scores, or gemma2's,
gemma3's and phi3's rotated queries: ``rope_kv``'s ``q_scale``), gemma2's soft cap on the
attention scores (``attention_*``'s ``softcap``, before the softmax) and the logit soft
cap (``softcap``).

Every launch and copy of a stage runs on the stage's own stream; a step returns after
synchronizing it, so a device array it returns is ready for another stre
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import cupy
import numpy as np

from runplan.quant_types import CHUNK, uses_q8
from runtime_core.workers.forward_program import Segment
from runtime_core.workers.stage_weights import Linear, MatrixPart, StageWeights
from runtime_core.workers.stage_worker import BackendSpec
from runtime_cupy.cuda.expert_ops import DeviceExpertOps
from runtime_cupy.cuda.kernels import KernelSet

MATVEC_WARPS = 4  # MV_WARPS in matvec.cu
ATT_THREADS = 256  # ATT_WARPS * 32 in attention.cu
#: argmax_partial's blocks: at most this many, and no more than the logits fill (256
#: entries a block), so a small vocabulary launches no blocks that scan nothing.
ARGMAX_PARTS = 128
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension (a launch's rows)

_KERNELS: dict[int, KernelSet] = {}


def kernels_for(device: int) -> KernelSet:
    """One ``KernelSet`` per device, shared by the stages of a process."""
    if device not in _KERNELS:
        _KERNELS[device] = KernelSet()
    return _KERNELS[device]


def argmax_parts(n: int) -> int:
    """The blocks of ``argmax_partial`` over ``n`` logits (``ARGMAX_PARTS`` at most)."""
    return min(ARGMAX_PARTS, cdiv(n, 256))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _row_chunks(rows: int) -> list[tuple[int, int]]:
    """(first row, rows) of each launch of a kernel whose grid counts ``rows``."""
    return [(r0, min(MAX_GRID_Y, rows - r0)) for r0 in range(0, rows, MAX_GRID_Y)]


class _Q8:
    """Rows of 8-bit activations, ``n`` per row: q (rows n,), d and s (rows n / 32,)."""

    def __init__(self, n: int, rows: int = 1) -> None:
        self.n = n
        self.q = cupy.zeros(rows * n, dtype=cupy.int8)
        self.d = cupy.zeros(rows * n // CHUNK, dtype=cupy.float32)
        self.s = cupy.zeros(rows * n // CHUNK, dtype=cupy.float32)

    def rows(self, first: int, end: int, n: int | None = None) -> tuple[Any, Any, Any]:
        """Views of rows ``first .. end`` of ``n`` values each (at most ``self.n``: a
        mixture's experts are narrower than its shared expert, and the rows of a
        narrower product lie at its own stride, as its writer and its reader both take
        them; at ``self.n``'s, a batch's later rows were read from the wrong place)."""
        n = self.n if n is None else n
        assert n <= self.n and n % CHUNK == 0, (n, self.n)
        m = n // CHUNK
        return (
            self.q[first * n : end * n],
            self.d[first * m : end * m],
            self.s[first * m : end * m],
        )


@attrs.define(eq=False)
class DeviceCache:
    """One run's KV cache: per block, a ring of keys and one of values (``positions``
    long, or a sliding block's window when that is shorter), and the decode graph
    captured over them (a graph keeps the pointers it was captured with)."""

    k: Any  # list of (n_kv_heads, size, head_dim_k) arrays, one per block
    v: Any
    positions: int
    graph: Any = None


class DeviceOps(DeviceExpertOps):
    """``program.Ops`` as launches on ``stream`` (a mixture's: ``DeviceExpertOps``)."""

    def __init__(
        self, k: KernelSet, w: StageWeights[Any, Any], spec: BackendSpec, max_seq: int, stream: Any
    ) -> None:
        c = w.config
        self.k, self.w, self.spec, self.max_seq, self.stream = k, w, spec, max_seq, stream
        self.kv_half = spec.kv_dtype == "f16"
        # per block: its window (0: global); a run's cache is a ring per block of that
        # many positions or all of the run's (``new_cache``)
        self.windows = [layer.window for layer in w.layers]
        tables = {
            id(r): cupy.asarray(np.ascontiguousarray(r).view(np.float32))
            for r in (w.rot, w.rot_swa)
            if r is not None
        }
        self.rots = [tables[id(w.layer_rot(i))] for i in range(len(w.layers))]
        # each position's factor on the rotated queries (mistral3), or none
        self.q_temps = None if w.q_temps is None else cupy.asarray(w.q_temps)
        # llama.cpp scales the scores, or (gemma2/3, phi3) the rotated queries; gemma2
        # caps the scores (those with a cap scale the queries, as llama.cpp caps the
        # scores before its softmax's scale)
        scale = float(np.float32(c.query_scale))
        self.q_scale, self.scale = (scale, 1.0) if c.spec.queries_scaled else (1.0, scale)
        self.attn_softcap = float(np.float32(c.attn_logit_softcap))  # 0: none
        # a prefill's keys and values, by position, while a sliding block's ring cannot
        # take them (``_wrapping_cache``)
        self.step_kv: tuple[Any, Any] | None = None
        self.state = cupy.zeros(2, dtype=cupy.int32)  # [position of row 0, token id]
        # each segment's [first position, 0], by its first row (a lone decode: ``state``)
        self.states: dict[int, Any] = {}
        self.tokens = cupy.zeros(max_seq, dtype=cupy.int32)
        self.one_token_out = cupy.zeros(2, dtype=cupy.int32)  # [id, non-finite count]
        self.token_out = self.one_token_out  # per head row: [id, non-finite count]
        self.pmax = cupy.zeros(ARGMAX_PARTS, dtype=cupy.float32)
        self.pidx = cupy.zeros(ARGMAX_PARTS, dtype=cupy.int32)
        self.pbad = cupy.zeros(ARGMAX_PARTS, dtype=cupy.int32)
        self.qkv_dim = c.q_dim + c.k_dim + c.v_dim
        self.att_dim = c.n_heads * c.head_dim_v
        # one-row buffers (decode), fixed for the graph
        h, f = c.hidden_dim, w.max_ffn
        self.one = {
            "x": cupy.zeros((1, h), cupy.float32),
            "xn": cupy.zeros((1, h), cupy.float32),
            "qkv": cupy.zeros((1, self.qkv_dim), cupy.float32),
            "att": cupy.zeros((1, self.att_dim), cupy.float32),
            "h": cupy.zeros(2 * f, cupy.float32),  # viewed (1, 2 ffn) per layer
            "act": cupy.zeros(f, cupy.float32),  # viewed (1, ffn) per layer
            "o": cupy.zeros((1, h), cupy.float32),  # a block's output before its post-norm
            "xl": cupy.zeros((1, h), cupy.float32),
        }
        self.q8 = {
            name: _Q8(size)
            for name, size in (("xn", h), ("att", self.att_dim), ("act", f), ("xl", h))
            if size % CHUNK == 0
        }
        self.one_logits = cupy.zeros((1, w.vocab_size), cupy.float32) if spec.is_last else None
        self.logits = self.one_logits
        self.buf: dict[str, Any] = {}
        self.bq8: dict[str, _Q8] = {}  # the step's 8-bit rows, by buffer name (q8 mode)
        # the step's row ranges (first, end) and whether their products take 8-bit rows
        self.groups: list[tuple[int, int, bool]] = [(0, 1, spec.matvec == "q8")]
        self.use_tokens = False  # embed from `tokens` (a batch) or state[1] (a lone decode)

    # -- buffers ----------------------------------------------------------------------
    def new_cache(self, positions: int) -> DeviceCache:
        """A run's KV cache of ``positions`` positions on the device: a ring per block of
        that many positions, or of a sliding block's window when that is shorter."""
        c = self.w.config
        kv = cupy.uint16 if self.kv_half else cupy.float32
        sizes = [min(n, positions) if n else positions for n in self.windows]
        return DeviceCache(
            [cupy.zeros((c.n_kv_heads, n, c.head_dim_k), dtype=kv) for n in sizes],
            [cupy.zeros((c.n_kv_heads, n, c.head_dim_v), dtype=kv) for n in sizes],
            positions,
        )

    def use_rows(self, rows: int) -> None:
        """Point the named buffers at the one-row set, or at fresh ones for ``rows``."""
        q8 = self.spec.matvec == "q8"
        if rows == 1:
            self.buf = {k: v for k, v in self.one.items() if k not in ("h", "act")}
            self.bq8 = dict(self.q8) if q8 else {}
        else:
            c, f = self.w.config, self.w.max_ffn
            self.buf = {
                "x": cupy.empty((rows, c.hidden_dim), cupy.float32),
                "xn": cupy.empty((rows, c.hidden_dim), cupy.float32),
                "qkv": cupy.empty((rows, self.qkv_dim), cupy.float32),
                "att": cupy.empty((rows, self.att_dim), cupy.float32),
                "o": cupy.empty((rows, c.hidden_dim), cupy.float32),
                "_h": cupy.empty(rows * 2 * f, cupy.float32),
                "_act": cupy.empty(rows * f, cupy.float32),
            }
            sizes = (("xn", c.hidden_dim), ("att", self.att_dim), ("act", f))
            self.bq8 = {n: _Q8(size, rows) for n, size in sizes if q8 and size % CHUNK == 0}
        self.use_heads(1)

    def use_heads(self, heads: int) -> None:
        """The head's buffers (``xl``, ``logits``, ``token_out``) for ``heads`` rows."""
        if heads == 1:
            self.buf["xl"] = self.one["xl"]
            self.logits, self.token_out = self.one_logits, self.one_token_out
            if "xl" in self.q8 and self.spec.matvec == "q8":
                self.bq8["xl"] = self.q8["xl"]
        else:
            h = self.w.config.hidden_dim
            self.buf["xl"] = cupy.empty((heads, h), cupy.float32)
            if self.spec.is_last:
                self.logits = cupy.empty((heads, self.w.vocab_size), cupy.float32)
            self.token_out = cupy.zeros(2 * heads, dtype=cupy.int32)
            if "xl" in self.q8 and self.spec.matvec == "q8":
                self.bq8["xl"] = _Q8(h, heads)
        if self.logits is not None:
            self.buf["logits"] = self.logits

    def _flat(self, name: str, rows: int) -> Any:
        return self.one[name] if rows == 1 else self.buf["_" + name]

    def _launch(self, name: str, grid: int | tuple[int, ...], block: int, *args: Any) -> None:
        self.k.launch(name, grid, block, args, stream=self.stream)

    # -- Ops ---------------------------------------------------------------------------
    def embed(self, table: Linear[Any], rows: int) -> None:
        ((part, raw),) = table.parts
        n_chunks = part.n_in // CHUNK
        ids = self.tokens if self.use_tokens else self.state[1:2]
        grid = min(cdiv(rows * n_chunks, 128), 4096)
        self._launch(
            f"dequant_rows_{part.qtype}", grid, 128,
            raw, part.row_bytes, n_chunks, ids, 0, rows, self.buf["x"],
        )  # fmt: skip

    def norm(self, weight: Any, rows: int) -> None:
        self._norm(self.buf["x"], weight, self.buf["xn"], rows, self.bq8.get("xn"), 0)

    def head_norm(self, weight: Any, heads: Sequence[int]) -> None:
        """Each head row normed on its own (one block of ``rmsnorm_q8`` per row)."""
        self.use_heads(len(heads))
        self.groups = [(0, len(heads), self.spec.matvec == "q8")]  # every head row 8-bit
        x, xl, q8 = self.buf["x"], self.buf["xl"], self.bq8.get("xl")
        for k, row in enumerate(heads):
            self._norm(x[row : row + 1], weight, xl[k : k + 1], 1, q8, k)

    def _norm(self, x: Any, weight: Any, out: Any, rows: int, q8: _Q8 | None, first: int) -> None:
        """rows of ``x`` normed into ``out`` (and into rows ``first ..`` of ``q8``): one
        block of 1024 threads per row, whatever the rows."""
        n, eps = self.w.config.hidden_dim, self.w.config.rms_eps
        for r0, nr in _row_chunks(rows):
            xq, xd, xs = q8.rows(first + r0, first + r0 + nr) if q8 else (None, None, None)
            self._launch(
                "rmsnorm_q8", nr, 1024, x[r0 : r0 + nr], weight, out[r0 : r0 + nr], n, eps,
                xq, xd, xs,
            )  # fmt: skip

    def linear(
        self,
        lin: Linear[Any],
        src: str,
        dst: str,
        rows: int,
        *,
        accumulate: bool = False,
        bias: Any = None,
    ) -> None:
        """``dst (+)= src @ lin^T``: one matvec launch per part over all the rows (a
        part that is not the whole output row writes a scratch, then its columns)."""
        if dst in ("h",):
            self.buf["h"] = self._flat("h", rows)[: rows * lin.n_out].reshape(rows, lin.n_out)
        elif dst == "router":
            self.buf["router"] = cupy.empty((rows, lin.n_out), cupy.float32)
        x, y = self.buf[src], self.buf[dst]
        for part, raw in lin.parts:
            at = slice(part.out_offset, part.out_offset + part.n_out)
            part_bias = None if bias is None else bias[at]
            if rows == 1 or part.n_out == lin.n_out:
                target = y[0, at] if rows == 1 else y[:, at]
                self._matvec(part, raw, src, x, target, rows, part_bias, accumulate)
                continue
            out = cupy.empty((rows, part.n_out), cupy.float32)
            self._matvec(part, raw, src, x, out, rows, part_bias, False)
            with self.stream:
                if accumulate:
                    y[:rows, at] += out
                else:
                    y[:rows, at] = out

    def _matvec(
        self, part: MatrixPart, raw: Any, src: str, x: Any, y: Any, rows: int, bias: Any,
        acc: bool,
    ) -> None:  # fmt: skip
        """y (rows, n_out, contiguous rows) from the rows of ``x``, or of their 8-bit form
        in a group of 8-bit rows: grid (n_out / warps, rows), a launch per group and per
        ``MAX_GRID_Y`` rows."""
        n_chunks = part.n_in // CHUNK
        block = 32 * MATVEC_WARPS
        q8 = self.bq8.get(src)
        eight = uses_q8(part.qtype, self.spec.matvec) and q8 is not None
        for r0, nr in self._launch_rows(rows, eight):
            grid = (cdiv(part.n_out, MATVEC_WARPS), nr)
            out = y if nr == rows else y[r0 : r0 + nr]
            if eight and self._eight_bit(r0):
                assert q8 is not None
                xq, xd, xs = q8.rows(r0, r0 + nr, part.n_in)
                self._launch(
                    f"matvec_q8_{part.qtype}", grid, block,
                    raw, part.row_bytes, n_chunks, part.n_out, xq, xd, xs, out, bias, int(acc),
                )  # fmt: skip
            else:
                self._launch(
                    f"matvec_f_{part.qtype}", grid, block,
                    raw, part.row_bytes, n_chunks, part.n_out, x[r0 : r0 + nr], out, bias,
                    int(acc),
                )  # fmt: skip

    def _launch_rows(self, rows: int, eight: bool) -> list[tuple[int, int]]:
        """(first row, rows) of each product launch: per group of ``groups`` (all rows at
        once where 8-bit rows are not an option), per ``MAX_GRID_Y`` rows."""
        spans = [(a, b) for a, b, _ in self.groups] if eight else [(0, rows)]
        return [(a + r0, nr) for a, b in spans for r0, nr in _row_chunks(b - a)]

    def _eight_bit(self, row: int) -> bool:
        return next(q8 for a, b, q8 in self.groups if a <= row < b)

    def rope_kv(self, layer: int, bias: Any, seg: Segment) -> None:
        """The segment's rows rotated at its positions (its ``state``), K and V into its
        run's cache."""
        rows = seg.rows
        c = self.w.config
        kv = "f16" if self.kv_half else "f32"
        k, v = seg.cache.k[layer], seg.cache.v[layer]
        self.step_kv = None
        if rows > 1 and seg.pos + rows > k.shape[1]:  # a sliding block's ring would wrap
            k, v = self.step_kv = self._wrapping_cache(layer, seg)
        self._launch(
            f"rope_kv_{kv}", rows, 256,
            self.buf["qkv"][seg.start : seg.end], rows, bias, self.rots[layer],
            self.states[seg.start], c.n_heads, c.n_kv_heads, c.head_dim_k, c.head_dim_v,
            c.rope.n_dims if self.w.layers[layer].rotary else 0, int(c.rope.neox),
            self.q_scale, k, v, k.shape[1], self.q_temps,
        )  # fmt: skip

    def _wrapping_cache(self, layer: int, seg: Segment) -> tuple[Any, Any]:
        """A ring for this step only, long enough for every position a row of the
        segment sees: its run's ring's positions before the rows (the window's) and the
        rows' own, position p in slot p % length as in the run's ring (the kernels'
        rule), so the step holds at most a window and its rows, however far the run is."""
        ring_k, ring_v = seg.cache.k[layer], seg.cache.v[layer]
        size, end = ring_k.shape[1], seg.pos + seg.rows
        start = max(0, seg.pos - size)
        length = end - start  # distinct positions start .. end - 1: distinct slots
        k = cupy.empty((ring_k.shape[0], length, ring_k.shape[2]), ring_k.dtype)
        v = cupy.empty((ring_v.shape[0], length, ring_v.shape[2]), ring_v.dtype)
        if start < seg.pos:
            with self.stream:  # the index array too: the stage's stream does not wait for others
                held = cupy.arange(start, seg.pos)
                k[:, held % length] = ring_k[:, held % size]
                v[:, held % length] = ring_v[:, held % size]
        return k, v

    def attention(self, layer: int, seg: Segment) -> None:
        """The segment's rows over its run's cache, then their 8-bit form (q8 mode)."""
        rows = seg.rows
        c = self.w.config
        kv = "f16" if self.kv_half else "f32"
        k, v = self.step_kv or (seg.cache.k[layer], seg.cache.v[layer])
        att = self.buf["att"][seg.start : seg.end]
        self._launch(
            f"attention_{kv}", (rows, c.n_heads), ATT_THREADS,
            self.buf["qkv"][seg.start : seg.end], rows, k, v, self.states[seg.start],
            c.n_heads, c.n_kv_heads, c.head_dim_k, c.head_dim_v, k.shape[1],
            self.windows[layer], self.scale, self.attn_softcap, att, None, None, None,
        )  # fmt: skip
        q8 = self.bq8.get("att")
        if q8 is not None:
            xq, xd, xs = q8.rows(seg.start, seg.end)
            self._quantize(att, xq, xd, xs, rows * self.att_dim // CHUNK)
        if self.step_kv is not None:  # the ring keeps the step's last `size` positions
            ring_k, ring_v = seg.cache.k[layer], seg.cache.v[layer]
            size, end = ring_k.shape[1], seg.pos + rows
            with self.stream:
                kept = cupy.arange(max(seg.pos, end - size), end)
                ring_k[:, kept % size] = k[:, kept % k.shape[1]]
                ring_v[:, kept % size] = v[:, kept % k.shape[1]]
            self.step_kv = None

    def _quantize(self, x: Any, xq: Any, xd: Any, xs: Any, n_chunks: int) -> None:
        self._launch("quantize_q8", cdiv(n_chunks, 8), 256, x, n_chunks, xq, xd, xs)

    def swiglu(self, rows: int) -> None:
        self._gated("swiglu", rows)

    def geglu(self, rows: int) -> None:
        self._gated("geglu", rows)

    def _gated(self, kernel: str, rows: int) -> None:
        """act = act(gate) * up: a warp per chunk of 32 outputs per row (and its 8-bit
        form), or one element per thread where the rows are not whole chunks."""
        h = self.buf["h"]
        f = h.shape[1] // 2
        act = self._flat("act", rows)[: rows * f].reshape(rows, f)
        self.buf["act"] = act
        if f % CHUNK:
            self._launch(f"{kernel}_rows", min(cdiv(rows * f, 256), 65535), 256, h, act, f, rows)
            return
        q8 = self.bq8.get("act")
        for r0, nr in _row_chunks(rows):
            xq, xd, xs = q8.rows(r0, r0 + nr, f) if q8 else (None, None, None)
            self._launch(
                f"{kernel}_q8", (cdiv(f // CHUNK, 8), nr), 256, h[r0 : r0 + nr],
                act[r0 : r0 + nr], f, xq, xd, xs,
            )  # fmt: skip

    def scale_x(self, factor: float, rows: int) -> None:
        n = rows * self.w.config.hidden_dim
        f = float(np.float32(factor))
        self._launch("scale_inplace", min(cdiv(n, 256), 4096), 256, self.buf["x"], f, n)

    def qk_norm(self, q_norm: Any, k_norm: Any, bias: Any, rows: int) -> None:
        c = self.w.config
        self._launch(
            "head_rmsnorm", (rows, c.n_heads + 2 * c.n_kv_heads), 32,
            self.buf["qkv"], rows, bias, q_norm, k_norm, c.n_heads, c.n_kv_heads, c.head_dim_k,
            c.head_dim_v, c.rms_eps,
        )  # fmt: skip

    def add_norm(self, weight: Any, rows: int) -> None:
        c = self.w.config
        self._launch(
            "rmsnorm_add_rows", rows, 256, self.buf["o"], weight, self.buf["x"], c.hidden_dim,
            c.rms_eps,
        )  # fmt: skip

    def add_scaled(self, factor: float, rows: int) -> None:
        """x += o * factor: the scaled output rounded, then the sum (ggml's two ops)."""
        n = rows * self.w.config.hidden_dim
        grid = min(cdiv(n, 256), 4096)
        self._launch("scale_inplace", grid, 256, self.buf["o"], float(np.float32(factor)), n)
        self._launch("add_inplace", grid, 256, self.buf["x"], self.buf["o"], n)

    def scale_logits(self, factor: float, rows: int) -> None:
        assert self.logits is not None
        n = rows * self.logits.shape[1]
        f = float(np.float32(factor))
        self._launch("scale_inplace", min(cdiv(n, 256), 4096), 256, self.logits, f, n)

    def softcap(self, cap: float, rows: int) -> None:
        assert self.logits is not None
        n = rows * self.logits.shape[1]
        inv, c = float(np.float32(1.0 / cap)), float(np.float32(cap))
        self._launch("softcap", min(cdiv(n, 256), 4096), 256, self.logits, inv, c, n)

    def argmax(self, rows: int) -> None:
        """Each head row's token into its pair of ``token_out``."""
        assert self.logits is not None
        n = self.logits.shape[1]
        parts = argmax_parts(n)
        for k in range(rows):
            self._launch(
                "argmax_partial", parts, 256, self.logits[k], n, self.pmax, self.pidx, self.pbad
            )
            self._launch(
                "argmax_final", 1, 256, self.pmax, self.pidx, self.pbad, parts,
                self.token_out[2 * k : 2 * k + 2],
            )  # fmt: skip
