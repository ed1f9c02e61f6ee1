"""The CUDA worker's program on the kernels' NumPy twins, on any CPU.

``TwinWorker`` is ``CudaWorker`` over ``TwinBackend``: the same interface logic, checks,
weight layout and step sequence (``forward_program.py``) as the CUDA worker, with every kernel
replaced by its twin (``twins.py``). Tests run it against the NumPy reference worker and
llama.cpp's fixtures on a CPU; on a GPU, the CUDA worker is compared with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from runplan import SamplingConfig
from runplan.quant_types import CHUNK, uses_q8
from runtime_core import activations
from runtime_core.gguf_slice import StageSlice
from runtime_core.workers import device_sampling
from runtime_core.workers.forward_program import (
    Linear,
    Segment,
    StageWeights,
    forward_blocks,
    forward_embed,
    forward_head,
    load_weights,
)
from runtime_core.workers.interface import Progress
from runtime_core.workers.looped_batch import Kept, RunsOneAtATime
from runtime_core.workers.stage_worker import BackendSpec, StageBackend
from runtime_cupy.cuda.worker import CudaWorker
from tests.support import twins

U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]


class _HostUploader:
    def raw(self, data: U8) -> U8:
        return np.array(data, dtype=np.uint8, copy=True)

    def f32(self, data: F32) -> F32:
        return np.array(data, dtype=np.float32, copy=True)


class TwinOps:
    """``program.Ops`` on NumPy arrays, each operation its kernels' twin. The KV cache
    holds every position (a sliding block's ring on the device holds what its window
    sees, which is what attention reads here)."""

    def __init__(self, w: StageWeights[U8, F32], mode: str, kv_dtype: str, max_seq: int) -> None:
        c = w.config
        self.w = w
        self.mode = mode
        self.kv = np.float16 if kv_dtype == "f16" else np.float32
        self.k_cache = self.v_cache = np.zeros((0,), self.kv)  # a run's (use_cache)
        self.bufs: dict[str, F32] = {}
        self.q8: dict[str, twins.Q8Act] = {}
        self.ids: npt.NDArray[np.int32] = np.zeros(0, np.int32)
        # decoded matrices, by the id of their raw rows (kept for the stage's life)
        self._dense: dict[int, F32] = {}
        self._decoded: dict[int, twins.Decoded] = {}
        self.pos = 0
        self.token = (0, 0)
        self.windows = [layer.window for layer in w.layers]
        scale = float(np.float32(c.query_scale))
        self.q_scale, self.scale = (scale, 1.0) if c.spec.queries_scaled else (1.0, scale)

    def new_cache(self, positions: int) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """A run's KV cache of ``positions`` positions (keys, values)."""
        c, n = self.w.config, len(self.w.layers)
        return (
            np.zeros((n, c.n_kv_heads, positions, c.head_dim_k), self.kv),
            np.zeros((n, c.n_kv_heads, positions, c.head_dim_v), self.kv),
        )

    def _maybe_q8(self, name: str, rows: int) -> None:
        row = self.bufs[name]
        if rows == 1 and self.mode == "q8" and row.shape[1] % CHUNK == 0:
            self.q8[name] = twins.quantize_q8(row[0])

    def embed(self, table: Linear[U8], rows: int) -> None:
        ((part, raw),) = table.parts
        self.bufs["x"] = twins.dequantize(raw[self.ids[:rows]], part.qtype)

    def norm(self, weight: F32, rows: int) -> None:
        self.bufs["xn"], _ = twins.rmsnorm(self.bufs["x"][:rows], weight, self.w.config.rms_eps)
        self._maybe_q8("xn", rows)

    def head_norm(self, weight: F32, heads: Sequence[int]) -> None:
        (row,) = heads  # one run's step at a time, as the CUDA worker's
        last = self.bufs["x"][row : row + 1]
        self.bufs["xl"], _ = twins.rmsnorm(last, weight, self.w.config.rms_eps)
        self._maybe_q8("xl", 1)

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
        x = self.bufs[src][:rows]
        out = np.zeros((rows, lin.n_out), np.float32)
        for part, raw in lin.parts:
            at = slice(part.out_offset, part.out_offset + part.n_out)
            if rows == 1 and uses_q8(part.qtype, self.mode):
                dec = self._decoded.get(id(raw))
                if dec is None:
                    dec = self._decoded[id(raw)] = twins.decode(raw, part.qtype)
                out[0, at] = twins.matvec_q8(dec, part.qtype, self.q8[src]).y
                continue
            dense = self._dense.get(id(raw))
            if dense is None:
                dense = self._dense[id(raw)] = twins.dequantize(raw, part.qtype)
            if rows == 1:
                out[0, at] = twins.matvec_f(raw, part.qtype, x[0], dense).y
            else:
                out[:, at] = np.matmul(x, dense.T)
        if bias is not None:
            out += bias
        if accumulate:
            self.bufs[dst][:rows] += out
        else:
            self.bufs[dst] = out

    def rope_kv(self, layer: int, bias: F32 | None, seg: Segment) -> None:
        rows = seg.rows  # the step's only segment, at ``pos``
        c = self.w.config
        qkv = self.bufs["qkv"][:rows]
        if bias is not None:
            qkv = qkv + bias
        qd, kd = c.q_dim, c.k_dim
        rot = self.w.layer_rot(layer)[self.pos : self.pos + rows]
        q = qkv[:, :qd].reshape(rows, c.n_heads, c.head_dim_k)
        k = qkv[:, qd : qd + kd].reshape(rows, c.n_kv_heads, c.head_dim_k)
        v = qkv[:, qd + kd :].reshape(rows, c.n_kv_heads, c.head_dim_v)
        q = twins.rotate(q, rot, c.rope.n_dims, c.rope.neox)
        k = twins.rotate(k, rot, c.rope.n_dims, c.rope.neox)
        span = slice(self.pos, self.pos + rows)
        self.k_cache[layer][:, span] = k.transpose(1, 0, 2).astype(self.kv)
        self.v_cache[layer][:, span] = v.transpose(1, 0, 2).astype(self.kv)
        self.bufs["q"] = (q * np.float32(self.q_scale)).reshape(rows, -1)

    def attention(self, layer: int, seg: Segment) -> None:
        rows = seg.rows
        c = self.w.config
        n_ctx = self.pos + rows
        q = self.bufs["q"].reshape(rows, c.n_heads, c.head_dim_k)
        keys = self.k_cache[layer][:, :n_ctx].astype(np.float32)
        values = self.v_cache[layer][:, :n_ctx].astype(np.float32)
        group = c.n_heads // c.n_kv_heads
        self.bufs["att"] = twins.attention(
            q, keys, values, self.pos, group, self.scale, self.windows[layer]
        )
        self._maybe_q8("att", rows)

    def swiglu(self, rows: int) -> None:
        h = self.bufs["h"][:rows]
        f = h.shape[1] // 2
        self.bufs["act"] = twins.silu_mul(h[:, :f], h[:, f:])
        self._maybe_q8("act", rows)

    def geglu(self, rows: int) -> None:
        h = self.bufs["h"][:rows]
        f = h.shape[1] // 2
        self.bufs["act"] = twins.gelu_mul(h[:, :f], h[:, f:])
        self._maybe_q8("act", rows)

    def scale_x(self, factor: float, rows: int) -> None:
        self.bufs["x"] = (self.bufs["x"][:rows] * np.float32(factor)).astype(np.float32)

    def qk_norm(self, q_norm: F32, k_norm: F32, bias: F32 | None, rows: int) -> None:
        c = self.w.config
        heads = (c.n_heads, c.n_kv_heads, c.head_dim_k, c.head_dim_v)
        self.bufs["qkv"] = twins.head_rmsnorm(
            self.bufs["qkv"][:rows], bias, q_norm, k_norm, heads, c.rms_eps
        )

    def add_norm(self, weight: F32, rows: int) -> None:
        y, _ = twins.rmsnorm(self.bufs["o"][:rows], weight, self.w.config.rms_eps)
        self.bufs["x"] = (self.bufs["x"][:rows] + y).astype(np.float32)

    def softcap(self, cap: float, rows: int) -> None:
        assert rows == 1  # one run's step at a time, as the CUDA worker's
        self.bufs["logits"] = twins.softcap(self.bufs["logits"], cap)

    def argmax(self, rows: int) -> None:
        assert rows == 1
        self.token = twins.argmax(self.bufs["logits"][0])


class TwinBackend(RunsOneAtATime):
    """``stage_worker.StageBackend`` on the twins, one run's step at a time, as the CUDA
    worker's."""

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        self.ops: TwinOps | None = None
        self.weights: StageWeights[U8, F32] | None = None
        self._input: F32 | None = None
        self.kept: list[Kept] = []

    def load(self, stage: StageSlice, max_seq_len: int, progress: Progress | None) -> None:
        self.weights = load_weights(stage, _HostUploader(), max_seq_len, progress)
        self.ops = TwinOps(self.weights, self.spec.matvec, self.spec.kv_dtype, max_seq_len)

    def put_tokens(self, ids: npt.NDArray[np.int32]) -> None:
        assert self.ops is not None
        self.ops.ids = np.asarray(ids, np.int32)

    def put_activations(self, data: Any) -> None:
        self._input = activations.decode(np.asarray(data), self.spec.edge_dtype)

    def new_cache(self, positions: int) -> Any:
        assert self.ops is not None
        return self.ops.new_cache(positions)

    def use_cache(self, cache: Any) -> None:
        assert self.ops is not None
        self.ops.k_cache, self.ops.v_cache = cache

    def free_cache(self, cache: Any) -> None:
        pass

    def run(self, rows: int, pos: int, head: bool = True) -> None:
        ops, w = self.ops, self.weights
        assert ops is not None and w is not None
        ops.pos = pos
        if self.spec.is_first:
            forward_embed(ops, w, rows)
        else:
            assert self._input is not None
            ops.bufs["x"] = self._input
        forward_blocks(ops, w, (Segment(0, rows, pos, None),))
        if self.spec.is_last and head:
            forward_head(ops, w, (rows - 1,))

    def take_activations(self, rows: int) -> npt.NDArray[np.generic]:
        assert self.ops is not None
        return activations.encode(self.ops.bufs["x"][:rows], self.spec.edge_dtype)

    def token(self) -> tuple[int, int]:
        assert self.ops is not None
        return self.ops.token

    def logits(self) -> F32:
        assert self.ops is not None
        return np.array(self.ops.bufs["logits"][0], dtype=np.float32, copy=True)

    def sample(self, config: SamplingConfig, u: float) -> int:
        return device_sampling.sample(np, self.logits(), config, u)

    def keep_logits(self) -> F32:
        return self.logits()

    def kept_to_host(self, logits: Any) -> F32:
        return np.array(logits, dtype=np.float32, copy=True)

    def sample_kept(self, logits: Any, config: SamplingConfig, u: float) -> int:
        return device_sampling.sample(np, logits, config, u)

    def to_host(self, data: Any) -> npt.NDArray[np.generic]:
        return np.asarray(data)

    def release(self) -> None:
        self.ops = None
        self.weights = None


class TwinWorker(CudaWorker):
    """The CUDA worker's program on NumPy twins, with the CUDA worker's checks.
    Implements ``runtime_core.workers.interface.Worker``."""

    def _make_backend(self, spec: BackendSpec) -> StageBackend:
        return TwinBackend(spec)
