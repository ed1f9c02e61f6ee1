"""The CUDA worker's backend: the stage's weights on one GPU and its batches run there,
each as one step of ``ops.DeviceOps``'s launches. Imports CuPy: only
``worker.CudaWorker.bind`` imports this module.

A batch (``run_batch``) is one step of all its runs' rows stacked (``Segment``s): every
matrix product and row-wise operation is one launch over all the rows (a matvec
kernel's grid has a row dimension, a norm one block per row), rotary embedding and
attention one launch per segment, against the segment's run's cache at its positions
(``state``, a pair per segment), and the head one launch for all head rows. Each row
takes the same arithmetic whatever the step's rows: the one-row kernels, a prompt's
rows (a prefill or a chunk of it) with float32 activations, a generated token's row and
every head row with 8-bit ones in ``q8`` mode (``groups``): a run's bits are the same
alone or batched, and whatever its prefill chunks.

Buffers. A lone generated token's row uses buffers allocated at bind time, so that the
step can be captured once as a CUDA graph and replayed: position and token id are read
from ``state`` (device memory, written before each replay), the attention kernels loop
over the context length they read there. Any other batch allocates its row buffers for
the step and runs eagerly.

Edges. A float16 edge refuses activations past float16's range, as every worker's does
(``runtime_core.activations.encode``): the conversion kernel counts the finite values it
made infinite in a counter allocated at bind time (cleared by the step, in the graph
too), read back with the step's outputs; only when it counted one are the step's
float32 rows copied to the host, where ``kept_steps.edge_rows`` (``encode``) names the
first such value of each run's rows, and those runs' steps fail with its
``ActivationOverflow`` (the others' outputs stand).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import cupy
import numpy as np
import numpy.typing as npt

from runplan import SamplingConfig
from runtime_core.gguf_slice import StageSlice
from runtime_core.workers import device_sampling
from runtime_core.workers.forward_program import (
    Segment,
    forward_blocks,
    forward_embed,
    forward_head,
    segments_of,
)
from runtime_core.workers.interface import Progress, TraceEvent
from runtime_core.workers.kept_steps import Kept, KeptSteps, edge_rows
from runtime_core.workers.stage_weights import StageWeights, load_weights
from runtime_core.workers.stage_worker import BackendSpec, BackendStep
from runtime_cupy.cuda.ops import DeviceCache, DeviceOps, cdiv, kernels_for

_H2D, _D2H, _D2D = 1, 2, 3


def _groups(
    segments: Sequence[Segment], prompts: Sequence[bool], q8: bool
) -> list[tuple[int, int, bool]]:
    """The step's row ranges whose products take 8-bit rows (a generated token's, in
    ``q8`` mode) or float32 ones (a prompt's), neighbours of one kind joined."""
    groups: list[tuple[int, int, bool]] = []
    for seg, prompt in zip(segments, prompts, strict=True):
        eight = q8 and not prompt
        if groups and groups[-1][2] == eight:
            groups[-1] = (groups[-1][0], seg.end, eight)
        else:
            groups.append((seg.start, seg.end, eight))
    return groups


class _Uploader:
    def raw(self, data: npt.NDArray[np.uint8]) -> Any:
        return cupy.asarray(np.ascontiguousarray(data))

    def f32(self, data: npt.NDArray[np.float32]) -> Any:
        return cupy.asarray(np.ascontiguousarray(data, dtype=np.float32))


class DeviceBackend(KeptSteps):
    """``stage_worker.StageBackend`` on one CUDA device: a batch of runs' steps is one
    step of all their rows (a lone generated token's row: its cache's captured graph)."""

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
        self._parked: DeviceCache | None = None  # the cache of the run that ended last
        self._edge_in: Any = None
        self._edge_out: Any = None
        self._overflowed: Any = None  # f32_to_f16's count of values made infinite
        self._host_state = np.zeros(2, dtype=np.int32)
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
            if stage.config.n_experts:  # each step's routing is read back: no graph holds it
                self.use_graph = False
            self.ops = DeviceOps(self.k, self.weights, self.spec, max_seq_len, self.stream)
            h = stage.config.hidden_dim
            edge = self.spec.edge_dtype
            self._edge_in = cupy.zeros((1, h), dtype=edge)
            self._edge_out = cupy.zeros((1, h), dtype=edge)
            self._overflowed = cupy.zeros(1, dtype=cupy.uint32)
            cupy.cuda.Device().synchronize()

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
        # on the stage's stream: CuPy allocates and zero-fills on the current stream, and
        # the non-blocking stage stream would not wait for a fill on the default one (its
        # first step's keys could be written before the zeros)
        with self.device, self.stream:
            return ops.new_cache(positions)

    def free_cache(self, cache: Any) -> None:
        """A run is over: its cache is kept for the next run of its length (it holds
        nothing a run reads: each starts with a prefill at position 0 and attends only
        to the positions it wrote); the one kept before goes."""
        if self._parked is not None and self._parked is not cache:
            self._drop(self._parked)
        self._parked = cache

    @staticmethod
    def _drop(cache: DeviceCache) -> None:
        cache.graph = cache.k = cache.v = None  # the memory returns to CuPy's pool

    def run_batch(self, steps: Sequence[BackendStep]) -> None:
        """The steps' rows as one step (a lone generated token's row: its graph), each
        step's outputs kept."""
        ops = self._ops()
        if any(step.cache is None for step in steps):
            raise RuntimeError("no KV cache: a step runs for an open run")
        # The stage's stream current for the whole step: CuPy hands out (and clears) memory
        # on the stream current at allocation, and this one is non-blocking, so a buffer
        # made on the default stream could take memory a queued copy here still reads.
        with self.device, self.stream:
            if self.use_graph and len(steps) == 1 and steps[0].rows == 1 and not steps[0].prompt:
                self.kept = [self._decode(steps[0])]
            else:
                self.kept = self._batch(ops, steps)

    def _decode(self, step: BackendStep) -> Kept:
        """A lone generated token's row: the graph captured for its cache, replayed (its head runs
        whether or not the row needs a token: it is cheap, its result then unused)."""
        ops, cache = self._ops(), step.cache
        self._host_state[0] = step.pos
        if self.spec.is_first:
            self._host_state[1] = int(step.data[0])
        else:
            self._put(step.data, self._edge_in)
        ops.state.set(self._host_state, stream=self.stream)
        ops.use_tokens = False
        ops.states = {0: ops.state}
        if cache.graph is None:
            cache.graph = self._capture(Segment(0, 1, step.pos, cache), step.prompt)
        cache.graph.launch(stream=self.stream)
        if not self.spec.is_last:
            return self._outputs(ops.one["x"], self._edge_out, [(0, 1)])[0]
        if not step.head:
            self.stream.synchronize()
            return Kept()
        token = cupy.asnumpy(ops.one_token_out, stream=self.stream)
        logits = self._kept_logits(ops.one_logits, 0)
        self.stream.synchronize()
        return Kept(token=(int(token[0]), int(token[1])), logits=logits)

    def _batch(self, ops: DeviceOps, steps: Sequence[BackendStep]) -> list[Kept]:
        """Any other batch, eagerly: one launch per product and row-wise operation over
        all its rows, rotary embedding and attention per run's segment."""
        segments = segments_of([(step.rows, step.pos, step.cache) for step in steps])
        rows = segments[-1].end
        states = cupy.empty((len(segments), 2), dtype=cupy.int32)
        host = np.zeros((len(segments), 2), dtype=np.int32)
        host[:, 0] = [seg.pos for seg in segments]
        states.set(host, stream=self.stream)
        ops.states = {seg.start: states[i] for i, seg in enumerate(segments)}
        ops.use_tokens = True
        source = None
        if self.spec.is_first:
            if rows > ops.tokens.size:
                ops.tokens = cupy.zeros(rows, dtype=cupy.int32)
            ids = np.concatenate([np.asarray(step.data, np.int32) for step in steps])
            ops.tokens[:rows].set(ids, stream=self.stream)
        else:
            source = cupy.empty((rows, ops.w.config.hidden_dim), self.spec.edge_dtype)
            for step, seg in zip(steps, segments, strict=True):
                self._put(step.data, source[seg.start : seg.end])
        heads = [seg.end - 1 for seg, step in zip(segments, steps, strict=True) if step.head]
        prompts = [step.prompt for step in steps]
        self._step(segments, heads if self.spec.is_last else [], source, prompts)
        if not self.spec.is_last:
            out = cupy.empty((rows, ops.w.config.hidden_dim), self.spec.edge_dtype)
            self._convert_out(ops.buf["x"], out)
            return self._outputs(ops.buf["x"], out, [(seg.start, seg.end) for seg in segments])
        tokens = cupy.asnumpy(ops.token_out, stream=self.stream)
        kept: list[Kept] = []
        k = 0
        for step in steps:
            if step.head:
                token = (int(tokens[2 * k]), int(tokens[2 * k + 1]))
                kept.append(Kept(token=token, logits=self._kept_logits(ops.logits, k)))
                k += 1
            else:
                kept.append(Kept())
        self.stream.synchronize()
        return kept

    def _put(self, data: Any, target: Any) -> None:
        """A step's input activations (a host or a device array) into ``target``."""
        if isinstance(data, cupy.ndarray):
            with self.stream:  # a copy of a strided input is ordered before the memcpy
                src = cupy.ascontiguousarray(data)
            cupy.cuda.runtime.memcpyAsync(
                target.data.ptr, src.data.ptr, src.nbytes, _D2D, self.stream.ptr
            )
        else:
            target.set(np.ascontiguousarray(data), stream=self.stream)

    def _outputs(self, x: Any, out: Any, ranges: Sequence[tuple[int, int]]) -> list[Kept]:
        """Each run's output activations, rows ``ranges`` of ``out`` (the edge's, converted
        from the float32 rows ``x``): a device copy (``device_io``) or a host one; a run
        whose rows a float16 edge cannot hold keeps its ``ActivationOverflow`` instead."""
        with self.stream:
            if self.device_io:
                copies = [out[start:end].copy() for start, end in ranges]
            else:
                copies = [cupy.asnumpy(out[start:end], stream=self.stream) for start, end in ranges]
            counted = None
            if self.spec.edge_dtype == np.float16:
                counted = cupy.asnumpy(self._overflowed, stream=self.stream)
            self.stream.synchronize()
            if counted is None or not counted[0]:
                return [Kept(activations=copy) for copy in copies]
            host = cupy.asnumpy(x[: ranges[-1][1]], stream=self.stream)
            self.stream.synchronize()
        return edge_rows(host, ranges, self.spec.edge_dtype, copies)

    def _kept_logits(self, logits: Any, k: int) -> Any:
        """A copy of head row ``k`` of ``logits`` that the next step does not overwrite."""
        with self.stream:
            return logits[k].copy()

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
        if self._parked is not None:
            self._drop(self._parked)
        self._parked = None
        self.ops = None
        self.weights = None
        self._edge_in = self._edge_out = self._input = self._overflowed = None
        self.stream = None
        with self.device:
            cupy.get_default_memory_pool().free_all_blocks()

    # -- the step --------------------------------------------------------------------
    def _ops(self) -> DeviceOps:
        if self.ops is None:
            raise RuntimeError("the stage is not bound")
        return self.ops

    def _capture(self, segment: Segment, prompt: bool) -> Any:
        s = self.stream
        with s:
            s.begin_capture()
            try:
                self._step((segment,), [0], self._edge_in, [prompt])
            finally:
                graph = s.end_capture()
        if self.trace is not None:
            self.trace("graph captured", rows=1)
        return graph

    def _step(
        self,
        segments: Sequence[Segment],
        heads: Sequence[int],
        source: Any,
        prompts: Sequence[bool],
    ) -> None:
        """Every launch of one step of the ``segments``' rows (captured into the graph
        for a lone generated token's row); the head for the rows ``heads`` (last stage).
        ``prompts``: whether each segment's rows are its run's prompt (float32 products)."""
        ops, w = self._ops(), self.weights
        assert w is not None
        rows = segments[-1].end
        ops.use_rows(rows)
        ops.groups = _groups(segments, prompts, self.spec.matvec == "q8")
        if self.spec.is_first:
            forward_embed(ops, w, rows)
        else:
            self._convert_in(source, ops.buf["x"])
        forward_blocks(ops, w, segments)
        if self.spec.is_last:
            if heads:
                forward_head(ops, w, heads)
        elif rows == 1 and len(segments) == 1 and source is self._edge_in:
            self._convert_out(ops.buf["x"], self._edge_out)

    def _convert_in(self, src: Any, x: Any) -> None:
        self._convert(src, x, {np.float16: "f16_to_f32", np.uint16: "bf16_to_f32"})

    def _convert_out(self, x: Any, dst: Any) -> None:
        """``x`` into the edge's dtype; to float16, counting in ``_overflowed`` (cleared
        first, on the stream: a captured graph clears it too) the values made infinite."""
        if self.spec.edge_dtype == np.float16:
            flag = self._overflowed
            cupy.cuda.runtime.memsetAsync(flag.data.ptr, 0, flag.nbytes, self.stream.ptr)
            self._convert(x, dst, {np.float16: "f32_to_f16"}, flag)
        else:
            self._convert(x, dst, {np.uint16: "f32_to_bf16"})

    def _convert(self, src: Any, dst: Any, names: dict[type, str], *more: Any) -> None:
        edge = self.spec.edge_dtype
        n = int(src.size)
        if edge == np.float32:
            cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, n * 4, _D2D, self.stream.ptr)
            return
        name = names[edge.type]
        grid = min(cdiv(n, 256), 4096)
        self.k.launch(name, grid, 256, (src, dst, n, *more), stream=self.stream)
