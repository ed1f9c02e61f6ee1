"""The CPU worker's backend: ``stage_worker.StageBackend`` on the host's cores. ``load``
takes the stage's tensors as views of the file's memory map (``load_weights``), builds
the operations on them (``ops.CpuOps``: the matrices products read repacked there) and
reads every other page of the stage's tensors once, so the first step does not wait on
the disk.

Batches (``run_batch``, CONCURRENT_RUNS.md §3): the rows of every step of a batch (prefill
chunks and decode rows of several runs) are stacked into one step; each product is one
kernel call over all of them, so a batch of 8 decode rows reads each weight block once,
not 8 times, and so are the norms, gates and the head (for each run's last row that
needs a token). Rotary embedding and attention run per run (``forward_program.Segment``)
against that run's cache at its positions. Every row's arithmetic is that of the row
alone: a run computes the same bits alone or beside others, in one prefill or in chunks.

A batch's shape runs as its step program where ``CpuOps.program`` gives one (recorded
at the shape's first step), else call by call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from runplan import SamplingConfig
from runtime_core import activations
from runtime_core.gguf_slice import StageSlice
from runtime_core.workers import device_sampling
from runtime_core.workers.cpu.ops import CpuCache, CpuOps
from runtime_core.workers.cpu.step_buffers import PAGE
from runtime_core.workers.forward_program import (
    Segment,
    forward_blocks,
    forward_embed,
    forward_head,
    segments_of,
)
from runtime_core.workers.interface import Progress
from runtime_core.workers.stage_weights import StageWeights, load_weights
from runtime_core.workers.stage_worker import BackendSpec, BackendStep

U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]


class _MappedUploader:
    """Matrices stay views of the file's memory map; vectors become owned float32."""

    def raw(self, data: U8) -> U8:
        return data

    def f32(self, data: F32) -> F32:
        return np.array(data, dtype=np.float32, copy=True)


def _touch(raw: U8) -> None:
    """Read one byte of every page of ``raw`` (bring the mapped file into memory)."""
    flat = raw.reshape(-1)
    if flat.size:
        int(flat[::PAGE].sum(dtype=np.uint64))


class CpuBackend:
    """``stage_worker.StageBackend`` on the host's cores."""

    def __init__(self, spec: BackendSpec, threads: int, isa: str | None = None) -> None:
        self.spec = spec
        self.threads = threads
        self.isa = isa
        self.ops: CpuOps | None = None
        self.weights: StageWeights[U8, F32] | None = None
        self.segments: tuple[Segment, ...] = ()  # the last batch's, by step
        self.head_of: dict[int, int] = {}  # step index -> its row of ``ops.logits``

    def load(self, stage: StageSlice, max_seq_len: int, progress: Progress | None) -> None:
        self.weights = load_weights(
            stage, _MappedUploader(), max_seq_len, progress, join_parts=False
        )
        self.ops = CpuOps(self.weights, self.spec, max_seq_len, self.threads, self.isa)
        seen: set[int] = set()
        for lin in self.weights.linears:
            for _, raw in lin.parts:
                if id(raw) not in seen and id(raw) not in self.ops.released:
                    seen.add(id(raw))
                    _touch(raw)

    def _ops(self) -> CpuOps:
        if self.ops is None:
            raise RuntimeError("the stage is not bound")
        return self.ops

    def new_cache(self, positions: int) -> CpuCache:
        return self._ops().new_cache(positions)

    def free_cache(self, cache: Any) -> None:
        """Nothing to do: the cache's arrays go with the last reference to them."""

    def run_batch(self, steps: Sequence[BackendStep]) -> None:
        """The steps' rows stacked into one step: each weight read once for all of them,
        each run's attention against its own cache, the head for each head step's last
        row."""
        ops, w = self._ops(), self.weights
        assert w is not None
        if not steps:
            raise ValueError("a batch of no steps")
        if not all(isinstance(s.cache, CpuCache) for s in steps):
            raise RuntimeError("a step without its run's KV cache")
        segments = segments_of([(s.rows, s.pos, s.cache) for s in steps])
        rows = segments[-1].end
        ops.use_rows(rows)
        ops.heads = steps[0].cache.heads[0]
        if self.spec.is_first:
            ids = [np.asarray(s.data, np.int32).reshape(-1) for s in steps]
            ops.use_ids(ids[0] if len(ids) == 1 else np.concatenate(ids))
        else:
            for seg, s in zip(segments, steps, strict=True):
                ops.buf.x[seg.start : seg.end] = activations.decode(
                    np.asarray(s.data), self.spec.edge_dtype
                )
        heads = [i for i, s in enumerate(steps) if s.head and self.spec.is_last]
        head_rows = [segments[i].end - 1 for i in heads]
        self.segments = segments
        self.head_of = {i: k for k, i in enumerate(heads)}
        if heads:
            ops.use_heads(len(heads))

        def forward() -> None:
            if self.spec.is_first:
                forward_embed(ops, w, rows)
            forward_blocks(ops, w, segments)
            if heads:
                forward_head(ops, w, head_rows)

        program = ops.program(segments, head_rows, forward)
        if program is None:
            forward()
        else:
            tables = [s.cache.table for s in steps]
            ops.tokens = program.run([s.pos for s in segments], tables)
        ops.end_step()

    def activations_of(self, index: int) -> npt.NDArray[np.generic]:
        seg = self.segments[index]
        return activations.encode(self._ops().out[seg.start : seg.end], self.spec.edge_dtype)

    def _head(self, index: int) -> int:
        if index not in self.head_of:
            raise RuntimeError(f"step {index} of the batch computed no token")
        return self.head_of[index]

    def token_of(self, index: int) -> tuple[int, int]:
        return self._ops().tokens[self._head(index)]

    def logits_of(self, index: int) -> F32:
        logits = self._ops().logits
        assert logits is not None
        return np.array(logits[self._head(index)], dtype=np.float32, copy=True)

    def sample_of(self, index: int, config: SamplingConfig, u: float) -> int:
        return int(device_sampling.sample(np, self.logits_of(index), config, u))

    def to_host(self, data: Any) -> npt.NDArray[np.generic]:
        return np.asarray(data)

    def release(self) -> None:
        self.ops = None
        self.weights = None
        self.segments = ()
        self.head_of = {}
