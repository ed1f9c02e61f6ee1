"""The CPU worker's operations: ``program.Ops`` on host memory (``CpuOps``), each
operation one call of the compiled kernels (``kernels.py``), split across the stage's
threads; a mixture's experts are ``expert_ops.py``'s, the backend that drives them
``backend.py``.

Weights are the file's own bytes: ``load_weights`` hands over views of the memory map
(``join_parts=False``: Q, K, V and gate, up stay the separate matrices the file
stores, each writing its columns of the output), the kernels multiply the GGUF blocks
in place, and only norm weights and biases are copied (as float32). The exception is the
quantized types, every one (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K to Q6_K, IQ4_NL and
IQ4_XS: those with x8 kernels, ``csrc/repack.h``): such a matrix that products read
is copied once at bind (on the stage's threads) into groups of 8 interleaved rows, whose
kernels compute 8 rows' products side by side, the same bits as on the stored rows; the
copy replaces the mapped pages in the process (dropped with ``MADV_DONTNEED``: a copy of
the tensor's bytes, 2.8 % more for Q4_K and Q5_K, 3.6 % for Q3_K and 1.5 % for IQ4_XS,
whose scales it keeps unpacked, in private memory instead of the file's shared,
reclaimable pages). An embedding only looked up stays mapped. ``load`` reads every
other page of the stage's tensors once, so the first step does not wait on the disk.

Every kernel call names the worker's instruction set (``isa``: ``kernels.py``), and a
matrix times R activation rows gives each row the bits it gets alone, whatever the
other rows, the threads or the set: the product prefill and batched steps share.

Step programs (``csrc/program.c``). The forward program (``forward_program.py``) makes a
few kernel calls per block; between them the interpreter runs Python, and since each
product streams megabytes of weights through the caches, that Python runs cold: on
SmolLM2 it was a sixth of a decode token. So the first step of each shape (its rows per
run and its head rows, ``CpuOps.program``) runs the forward program once with every
kernel call recorded into a ``_kernels.Program`` (arguments parsed and checked once),
and that step and every later one of the shape make all the calls in one ``run``,
without the GIL, each segment taking its run's position and cache (``CpuCache.table``).
The same kernels on the same buffers: the same bits as the calls made one by one, which
steps still make where a program cannot (steps beyond the kept buffers, a prefill whose
keys a sliding ring cannot take before attention). A stage keeps ``KEPT_PROGRAMS`` of
them.

Products. With ``matvec="q8"`` (the default) activations are rounded as llama.cpp's
CPU path rounds them for the weight type (``ACT_FORMAT``: Q8_0, Q8_1 or Q8_K blocks,
``csrc/dot.h``; half or bfloat16 for F16 / BF16 weights), and quantized matrices
multiply them by integer dot products, prefill rows as well as decode rows. A matrix of
several rows (prefill) is a blocked product: each block of weight rows is read once
from memory and multiplied with every activation row while it is in cache. A row's
result is the same whichever rows it is computed with, so a prompt's prefill computes
exactly what decoding it one row at a time would. ``matvec="f32"`` dequantizes chunks
of the weights exactly (as the gguf package does) and multiplies float32 activations.
A source's rounded forms are computed once per value of the source (``StepRows.fresh``).

Step buffers (``step_buffers.py``): a bound stage's steps of up to ``KEPT_ROWS`` rows
take views of buffers made and written at bind. A longer step (a prefill chunk of the
runtime's default 512 rows, a prompt fed whole) makes its own, and lets them go when it
ends but for its output rows (``end_step``).

The residual stream is float32; the KV cache float32 or float16 (``BackendSpec.kv_dtype``),
one per run (``new_cache``; each step of a batch names its run's), one ring per block:
the run's positions, or a sliding block's window when that is shorter (what the planner
counts, ``ModelFacts.layer_kv_positions``), position ``p`` in slot ``p % size``. A
prefill that would wrap a sliding block's ring holds its own keys and values beside the
ring until attention has read the positions they overwrite. Attention reads every
position in order, whether from the ring or the step's rows, so a prefill computes what
decoding it row by row computes, past the window too.

The architectures' optional steps (``forward_program.py``) are the kernels' too: per-head Q/K
norms, post-norms, GELU gating (llama.cpp's table of halves), the embedding scale, the
query scale where llama.cpp applies it (the scores, or gemma3's and phi3's queries
after rotary) and the logit soft cap.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from runtime_core.workers.cpu import _kernels
from runtime_core.workers.cpu.expert_ops import CpuExpertOps
from runtime_core.workers.cpu.step_buffers import (
    KEPT_ROWS,
    RowSet,
    buffer,
    written,
)
from runtime_core.workers.forward_program import Segment
from runtime_core.workers.stage_weights import Linear, StageWeights
from runtime_core.workers.stage_worker import BackendSpec

U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]
#: the step programs a stage keeps (``CpuOps.program``): one per shape of step (a batch's
#: rows per run and head rows), the least recently used dropped beyond these
KEPT_PROGRAMS = 16


#: The activations each weight type multiplies, as llama.cpp pairs them: an 8-bit
#: format (csrc/dot.h), or float32 rounded to half (F16 weights) or bfloat16 (BF16).
ACT_FORMAT = {
    "F32": "f32",
    "F16": "f16",
    "BF16": "bf16",
    **dict.fromkeys(("Q8_0", "Q4_0", "Q5_0", "IQ4_NL"), "q8_0"),
    **dict.fromkeys(("Q4_1", "Q5_1"), "q8_1"),
    **dict.fromkeys(("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"), "q8_K"),
}


@attrs.frozen
class CpuCache:
    """One run's KV cache: per block, keys, values, and the heads tuple the kernels
    take (with the ring's size); ``table``, the same as a step program takes it."""

    k: list[npt.NDArray[Any]]
    v: list[npt.NDArray[Any]]
    heads: list[tuple[int, int, int, int, int, bool]]
    table: _kernels.KvCache = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "table", _kernels.KvCache(self.k, self.v, self.heads))

    @property
    def ring(self) -> int:
        """The positions of its shortest ring (a sliding block's window)."""
        return min((k.shape[1] for k in self.k), default=0)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.k, *self.v))


class CpuOps(CpuExpertOps):
    """``program.Ops`` as calls of the compiled kernels (a mixture's: ``CpuExpertOps``)."""

    def __init__(
        self,
        w: StageWeights[U8, F32],
        spec: BackendSpec,
        max_seq: int,
        threads: int,
        isa: str | None = None,
    ) -> None:
        c = w.config
        self.w, self.spec, self.max_seq, self.threads = w, spec, max_seq, threads
        self.isa = isa  # the kernels' instruction set (None: the best)
        self.use_q8 = spec.matvec == "q8"
        self.kv = np.float16 if spec.kv_dtype == "f16" else np.float32
        # per block: its window (0: global; a run's cache holds a ring of ``size``
        # positions per block), its rotations
        self.windows = [layer.window for layer in w.layers]
        # the heads tuple of the batch's first run: the shape of its heads (qk_norm)
        self.heads: tuple[int, int, int, int, int, bool] | None = None
        tables = [r for r in (w.rot, w.rot_swa) if r is not None]
        flat = {id(r): np.ascontiguousarray(r).view(np.float32) for r in tables}
        self.rots = [flat[id(w.layer_rot(i))] for i in range(len(w.layers))]  # (max_seq, n_rot)
        # llama.cpp scales the scores, or (gemma2/3, phi3) the rotated queries; gemma2
        # caps the scores (those with a cap scale the queries, as llama.cpp caps the
        # scores before its softmax's scale)
        scale = float(np.float32(c.query_scale))
        self.q_scale, self.scale = (scale, 1.0) if c.spec.queries_scaled else (1.0, scale)
        self.attn_softcap = float(np.float32(c.attn_logit_softcap))
        # a prefill's own keys and values, while a sliding block's ring cannot take them
        self.step_kv: tuple[npt.NDArray[Any], npt.NDArray[Any]] | None = None
        self.qkv_dim = c.q_dim + c.k_dim + c.v_dim
        self.att_dim = c.n_heads * c.head_dim_v
        # per matrix, its parts grouped by the activations they take; the matrices a
        # product reads (not an embedding only looked up) repacked where their type
        # repacks, each stored tensor's pages then dropped (``released``)
        self.matrices: dict[int, list[tuple[str, _kernels.Matrix]]] = {}
        self.released: set[int] = set()  # ids of the stored tensors no longer read
        multiplied = {
            id(raw) for lin in w.linears if lin is not w.embedding for _, raw in lin.parts
        }
        built: dict[tuple[tuple[int, ...], tuple[int, ...]], _kernels.Matrix] = {}
        for lin in w.linears:
            groups: dict[str, list[tuple[U8, str, int, int, int]]] = {}
            for p, raw in lin.parts:
                groups.setdefault(ACT_FORMAT[p.qtype], []).append(
                    (raw, p.qtype, p.n_out, p.n_in, p.out_offset)
                )
            mats = []
            for f, parts in groups.items():
                key = (tuple(id(part[0]) for part in parts), tuple(part[4] for part in parts))
                if key not in built:  # a tied embedding shares the head's matrix
                    repack = all(id(part[0]) in multiplied for part in parts)
                    built[key] = _kernels.Matrix(parts, repack=repack, threads=threads)
                    for part, packed in zip(parts, built[key].repacked, strict=True):
                        if packed:
                            _drop_pages(part[0])
                            self.released.add(id(part[0]))
                mats.append((f, built[key]))
            self.matrices[id(lin)] = mats
        # the step buffers of up to KEPT_ROWS rows, written now (a bound stage's steps
        # take no page faults in them), with the 8-bit (or f16 / bf16) forms of the formats
        # it multiplies
        formats = {f for mats in self.matrices.values() for f, _ in mats} - {"f32"}
        self.kept = self._row_set(KEPT_ROWS, True, sorted(formats) if self.use_q8 else ())
        self.buf = self.kept.rows(1)
        self.out: F32 = self.buf.x  # the last step's output rows (``end_step``)
        # the head's logits: the first rows of ``logits_kept`` (made for the most head rows
        # a step has had, one at first, written now), or a step's own beyond KEPT_ROWS
        self.logits_kept = written((1, w.vocab_size), np.float32) if spec.is_last else None
        self.logits = self.logits_kept
        self.ids_kept = written(KEPT_ROWS, np.int32)  # a step's token ids (first stage)
        self.ids: npt.NDArray[np.int32] = self.ids_kept[:0]
        self.tokens: list[tuple[int, int]] = []  # per head row: (token, non-finite logits)
        # where the operations' kernel calls go: the module (run now), or a step program
        # being recorded (``program``); the step's segments (a recorded call's slot)
        self.kernels: Any = _kernels
        self.segments: Sequence[Segment] = ()
        # the step programs made, by shape (rows per segment, head rows), the last used last
        self.programs: dict[tuple[tuple[int, ...], tuple[int, ...]], _kernels.Program] = {}
        # a mixture of experts (``forward_program.forward_experts``): the router's logits,
        # the buffers of its (row, slot) pairs (``_pair_buffers``), those of a step of
        # KEPT_ROWS rows made now, and the formats its experts' inputs take
        self.moe = any(layer.experts is not None for layer in w.layers)
        self.router_logits: F32 = np.empty((0, 0), np.float32)
        self.moe_bufs: dict[str, npt.NDArray[Any]] = {}
        self.pair_views: dict[tuple[int, int, int, int], dict[str, Any]] = {}  # by shape
        self.expert_formats = sorted(
            {
                (src, fmt)
                for layer in w.layers
                if layer.experts is not None
                for src, lins in (("xs", layer.experts.gate_up), ("act", layer.experts.down))
                for lin in lins
                for fmt, _ in self.matrices[id(lin)]
                if self.use_q8 and fmt != "f32"
            }
        )
        if self.moe:
            used = c.n_experts_used
            self._pair_buffers(KEPT_ROWS * used, KEPT_ROWS, used, w.max_ffn)

    def new_cache(self, positions: int) -> CpuCache:
        """A KV cache of ``positions`` positions: each block's ring holds that many, or
        its window when that is shorter. Zeroed pages cost no memory until written (a
        debug build's poisoned ones do: ``buffer``)."""
        c = self.w.config
        sizes = [min(n, positions) if n else positions for n in self.windows]
        return CpuCache(
            [buffer((c.n_kv_heads, n, c.head_dim_k), self.kv) for n in sizes],
            [buffer((c.n_kv_heads, n, c.head_dim_v), self.kv) for n in sizes],
            [
                (c.n_heads, c.n_kv_heads, c.head_dim_k, c.head_dim_v, n, self.kv == np.float16)
                for n in sizes
            ],
        )

    def _row_set(self, cap: int, kept: bool = False, formats: Sequence[str] = ()) -> RowSet:
        c = self.w.config
        dims = (c.hidden_dim, self.qkv_dim, self.att_dim, self.w.max_ffn)
        return RowSet(cap, *dims, kept, formats)

    def use_rows(self, rows: int) -> None:
        """Point the named buffers at views of the kept buffers' first ``rows`` rows, or,
        beyond KEPT_ROWS (a long prefill), at buffers made for this step. Every step
        writes each buffer before reading it."""
        if rows > KEPT_ROWS:
            self.buf = self._row_set(rows).rows(rows)
        elif self.buf.base is not self.kept or self.buf.rows != rows:
            self.buf = self.kept.rows(rows)
        self.buf.fresh.clear()

    def end_step(self) -> None:
        """The step's output rows (``out``: its residual stream, what a stage before the
        last sends on), kept until the next step; a step beyond KEPT_ROWS lets the rest of
        its own buffers go now (about 155 MB at 512 rows of an 8B shape), so that a stage
        idle after a long prefill holds only what it keeps, as ``kept_bytes`` counts."""
        self.out = self.buf.x
        if self.buf.base is not self.kept:
            self.buf = self.kept.rows(1)
            self.ids = self.ids_kept[:0]

    @property
    def kept_bytes(self) -> int:
        """The bytes of the step buffers the stage keeps (``kept``, the logits', a
        mixture's)."""
        logits = 0 if self.logits_kept is None else self.logits_kept.nbytes
        return self.kept.nbytes + logits + sum(a.nbytes for a in self.moe_bufs.values())

    def use_heads(self, rows: int) -> None:
        """The logits of ``rows`` head rows (each run's last row that needs a token)."""
        kept = self.logits_kept
        if kept is None:
            return
        if rows > KEPT_ROWS:
            self.logits = buffer((rows, self.w.vocab_size), np.float32)
            return
        if kept.shape[0] < rows:
            kept = self.logits_kept = written((rows, self.w.vocab_size), np.float32)
            self.programs.clear()  # they write the logits they were recorded with
        self.logits = kept[:rows]

    def use_ids(self, ids: npt.NDArray[np.int32]) -> None:
        """The step's token ids: in ``ids_kept`` (where a program's embedding reads them),
        or, beyond KEPT_ROWS, an array of the step's own."""
        if len(ids) > KEPT_ROWS:
            self.ids = np.ascontiguousarray(ids, np.int32)
        else:
            self.ids = self.ids_kept[: len(ids)]
            self.ids[:] = ids

    def program(
        self, segments: Sequence[Segment], heads: Sequence[int], record: Any
    ) -> _kernels.Program | None:
        """The step program of a step of these ``segments`` and head rows (``use_rows``,
        ``use_heads`` and the inputs done), recorded now by ``record()`` (the forward
        program run with every kernel call going to the program) if this shape has none;
        None where a step must run call by call: a step beyond the kept buffers, or one
        whose keys and values a sliding ring cannot take before attention (``rope_kv``'s
        step buffers)."""
        rows = segments[-1].end
        if rows > KEPT_ROWS or self.moe:  # a mixture's calls follow each step's routing
            return None
        if any(s.rows > 1 and s.pos + s.rows > s.cache.ring for s in segments):
            return None
        key = (tuple(s.rows for s in segments), tuple(heads))
        program = self.programs.pop(key, None)
        if program is None:
            program = _kernels.Program()
            self.kernels, self.segments = program, segments
            try:
                record()
            finally:
                self.kernels, self.segments = _kernels, ()
            if len(self.programs) >= KEPT_PROGRAMS:
                del self.programs[next(iter(self.programs))]  # the least recently used
        self.programs[key] = program
        return program

    def _written(self, name: str) -> None:
        self.buf.fresh.pop(name, None)

    # -- Ops -------------------------------------------------------------------------------
    def embed(self, table: Linear[U8], rows: int) -> None:
        ((_, matrix),) = self.matrices[id(table)]
        self.kernels.embed(matrix, self.ids[:rows], self.buf.x, self.threads)

    def scale_x(self, factor: float, rows: int) -> None:
        self.kernels.scale(self.buf.x, factor, self.threads)

    def _rmsnorm(self, x: F32, weight: F32, out: F32, rows: int, accumulate: bool = False) -> None:
        c = self.w.config
        self.kernels.rmsnorm(
            x, weight, out, rows, c.hidden_dim, c.rms_eps, self.threads, accumulate
        )

    def norm(self, weight: F32, rows: int) -> None:
        self._rmsnorm(self.buf.x, weight, self.buf.views["xn"], rows)
        self._written("xn")

    def add_norm(self, weight: F32, rows: int) -> None:
        self._rmsnorm(self.buf.views["o"], weight, self.buf.x, rows, True)

    def head_norm(self, weight: F32, heads: Sequence[int]) -> None:
        x, xl = self.buf.x, self.buf.views["xl"]
        n, first = len(heads), heads[0]
        if list(heads) == list(range(first, first + n)):  # one run's rows, or decode rows
            self._rmsnorm(x[first : first + n], weight, xl, n)
        else:  # row by row: the same bits (each row's norm is its own)
            for k, h in enumerate(heads):
                self._rmsnorm(x[h : h + 1], weight, xl[k : k + 1], 1)
        self._written("xl")

    def linear(
        self,
        lin: Linear[U8],
        src: str,
        dst: str,
        rows: int,
        *,
        accumulate: bool = False,
        bias: F32 | None = None,
    ) -> None:
        b = self.buf
        x = b.views[src][:rows]  # the head's rows are the first of ``xl``
        if dst == "h":
            y = b.views["h"] = b.h_flat[: rows * lin.n_out].reshape(rows, lin.n_out)
        elif dst == "logits":
            assert self.logits is not None
            y = self.logits
        elif dst == "router":
            y = self.router_logits = np.empty((rows, lin.n_out), np.float32)
        else:
            y = b.views[dst][:rows]  # the kernel takes the row stride from its length
        for fmt, matrix in self.matrices[id(lin)]:
            if fmt in ("f32", "f16", "bf16") or not self.use_q8:
                xf = self._rounded(src, fmt, x) if self.use_q8 and fmt != "f32" else x
                self.kernels.linear(
                    matrix, rows, xf, None, None, None, None,
                    False, False, y, bias, accumulate, self.threads, isa=self.isa,
                )  # fmt: skip
                continue
            q8 = b.q8_of(src, fmt)
            fresh = b.fresh.setdefault(src, set())
            self.kernels.linear(
                matrix, rows, x, q8.q, q8.d, q8.s, q8.g,
                fmt not in fresh, True, y, bias, accumulate, self.threads, isa=self.isa,
            )  # fmt: skip
            fresh.add(fmt)

    def _rounded(self, src: str, fmt: str, x: F32) -> F32:
        """``x`` rounded to half or bfloat16 (nearest even), as float32: what llama.cpp's
        products with F16 / BF16 weights multiply."""
        b = self.buf
        fresh = b.fresh.setdefault(src, set())
        out = b.rounded_of(src, fmt)
        if fmt not in fresh:
            self.kernels.round(x, out, fmt, self.threads)
            fresh.add(fmt)
        return out

    def qk_norm(self, q_norm: F32, k_norm: F32, bias: F32 | None, rows: int) -> None:
        assert self.heads is not None
        self.kernels.qk_norm(
            self.buf.views["qkv"], rows, bias, q_norm, k_norm, self.heads,
            self.w.config.rms_eps, self.threads,
        )  # fmt: skip

    def rope_kv(self, layer: int, bias: F32 | None, seg: Segment) -> None:
        rope = self.w.config.rope  # its rotated dims and pairs; the block's base is in rots
        n_rot = rope.n_dims if self.w.layers[layer].rotary else 0
        cache: CpuCache = seg.cache
        k, v, heads = cache.k[layer], cache.v[layer], cache.heads[layer]
        rows, pos = seg.rows, seg.pos
        self.step_kv = None
        if rows > 1 and pos + rows > k.shape[1]:  # a sliding block's ring would wrap
            c = self.w.config
            self.step_kv = (
                buffer((c.n_kv_heads, rows, c.head_dim_k), self.kv),
                buffer((c.n_kv_heads, rows, c.head_dim_v), self.kv),
            )
        step = self.step_kv or (None, None)
        self.kernels.rope_kv(
            self.buf.views["qkv"][seg.start : seg.end], rows, bias, self.rots[layer], pos,
            heads, n_rot, rope.neox, k, v, self.threads, self.q_scale, *step, self.w.q_temps,
            **self._slot(seg, layer),
        )  # fmt: skip

    def _slot(self, seg: Segment, layer: int) -> dict[str, tuple[int, int]]:
        """A recorded call's slot: which segment's position and cache it takes at a run."""
        if not self.segments:  # not recording
            return {}
        return {"slot": (self.segments.index(seg), layer)}

    def attention(self, layer: int, seg: Segment) -> None:
        b = self.buf
        cache: CpuCache = seg.cache
        step = self.step_kv or (None, None)
        self.kernels.attention(
            b.views["qkv"][seg.start : seg.end], seg.rows, cache.k[layer], cache.v[layer],
            seg.pos, cache.heads[layer], self.scale, b.views["att"][seg.start : seg.end],
            self.threads, self.windows[layer], *step, isa=self.isa, softcap=self.attn_softcap,
            **self._slot(seg, layer),
        )  # fmt: skip
        self.step_kv = None  # its last ``size`` positions are in the ring now
        self._written("att")

    def swiglu(self, rows: int) -> None:
        self._gated(self.kernels.swiglu, rows, isa=self.isa)  # its exp32 (csrc/ieee32.h)

    def geglu(self, rows: int) -> None:
        self._gated(self.kernels.geglu, rows)

    def _gated(self, kernel: Any, rows: int, **isa: str | None) -> None:
        b = self.buf
        h = b.views["h"]
        f = h.shape[1] // 2
        act = b.views["act"] = b.act_flat[: rows * f].reshape(rows, f)
        kernel(h, act, rows, f, self.threads, **isa)
        self._written("act")

    def softcap(self, cap: float, rows: int) -> None:
        assert self.logits is not None
        # its tanh32 (csrc/ieee32.h)
        self.kernels.softcap(self.logits[:rows], cap, self.threads, isa=self.isa)

    def add_scaled(self, factor: float, rows: int) -> None:
        x, o = self.buf.x[:rows], self.buf.views["o"][:rows]
        self.kernels.add_scaled(x, o, factor, self.threads)

    def scale_logits(self, factor: float, rows: int) -> None:
        assert self.logits is not None
        self.kernels.scale(self.logits[:rows], factor, self.threads)

    def argmax(self, rows: int) -> None:
        assert self.logits is not None
        self.tokens = [self.kernels.argmax(self.logits[r]) for r in range(rows)]


def _drop_pages(raw: U8) -> None:
    """Drop the pages of ``raw`` from this process where it is a view of a file's read-only
    memory map (a repacked tensor: its stored bytes are not read again). The pages stay
    the file's (in the page cache until the kernel reclaims them; read back, whole pages,
    if anything reads them again). Anything else (a private or writable mapping, an
    array in memory) is left as it is."""
    base: object = raw
    while isinstance(base, np.ndarray):
        base = base.base
    if not isinstance(base, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED") or not raw.size:
        return
    if not memoryview(base).readonly:  # MADV_DONTNEED would discard a private copy's writes
        return
    start = np.frombuffer(base, np.uint8).ctypes.data
    first = raw.ctypes.data - start
    last = first + raw.nbytes
    if first < 0 or last > len(base):
        return
    page = mmap.PAGESIZE
    first -= first % page
    base.madvise(mmap.MADV_DONTNEED, first, min(len(base), -(-last // page) * page) - first)
