"""The CPU worker (EDGES_AND_WORKERS.md §4): one stage on the host's cores, weights kept
in their GGUF blocks.

``CpuWorker`` is ``stage_worker.StageWorker`` (the interface's checks, sequence and position,
edge dtypes, sampling) over ``backend.CpuBackend``: the stage's forward pass of
``forward_program.py`` on compiled kernels (``csrc/``). Its memory is the stage's slice of the
file as stored (mapped, not copied) plus the KV cache and a few rows of buffers, which
is what ``CPU_CAPABILITIES`` tells the planner.

Options (``CpuWorker(...)``):

- ``matvec``: ``"q8"`` (default) multiplies quantized weights with 8-bit activations
  by integer dot products, as llama.cpp's CPU path does; ``"f32"`` with float32
  activations (slower; closest to the NumPy reference worker).
- ``kv_dtype``: ``"auto"`` (default: the width the plan counted the cache at,
  ``kv_dtype_width_bytes``: float32 for 4 bytes, float16 for 2), ``"f16"`` or ``"f32"``
  (``stage_worker.kv_dtype_for``).
- ``threads``: how many threads a step uses (default: ``kernels.default_threads()``,
  the stage's share of the host's cores). Results do not depend on it.
- ``isa``: the instruction set of the kernels (``"portable"``, ``"avx2"``,
  ``"avxvnni"``, ``"avx512bw"``, ``"avx512"``, ``"avx512-zen4"``, ``"avx512-intel"``;
  default: the best this processor runs, ``kernels.host_isas()[-1]``).
  Results do not depend on it; a set the processor lacks is a ValueError naming it.
"""

from __future__ import annotations

import operator
from typing import ClassVar

from runplan import WorkerCapabilities
from runplan.config import REFERENCE_ARCHITECTURES
from runplan.quant_types import CHUNK, QUANT_TYPES
from runtime_core.workers.cpu.kernels import (
    MAX_THREADS,
    THREADS_VARIABLE,
    checked_isa,
    default_threads,
    load,
)
from runtime_core.workers.interface import TraceEvent
from runtime_core.workers.stage_worker import BackendSpec, StageBackend, StageWorker

#: Every architecture the reference worker runs (``runtime_core.architectures``: the
#: kernels implement each optional step; a new architecture needs its operations here,
#: not only in the reference worker), every one of the 15 weight types
#: (``QUANT_TYPES``); weights as stored and a KV cache in the activation dtype, or the
#: one the runtime's ``kv_dtype`` sets (a sliding block's only as long as its window),
#: as the planner's memory check counts them.
CPU_CAPABILITIES = WorkerCapabilities(
    name="cpu",
    architectures=REFERENCE_ARCHITECTURES,
    quant_types=QUANT_TYPES,
    weight_bytes_per_element=0,
    kv_bytes_per_element=0,
    row_multiple=CHUNK,
)


class CpuWorker(StageWorker):
    """One stage's compute engine on the CPU. Implements
    ``runtime_core.workers.interface.Worker``."""

    capabilities: ClassVar[WorkerCapabilities] = CPU_CAPABILITIES

    def __init__(
        self,
        *,
        matvec: str = "q8",
        kv_dtype: str = "auto",
        threads: int | None = None,
        isa: str | None = None,
        trace: TraceEvent | None = None,
    ) -> None:
        super().__init__(matvec=matvec, kv_dtype=kv_dtype, trace=trace)
        if threads is not None:  # 2.5, 2.0 and "2" passed here and failed at bind
            threads = _thread_count(threads)
        self.threads = threads if threads is not None else default_threads()
        # where the count came from, for the bind's error past the kernels' bound
        self._threads_from = "threads" if threads is not None else THREADS_VARIABLE
        self.isa = checked_isa(isa)  # the set's name (None only where nothing is built)

    def _make_backend(self, spec: BackendSpec) -> StageBackend:
        load()  # KernelsUnavailable (a RuntimeError: WorkerError at bind) if not built
        if self.threads > MAX_THREADS:  # the kernels' error named only "threads"
            raise ValueError(
                f"{self._threads_from} {self.threads}: the CPU worker runs 1..{MAX_THREADS} threads"
            )
        from runtime_core.workers.cpu.backend import CpuBackend

        return CpuBackend(spec, self.threads, checked_isa(self.isa))


def _thread_count(threads: object) -> int:
    """``threads`` as a count of threads: an integer (not a bool) of at least 1, else a
    ``ValueError`` naming it."""
    try:
        count = operator.index(threads)  # type: ignore[arg-type]  # numpy's integers too
    except TypeError:
        count = 0
    if isinstance(threads, bool) or count < 1:
        raise ValueError(f"threads {threads!r} is not a positive count")
    return count
