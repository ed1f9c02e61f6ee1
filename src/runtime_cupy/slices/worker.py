"""A worker whose weights may come over the network: ``SlicedWorker`` wraps the stage's
worker and, in ``bind``, asks its ``SliceFetcher`` where the slice of the plan's source
is on this host (the cache, the file at the plan's path, or a transfer from the
orchestrator's host) before the worker binds it. Everything else is the worker's own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from runplan import GgufSource, ProvisionStage, WorkerCapabilities
from runplan.shards import SliceParts
from runtime_core.workers.interface import (
    BatchStep,
    Progress,
    StepResult,
    StepWorker,
    TokenOutput,
    WorkerError,
)
from runtime_core.workers.kept_weights import KeepsWeights
from runtime_cupy.slices.fetch import SliceFetcher


def sliced(worker: StepWorker, fetcher: SliceFetcher) -> Any:
    """``worker``, binding what ``fetcher`` resolves (a class of its own per worker
    class, so that it has the worker's capabilities)."""
    cls = type(
        f"Sliced{type(worker).__name__}",
        (SlicedWorker,),
        {"capabilities": type(worker).capabilities},
    )
    made: StepWorker = cls(worker, fetcher)
    return made


class SlicedWorker:
    """``inner`` with its sources resolved by ``fetcher``."""

    capabilities: ClassVar[WorkerCapabilities]

    def __init__(self, inner: StepWorker, fetcher: SliceFetcher) -> None:
        self.inner = inner
        self.fetcher = fetcher
        self._provision: ProvisionStage | None = None

    def configure(self, provision: ProvisionStage) -> None:
        self._provision = provision
        self.inner.configure(provision)

    def bind(self, gguf_source: GgufSource, progress: Progress | None = None) -> None:
        p = self._provision
        if p is None:
            raise WorkerError("bind before configure")
        parts = SliceParts(p.layer_start, p.layer_end_exclusive, p.is_first, p.is_last)
        self.inner.bind(self.fetcher.resolve(gguf_source, parts), progress)

    def execute_step(
        self, sequence: int, data: npt.NDArray[np.generic]
    ) -> npt.NDArray[np.generic] | TokenOutput:
        return self.inner.execute_step(sequence, data)

    # -- the chain's batched interface (runtime_core.workers.interface.Worker) ---------
    @property
    def kv_reserved_bytes(self) -> int:
        inner: Any = self.inner
        return int(inner.kv_reserved_bytes)

    def open_run(self, provision: ProvisionStage) -> None:
        inner: Any = self.inner
        inner.open_run(provision)

    def execute_batch(self, steps: Sequence[BatchStep]) -> tuple[StepResult, ...]:
        inner: Any = self.inner
        results: tuple[StepResult, ...] = inner.execute_batch(steps)
        return results

    def close_run(self, run_id: str) -> None:
        inner: Any = self.inner
        inner.close_run(run_id)

    def release(self) -> None:
        self.inner.release()

    # -- kept weights (runtime_core.workers.kept_weights), when the worker keeps them ------------
    @property
    def weights_reused(self) -> bool:
        inner: Any = self.inner
        return isinstance(inner, KeepsWeights) and bool(inner.weights_reused)

    def forget_weights(self) -> None:
        if isinstance(self.inner, KeepsWeights):
            self.inner.forget_weights()
