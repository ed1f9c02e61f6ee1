"""The CUDA worker's backend: the stage's weights, caches and buffers on one GPU, and
``program.Ops`` as kernel launches (``kernels.KernelSet``). Imports CuPy: only
``worker.CudaWorker.bind`` imports this module.

Buffers. A decode step (one row) uses buffers allocated at bind time, so that the
step can be captured once as a CUDA graph and replayed: position and token id are
read from ``state`` (device memory, written before each replay), the attention
kernels loop over the context length they read there. A prefill of ``rows > 1`` rows
allocates its row buffers for the step, runs eagerly, and multiplies matrices as
float32 tiles dequantized by ``dequant_rows_<T>`` and cuBLAS (``cupy.matmul``, no
TF32), a tile at most ``TILE_FLOATS`` floats.

A run's KV cache (``DeviceCache``) is one ring per block (``rope.cu``): the run's
positions, or a sliding block's window when that is shorter (what the planner counts,
``ModelFacts.layer_kv_positions``), position ``p`` in slot ``p % size``. A prefill whose
positions would wrap a sliding block's ring writes its keys and values to a cache of
every position of the step instead (the ring's positions the step sees copied in
first), attends there, and leaves its last ``size`` positions in the ring.

The architectures' optional steps (``forward_program.py``) are kernels too: per-head Q/K norms
(``head_rmsnorm``), post-norms (``rmsnorm_add_rows``), GELU gating (``geglu_*``), the
embedding scale, the query scale where llama.cpp applies it (the scores, or gemma3's and
phi3's rotated queries: ``rope_kv``'s ``q_scale``) and the logit soft cap.

Every launch and copy of a stage runs on the stage's own stream; a step returns after
synchronizing it, so a device array it returns is ready for another stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import cupy
import numpy as np
import numpy.typing as npt

from runplan import SamplingConfig
from runplan.quant_types import CHUNK, uses_q8
from runtime_core.gguf_slice import StageSlice
from runtime_core.workers import device_sampling
from runtime_core.workers.forward_program import (
    Linear,
    MatrixPart,
    Segment,
    StageWeights,
    forward_blocks,
    forward_embed,
    forward_head,
    load_weights,
)
from runtime_core.workers.interface import Progress, TraceEvent
from runtime_core.workers.looped_batch import Kept, RunsOneAtATime
from runtime_core.workers.stage_worker import BackendSpec
from runtime_cupy.cuda.kernels import KernelSet

TILE_FLOATS = 1 << 26  # 256 MiB of float32 per prefill tile
MATVEC_WARPS = 4  # MV_WARPS in matvec.cu
ATT_THREADS = 256  # ATT_WARPS * 32 in attention.cu
ARGMAX_PARTS = 128
_H2D, _D2H, _D2D = 1, 2, 3

_KERNELS: dict[int, KernelSet] = {}


def kernels_for(device: int) -> KernelSet:
    """One ``KernelSet`` per device, shared by the stages of a process."""
    if device not in _KERNELS:
        _KERNELS[device] = KernelSet()
    return _KERNELS[device]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Uploader:
    def raw(self, data: npt.NDArray[np.uint8]) -> Any:
        return cupy.asarray(np.ascontiguousarray(data))

    def f32(self, data: npt.NDArray[np.float32]) -> Any:
        return cupy.asarray(np.ascontiguousarray(data, dtype=np.float32))


class _Q8:
    """One row's 8-bit activations: q (n,), d and s (n / 32,)."""

    def __init__(self, n: int) -> None:
        self.q = cupy.zeros(n, dtype=cupy.int8)
        self.d = cupy.zeros(n // CHUNK, dtype=cupy.float32)
        self.s = cupy.zeros(n // CHUNK, dtype=cupy.float32)


@attrs.define(eq=False)
class DeviceCache:
    """One run's KV cache: per block, a ring of keys and one of values (``positions``
    long, or a sliding block's window when that is shorter), and the decode graph
    captured over them (a graph keeps the pointers it was captured with)."""

    k: Any  # list of (n_kv_heads, size, head_dim_k) arrays, one per block
    v: Any
    positions: int
    graph: Any = None


class DeviceOps:
    """``program.Ops`` as launches on ``stream``."""

    def __init__(
        self, k: KernelSet, w: StageWeights[Any, Any], spec: BackendSpec, max_seq: int, stream: Any
    ) -> None:
        c = w.config
        self.k, self.w, self.spec, self.max_seq, self.stream = k, w, spec, max_seq, stream
        self.kv_half = spec.kv_dtype == "f16"
        # per block: its window (0: global); a run's cache is a ring per block of that
        # many positions or all of the run's (``new_cache``)
        self.windows = [layer.window for layer in w.layers]
        # The KV cache in use (a run's: ``use_cache``), per block.
        self.k_cache: Any = None
        self.v_cache: Any = None
        tables = {
            id(r): cupy.asarray(np.ascontiguousarray(r).view(np.float32))
            for r in (w.rot, w.rot_swa)
            if r is not None
        }
        self.rots = [tables[id(w.layer_rot(i))] for i in range(len(w.layers))]
        # llama.cpp scales the scores, or (gemma3, phi3) the rotated queries
        scale = float(np.float32(c.query_scale))
        self.q_scale, self.scale = (scale, 1.0) if c.spec.queries_scaled else (1.0, scale)
        self.pos = 0  # the step's first position (a prefill's; a graph reads `state`)
        # a prefill's keys and values, by position, while a sliding block's ring cannot
        # take them (``_wrapping_cache``)
        self.step_kv: tuple[Any, Any] | None = None
        self.state = cupy.zeros(2, dtype=cupy.int32)  # [position of row 0, token id]
        self.tokens = cupy.zeros(max_seq, dtype=cupy.int32)
        self.token_out = cupy.zeros(2, dtype=cupy.int32)  # [id, non-finite count]
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
        self.logits = cupy.zeros((1, w.vocab_size), cupy.float32) if spec.is_last else None
        self.buf: dict[str, Any] = {}
        self.use_tokens = False  # embed from `tokens` (prefill) or state[1] (decode)

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

    def use_cache(self, cache: DeviceCache) -> None:
        self.k_cache, self.v_cache = cache.k, cache.v

    def use_rows(self, rows: int) -> None:
        """Point the named buffers at the one-row set, or at fresh ones for ``rows``."""
        if rows == 1:
            self.buf = {k: v for k, v in self.one.items() if k not in ("h", "act")}
        else:
            c, f = self.w.config, self.w.max_ffn
            self.buf = {
                "x": cupy.empty((rows, c.hidden_dim), cupy.float32),
                "xn": cupy.empty((rows, c.hidden_dim), cupy.float32),
                "qkv": cupy.empty((rows, self.qkv_dim), cupy.float32),
                "att": cupy.empty((rows, self.att_dim), cupy.float32),
                "o": cupy.empty((rows, c.hidden_dim), cupy.float32),
                "xl": self.one["xl"],
                "_h": cupy.empty(rows * 2 * f, cupy.float32),
                "_act": cupy.empty(rows * f, cupy.float32),
            }
        if self.logits is not None:
            self.buf["logits"] = self.logits

    def _flat(self, name: str, rows: int) -> Any:
        return self.one[name] if rows == 1 else self.buf["_" + name]

    def _q8(self, name: str, rows: int) -> _Q8 | None:
        if rows == 1 and self.spec.matvec == "q8":
            return self.q8.get(name)
        return None

    def _launch(self, name: str, grid: int | tuple[int, ...], block: int, *args: Any) -> None:
        self.k.launch(name, grid, block, args, stream=self.stream)

    # -- Ops ---------------------------------------------------------------------------
    def embed(self, table: Linear[Any], rows: int) -> None:
        ((part, raw),) = table.parts
        n_chunks = part.n_in // CHUNK
        ids = self.tokens if rows > 1 or self.use_tokens else self.state[1:2]
        grid = min(_cdiv(rows * n_chunks, 128), 4096)
        self._launch(
            f"dequant_rows_{part.qtype}", grid, 128,
            raw, part.row_bytes, n_chunks, ids, 0, rows, self.buf["x"],
        )  # fmt: skip

    def norm(self, weight: Any, rows: int) -> None:
        self._norm(self.buf["x"], weight, self.buf["xn"], rows, self._q8("xn", rows))

    def head_norm(self, weight: Any, heads: Sequence[int]) -> None:
        (row,) = heads  # one run's step at a time (``RunsOneAtATime``)
        last = self.buf["x"][row : row + 1]
        self._norm(
            last, weight, self.buf["xl"], 1, self.q8.get("xl") if self.spec.matvec == "q8" else None
        )

    def _norm(self, x: Any, weight: Any, out: Any, rows: int, q8: _Q8 | None) -> None:
        n, eps = self.w.config.hidden_dim, self.w.config.rms_eps
        if rows == 1:
            self._launch(
                "rmsnorm_q8", 1, 1024, x, weight, out, n, eps,
                q8.q if q8 else None, q8.d if q8 else None, q8.s if q8 else None,
            )  # fmt: skip
        else:
            self._launch("rmsnorm_rows", rows, 256, x, weight, out, n, eps)

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
        if dst in ("h",):
            self.buf["h"] = self._flat("h", rows)[: rows * lin.n_out].reshape(rows, lin.n_out)
        x, y = self.buf[src], self.buf[dst]
        for part, raw in lin.parts:
            at = slice(part.out_offset, part.out_offset + part.n_out)
            part_bias = None if bias is None else bias[at]
            if rows == 1:
                self._matvec(part, raw, src, x, y[0, at], part_bias, accumulate)
            else:
                self._tiles(part, raw, x, y[:, at], part_bias, accumulate)

    def _matvec(
        self, part: MatrixPart, raw: Any, src: str, x: Any, y: Any, bias: Any, acc: bool
    ) -> None:
        n_chunks = part.n_in // CHUNK
        grid = _cdiv(part.n_out, MATVEC_WARPS)
        block = 32 * MATVEC_WARPS
        q8 = self.q8.get(src)
        if uses_q8(part.qtype, self.spec.matvec) and q8 is not None:
            self._launch(
                f"matvec_q8_{part.qtype}", grid, block,
                raw, part.row_bytes, n_chunks, part.n_out, q8.q, q8.d, q8.s, y, bias, int(acc),
            )  # fmt: skip
        else:
            self._launch(
                f"matvec_f_{part.qtype}", grid, block,
                raw, part.row_bytes, n_chunks, part.n_out, x, y, bias, int(acc),
            )  # fmt: skip

    def _tiles(self, part: MatrixPart, raw: Any, x: Any, y: Any, bias: Any, acc: bool) -> None:
        n_chunks = part.n_in // CHUNK
        tile_rows = max(1, min(part.n_out, TILE_FLOATS // part.n_in))
        scratch = cupy.empty((tile_rows, part.n_in), cupy.float32)
        with self.stream:
            for r0 in range(0, part.n_out, tile_rows):
                nt = min(tile_rows, part.n_out - r0)
                tile = scratch[:nt]
                grid = min(_cdiv(nt * n_chunks, 128), 65535)
                self._launch(
                    f"dequant_rows_{part.qtype}", grid, 128,
                    raw, part.row_bytes, n_chunks, None, r0, nt, tile,
                )  # fmt: skip
                out = cupy.matmul(x, tile.T)
                if bias is not None:
                    out += bias[r0 : r0 + nt]
                if acc:
                    y[:, r0 : r0 + nt] += out
                else:
                    y[:, r0 : r0 + nt] = out

    def rope_kv(self, layer: int, bias: Any, seg: Segment) -> None:
        rows = seg.rows  # the step's only segment, at ``self.pos`` (and in ``state``)
        c = self.w.config
        kv = "f16" if self.kv_half else "f32"
        k, v = self.k_cache[layer], self.v_cache[layer]
        self.step_kv = None
        if rows > 1 and self.pos + rows > k.shape[1]:  # a sliding block's ring would wrap
            k, v = self.step_kv = self._wrapping_cache(layer, rows)
        self._launch(
            f"rope_kv_{kv}", rows, 256,
            self.buf["qkv"], rows, bias, self.rots[layer], self.state, c.n_heads, c.n_kv_heads,
            c.head_dim_k, c.head_dim_v, c.rope.n_dims, int(c.rope.neox), self.q_scale,
            k, v, k.shape[1],
        )  # fmt: skip

    def _wrapping_cache(self, layer: int, rows: int) -> tuple[Any, Any]:
        """Caches of every position of a prefill of ``rows`` at ``self.pos``, holding the
        ring's positions before it (the older ones no row sees)."""
        ring_k, ring_v = self.k_cache[layer], self.v_cache[layer]
        size, end = ring_k.shape[1], self.pos + rows
        k = cupy.empty((ring_k.shape[0], end, ring_k.shape[2]), ring_k.dtype)
        v = cupy.empty((ring_v.shape[0], end, ring_v.shape[2]), ring_v.dtype)
        start = max(0, self.pos - size)
        if start < self.pos:
            with self.stream:  # the index array too: the stage's stream does not wait for others
                held = cupy.arange(start, self.pos) % size
                k[:, start : self.pos] = ring_k[:, held]
                v[:, start : self.pos] = ring_v[:, held]
        return k, v

    def attention(self, layer: int, seg: Segment) -> None:
        rows = seg.rows  # the step's only segment, at ``self.pos``
        c = self.w.config
        kv = "f16" if self.kv_half else "f32"
        q8 = self._q8("att", rows)
        fused = q8 if (q8 is not None and c.head_dim_v % CHUNK == 0) else None
        k, v = self.step_kv or (self.k_cache[layer], self.v_cache[layer])
        self._launch(
            f"attention_{kv}", (rows, c.n_heads), ATT_THREADS,
            self.buf["qkv"], rows, k, v, self.state, c.n_heads, c.n_kv_heads, c.head_dim_k,
            c.head_dim_v, k.shape[1], self.windows[layer], self.scale, self.buf["att"],
            fused.q if fused else None, fused.d if fused else None, fused.s if fused else None,
        )  # fmt: skip
        if q8 is not None and fused is None:
            self._quantize(self.buf["att"], q8, self.att_dim // CHUNK)
        if self.step_kv is not None:  # the ring keeps the step's last `size` positions
            ring_k, ring_v = self.k_cache[layer], self.v_cache[layer]
            size, end = ring_k.shape[1], self.pos + rows
            with self.stream:
                kept = cupy.arange(max(self.pos, end - size), end)
                ring_k[:, kept % size] = k[:, kept]
                ring_v[:, kept % size] = v[:, kept]
            self.step_kv = None

    def _quantize(self, x: Any, q8: _Q8, n_chunks: int) -> None:
        self._launch("quantize_q8", _cdiv(n_chunks, 8), 256, x, n_chunks, q8.q, q8.d, q8.s)

    def swiglu(self, rows: int) -> None:
        self._gated("swiglu", rows)

    def geglu(self, rows: int) -> None:
        self._gated("geglu", rows)

    def _gated(self, kernel: str, rows: int) -> None:
        h = self.buf["h"]
        f = h.shape[1] // 2
        act = self._flat("act", rows)[: rows * f].reshape(rows, f)
        self.buf["act"] = act
        if rows == 1:
            q8 = self._q8("act", rows)
            if f % CHUNK == 0:
                self._launch(
                    f"{kernel}_q8", _cdiv(f // CHUNK, 8), 256, h, act, f,
                    q8.q if q8 else None, q8.d if q8 else None, q8.s if q8 else None,
                )  # fmt: skip
            else:
                self._launch(f"{kernel}_rows", _cdiv(f, 256), 256, h, act, f, 1)
        else:
            self._launch(f"{kernel}_rows", min(_cdiv(rows * f, 256), 65535), 256, h, act, f, rows)

    def scale_x(self, factor: float, rows: int) -> None:
        n = rows * self.w.config.hidden_dim
        f = float(np.float32(factor))
        self._launch("scale_inplace", min(_cdiv(n, 256), 4096), 256, self.buf["x"], f, n)

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

    def softcap(self, cap: float, rows: int) -> None:
        assert self.logits is not None and rows == 1  # one run's step at a time
        n = self.logits.shape[1]
        inv, c = float(np.float32(1.0 / cap)), float(np.float32(cap))
        self._launch("softcap", min(_cdiv(n, 256), 4096), 256, self.logits, inv, c, n)

    def argmax(self, rows: int) -> None:
        assert self.logits is not None and rows == 1
        n = self.logits.shape[1]
        self._launch(
            "argmax_partial", ARGMAX_PARTS, 256, self.logits, n, self.pmax, self.pidx, self.pbad
        )
        self._launch(
            "argmax_final", 1, 256, self.pmax, self.pidx, self.pbad, ARGMAX_PARTS, self.token_out
        )


class DeviceBackend(RunsOneAtATime):
    """``stage_worker.StageBackend`` on one CUDA device. Its batched entry runs a batch's
    steps one run at a time (``RunsOneAtATime``: the CUDA kernels take one run's rows)."""

    def __init__(
        self,
        spec: BackendSpec,
        *,
        use_graph: bool,
        device_io: bool,
        device: int,
        trace: TraceEvent | None = None,
    ) -> None:
        self.spec = spec
        self.use_graph = use_graph
        self.trace = trace
        self.device_io = device_io
        self.device = cupy.cuda.Device(device)
        self.k = kernels_for(device)
        self.ops: DeviceOps | None = None
        self.weights: StageWeights[Any, Any] | None = None
        self.stream: Any = None
        self.cache: DeviceCache | None = None  # the run's cache the next step uses
        self._parked: DeviceCache | None = None  # the cache of the run that ended last
        self._edge_in: Any = None
        self._edge_out: Any = None
        self._host_state = np.zeros(2, dtype=np.int32)
        self._token = 0
        self._rows_in = 0
        self.kept: list[Kept] = []  # the outputs of the last batch's steps

    # -- StageBackend ------------------------------------------------------------------
    def load(self, stage: StageSlice, max_seq_len: int, progress: Progress | None) -> None:
        with self.device:
            try:
                self.k.compile_all()
            except Exception as exc:  # NVRTC's CompileException and friends
                raise RuntimeError(f"compiling the CUDA kernels failed: {exc}") from exc
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self.weights = load_weights(stage, _Uploader(), max_seq_len, progress)
            self.ops = DeviceOps(self.k, self.weights, self.spec, max_seq_len, self.stream)
            h = stage.config.hidden_dim
            edge = self.spec.edge_dtype
            self._edge_in = cupy.zeros((1, h), dtype=edge)
            self._edge_out = cupy.zeros((1, h), dtype=edge)
            cupy.cuda.Device().synchronize()

    def put_tokens(self, ids: npt.NDArray[np.int32]) -> None:
        ops = self._ops()
        self._rows_in = int(ids.shape[0])
        with self.device:
            if ids.shape[0] == 1:
                self._token = int(ids[0])
            else:
                ops.tokens[: ids.shape[0]].set(
                    np.ascontiguousarray(ids, np.int32), stream=self.stream
                )

    def put_activations(self, data: Any) -> None:
        rows = int(data.shape[0])
        self._rows_in = rows
        with self.device:
            target = self._edge_in if rows == 1 else cupy.empty(data.shape, self.spec.edge_dtype)
            if isinstance(data, cupy.ndarray):
                with self.stream:  # a copy of a strided input is ordered before the memcpy
                    src = cupy.ascontiguousarray(data)
                cupy.cuda.runtime.memcpyAsync(
                    target.data.ptr, src.data.ptr, src.nbytes, _D2D, self.stream.ptr
                )
            else:
                target.set(np.ascontiguousarray(data), stream=self.stream)
            self._input = target

    def new_cache(self, positions: int) -> DeviceCache:
        """A run's cache: the one last freed when it has the same positions (with its
        captured graph: a warm stage's next run replays it), else a new one (the one
        last freed goes first, so the stage never holds more than its runs had)."""
        ops = self._ops()
        parked, self._parked = self._parked, None
        if parked is not None and parked.positions == positions:
            return parked
        if parked is not None:
            self._drop(parked)
        with self.device:
            return ops.new_cache(positions)

    def use_cache(self, cache: Any) -> None:
        self._ops().use_cache(cache)
        self.cache = cache

    def free_cache(self, cache: Any) -> None:
        """A run is over: its cache is kept for the next run of its length (it holds
        nothing a run reads: each starts with a prefill at position 0 and attends only
        to the positions it wrote); the one kept before goes."""
        if self.cache is cache:
            self.cache = None
            if self.ops is not None:
                self.ops.k_cache = self.ops.v_cache = None
        if self._parked is not None and self._parked is not cache:
            self._drop(self._parked)
        self._parked = cache

    @staticmethod
    def _drop(cache: DeviceCache) -> None:
        cache.graph = cache.k = cache.v = None  # the memory returns to CuPy's pool

    def run(self, rows: int, pos: int, head: bool = True) -> None:
        """A step of ``rows`` rows at ``pos`` against the cache in use. A decode row
        replays the graph captured for that cache (``head`` is ignored there: the
        graph's head is cheap, and its result unused)."""
        ops = self._ops()
        cache = self.cache
        if cache is None:
            raise RuntimeError("no KV cache in use: a step runs for an open run")
        with self.device:
            self._host_state[0] = pos
            self._host_state[1] = self._token
            ops.state.set(self._host_state, stream=self.stream)
            ops.pos = pos
            ops.use_tokens = False
            if rows == 1 and self.use_graph:
                if cache.graph is None:
                    cache.graph = self._capture()
                cache.graph.launch(stream=self.stream)
            else:
                self._step(rows, head)
            self.stream.synchronize()

    def take_activations(self, rows: int) -> Any:
        ops = self._ops()
        with self.device:
            if rows == 1:
                out = self._edge_out
            else:
                out = cupy.empty((rows, ops.w.config.hidden_dim), self.spec.edge_dtype)
                self._convert_out(ops.buf["x"], out)
            if self.device_io:
                with self.stream:
                    copy = out.copy()
                self.stream.synchronize()
                return copy
            host = cupy.asnumpy(out, stream=self.stream)
            self.stream.synchronize()
            return host

    def token(self) -> tuple[int, int]:
        ops = self._ops()
        with self.device:
            out = cupy.asnumpy(ops.token_out, stream=self.stream)
            self.stream.synchronize()
        return int(out[0]), int(out[1])

    def logits(self) -> npt.NDArray[np.float32]:
        ops = self._ops()
        assert ops.logits is not None
        with self.device:
            out = cupy.asnumpy(ops.logits[0], stream=self.stream)
            self.stream.synchronize()
        return np.asarray(out, dtype=np.float32)

    def sample(self, config: SamplingConfig, u: float) -> int:
        ops = self._ops()
        assert ops.logits is not None
        return self.sample_kept(ops.logits[0], config, u)

    def keep_logits(self) -> Any:
        ops = self._ops()
        assert ops.logits is not None
        with self.device, self.stream:
            return ops.logits[0].copy()

    def kept_to_host(self, logits: Any) -> npt.NDArray[np.float32]:
        with self.device:
            out = cupy.asnumpy(logits, stream=self.stream)
            self.stream.synchronize()
        return np.asarray(out, dtype=np.float32)

    def sample_kept(self, logits: Any, config: SamplingConfig, u: float) -> int:
        with self.device, self.stream:
            token = device_sampling.sample(cupy, logits, config, u)
        return token

    def to_host(self, data: Any) -> npt.NDArray[np.generic]:
        if isinstance(data, cupy.ndarray):
            with self.device:
                return np.asarray(cupy.asnumpy(data))
        return np.asarray(data)

    def release(self) -> None:
        if self.stream is not None:
            with self.device:
                self.stream.synchronize()
        for cache in (self.cache, self._parked):
            if cache is not None:
                self._drop(cache)
        self.cache = self._parked = None
        self.ops = None
        self.weights = None
        self._edge_in = self._edge_out = self._input = None
        self.stream = None
        with self.device:
            cupy.get_default_memory_pool().free_all_blocks()

    # -- the step --------------------------------------------------------------------
    def _ops(self) -> DeviceOps:
        if self.ops is None:
            raise RuntimeError("the stage is not bound")
        return self.ops

    def _capture(self) -> Any:
        s = self.stream
        with s:
            s.begin_capture()
            try:
                self._step(1)
            finally:
                graph = s.end_capture()
        if self.trace is not None:
            self.trace("graph captured", rows=1)
        return graph

    def _step(self, rows: int, head: bool = True) -> None:
        """Every launch of one step (captured into the graph for a decode row)."""
        ops, w = self._ops(), self.weights
        assert w is not None
        ops.use_rows(rows)
        if self.spec.is_first:
            forward_embed(ops, w, rows)
        else:
            self._convert_in(self._input, ops.buf["x"])
        # one segment; the kernels read its position from ``state`` (graph replays)
        forward_blocks(ops, w, (Segment(0, rows, int(self._host_state[0]), self.cache),))
        if self.spec.is_last:
            if head:
                forward_head(ops, w, (rows - 1,))
        elif rows == 1:
            self._convert_out(ops.buf["x"], self._edge_out)

    def _convert_in(self, src: Any, x: Any) -> None:
        self._convert(src, x, {np.float16: "f16_to_f32", np.uint16: "bf16_to_f32"})

    def _convert_out(self, x: Any, dst: Any) -> None:
        self._convert(x, dst, {np.float16: "f32_to_f16", np.uint16: "f32_to_bf16"})

    def _convert(self, src: Any, dst: Any, names: dict[type, str]) -> None:
        edge = self.spec.edge_dtype
        n = int(src.size)
        if edge == np.float32:
            cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, n * 4, _D2D, self.stream.ptr)
            return
        name = names[edge.type]
        self.k.launch(name, min(_cdiv(n, 256), 4096), 256, (src, dst, n), stream=self.stream)
