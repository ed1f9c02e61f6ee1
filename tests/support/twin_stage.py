"""The CUDA worker's program on the kernels' NumPy twins, on any CPU.

As the CUDA backend, a batch is one step of its runs' rows, each row taking the one-row
kernels' arithmetic whatever the step's rows (in ``q8`` mode a generated token's row and
every head row 8-bit, a prompt's rows float32), rotary embedding and attention per
run's segment against the run's cache.

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
from runtime_core.workers.experts import Routing, weighted_sum
from runtime_core.workers.forward_program import (
    Segment,
    experts_by_gather,
    forward_blocks,
    forward_embed,
    forward_head,
    segments_of,
)
from runtime_core.workers.interface import Progress
from runtime_core.workers.kept_steps import Kept, KeptSteps, edge_rows
from runtime_core.workers.stage_weights import Experts, Linear, StageWeights, load_weights
from runtime_core.workers.stage_worker import BackendSpec, BackendStep, StageBackend
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
        self.bufs: dict[str, F32] = {}
        self.q8: dict[str, list[twins.Q8Act]] = {}  # per row
        self.row_q8: list[bool] = []  # per row of the step: its products 8-bit
        self.ids: npt.NDArray[np.int32] = np.zeros(0, np.int32)
        # decoded matrices, by the id of their raw rows (kept for the stage's life)
        self._dense: dict[int, F32] = {}
        self._decoded: dict[int, twins.Decoded] = {}
        self.tokens: list[tuple[int, int]] = []  # per head row
        self.windows = [layer.window for layer in w.layers]
        scale = float(np.float32(c.query_scale))
        self.q_scale, self.scale = (scale, 1.0) if c.spec.queries_scaled else (1.0, scale)
        self.attn_softcap = float(np.float32(c.attn_logit_softcap))  # 0: none (gemma2's)

    def new_cache(self, positions: int) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """A run's KV cache of ``positions`` positions (keys, values)."""
        c, n = self.w.config, len(self.w.layers)
        return (
            np.zeros((n, c.n_kv_heads, positions, c.head_dim_k), self.kv),
            np.zeros((n, c.n_kv_heads, positions, c.head_dim_v), self.kv),
        )

    def _maybe_q8(self, name: str) -> None:
        rows = self.bufs[name]
        if self.mode == "q8" and rows.shape[1] % CHUNK == 0:
            self.q8[name] = [twins.quantize_q8(row) for row in rows]

    def embed(self, table: Linear[U8], rows: int) -> None:
        ((part, raw),) = table.parts
        self.bufs["x"] = twins.dequantize(raw[self.ids[:rows]], part.qtype)

    def norm(self, weight: F32, rows: int) -> None:
        self.bufs["xn"], _ = twins.rmsnorm(self.bufs["x"][:rows], weight, self.w.config.rms_eps)
        self._maybe_q8("xn")

    def head_norm(self, weight: F32, heads: Sequence[int]) -> None:
        self.row_q8 = [self.mode == "q8"] * len(heads)  # every head row 8-bit
        picked = self.bufs["x"][list(heads)]
        self.bufs["xl"], _ = twins.rmsnorm(picked, weight, self.w.config.rms_eps)
        self._maybe_q8("xl")

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
            eight = uses_q8(part.qtype, self.mode) and src in self.q8
            for r in range(rows):
                if eight and self.row_q8[r]:
                    dec = self._decoded.get(id(raw))
                    if dec is None:
                        dec = self._decoded[id(raw)] = twins.decode(raw, part.qtype)
                    out[r, at] = twins.matvec_q8(dec, part.qtype, self.q8[src][r]).y
                else:
                    dense = self._dense.get(id(raw))
                    if dense is None:
                        dense = self._dense[id(raw)] = twins.dequantize(raw, part.qtype)
                    out[r, at] = twins.matvec_f(raw, part.qtype, x[r], dense).y
        if bias is not None:
            out += bias
        if accumulate:
            self.bufs[dst][:rows] += out
        else:
            self.bufs[dst] = out

    def rope_kv(self, layer: int, bias: F32 | None, seg: Segment) -> None:
        rows, pos = seg.rows, seg.pos
        c = self.w.config
        qkv = self.bufs["qkv"][seg.start : seg.end]
        if bias is not None:
            qkv = qkv + bias
        qd, kd = c.q_dim, c.k_dim
        rot = self.w.layer_rot(layer)[pos : pos + rows]
        q = qkv[:, :qd].reshape(rows, c.n_heads, c.head_dim_k)
        k = qkv[:, qd : qd + kd].reshape(rows, c.n_kv_heads, c.head_dim_k)
        v = qkv[:, qd + kd :].reshape(rows, c.n_kv_heads, c.head_dim_v)
        n_rot = c.rope.n_dims if self.w.layers[layer].rotary else 0
        q = twins.rotate(q, rot, n_rot, c.rope.neox)
        k = twins.rotate(k, rot, n_rot, c.rope.neox)
        k_cache, v_cache = seg.cache
        span = slice(pos, pos + rows)
        k_cache[layer][:, span] = k.transpose(1, 0, 2).astype(self.kv)
        v_cache[layer][:, span] = v.transpose(1, 0, 2).astype(self.kv)
        q = q * np.float32(self.q_scale)
        if self.w.q_temps is not None:  # mistral3's temperature, after the queries' scale
            q = q * self.w.q_temps[pos : pos + rows, None, None]
        self.bufs["q"] = q.reshape(rows, -1)

    def attention(self, layer: int, seg: Segment) -> None:
        rows, pos = seg.rows, seg.pos
        c = self.w.config
        total = self.bufs["qkv"].shape[0]
        if seg.start == 0:
            self.bufs["att"] = np.zeros((total, c.n_heads * c.head_dim_v), np.float32)
        n_ctx = pos + rows
        q = self.bufs["q"].reshape(rows, c.n_heads, c.head_dim_k)
        k_cache, v_cache = seg.cache
        keys = k_cache[layer][:, :n_ctx].astype(np.float32)
        values = v_cache[layer][:, :n_ctx].astype(np.float32)
        group = c.n_heads // c.n_kv_heads
        self.bufs["att"][seg.start : seg.end] = twins.attention(
            q, keys, values, pos, group, self.scale, self.windows[layer], self.attn_softcap
        ).reshape(rows, -1)
        if seg.end == total:
            self._maybe_q8("att")

    def swiglu(self, rows: int) -> None:
        h = self.bufs["h"][:rows]
        f = h.shape[1] // 2
        self.bufs["act"] = twins.silu_mul(h[:, :f], h[:, f:])
        self._maybe_q8("act")

    def geglu(self, rows: int) -> None:
        h = self.bufs["h"][:rows]
        f = h.shape[1] // 2
        self.bufs["act"] = twins.gelu_mul(h[:, :f], h[:, f:])
        self._maybe_q8("act")

    # -- a mixture of experts (forward_program.ExpertOps), as the CUDA backend's ----------
    def router(self, lin: Linear[U8], rows: int) -> F32:
        self.linear(lin, "xn", "router", rows)
        return np.array(self.bufs["router"], dtype=np.float32, copy=True)

    def experts(
        self, experts: Experts[Any], routing: Routing, rows: int, accumulate: bool = False
    ) -> None:
        experts_by_gather(self, experts, routing, rows, accumulate)

    def scale_rows(self, factors: F32, rows: int) -> None:
        self.bufs["o"] = (self.bufs["o"][:rows] * factors[:, None]).astype(np.float32)

    def begin_experts(self, used: int, rows: int, accumulate: bool) -> None:
        self.moe_base = self.bufs["o"][:rows].copy() if accumulate else None
        self.moe_in = self.bufs["xn"][:rows].copy()
        self.moe_q8 = list(self.q8.get("xn", []))
        self.moe_row_q8 = list(self.row_q8)
        self.moe_out = np.empty((used, rows, self.w.config.hidden_dim), np.float32)

    def pick_rows(self, rows: npt.NDArray[np.int64]) -> None:
        self.bufs["xn"] = self.moe_in[rows]
        if self.moe_q8:
            self.q8["xn"] = [self.moe_q8[int(r)] for r in rows]
        self.row_q8 = [self.moe_row_q8[int(r)] for r in rows]

    def put_rows(
        self, rows: npt.NDArray[np.int64], slots: npt.NDArray[np.int64], weights: F32
    ) -> None:
        self.moe_out[slots, rows] = self.bufs["o"][: len(rows)] * weights[:, None]

    def end_experts(self, rows: int) -> None:
        total = weighted_sum(self.moe_out)
        self.bufs["o"] = total if self.moe_base is None else self.moe_base + total
        self.row_q8 = self.moe_row_q8

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
        self.bufs["logits"] = twins.softcap(self.bufs["logits"][:rows], cap)

    def add_scaled(self, factor: float, rows: int) -> None:
        scaled = (self.bufs["o"][:rows] * np.float32(factor)).astype(np.float32)
        self.bufs["x"] = (self.bufs["x"][:rows] + scaled).astype(np.float32)

    def scale_logits(self, factor: float, rows: int) -> None:
        self.bufs["logits"] = (self.bufs["logits"][:rows] * np.float32(factor)).astype(np.float32)

    def argmax(self, rows: int) -> None:
        self.tokens = [twins.argmax(row) for row in self.bufs["logits"][:rows]]


class TwinBackend(KeptSteps):
    """``stage_worker.StageBackend`` on the twins: a batch is one step of its runs' rows,
    as the CUDA worker's."""

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        self.ops: TwinOps | None = None
        self.weights: StageWeights[U8, F32] | None = None
        self.kept: list[Kept] = []

    def load(self, stage: StageSlice, max_seq_len: int, progress: Progress | None) -> None:
        self.weights = load_weights(stage, _HostUploader(), max_seq_len, progress)
        self.ops = TwinOps(self.weights, self.spec.matvec, self.spec.kv_dtype, max_seq_len)

    def new_cache(self, positions: int) -> Any:
        assert self.ops is not None
        return self.ops.new_cache(positions)

    def free_cache(self, cache: Any) -> None:
        pass

    def run_batch(self, steps: Sequence[BackendStep]) -> None:
        ops, w = self.ops, self.weights
        assert ops is not None and w is not None
        segments = segments_of([(step.rows, step.pos, step.cache) for step in steps])
        rows = segments[-1].end
        ops.row_q8 = [ops.mode == "q8" and not s.prompt for s in steps for _ in range(s.rows)]
        if self.spec.is_first:
            ops.ids = np.concatenate([np.asarray(step.data, np.int32) for step in steps])
            forward_embed(ops, w, rows)
        else:
            ops.bufs["x"] = np.concatenate(
                [activations.decode(np.asarray(step.data), self.spec.edge_dtype) for step in steps]
            )
        forward_blocks(ops, w, segments)
        if not self.spec.is_last:
            ranges = [(seg.start, seg.end) for seg in segments]
            self.kept = edge_rows(ops.bufs["x"][:rows], ranges, self.spec.edge_dtype)
            return
        heads = [seg.end - 1 for seg, step in zip(segments, steps, strict=True) if step.head]
        self.kept = [Kept() for _ in steps]
        if heads:
            forward_head(ops, w, heads)
            at = [i for i, step in enumerate(steps) if step.head]
            for k, i in enumerate(at):
                logits = np.array(ops.bufs["logits"][k], dtype=np.float32, copy=True)
                self.kept[i] = Kept(token=ops.tokens[k], logits=logits)

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
